"""Reward collapse: how many distinct advantage groups each estimator can produce.

Reproduces the paper's Figure 3. For binary rewards, a group of G samples with R rewards
is a G x R matrix of 0/1. We enumerate every such group, run the real estimator from
`minigdpo.advantages` on all of them at once, and count the distinct advantage vectors.

    python examples/collapse.py                  # the table, every estimator: G = 2..16 (R=2), R = 2..8 (G=4)
    python examples/collapse.py --plot out.png   # and the figure (needs matplotlib)
    python examples/collapse.py --example        # the paper's smallest example (G = 2, two rewards)
    python examples/collapse.py --informative    # the groups each estimator can learn from (--dynamic-sampling)
    python examples/collapse.py --write-docs     # rewrite the tables README.md and docs/ show (DOC_TABLES)

Counting rules:
- A group is a multiset of samples, so an advantage vector is compared sorted.
- Every estimator here is symmetric in its samples and (with equal weights) in its rewards,
  so the advantage multiset does not change when rows or columns of the 0/1 matrix are
  permuted. We enumerate multisets of rows (2^R kinds, G of them) or of columns
  (2^G kinds, R of them), whichever is fewer, never ordered tuples.
- The estimators run in float64 with eps = 0 so that the count reflects the formula, not
  the 1e-4 (or 1e-6) guard. GDPO's batch step (Eq. 6), and the batch steps of gdpo_verl
  (every completion one token long here) and gdpo_nemo, are one affine map shared by every
  group, so they neither merge nor split advantage groups (the paper's Figure 2 omits the
  batch step for the same reason). What separates the GDPO variants is the group step:
  gdpo_nemo's leave-one-out baselines give each sample its own scale. GD2PO's batch step whitens
  the rollouts it keeps and gives the others 0; the group step decides which.
- SAW (saw_gdpo, saw_grpo) is left out: its reward weights come from the whole batch, so its count
  depends on which groups share a batch, here the enumeration itself. On a batch whose weights differ
  it splits groups as weighted GDPO (saw_gdpo) or weighted GRPO (saw_grpo) with those weights.

Shape legend: M enumerated groups, G samples, R rewards.
"""

import argparse
import itertools
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minigdpo.estimators import REGISTRY, informative_groups  # noqa: E402

DECIMALS = 6
COUNTED = tuple(e for e in REGISTRY if not e.startswith("saw_"))  # SAW's weights come from the batch (above)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The pages that show a table this script prints, each in the fenced block after the line naming its command
# (tests/test_docs_tables.py checks them; --write-docs rewrites them, as a new estimator needs)
DOC_TABLES = [("README.md", ["--example"]), ("docs/estimators.md", ["--max-group", "8", "--max-rewards", "5"]),
              ("docs/conditions-and-dynamic-sampling.md", ["--informative"])]


def enumerate_groups(group_size, num_rewards):
    """Every binary (G, R) group up to row or column permutation, as an (M, G, R) tensor."""
    G, R = group_size, num_rewards
    by_rows = math.comb(2**R + G - 1, G)
    by_cols = math.comb(2**G + R - 1, R)
    if by_rows <= by_cols:
        patterns = torch.tensor(list(itertools.product([0.0, 1.0], repeat=R)), dtype=torch.float64)  # (2^R, R)
        idx = torch.tensor(list(itertools.combinations_with_replacement(range(2**R), G)))              # (M, G)
        return patterns[idx]                                                                            # (M, G, R)
    patterns = torch.tensor(list(itertools.product([0.0, 1.0], repeat=G)), dtype=torch.float64)      # (2^G, G)
    idx = torch.tensor(list(itertools.combinations_with_replacement(range(2**G), R)))                  # (M, R)
    return patterns[idx].transpose(1, 2)                                                                # (M, G, R)


def distinct_rows(advantages, decimals=DECIMALS):
    """Number of distinct sorted advantage vectors among the rows of (M, G)."""
    keys = torch.round(advantages.sort(dim=1).values * 10**decimals).long()  # (M, G)
    return torch.unique(keys, dim=0).shape[0]


def count_all(group_size, num_rewards, estimators=COUNTED):
    """{estimator: distinct advantage groups over all binary reward outcomes}, enumerating once."""
    if group_size < 2 or num_rewards < 1:
        raise ValueError("group_size must be >= 2 and num_rewards >= 1")
    groups = enumerate_groups(group_size, num_rewards)            # (M, G, R)
    return {name: distinct_rows(REGISTRY[name].advantages(groups, None, eps=0.0)) for name in estimators}  # (M, G) each


def count_distinct(estimator, group_size, num_rewards):
    """Distinct advantage groups that `estimator` gives over all binary reward outcomes."""
    return count_all(group_size, num_rewards, (estimator,))[estimator]


def table(group_sizes=range(2, 17), reward_counts=range(2, 9), fixed_rewards=2, fixed_group=4):
    """Rows of (axis, value, {estimator: count}) for both sweeps of Figure 3."""
    rows = []
    for G in group_sizes:
        rows.append(("G", G, count_all(G, fixed_rewards)))
    for R in reward_counts:
        rows.append(("R", R, count_all(fixed_group, R)))
    return rows


def format_table(rows):
    names = list(COUNTED)
    lines = []
    for axis, title in (("G", "rewards R = 2, group size G varies"), ("R", "group size G = 4, rewards R vary")):
        lines.append(f"{title}\n{axis:>3} " + " ".join(f"{n:>12}" for n in names))
        lines += [f"{v:>3} " + " ".join(f"{c[n]:>12}" for n in names) for a, v, c in rows if a == axis]
        lines.append("")
    return "\n".join(lines)


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install 'minigdpo[plot]'") from None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, axis, xlabel in ((axes[0], "G", "group size G (R = 2 rewards)"), (axes[1], "R", "number of rewards R (G = 4)")):
        xs = [v for a, v, _ in rows if a == axis]
        for name, marker in zip(COUNTED, "o^sDvP"):
            ax.plot(xs, [c[name] for a, _, c in rows if a == axis], marker=marker, label=name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("distinct advantage groups")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Reward collapse: distinct advantage groups over all binary reward outcomes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def two_sample_example():
    """The paper's smallest case (G=2, two binary rewards): every group and its advantages."""
    groups = enumerate_groups(2, 2)                                # (10, 2, 2)
    grpo = REGISTRY["grpo"].advantages(groups, None)                        # (10, 2)
    gdpo_sum = REGISTRY["gdpo"].group_step(groups, None)           # (10, 2) Eq. 4-5, before the batch step
    lines = [f"{'rewards of the 2 samples':<26} {'grpo advantages':>18} {'gdpo, Eq. 4-5':>18}"]
    for g, a, b in zip(groups.tolist(), grpo.tolist(), gdpo_sum.tolist()):
        pair = f"({g[0][0]:.0f},{g[0][1]:.0f}) vs ({g[1][0]:.0f},{g[1][1]:.0f})"
        lines.append(f"{pair:<26} {a[0]:>8.4f} {a[1]:>8.4f}  {b[0]:>8.4f} {b[1]:>8.4f}")
    return "\n".join(lines)


def informative_table(cases=((2, 2), (2, 3), (3, 3), (4, 2), (4, 3), (4, 4), (6, 3), (8, 3))):
    """For every binary group of G samples and R rewards (a multiset of G reward vectors): how many a
    variance filter on the summed reward keeps (DAPO's, and the peers'), how many each estimator can
    learn from (informative_groups), and how many GDPO can use that the summed filter drops."""
    lines = [f"{'G':>3} {'R':>3} {'groups':>8} {'sum varies':>11} " + " ".join(f"{e:>11}" for e in REGISTRY)
             + f" {'gdpo only':>10}"]
    for G, R in cases:
        patterns = torch.tensor(list(itertools.product([0.0, 1.0], repeat=R)), dtype=torch.float64)  # (2^R, R)
        groups = patterns[torch.tensor(list(itertools.combinations_with_replacement(range(2**R), G)))]  # (M, G, R)
        summed = groups.sum(-1).std(dim=1) > 0                                                        # (M,)
        keeps = {e: informative_groups(groups, None, e) for e in REGISTRY if not (e == "gdpo_nemo" and R < 2)}
        lines.append(f"{G:>3} {R:>3} {len(groups):>8} {int(summed.sum()):>11} "
                     + " ".join(f"{int(k.sum()):>11}" for k in keeps.values())
                     + f" {int((keeps['gdpo'] & ~summed).sum()):>10}")
    return "\n".join(lines)


def write_docs():
    """Put each of DOC_TABLES' outputs into the first fenced block after the line that names its command."""
    for page, args in DOC_TABLES:
        path, command = os.path.join(ROOT, page), f"python examples/collapse.py {' '.join(args)}"
        lines = open(path).read().split("\n")
        named = next(i for i, line in enumerate(lines) if command in line)
        start = next(i for i in range(named, len(lines)) if lines[i].startswith("```"))
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
        table = output(args).rstrip("\n").split("\n")
        with open(path, "w") as f:
            f.write("\n".join(lines[:start + 1] + table + lines[end:]))
        print(f"{page}: {len(table)} lines after '{command}'")


def output(args):
    """What `python examples/collapse.py ARGS` prints."""
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        main(args)
    return buffer.getvalue()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", metavar="PNG", help="also draw the figure to this file")
    parser.add_argument("--example", action="store_true", help="print the paper's G=2 example instead of the table")
    parser.add_argument("--informative", action="store_true", help="print the informative-group counts instead")
    parser.add_argument("--max-group", type=int, default=16, help="largest G in the first sweep")
    parser.add_argument("--max-rewards", type=int, default=8, help="largest R in the second sweep")
    parser.add_argument("--write-docs", action="store_true", help="rewrite the tables in README.md and docs/")
    args = parser.parse_args(argv)
    if args.write_docs:
        return write_docs()
    if args.example or args.informative:
        print(two_sample_example() if args.example else informative_table())
        return
    rows = table(range(2, args.max_group + 1), range(2, args.max_rewards + 1))
    print(format_table(rows))
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
