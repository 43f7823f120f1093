"""One step of train.py recorded: each rank's micro-batches (its sequences, their tool masks, advantages and the
sampler's log-probs), the weights before the update and the gradient the optimizer step sees, saved for the hand
computations of tests/test_tools.py (the tool mask) and tests/test_async.py (the decoupled objective).

    python tests/agent_step.py OUT [--record-step N] [train.py flags]             # one rank; step N (default 1)
    torchrun --nproc_per_node 2 tests/agent_step.py OUT [flags]                   # two gloo ranks

OUT/rank{r}.pt holds {"sequences": [(prompt ids, completion ids, tool mask, advantage, sampler log-probs)],
"before": {name: tensor}, "grads": {name: tensor}} (weights and gradients whole, on every rank).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402
from minigdpo import dist  # noqa: E402


def whole(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def main(out, argv, record=1):
    seen = {"sequences": [], "grads": {}, "before": {}}
    update, optimizer, step = train.update, train.optimizer, [0]

    def recording_update(model, opt, sched, batches, cfg):
        step[0] += 1
        if step[0] != record:
            return update(model, opt, sched, batches, cfg)
        seen["before"] = {n.removeprefix("lm."): whole(p) for n, p in model.named_parameters()}
        for mb in batches:  # each sequence as the trainer reads it: prompt, completion, what the loss counts
            index = torch.repeat_interleave(torch.arange(len(mb.repeats)), mb.repeats.cpu())
            lengths = torch.bincount(mb.out_index.cpu() // mb.completion_ids.shape[1], minlength=len(index))
            for row in range(mb.seqs):
                n = int(lengths[row])
                prompt = mb.prompt_ids[index[row]][mb.prompt_mask[index[row]].bool()].tolist()
                seen["sequences"].append((prompt, mb.completion_ids[row, :n].tolist(), mb.mask[row, :n].tolist(),
                                          mb.adv[row].item(), mb.sampler_logp[row, :n].tolist()))
        return update(model, opt, sched, batches, cfg)

    def recording_optimizer(model, lr, weight_decay):
        opt = optimizer(model, lr, weight_decay)
        names = {id(p): n.removeprefix("lm.") for n, p in model.named_parameters()}

        def hook(o, args, kwargs):
            if step[0] == record:
                seen["grads"].update({names[id(p)]: whole(p.grad) for g in o.param_groups for p in g["params"]
                                      if p.grad is not None})
        opt.register_step_pre_hook(hook)
        return opt

    train.update, train.optimizer = recording_update, recording_optimizer
    try:
        train.run_training(argv)
    finally:
        train.update, train.optimizer = update, optimizer
    os.makedirs(out, exist_ok=True)
    torch.save(seen, os.path.join(out, f"rank{dist.rank()}.pt"))


if __name__ == "__main__":
    args = sys.argv[2:]
    at = args.index("--record-step") if "--record-step" in args else None
    main(sys.argv[1], args if at is None else args[:at] + args[at + 2:], 1 if at is None else int(args[at + 1]))
    dist.cleanup()
