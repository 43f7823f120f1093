"""What the user sees: a tqdm bar, metrics.jsonl (always), samples.jsonl, optional wandb.

Only rank 0 writes. Metric keys are namespaced: reward/<name>/..., adv/..., loss/...,
kl, completion/..., sampler/..., time/..., throughput/...
"""

import json
from collections import deque
import math
import os
import sys

import torch
from tqdm import tqdm

from minigdpo import dist


def _json_safe(value):
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def reward_metrics(rewards, names, counts):
    """Per-reward mean/std over the global batch (NaN left out) and the failure counts.

    rewards: (B, G, R) raw reward tensor; counts: {name: {"errors": n, ...}} summed over ranks.
    """
    flat = rewards.reshape(-1, rewards.shape[-1])                    # (B*G, R)
    out = {}
    for k, name in enumerate(names):
        col = flat[:, k]
        valid = col[~torch.isnan(col)]
        out[f"reward/{name}/mean"] = valid.mean().item() if valid.numel() else float("nan")
        out[f"reward/{name}/std"] = valid.std().item() if valid.numel() > 1 else 0.0
        for kind, n in counts.get(name, {}).items():
            if kind != "seconds":
                out[f"reward/{name}/{kind}"] = n
    return out


def sum_counts(per_rank):
    """Add the reward scorer's stats dicts of all ranks."""
    total = {}
    for stats in per_rank:
        for name, kinds in stats.items():
            slot = total.setdefault(name, {})
            for kind, n in kinds.items():
                slot[kind] = slot.get(kind, 0) + n
    return total


class Logger:
    """Rank 0's sinks. On resume, metrics after the resumed step (from the lost run) are dropped."""

    def __init__(self, output_dir, total_steps, start_step, run_config, wandb_project=""):
        self.main = dist.is_main()
        self.first, self.recent = None, deque(maxlen=3)  # all the start/end table needs: memory stays flat
        if not self.main:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.metrics_path = os.path.join(output_dir, "metrics.jsonl")
        self.samples_path = os.path.join(output_dir, "samples.jsonl")
        self._truncate_after(self.metrics_path, start_step)
        self._truncate_after(self.samples_path, start_step)
        with open(os.path.join(output_dir, "config.json"), "w") as f:
            json.dump(run_config, f, indent=2)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="steps", dynamic_ncols=True)
        self.wandb = None
        if wandb_project:
            import wandb  # only when asked for

            self.wandb = wandb.init(project=wandb_project, config=run_config, resume="allow")

    @staticmethod
    def _truncate_after(path, step):
        if not os.path.exists(path):
            return
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
        with open(path, "w") as f:
            f.writelines(kept)

    def log(self, step, metrics):
        if not self.main:
            return
        row = {"step": step, **{k: _json_safe(v) for k, v in metrics.items()}}
        self.first = self.first or row
        self.recent.append(row)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        self.bar.update(1)
        shown = {k.split("/")[1] if k.startswith("reward/") else k.split("/")[-1]: v for k, v in metrics.items()
                 if (k.startswith("reward/") and k.endswith("/mean")) or k in ("kl", "time/step")}
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items() if isinstance(v, (int, float))})

    def samples(self, step, rows):
        if not self.main:
            return
        with open(self.samples_path, "a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")

    def write(self, text, error=False):
        """A line above the progress bar (stderr for warnings and errors)."""
        if self.main:
            tqdm.write(text, file=sys.stderr if error else sys.stdout)

    def close(self):
        if self.main:
            self.bar.close()
            if self.wandb is not None:
                self.wandb.finish()


def start_end_table(first, last, reward_names):
    """Reward means at the first step of this run (sampled before any update) and over the `last` steps."""
    if not first:
        return ""
    last = list(last)

    def avg(rows, key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return sum(values) / len(values) if values else float("nan")

    lines = [f"{'reward':<14} {'start':>8} {'end':>8}   (step {first['step']} vs mean of steps "
             f"{last[0]['step']}-{last[-1]['step']})"]
    for name in reward_names:
        key = f"reward/{name}/mean"
        lines.append(f"{name:<14} {avg([first], key):>8.3f} {avg(last, key):>8.3f}")
    return "\n".join(lines)
