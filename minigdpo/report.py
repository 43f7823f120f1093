"""What the user sees of a run: a tqdm bar with the rewards' means, metrics.jsonl (always), samples.jsonl, optional
wandb, one sampled conversation on the console every --samples-every steps (an agent's), and the start/end table.

Metric keys are namespaced: reward/<name>/..., adv/..., loss/..., kl, tools/..., time/... (docs/outputs.md).
"""

import json
import math
import os
import sys
from collections import deque

import torch
from tqdm import tqdm

from minigdpo import dist
from minigdpo.scoring import RewardScorer


def reward_metrics(rewards, names, counts_per_rank):
    """Per-reward mean and std over the global batch (NaN left out) and the scorer's failure counts,
    summed over ranks. rewards: (B, G, R); counts_per_rank: every rank's {name: {kind: n}}."""
    flat = rewards.reshape(-1, rewards.shape[-1])                    # (B*G, R)
    out = {}
    for k, name in enumerate(names):
        valid = flat[:, k][~torch.isnan(flat[:, k])]
        out[f"reward/{name}/mean"] = valid.mean().item() if valid.numel() else float("nan")
        out[f"reward/{name}/std"] = valid.std().item() if valid.numel() > 1 else 0.0
        for key, value in RewardScorer.merge(counts_per_rank)[name].items():  # failures; a reward model's truncations
            if key.startswith("metric/"):                                       # and memory; a TRL-style log_metric
                out[f"reward/{name}/{key[7:]}"] = value[0] / max(value[1], 1)
            elif key != "error":
                out[f"reward/{name}/{key}"] = value
    return out


class Logger:
    """Rank 0's sinks (module docstring); on resume, the rows after the resumed step (the lost run's) are dropped."""

    def __init__(self, output_dir, total_steps, start_step, run_config, wandb_project=""):
        self.main, self.first, self.recent = dist.is_main(), None, deque(maxlen=3)  # what the start/end table needs
        if not self.main:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.metrics_path, self.samples_path = (os.path.join(output_dir, f) for f in ("metrics.jsonl", "samples.jsonl"))
        for path in (self.metrics_path, self.samples_path):
            if os.path.exists(path):
                with open(path) as f:
                    kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= start_step]
                with open(path, "w") as f:
                    f.writelines(kept)
        with open(os.path.join(output_dir, "config.json"), "w") as f:
            json.dump(run_config, f, indent=2)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="steps", dynamic_ncols=True)
        self.wandb = None
        if wandb_project:
            import wandb  # only when asked for

            self.wandb = wandb.init(project=wandb_project, config=run_config, resume="allow")

    def log(self, step, metrics):
        if not self.main:
            return
        finite = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in metrics.items()}
        row = {"step": step, **finite}
        self.first = self.first or row
        self.recent.append(row)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        self.bar.update(1)
        shown = {k.split("/")[1] if k.startswith("reward/") else k.split("/")[-1]: v for k, v in metrics.items()
                 if (k.startswith("reward/") and k.endswith("/mean"))
                 or k in ("kl", "sampling/uninformative_frac", "sampling/rounds", "time/step")}
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()})

    def samples(self, step, rows):
        """rows to samples.jsonl, and the first one on the console, shortened (TRL's log_completions)."""
        if self.main:
            with open(self.samples_path, "a") as f:
                f.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)
            self.write(shown(step, rows[0]))

    def write(self, text, error=False):
        """A line above the progress bar (stderr for warnings and errors)."""
        if self.main:
            tqdm.write(text, file=sys.stderr if error else sys.stdout)

    def close(self):
        """Ends the bar and the W&B run; a second call does nothing."""
        if self.main:
            self.bar.close()
            if self.wandb is not None:
                self.wandb.finish()
                self.wandb = None


def shown(step, row, width=160):
    """One sample as a few console lines: the prompt's end, each message (a tool call as name(arguments)), the
    rewards and the advantage; every text cut to `width` characters."""
    def cut(text):
        text = " ".join(str(text).split())
        return text if len(text) <= width else text[:width - 3] + "..."

    messages = row.get("conversation") or [{"role": "assistant", "content": row["completion"]}]
    lines = [f"sample at step {step}: ...{cut(row['prompt'][-width:])}"]
    for m in messages:
        calls = ", ".join(f"{c['function']['name']}({json.dumps(c['function'].get('arguments'))})"
                          for c in m.get("tool_calls") or [])
        lines.append(f"  {m['role']}: {cut(m.get('content') or '')}" + (f" -> {cut(calls)}" if calls else ""))
    rewards = ", ".join(f"{k} {v:.3g}" for k, v in row["rewards"].items())
    return "\n".join(lines + [f"  rewards: {rewards}; advantage {row['advantage']:.3g}"])


def start_end_table(first, last, names):
    """Reward means at the first step of this run (sampled before any update) and over the last steps."""
    if not first:
        return ""
    last, w = list(last), max([14] + [len(n) for n in names])  # names as wide as the longest, module:function ones too

    def avg(rows, key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return sum(values) / len(values) if values else float("nan")

    rows = [(n, avg([first], f"reward/{n}/mean"), avg(last, f"reward/{n}/mean")) for n in names]
    return "\n".join([f"{'reward':<{w}} {'start':>8} {'end':>8}   (step {first['step']} vs mean of steps "
                      f"{last[0]['step']}-{last[-1]['step']})"] + [f"{n:<{w}} {a:>8.3f} {b:>8.3f}" for n, a, b in rows])
