"""One policy update on a fixed global batch, split over however many ranks run it.

    torchrun --nproc_per_node 2 tests/dist_update.py OUT.pt [AGG [SHARDING [lora]]]

Rank 0 saves the full parameters and the loss statistics to OUT.pt; the test compares the
1-rank and 2-rank results. With `lora` the policy trains rank-4 adapters and its reference is
itself with the adapters off; the saved parameters are then the merged ones. The micro-batch size differs between the two runs on purpose.
"""

import os
import sys
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minigdpo import dist, lora, models, policy  # noqa: E402
from minigdpo.config import Config  # noqa: E402
from minigdpo.sampler import Completion  # noqa: E402
from microbatches import micro_batches  # noqa: E402
from minigdpo.update import fill_logprobs, optimizer, scheduler, step_metrics, update  # noqa: E402


def main(out, agg, sharding, lora_settings=None):
    path = models.resolve_model("tiny-random")  # before the group: transformers saves on rank 0 only with one
    device = dist.init(sharding)
    torch.manual_seed(0)
    model = policy.build(path, device, torch.float32, lora_settings=lora_settings)
    ref = policy.build(path, device, torch.float32, frozen=True) if lora_settings is None else None
    opt = optimizer(model, 1e-3, 0.0)
    sched = scheduler(opt, 10, 0.0, "constant")
    g = torch.Generator().manual_seed(123)
    S, G = 8, 2  # global sequences, completions per prompt
    prompts = [torch.randint(0, 250, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(S // G)]
    prompts = [p for p in prompts for _ in range(G)]
    comps = []
    for _ in range(S):
        n = int(torch.randint(1, 7, (1,), generator=g))
        comps.append(Completion(torch.randint(0, 250, (n,), generator=g).tolist(), (-torch.rand(n, generator=g)).tolist()))
    adv = torch.randn(S, generator=g)
    world, rank = dist.world_size(), dist.rank()
    per = S // world
    mine = slice(rank * per, (rank + 1) * per)
    cfg = Config(num_iterations=2, temperature=1.0, logprob_chunk=3, importance_sampling_cap=0.0, clip_low=0.2, clip_high=0.2,
                 beta=0.1, loss_agg=agg, max_new_tokens=6, max_grad_norm=1.0, grad_checkpointing="false")
    batches = micro_batches(prompts[mine], comps[mine], adv[mine], 3 if world == 1 else 2, 257, device, G)
    if ref is not None:
        fill_logprobs(ref, batches, "ref_logp", cfg)
    else:
        with lora.adapters_off(model):
            fill_logprobs(model, batches, "ref_logp", cfg)
    fill_logprobs(model, batches, "old_logp", cfg)
    totals = update(model, opt, sched, batches, cfg)
    stats = step_metrics(totals)
    params = {name: t.clone() for name, t in model.whole_weights()}
    if dist.is_main():
        torch.save({"params": params, "stats": stats, "mesh": tuple(dist.mesh().shape)}, out)


if __name__ == "__main__":
    settings = lora.Settings(4, 8.0, 0.0, ("q_proj", "v_proj", "down_proj")) if sys.argv[4:] == ["lora"] else None
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "token_mean", sys.argv[3] if len(sys.argv) > 3 else "auto",
         settings)
    dist.cleanup()  # once main's sharded models are gone: they hold the group
