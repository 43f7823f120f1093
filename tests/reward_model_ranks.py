"""Two gloo ranks score with one sharded reward model; rank 1's batch holds a completion its template refuses.

    torchrun --nproc_per_node 2 tests/reward_model_ranks.py MODEL_DIR

Each rank prints whether it scored or how it stopped (tests/test_reward_model.py reads it).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minigdpo import dist, policy  # noqa: E402
from minigdpo.scoring import RewardScorer  # noqa: E402
from rewards import reward_model  # noqa: E402

if __name__ == "__main__":
    dist.init()
    spec = f"model:{sys.argv[1]}"
    scorer = RewardScorer([spec])
    scorer.place_models(dist.device(), torch.float32, 2, "shard", policy.build_classifier)
    completions = ["fine", "FAIL" if dist.rank() == 1 else "also fine"]
    try:
        scorer(completions, [{"messages": [{"role": "user", "content": "hi"}]}] * 2)
        print(f"rank {dist.rank()} scored", flush=True)
    except reward_model.RewardModelError as e:
        print(f"rank {dist.rank()} stopped: {e}", flush=True)
    dist.cleanup()
