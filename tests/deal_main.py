"""Micro-batches by tokens on 2 gloo ranks whose groups differ in size: what each rank trains on.

    torchrun --nproc_per_node 2 tests/deal_main.py OUT.json

Rank 0 holds two long groups, rank 1 two short ones. With a budget that fits the two long ones apart and the
short ones together beside one long one, the groups move between the ranks; each rank writes what it got: its
groups, its micro-batches (as many on both), its tokens, and the update's normaliser.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minigdpo import dist, microbatch  # noqa: E402
from minigdpo.config import Config  # noqa: E402
from minigdpo.sampler import Completion  # noqa: E402
from minigdpo.update import normaliser  # noqa: E402


def group(prompt_len, completion_len, tag):
    prompt = [tag] * prompt_len
    return prompt, [Completion([tag] * completion_len, [0.0] * completion_len) for _ in range(2)], torch.zeros(2)


if __name__ == "__main__":
    device = dist.init()
    rank = dist.rank()
    mine = [group(40, 30, 10), group(40, 30, 11)] if rank == 0 else [group(5, 5, 20), group(5, 5, 21)]  # 100, 15
    cfg = Config(micro_batch_tokens=130, loss_agg="token_mean")
    batches = microbatch.cut(mine, cfg, 0, device, "packed")
    tags = sorted({int(mb.prompt_ids[i, -1]) for mb in batches if mb.seqs for i in range(len(mb.repeats))})
    out = {"rank": rank, "micro_batches": len(batches), "groups": tags, "tokens": sum(mb.tokens for mb in batches),
           "empty": sum(mb.seqs == 0 for mb in batches), "normaliser": normaliser(batches, cfg)}
    with open(f"{sys.argv[1]}.{rank}", "w") as f:
        json.dump(out, f)
    dist.cleanup()
