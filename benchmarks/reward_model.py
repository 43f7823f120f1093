"""What a reward model costs a CPU step: the demo's 32 completions scored by a 135M reward model.

    python benchmarks/reward_model.py            # needs the demo model (README command 1)

The reward model is SmolLM2-135M-Instruct as a sequence classifier (LlamaForSequenceClassification: the demo
model's layers, a seeded random one-label head), written once to the cache; its scores mean nothing, its
cost is a real 135M reward model's. The conversations are the demo's: arith prompts with completions of
about 24 tokens (the trained model's length). Each setting scores the batch 3 times; the median is printed.
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minigdpo import models  # noqa: E402
from minigdpo.scoring import RewardScorer  # noqa: E402
from rewards import load_task, reward_model  # noqa: E402


def build(path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    source = models.resolve_model(models.DEMO_MODEL)
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1, dtype=torch.float32)
    rm.config.pad_token_id = rm.config.eos_token_id
    rm.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)


def main():
    path = models.build_once("SmolLM2-135M-reward-model", build)
    task = load_task("arith", data_options={"arith_difficulty": 1})
    examples = [task.examples[i // 8] for i in range(32)]                  # 4 prompts x G = 8, as a demo step
    completions = [f"<think>{i} + 3 = {i + 3}</think>\n<answer>{i + 3}</answer>" for i in range(32)]
    spec = f"model:{path}"
    print(f"{'placement':<10} {'batch':>6} {'seconds / 32 completions':>26} {'weights GiB':>12}")
    for placement, batch in [("resident", 8), ("resident", 32), ("offload", 8)]:
        reward_model.forget(spec)
        scorer = RewardScorer([spec])
        scorer.place_models(torch.device("cpu"), torch.float32, batch, placement)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            _, stats = scorer(completions, examples)
            times.append(time.perf_counter() - t0)
        gib = sum(p.numel() * p.element_size() for p in reward_model.get(spec).model.parameters()) / 2**30
        print(f"{placement:<10} {batch:>6} {statistics.median(times):>26.2f} {gib:>12.2f}")
    print(f"({torch.get_num_threads()} threads; {stats[spec]['truncated']} truncated)")


if __name__ == "__main__":
    main()
