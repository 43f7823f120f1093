"""All-gathers per decoder layer for one micro-batch, with and without the shared-prefix pass, on 2 ranks.

    torchrun --nproc_per_node 2 tests/prefix_gathers.py OUT.json

Rank 0 writes, for each of share_prefix True/False: the all-gathers of each layer in the forward and
in the backward (counted by wrapping FSDP2's foreach_all_gather, as benchmarks/gpu_proxies.py does),
and the whole parameter gradients' largest difference between the two passes.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_proxies import Collectives  # noqa: E402
from minigdpo import dist, models, policy  # noqa: E402
from tests.test_policy import batches, model_logprobs  # noqa: E402


def main(out):
    path = models.resolve_model("tiny-random")  # before the group: transformers saves on rank 0 only with one
    device = dist.init()
    (mb,) = batches(3, size=6, prompts=2)                                  # 2 prompts x 3 completions
    result, grads = {}, {}
    for share in (True, False):
        model = policy.build(path, device, torch.float32)
        with Collectives() as coll:
            # the head in chunks of 4 tokens; the model's own forward in one block of rows (its chunk is in tokens)
            logp = model_logprobs(model, mb, 0.9, 4 if share else 64, share_prefix=share)
            forward = dict(coll.gathers)
            (logp * torch.arange(logp.shape[1])).sum().backward()
        backward = {k: v - forward.get(k, 0) for k, v in coll.gathers.items()}
        grads[share] = {n: dist.full_tensor(p.grad).clone() for n, p in model.named_parameters()}
        result[str(share)] = dict(forward=forward, backward=backward)
    result["grad_diff"] = max((grads[True][n] - grads[False][n]).abs().max().item() for n in grads[True])
    result["grad_max"] = max(g.abs().max().item() for g in grads[False].values())
    if dist.rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
    dist.cleanup()  # once main's sharded models are gone: they hold the group
