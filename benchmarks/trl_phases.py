"""Where a step of TRL's GRPOTrainer spends its time on vs_trl.py's work, by phase, from py-spy's samples.

minigdpo logs its own phases (`time/*` in metrics.jsonl); TRL logs none on the CPU, so this script samples its
process with py-spy (`pip install py-spy`, in the benchmark's environment) and sorts every sample of the main thread
by the phase its stack is in. The figures are seconds per step: the samples of all of a run's steps over the rate,
divided by the steps (its first, warm-up, included).

    python benchmarks/trl_phases.py --model smollm2 --steps 3          # runs vs_trl.py's TRL side under py-spy
    python benchmarks/trl_phases.py --raw trl.txt --steps 3            # sorts a py-spy --format raw file already made
"""

import argparse
import collections
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATE = 50  # samples a second

# A sample's phase: the first rule whose every marker is in its stack (frames as py-spy names them), else "other".
PHASES = [
    ("generation", ["_generate_and_score_completions", "(transformers/generation/utils.py"]),
    ("reference log-probs (no grad)", ["_generate_and_score_completions", "_get_per_token_logps"]),
    ("rewards", ["_generate_and_score_completions", "_calculate_rewards"]),
    ("backward: recomputed forward (gradient checkpointing)", ["training_step", "recompute_fn"]),
    ("backward", ["training_step", "backward ("]),
    ("loss: policy forward", ["training_step", "compute_loss"]),
    ("optimizer step", ["_inner_training_loop", "(torch/optim/"]),
]


def phase(stack):
    if "_inner_training_loop" not in stack:
        return None  # model load, setup, teardown: not a step's
    return next((name for name, markers in PHASES if all(m in stack for m in markers)), "other")


def sort(path, steps):
    seconds = collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            name = phase(stack)
            if name is not None:
                seconds[name] += int(count) / RATE / steps
    total = sum(seconds.values())
    print(f"TRL, seconds per step by phase (py-spy, {RATE} samples/s, {steps} steps)")
    for name, s in seconds.most_common():
        print(f"{name:<55} {s:7.1f} s  {100 * s / total:5.1f}%")
    print(f"{'in all':<55} {total:7.1f} s")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--raw", default="", help="a py-spy --format raw file of vs_trl.py's TRL side; none: make one")
    args = p.parse_args()
    raw = args.raw
    if not raw:
        raw = os.path.join(tempfile.mkdtemp(prefix="trl-phases-"), "trl.txt")
        cmd = ["py-spy", "record", "--format", "raw", "-r", str(RATE), "-o", raw, "--", sys.executable,
               os.path.join(ROOT, "benchmarks", "vs_trl.py"), "--child", "trl", "--model", args.model,
               "--steps", str(args.steps)]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    sort(raw, args.steps)


if __name__ == "__main__":
    main()
