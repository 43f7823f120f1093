"""Gradient reductions per optimizer step, counted on 2 ranks, for each --reduce-grads mode.

    torchrun --nproc_per_node 2 tests/grad_reductions.py OUT.json SHARDING

One update of 4 micro-batches on tiny-random. SHARDING fsdp shards over both ranks; hsdp runs them as
2 nodes of 1 (LOCAL_WORLD_SIZE=1: a replica each, so the only reduction is the all-reduce across
nodes). Counted by wrapping the torch.distributed functions FSDP2 calls for them (torch 2.13,
fsdp/_fully_shard/_fsdp_collectives.py foreach_reduce: reduce_scatter_single, all_reduce). Rank 0
writes, per mode: the reduce-scatters and all-reduces per FSDP2 module, the most gradient bytes rank 0
held between micro-batches (FSDP2's accumulated unsharded gradients, its sharded ones and HSDP's partial
sums: torch 2.13, fsdp/_fully_shard/_fsdp_param.py, unsharded_accumulated_grad), and the updated parameters' largest
difference from the micro_batch mode's.
"""

import json
import os
import sys

import torch
import torch.distributed as tdist
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minigdpo import dist, fsdp, models, policy  # noqa: E402
from minigdpo.config import Config  # noqa: E402
from minigdpo.sampler import Completion  # noqa: E402
from microbatches import micro_batches  # noqa: E402
from minigdpo import update as update_module  # noqa: E402
from minigdpo.update import normaliser, optimizer, scheduler, update  # noqa: E402


class Reductions:
    """Counts the reduce-scatters and all-reduces issued while it is entered."""

    def __init__(self):
        self.counts = {"reduce_scatter": 0, "all_reduce": 0}

    def __enter__(self):
        self.orig = tdist.reduce_scatter_single, tdist.all_reduce

        def wrap(name, fn):
            def counted(*args, **kwargs):
                self.counts[name] += 1
                return fn(*args, **kwargs)
            return counted

        tdist.reduce_scatter_single = wrap("reduce_scatter", self.orig[0])
        tdist.all_reduce = wrap("all_reduce", self.orig[1])
        return self

    def __exit__(self, *exc):
        tdist.reduce_scatter_single, tdist.all_reduce = self.orig


def grad_bytes(model):
    """Bytes of gradient this rank holds: FSDP2's accumulated whole gradients, its sharded .grad, and the
    reduce-scattered sums HSDP keeps until its all-reduce (_fsdp_param_group.py, _partial_reduce_output)."""
    total = 0
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        partial = getattr(group, "_partial_reduce_output", None)
        total += partial.numel() * partial.element_size() if partial is not None else 0
        for p in group.fsdp_params if group else []:
            held = [p.unsharded_accumulated_grad, getattr(getattr(p, "_unsharded_param", None), "grad", None),
                    p.sharded_param.grad.to_local() if p.sharded_param.grad is not None else None]
            total += sum(t.numel() * t.element_size() for t in held if t is not None)
    return total


def main(out, sharding):
    path = models.resolve_model("tiny-random")  # before the group: transformers saves on rank 0 only with one
    if sharding == "hsdp":
        os.environ["LOCAL_WORLD_SIZE"] = "1"
    device = dist.init(sharding)
    g = torch.Generator().manual_seed(dist.rank())
    prompts = [[5, 6, 7, 8]] * 8
    comps = [Completion(torch.randint(3, 250, (5,), generator=g).tolist(), [0.0] * 5) for _ in range(8)]
    adv = torch.randn(8, generator=g)
    result, params = {}, {}
    for mode in ("micro_batch", "step"):
        torch.manual_seed(0)
        model = policy.build(path, device, torch.float32)
        opt = optimizer(model, 1e-3, 0.0)
        sched = scheduler(opt, 10, 0.0, "constant")
        cfg = Config(beta=0.0, max_new_tokens=5, reduce_grads=mode, logprob_chunk=64)
        batches = micro_batches(prompts, comps, adv, 2, 257, device, 4)  # 4 micro-batches
        modules = sum(isinstance(m, FSDPModule) for m in model.modules())  # the decoder layers and the root
        peak, reduce = [0], fsdp.reduce_gradients

        def sampled(*args, **kwargs):  # before each micro-batch: what the previous backwards left
            peak[0] = max(peak[0], grad_bytes(model))
            return reduce(*args, **kwargs)

        fsdp.reduce_gradients = sampled
        norm = normaliser(batches, cfg)  # its all-reduce of the counts is the update's own, not FSDP2's: not counted
        update_module.normaliser = lambda *a: norm
        with Reductions() as counted:
            update(model, opt, sched, batches, cfg)
        fsdp.reduce_gradients, update_module.normaliser = reduce, normaliser
        result[mode] = {k: v / modules for k, v in counted.counts.items()} | {"micro_batches": len(batches),
                                                                              "peak_grad_bytes": peak[0]}
        params[mode] = {n: t.clone() for n, t in model.whole_weights()}
    result["param_diff"] = max((params["step"][n] - params["micro_batch"][n]).abs().max().item() for n in params["step"])
    result["param_bytes_fp32"] = 4 * sum(p.numel() for p in model.parameters())
    if dist.is_main():
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
    dist.cleanup()  # once main's sharded models are gone: they hold the group
