"""A CPU experiment where GDPO and GRPO diverge: three rewards of unequal difficulty.

    python examples/toy_multireward.py                 # all settings, 8 seeds each, about 80 s on 2 cores
    python examples/toy_multireward.py --plot toy.png  # and the curves (needs matplotlib)
    python examples/toy_multireward.py --dynamic-sampling   # each setting with and without dynamic sampling

The task. Each of P prompts has a hidden 8-bit target. A response is 8 binary tokens. Three
rewards check different parts of it against the target:

    easy    bit 0 right              (a random response succeeds 1/2 of the time)
    medium  bits 1-2 right           (1/4)
    hard    bits 3-7 right           (1/32)

so "every reward satisfied" means all 8 bits right (1/256 at the start). The policy is a table of
per-prompt, per-bit logits (a factorised categorical over the 256 responses), trained with
minigdpo's own estimators (`minigdpo.advantages`) and clipped-surrogate loss (`minigdpo.update`):
sample G responses per prompt, score, compute advantages, one Adam step on the token-mean loss.

Why the methods should differ. GRPO z-scores the summed reward, so a sample that gets only the
hard reward right looks exactly like one that gets only the easy reward right (same sum), and
the hard reward's rare successes are diluted by the easy reward's variance. GDPO z-scores each
reward within its group first, so a rare hard success stands out. The settings below vary the
group size and the difficulty gap, because the paper's effect should be strongest with small
groups and unequal difficulty, and vanish when the rewards are equally hard.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minigdpo.estimators import REGISTRY, informative_groups  # noqa: E402
from minigdpo.update import policy_loss  # noqa: E402

BITS = 8
SETTINGS = {  # name: (reward bit groups, group size G)
    "unequal, G=4": ([[0], [1, 2], [3, 4, 5, 6, 7]], 4),
    "unequal, G=16": ([[0], [1, 2], [3, 4, 5, 6, 7]], 16),
    "equal, G=4": ([[0, 1], [2, 3], [4, 5]], 4),
}
NAMES = {3: ["easy", "medium", "hard"]}
# GRPO, GDPO and GDPO's successors at their defaults (gd2po: snr, tau 0.8; SAW: no shift, the rewards are 0/1).
REGISTRY_RUN = ("grpo", "gdpo", "gd2po", "saw_gdpo", "saw_grpo")
COLOURS = {"grpo": "tab:blue", "gdpo": "tab:red", "gd2po": "tab:green", "saw_gdpo": "tab:purple", "saw_grpo": "tab:orange"}


def run(estimator, groups, G, seed, steps=200, prompts=32, batch=16, lr=0.05, dynamic=False, max_rounds=4):
    """Train one policy; returns per-step success rates (steps, R + 1): each reward, then all of them, on
    the step's first `batch` groups (before any filtering), and the completions sampled in all.

    dynamic=True is train.py's --dynamic-sampling: a round of `batch` prompts keeps the groups the
    estimator can tell apart (informative_groups), and rounds follow, at most max_rounds, until `batch`
    are found; the step trains on those (at the cap, on what it found; on none, it skips the update)."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, 2, (prompts, BITS), generator=g)               # (P, BITS)
    logits = torch.zeros(prompts, BITS, requires_grad=True)                   # (P, BITS) the policy
    opt = torch.optim.Adam([logits], lr=lr)
    masks = torch.zeros(len(groups), BITS, dtype=torch.bool)                  # (R, BITS)
    for k, bits in enumerate(groups):
        masks[k, bits] = True
    all_bits = masks.any(0)                                                   # (BITS,)
    history, sampled = [], 0
    for _ in range(steps):
        kept = []                                                             # (idx, bits, rewards) per round
        for round_ in range(max_rounds if dynamic else 1):
            idx = torch.randint(0, prompts, (batch,), generator=g)            # (B,)
            p = torch.sigmoid(logits[idx]).detach()                           # (B, BITS)
            bits = (torch.rand(batch, G, BITS, generator=g) < p[:, None]).long()  # (B, G, BITS) sampled responses
            right = bits == targets[idx][:, None]                             # (B, G, BITS)
            rewards = torch.stack([right[..., m].all(-1) for m in masks], -1).float()  # (B, G, R)
            sampled += batch * G
            if round_ == 0:
                every = right[..., all_bits].all(-1).float().mean()
                history.append(torch.cat([rewards.mean((0, 1)), every.reshape(1)]))
            keep = informative_groups(rewards, None, estimator) if dynamic else torch.ones(batch, dtype=torch.bool)
            kept.append((idx[keep], bits[keep], rewards[keep]))
            if sum(len(k[0]) for k in kept) >= batch:
                break
        idx, bits, rewards = (torch.cat(parts)[:batch] for parts in zip(*kept))  # (K, ...), K <= batch
        if len(idx) == 0:
            continue
        adv = REGISTRY[estimator].advantages(rewards, None)                            # (K, G)
        lp = torch.nn.functional.logsigmoid(torch.where(bits == 1, 1.0, -1.0) * logits[idx][:, None])  # (K, G, BITS)
        lp = lp.reshape(len(idx) * G, BITS)                                   # (N, T): one token per bit
        loss, _ = policy_loss(lp, lp.detach(), None, adv.reshape(-1), torch.ones_like(lp), beta=0.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.stack(history), sampled                                      # (steps, R + 1), completions


def summarise(curves, last=30):
    """Mean +- std over seeds of the success rates averaged over the last `last` steps."""
    final = curves[:, -last:].mean(1)                                         # (seeds, R + 1)
    return final.mean(0), final.std(0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--plot", metavar="PNG", help="draw the curves of every setting")
    p.add_argument("--dynamic-sampling", action="store_true", help="compare every setting with and without it")
    p.add_argument("--estimators", default=",".join(REGISTRY_RUN),
                   help=f"comma-separated, of {', '.join(REGISTRY)} (default: {','.join(REGISTRY_RUN)})")
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    if args.dynamic_sampling:
        return compare_dynamic(args.seeds, args.steps, t0)
    results = {}
    for setting, (groups, G) in SETTINGS.items():
        for est in args.estimators.split(","):
            results[setting, est] = torch.stack([run(est, groups, G, seed, args.steps)[0] for seed in range(args.seeds)])
    cols = ["reward 1", "reward 2", "reward 3", "all three"]
    print(f"success rate over the last 30 of {args.steps} steps, mean +- std over {args.seeds} seeds")
    print(f"{'setting':<15} {'method':<8} " + " ".join(f"{c:>15}" for c in cols))
    for setting, est in results:
        mean, std = summarise(results[setting, est])
        print(f"{setting:<15} {est:<8} " + " ".join(f"{m:>8.3f} +- {s:.3f}" for m, s in zip(mean, std)))
    print(f"({time.time() - t0:.0f} s; rewards are easy/medium/hard in the unequal settings, 2 bits each when equal)")
    if args.plot:
        plot(results, args.plot, cols)


def compare_dynamic(seeds, steps, t0):
    """The final "all three" success rate with and without dynamic sampling, and the completions sampled."""
    print(f'"all three" success over the last 30 of {steps} steps (mean +- std over {seeds} seeds), and the '
          "completions sampled per run (mean), with dynamic sampling (at most 4 rounds) and without")
    print(f"{'setting':<15} {'method':<6} {'dynamic':<8} {'all three':>16} {'completions sampled':>20}")
    for setting, (groups, G) in SETTINGS.items():
        for est in ("grpo", "gdpo"):
            for dynamic in (False, True):
                runs = [run(est, groups, G, seed, steps, dynamic=dynamic) for seed in range(seeds)]
                mean, std = summarise(torch.stack([curve for curve, _ in runs]))
                total = sum(n for _, n in runs) / seeds
                print(f"{setting:<15} {est:<6} {'yes' if dynamic else 'no':<8} {mean[-1]:>8.3f} +- {std[-1]:.3f} "
                      f"{total:>20,.0f}", flush=True)
    print(f"({time.time() - t0:.0f} s)")


def plot(results, path, cols):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install 'minigdpo[plot]'") from None
    settings = list(SETTINGS)
    fig, axes = plt.subplots(len(settings), len(cols), figsize=(14, 3.2 * len(settings)), squeeze=False)
    for i, setting in enumerate(settings):
        for est in sorted({e for _, e in results}, key=list(COLOURS).index):
            color = COLOURS[est]
            curves = results[setting, est]                                    # (seeds, steps, R + 1)
            c = torch.cumsum(curves, 1)                                       # trailing mean over 10 steps
            smooth = (c - torch.nn.functional.pad(c, (0, 0, 10, 0))[:, :-10]) / torch.arange(1, c.shape[1] + 1).clamp(max=10)[:, None]
            mean, std = smooth.mean(0).T, smooth.std(0).T                     # (R + 1, steps)
            x = range(mean.shape[1])
            for j in range(len(cols)):
                ax = axes[i, j]
                ax.plot(x, mean[j], color=color, label=est)
                ax.fill_between(x, mean[j] - std[j], mean[j] + std[j], color=color, alpha=0.2)
                ax.set_title(f"{setting}: {cols[j]}", fontsize=9)
                ax.set_ylim(0, 1)
                ax.grid(alpha=0.3)
        axes[i, 0].set_ylabel("success rate")
    axes[0, 0].legend()
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
