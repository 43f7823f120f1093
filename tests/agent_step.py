"""One step of train.py with the tool loop, recorded: each rank's micro-batches (its sequences, their tool masks and
advantages) and the gradient the optimizer step sees, saved for tests/test_tools.py's hand computation.

    python tests/agent_step.py OUT [train.py flags]                 # one rank
    torchrun --nproc_per_node 2 tests/agent_step.py OUT [flags]     # two gloo ranks

OUT/rank{r}.pt holds {"sequences": [(prompt ids, completion ids, tool mask, advantage)], "grads": {name: tensor}}
(the gradients whole, on every rank).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402
from minigdpo import dist  # noqa: E402


def main(out, argv):
    seen = {"sequences": [], "grads": {}}
    update, optimizer = train.update, train.optimizer

    def recording_update(model, opt, sched, batches, cfg):
        for mb in batches:  # each sequence as the trainer reads it: prompt, completion, what the loss counts
            index = torch.repeat_interleave(torch.arange(len(mb.repeats)), mb.repeats.cpu())
            lengths = torch.bincount(mb.out_index.cpu() // mb.completion_ids.shape[1], minlength=len(index))
            for row in range(mb.seqs):
                n = int(lengths[row])
                prompt = mb.prompt_ids[index[row]][mb.prompt_mask[index[row]].bool()].tolist()
                seen["sequences"].append((prompt, mb.completion_ids[row, :n].tolist(), mb.mask[row, :n].tolist(),
                                          mb.adv[row].item()))
        return update(model, opt, sched, batches, cfg)

    def recording_optimizer(model, lr, weight_decay):
        opt = optimizer(model, lr, weight_decay)
        names = {id(p): n.removeprefix("lm.") for n, p in model.named_parameters()}

        def hook(o, args, kwargs):
            seen["grads"].update({names[id(p)]: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                                  .detach().clone() for g in o.param_groups for p in g["params"] if p.grad is not None})
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
    main(sys.argv[1], sys.argv[2:])
    dist.cleanup()
