"""Curves of one or more runs from their metrics.jsonl, overlaid (for example a GRPO and a GDPO run).

    python plot.py runs/grpo runs/gdpo -o curves.png

One panel per reward mean, then the KL, the completion length, the number of distinct advantage
values per group (the reward-collapse signal), the share of sampled groups the estimator cannot learn
from, and the completions sampled per completion trained on (above 1 only with --dynamic-sampling).
Needs matplotlib (pip install 'minigdpo[plot]').
"""

import argparse
import json
import math
import os

PANELS = [("kl", "KL to the reference"), ("completion/len_mean", "completion length (tokens)"),
          ("adv/distinct_per_group", "distinct advantages per group"),
          ("sampling/uninformative_frac", "groups with no signal (share sampled)"),
          ("sampling/samples_per_trained", "completions sampled per one trained")]


def read_run(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"error: {path} does not exist (is {run_dir} a minigdpo output directory?)")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def panels_for(runs):
    """Every reward mean seen in any run, in first-seen order, then the fixed panels some run logged."""
    rewards = []
    for rows in runs.values():
        for key in rows[0] if rows else []:
            if key.startswith("reward/") and key.endswith("/mean") and key not in rewards:
                rewards.append(key)
    logged = [(k, title) for k, title in PANELS if any(k in row for rows in runs.values() for row in rows)]
    return [(k, f"reward: {k[len('reward/'):-len('/mean')]}") for k in rewards] + logged


def plot(run_dirs, out, labels=None):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install 'minigdpo[plot]'") from None
    labels = labels or [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    runs = {label: read_run(d) for label, d in zip(labels, run_dirs)}
    panels = panels_for(runs)
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        for label, data in runs.items():
            points = [(r["step"], r[key]) for r in data if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="output directories of train.py runs")
    p.add_argument("-o", "--output", default="curves.png", help="PNG to write")
    p.add_argument("--labels", help="comma-separated legend labels (default: directory names)")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else None
    if labels and len(labels) != len(args.runs):
        p.error(f"--labels has {len(labels)} names for {len(args.runs)} runs")
    print(f"wrote {plot(args.runs, args.output, labels)}")


if __name__ == "__main__":
    main()
