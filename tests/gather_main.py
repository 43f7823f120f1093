"""The Hugging Face export's gathers on 2 ranks: every whole tensor reaches rank 0 alone.

    torchrun --nproc_per_node 2 tests/gather_main.py OUT.json SHARDING

SHARDING fsdp shards over both ranks; hsdp runs them as 2 nodes of 1 (LOCAL_WORLD_SIZE=1), where
each rank holds a replica. Rank 0 checks each tensor whole_weights(main_only=True) yields against the
all-gathered one; every rank reports how many whole tensors it received.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minigdpo import dist, models, policy  # noqa: E402


def main(out, sharding):
    path = models.resolve_model("tiny-random")  # before the group: transformers saves on rank 0 only with one
    if sharding == "hsdp":
        os.environ["LOCAL_WORLD_SIZE"] = "1"
    device = dist.init(sharding)
    model = policy.build(path, device, torch.float32)
    whole = dict(model.whole_weights(torch.bfloat16))
    received, mismatched, names = 0, [], []
    for name, t in model.whole_weights(torch.bfloat16, main_only=True):
        names.append(name)
        if t is not None:
            received += 1
            if not torch.equal(t, whole[name]):
                mismatched.append(name)
    report = dict(rank=dist.rank(), mesh=list(dist.mesh().shape), received=received, names=len(names),
                  expected=len(whole), mismatched=mismatched)
    reports = dist.all_gather_object(report)
    if dist.rank() == 0:
        with open(out, "w") as f:
            json.dump(reports, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
    dist.cleanup()  # once main's sharded model is gone: it holds the group
