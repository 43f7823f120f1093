"""A 2-rank checkpoint write where each rank is given its own output directory, as two nodes with
different --output-dir paths were before check_shared looked at each rank's own: rank 1's shards land
where rank 0 cannot see them.

    torchrun --nproc_per_node 2 tests/split_save.py DIR

Rank r saves into DIR/rank{r}; each rank prints one line: "saved PATH" or "error: MESSAGE".
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minigdpo import checkpoint, dist, models, policy  # noqa: E402
from minigdpo.update import optimizer, scheduler  # noqa: E402


def main(root):
    path = models.resolve_model("tiny-random")  # before the group: transformers saves on rank 0 only with one
    device = dist.init()
    model = policy.build(path, device, torch.float32)
    opt = optimizer(model, 1e-3, 0.0)
    sched = scheduler(opt, 10, 0.0, "constant")
    out = os.path.join(root, f"rank{dist.rank()}")
    try:
        line = "saved " + checkpoint.save(out, 1, model, opt, sched, models.load_tokenizer(path),
                                          {"cursor": 0, "derived": {"world_size": 2}}, torch.float32, keep=2)
    except checkpoint.CheckpointError as e:
        line = f"error: {e}"
    sys.stdout.write(f"rank {dist.rank()}: {line}\n")  # one write: the ranks share the pipe
    sys.stdout.flush()
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    dist.cleanup()  # once main's sharded model is gone: it holds the group
