"""An agent learns by RL when a tool pays: the tiny agent on the calculator task, on CPU, offline, in about a minute.

examples/tiny_agent.py teaches a 150k-parameter Llama, in about 20 s, to call the calculator task's tool half the
time (rewards/calculator.py): it adds single digits right on its own, but gets two-digit products right only
through the tool. train.py then trains it with the tool loop (minigdpo/tools.py) on the task's three rewards, which
conflict: the right answer, its format, and tool economy (1 / (1 + calls), weighed 0.5). Each estimator runs over
--seeds seeds; the script prints each kind's call rate and share of right answers at step 1 and over the last 10
steps, and plots both per step (means over seeds).

    python examples/agent_cpu.py                                   # gdpo and grpo, seeds 0-2, 60 steps each
    python examples/agent_cpu.py --estimators gdpo --seeds 1 --plot docs/agent_cpu.png
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_agent  # noqa: E402

CURVES = {"calls on sums": "reward/tool_economy/calls_easy", "calls on products": "reward/tool_economy/calls_hard",
          "sums right": "reward/solved/easy", "products right": "reward/solved/hard"}
RECIPE = ["--preset", "smoke", "--task", "calculator", "--tools", "rewards.calculator:calculate", "--reward-weights",
          "1,1,0.5", "--arith-difficulty", "2", "--max-new-tokens", "40", "--max-prompt-len", "128", "--group-size", "8",
          "--batch-size", "64", "--micro-batch-size", "64", "--lr", "5e-4", "--lr-schedule", "constant", "--beta",
          "0.04", "--temperature", "1.0", "--save-every", "0", "--samples-every", "20", "--dtype", "fp32"]


def train(model, estimator, seed, steps, out):
    """One run of train.py; its metrics.jsonl rows."""
    run_dir = os.path.join(out, f"{estimator}-seed{seed}")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *RECIPE, "--model", model, "--estimator",
                           estimator, "--seed", str(seed), "--max-steps", str(steps), "--output-dir", run_dir],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"train.py failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def plot(curves, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for estimator, rows in curves.items():
        for ax, names in zip(axes, (("calls on sums", "calls on products"), ("sums right", "products right"))):
            for name, style in zip(names, ("--", "-")):
                ax.plot(range(1, len(rows) + 1), [r[name] for r in rows], style, label=f"{estimator}: {name}")
    for ax, title in zip(axes, ("share of rollouts that call the tool", "share of right answers")):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--estimators", default="gdpo,grpo")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per estimator")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="runs/agent-cpu")
    parser.add_argument("--plot", default="", help="a PNG to draw the curves into (needs matplotlib)")
    args = parser.parse_args(argv)
    model = tiny_agent.cached()
    curves = {}
    print(f"{'estimator':<10} {'':<18} {'step 1':>7} {f'steps {args.steps - 9}-{args.steps}':>12}")
    for estimator in args.estimators.split(","):
        runs = [train(model, estimator, seed, args.steps, args.out) for seed in range(args.seeds)]
        curves[estimator] = [{name: mean([rows[s].get(key) for rows in runs]) for name, key in CURVES.items()}
                             for s in range(args.steps)]
        for name in CURVES:
            last = mean([row[name] for row in curves[estimator][-10:]])
            print(f"{estimator:<10} {name:<18} {curves[estimator][0][name]:>7.2f} {last:>12.2f}")
    if args.plot:
        plot(curves, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
