"""Does GDPO train SmolLM2-135M better than GRPO, and where rewards conflict, do the paper's remedy or GDPO's
successors help? The same recipe over seeds, each run evaluated held out.

    python examples/gdpo_vs_grpo.py                    # every run not yet done, then the summary and the plot
    python examples/gdpo_vs_grpo.py --report           # only the summary, from the runs already done
    python examples/gdpo_vs_grpo.py --report --seeds 0-5   # the summary of seeds 0-5's runs alone (printed only)
    python examples/gdpo_vs_grpo.py --seeds 0-1 --settings arith   # a subset (the summary covers what is done)
    python examples/gdpo_vs_grpo.py --arms gdpo+cond,grpo+cond,gd2po,saw_gdpo   # the remedy and the successors

Needs vLLM's CPU build (docs/gpus.md, Sampling with vLLM) and the demo model (README command 1), and matplotlib
for the plot. Each run is one shell line, kept with its results: `train.py` with the CPU demo's recipe (4
prompts x G=8 a step, lr 2e-5, beta 0.04, fp32) cut to 8 steps, then `eval.py` on the first 128 held-out
arith problems, greedy, on the step-8 checkpoint. (A 12-step run with its evaluation took 7.5 min here; 8
steps bring the 24 runs of two settings x two arms x six seeds to about two hours.) A run lives in
runs/study/<setting>/<arm>/seed<N>; a run whose
held-out summary.json exists is skipped, so the study can span several sittings. Its checkpoint is deleted
once evaluated (2.2 GB each; --keep-checkpoints keeps them): rerunning the run's `command` rebuilds it.

The settings, fixed before any result was seen, the same for every arm:

    arith          the CPU demo's task: correct, integer, format (3 rewards)
    arith_length   the same with length_ok at 22 tokens added (4 rewards). The demo's trained model writes
                   22-25 tokens ("<think>8 - 1 = 7</think>\\n<answer>7</answer>" is 22), the base model's
                   greedy answers 14-48 (a fifth of them within 22): to stay under the limit the model must
                   drop reasoning, which pulls against `correct`, as the length limit does in the paper's
                   math runs. Unconditioned (no Eq. 8), so the two rewards pull freely.

The arms: `gdpo` and `grpo` in both settings; in `arith_length` only, where the rewards pull apart, the paper's
remedy for that case (Eq. 8, `length_ok` conditioned on `correct`) for both, `gdpo+cond` and `grpo+cond`, and
GDPO's two successors at their defaults, `gd2po` and `saw_gdpo` (see ARMS below for which defaults and why).

Statistics (computed from the runs' entries, written with them to docs/results/gdpo_vs_grpo.json):
- per arm, the mean over seeds and a 95% Student-t interval of each held-out metric and of each training
  reward averaged over the last three steps;
- for each comparison a - b in COMPARISONS, the paired differences d over the n seeds both arms ran (same seed:
  same prompts at every step, same held-out problems), and of them: the mean; a 95% percentile-bootstrap interval
  (10,000 resamples, seed 0); the paired Student-t 95% interval, mean +- t_0.975(n-1) sd/sqrt(n) (T975), and its
  two-sided p-value for a mean of 0 (t's CDF from the regularised incomplete beta function, no scipy); the exact
  two-sided sign-flip (permutation) p-value, the fraction of all 2^n sign assignments of d whose mean is at least as far
  from 0 as the observed one (above 16 seeds, 65,536 random assignments, seed 0, p = (1 + hits) / (1 + 65,536));
  and the seeds where a wins, ties and loses (|d| <= 1e-9 a tie). With few seeds the bootstrap interval is the
  narrower (its spread is the seeds' own, over n not n - 1, its quantiles near the normal's, not t's: about 15%
  narrower at 12 seeds), so a claim should rest on the tests;
- Holm's step-down correction over each family of tests fixed in advance together (HOLM_FAMILIES, in
  arith_length: the first five comparisons on held-out `correct` and `length_ok`, 10 tests; the three against
  gdpo_verl, added later, 6 tests), of the sign-flip p-values and of the t-test's; a family's m counts every test
  it was fixed with, one with no paired seeds yet as p = 1;
- adv/distinct_per_group, the distinct advantage values per group averaged over the steps (G=8 at most):
  GRPO's reward collapse, measured in the real run.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from study_stats import T975, betainc, holm, interval, paired, sign_flip_p, t_test_p  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results", "gdpo_vs_grpo.json")
PLOT = os.path.join(ROOT, "docs", "results", "gdpo_vs_grpo.png")
REMEDIES_PLOT = os.path.join(ROOT, "docs", "results", "gdpo_vs_grpo_remedies.png")
STEPS = 8
HELDOUT = 128
RECIPE = f"--preset cpu-demo --beta 0.04 --sampler vllm --max-steps {STEPS} --no-final-eval"  # the demo's is 0
SETTINGS = {  # name: (extra train.py flags, the rewards eval.py scores)
    "arith": ("", "correct,integer,format"),
    "arith_length": ("--rewards correct,integer,format,length_ok --length-limit 22", "correct,integer,format,length_ok"),
}
# Arms: name -> (train.py flags, the settings it runs in). The remedy and the successors are for rewards that pull
# against each other, so they run where the length limit pulls against correctness. Fixed before any result:
# the paper's remedy (Eq. 8) conditions the easy reward on the hard one, for both estimators; GD2PO at its released
# scripts' defaults (snr, tau 0.8: tool-calling/scripts/*/train_gd2po_snr.sh) and SAW-GDPO at shift 0 (its +3 is
# for ToolRL's correctness in [-3, 3]; these rewards are in [0, 1], their means away from 0).
CONDITION = "--condition 'length_ok:correct>=1'"
ARMS = {"gdpo": ("--estimator gdpo", ("arith", "arith_length")), "grpo": ("--estimator grpo", ("arith", "arith_length")),
        "gdpo+cond": (f"--estimator gdpo {CONDITION}", ("arith_length",)),
        "grpo+cond": (f"--estimator grpo {CONDITION}", ("arith_length",)),
        "gd2po": ("--estimator gd2po", ("arith_length",)), "saw_gdpo": ("--estimator saw_gdpo", ("arith_length",)),
        # Added 2026-11-26, before any of its runs: GD2PO and SAW-GDPO are built on verl-GDPO's batch step
        # (token-weighted whitening, eps 1e-6), the `gdpo` arm on TRL's; a successor minus `gdpo_verl` is its own change.
        "gdpo_verl": ("--estimator gdpo_verl", ("arith_length",))}
# The comparisons, fixed before any result: a - b, paired by seed. A comparison is open at 6 seeds when its interval
# on held-out `correct` or `length_ok` holds 0; then seeds 6-11 go to both its arms (`--seeds 6-11 --arms ...`).
COMPARISONS = {"arith": [("gdpo", "grpo")],
               "arith_length": [("gdpo", "grpo"), ("gdpo+cond", "gdpo"), ("gdpo+cond", "grpo+cond"), ("gd2po", "gdpo"),
                                ("saw_gdpo", "gdpo"), ("gd2po", "gdpo_verl"), ("saw_gdpo", "gdpo_verl"),
                                ("gdpo_verl", "gdpo")]}
# The families of tests that Holm's correction runs over: each fixed in advance together, every comparison in it on
# each of HOLM_METRICS, the rewards that pull against each other.
HOLM_METRICS = ("heldout/reward/correct", "heldout/reward/length_ok")
HOLM_FAMILIES = {"arith_length": {
    # fixed with the comparisons (commit 115b0b7): 5 comparisons x 2 metrics = 10 tests
    "conflict": [("gdpo", "grpo"), ("gdpo+cond", "gdpo"), ("gdpo+cond", "grpo+cond"), ("gd2po", "gdpo"),
                 ("saw_gdpo", "gdpo")],
    # added 2026-11-26, before any gdpo_verl run: 3 x 2 = 6 tests
    "gdpo_verl": [("gd2po", "gdpo_verl"), ("saw_gdpo", "gdpo_verl"), ("gdpo_verl", "gdpo")]}}


def run_dir(setting, arm, seed):
    return os.path.join("runs", "study", setting, arm, f"seed{seed}")


def command(setting, arm, seed):
    """The one shell line, run from the repository root, that trains the run and evaluates it held out."""
    out = run_dir(setting, arm, seed)
    flags, rewards = SETTINGS[setting]
    train = f"python train.py {RECIPE} {flags} {ARMS[arm][0]} --seed {seed} --output-dir {out}".replace("  ", " ")
    heldout = (f"python eval.py --model {out}/checkpoints/step_{STEPS:06d}/hf --rewards {rewards} --limit {HELDOUT} "
               f"--sampler vllm --output {out}/heldout")
    return f"{train} && {heldout}"


def read_run(setting, arm, seed):
    """The run's entry from its directory (None while it has no held-out summary)."""
    out = os.path.join(ROOT, run_dir(setting, arm, seed))
    summary = os.path.join(out, "heldout", "summary.json")
    if not os.path.exists(summary):
        return None
    with open(summary) as f:
        heldout = json.load(f)  # eval.py's figures (under "model" when it also ran a baseline)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(out, "study_wall_s.txt")) as f:
        wall = float(f.read())
    rewards = [k for k in steps[0] if k.startswith("reward/") and k.endswith("/mean")]
    return {"setting": setting, "arm": arm, "estimator": ARMS[arm][0].split()[1], "seed": seed,
            "command": command(setting, arm, seed),
            "heldout": {k: v for k, v in heldout.items() if isinstance(v, (int, float))},
            "train_last3": {k[:-len("/mean")]: [row[k] for row in steps[-3:]] for k in rewards},
            "curves": {k[:-len("/mean")]: [row[k] for row in steps] for k in rewards},
            "distinct_per_group": float(np.mean([row["adv/distinct_per_group"] for row in steps])),
            "wall_s": round(wall, 1)}


def do_run(setting, arm, seed, keep_checkpoints):
    out = os.path.join(ROOT, run_dir(setting, arm, seed))
    if os.path.exists(os.path.join(out, "heldout", "summary.json")):
        return
    if os.path.exists(out):  # an interrupted run: start it over, so every run is one uninterrupted command
        shutil.rmtree(out)
    line = command(setting, arm, seed)
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)
    t0 = time.time()
    with open(os.path.join(ROOT, "runs", "study", "log.txt"), "a") as log:
        env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        done = subprocess.run(line, check=False, shell=True, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"error: the run exited with {done.returncode} (its output: runs/study/log.txt): {line}")
    with open(os.path.join(out, "study_wall_s.txt"), "w") as f:
        f.write(f"{time.time() - t0:.1f}")
    if not keep_checkpoints:
        shutil.rmtree(os.path.join(out, "checkpoints"))
    print(f"  done in {time.time() - t0:.0f} s", flush=True)


def holm_family(pairs, comparisons):
    """One family's tests (each comparison on each of HOLM_METRICS), their p-values and Holm's adjustment of each
    kind. m is the whole family: a test whose comparison has no paired seeds yet counts as p = 1 and shows None."""
    tests = {f"{a} - {b} / {k}": pairs.get(f"{a} - {b}", {}).get(k) for a, b in comparisons for k in HOLM_METRICS}
    out = {name: {"n": d["n"] if d else 0} for name, d in tests.items()}
    for kind in ("p_t", "p_signflip"):
        ps = [d[kind] if d else None for d in tests.values()]
        for row, p, q in zip(out.values(), ps, holm([1.0 if p is None else p for p in ps])):
            row |= {kind: p, f"{kind}_holm": None if p is None else q}
    return out


def metrics_of(run):
    """The figures summarised: held-out rewards, accuracy and length, then the last three steps' training rewards."""
    out = {f"heldout/{k}": v for k, v in run["heldout"].items()
           if k.startswith("reward/") or k in ("accuracy", "length/mean", "length/truncated_frac")}
    out.update({f"train_last3/{k}": float(np.mean(v)) for k, v in run["train_last3"].items()})
    out["adv/distinct_per_group"] = run["distinct_per_group"]
    return out


def summarise(runs):
    summary = {}
    for setting in SETTINGS:
        arms = {arm: sorted((r for r in runs if r["setting"] == setting and r["arm"] == arm), key=lambda r: r["seed"])
                for arm in ARMS if setting in ARMS[arm][1]}
        arms = {arm: rs for arm, rs in arms.items() if rs}
        if not arms:
            continue
        keys = list(metrics_of(next(iter(arms.values()))[0]))
        entry = {"per_arm": {arm: {k: interval([metrics_of(r)[k] for r in rs]) for k in keys} for arm, rs in arms.items()},
                 "paired": {}, "paired_arms": {}, "seeds": {arm: [r["seed"] for r in rs] for arm, rs in arms.items()}}
        by_seed = {arm: {r["seed"]: metrics_of(r) for r in rs} for arm, rs in arms.items()}
        for a, b in COMPARISONS[setting]:
            seeds = sorted(set(by_seed.get(a, ())) & set(by_seed.get(b, ())))
            if seeds:
                entry["paired"][f"{a} - {b}"] = {
                    k: paired([by_seed[a][s][k] for s in seeds], [by_seed[b][s][k] for s in seeds]) for k in keys}
                # Each arm over the same seeds, so that a table's columns and its difference describe one set of runs.
                entry["paired_arms"][f"{a} - {b}"] = {
                    arm: {k: interval([by_seed[arm][s][k] for s in seeds]) for k in keys} for arm in (a, b)}
        if setting in HOLM_FAMILIES:
            entry["holm"] = {name: holm_family(entry["paired"], comparisons)
                             for name, comparisons in HOLM_FAMILIES[setting].items()}
        entry["wall_s"] = sum(r["wall_s"] for rs in arms.values() for r in rs)
        entry["wall_s_per_arm"] = {arm: sum(r["wall_s"] for r in rs) for arm, rs in arms.items()}
        summary[setting] = entry
    summary["total_wall_s"] = sum(r["wall_s"] for r in runs)
    summary["intervals"] = ("per arm: mean and 95% Student-t interval over seeds; paired: mean of a - b over the seeds "
                            "both ran, 95% percentile bootstrap over seeds (10,000 resamples, seed 0), 95% paired-t "
                            "interval and its two-sided p, exact two-sided sign-flip p; Holm over each family fixed in "
                            "advance")
    return summary


def fmt(iv):
    if iv.get("low") is None:
        return f"{iv['mean']:.3f}"
    return f"{iv['mean']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]"


PER_ARM = ("heldout/reward/correct", "heldout/reward/length_ok", "adv/distinct_per_group")


def fmt_p(p):
    return "-" if p is None else "<0.0001" if p < 1e-4 else f"{p:.4f}"


def report(summary, markdown=False):
    """Each setting's arms over all their seeds, then its comparisons: both arms' means over the seeds they pair
    on, the paired difference's mean, its bootstrap and t intervals, the two tests' p-values and wins / ties /
    losses; then Holm's correction over each family of tests; as text or markdown tables."""
    for setting, entry in summary.items():
        if not isinstance(entry, dict) or "per_arm" not in entry:
            continue
        keys = [k for k in PER_ARM if k in next(iter(entry["per_arm"].values()))]
        if markdown:
            print(f"\n{setting}, every arm over all its seeds:\n")
            print("| arm | seeds | " + " | ".join(keys) + " | minutes of runs |\n" + "|---" * (len(keys) + 3) + "|")
        else:
            print(f"\n{setting}: every arm over all its seeds")
            print(f"{'arm':<10} {'seeds':>5} " + " ".join(f"{k:>26}" for k in keys) + f" {'minutes':>8}")
        for arm, per in entry["per_arm"].items():
            n, minutes = len(entry["seeds"][arm]), entry["wall_s_per_arm"][arm] / 60
            if markdown:
                print(f"| {arm} | {n} | " + " | ".join(fmt(per[k]) for k in keys) + f" | {minutes:.0f} |")
            else:
                print(f"{arm:<10} {n:>5} " + " ".join(f"{fmt(per[k]):>26}" for k in keys) + f" {minutes:>8.0f}")
        for name, diffs in entry["paired"].items():
            a, b = name.split(" - ")
            n = next(iter(diffs.values()))["n"]
            if markdown:
                print(f"\n{setting}, {name}, {n} paired seeds:\n")
                print(f"| metric | {a} | {b} | {a} - {b} | bootstrap 95% | t 95% | p (t) | p (sign-flip) | "
                      "wins / ties / losses |\n" + "|---" * 9 + "|")
            else:
                print(f"\n{setting}: {name}, {n} paired seeds ({a}, {b}: means; a - b: mean, 95% intervals, p-values)")
                print(f"{'metric':<30} {a:>9} {b:>9} {'a - b':>7} {'bootstrap':>17} {'t':>17} {'p (t)':>7} "
                      f"{'p (flip)':>8} {'W/T/L':>7}")
            for k, d in diffs.items():
                arms = entry["paired_arms"][name]
                boot = f"[{d['low']:+.3f}, {d['high']:+.3f}]"
                t = "-" if d["t_low"] is None else f"[{d['t_low']:+.3f}, {d['t_high']:+.3f}]"
                wtl = f"{d['wins']}/{d['ties']}/{d['losses']}"
                if markdown:
                    print(f"| {k} | {fmt(arms[a][k])} | {fmt(arms[b][k])} | {d['mean']:+.3f} | {boot} | {t} | "
                          f"{fmt_p(d['p_t'])} | {fmt_p(d['p_signflip'])} | {wtl.replace('/', ' / ')} |")
                else:
                    print(f"{k:<30} {arms[a][k]['mean']:>9.3f} {arms[b][k]['mean']:>9.3f} {d['mean']:>+7.3f} "
                          f"{boot:>17} {t:>17} {fmt_p(d['p_t']):>7} {fmt_p(d['p_signflip']):>8} {wtl:>7}")
        for family, tests in entry.get("holm", {}).items():
            if markdown:
                print(f"\n{setting}, Holm's correction over the family `{family}` ({len(tests)} tests):\n")
                print("| family | test | seeds | p (t) | Holm | p (sign-flip) | Holm |\n" + "|---" * 7 + "|")
            else:
                print(f"\n{setting}: Holm's correction over the family {family} ({len(tests)} tests, fixed together)")
                print(f"{'test':<36} {'seeds':>5} {'p (t)':>7} {'Holm':>7} {'p (flip)':>8} {'Holm':>7}")
            for test, p in tests.items():
                name = test.replace("heldout/reward/", "")
                cells = [fmt_p(p[kind]) for kind in ("p_t", "p_t_holm", "p_signflip", "p_signflip_holm")]
                if markdown:
                    print(f"| {family} | {name} | {p['n']} | " + " | ".join(cells) + " |")
                else:
                    print(f"{name:<36} {p['n']:>5} {cells[0]:>7} {cells[1]:>7} {cells[2]:>8} {cells[3]:>7}")
    if not markdown:
        print(f"\n{summary['intervals']}; total {summary['total_wall_s'] / 60:.0f} min of runs")


COLOURS = dict(zip(ARMS, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink")))


def curve_panel(ax, runs, setting, reward, arms, bands=True):
    """One reward's training curve per arm: the mean over seeds, and its 95% t band."""
    for arm in arms:
        curves = np.array([r["curves"][reward] for r in runs if r["setting"] == setting and r["arm"] == arm])
        if not len(curves):
            continue
        steps = np.arange(1, curves.shape[1] + 1)
        per_step = [interval(curves[:, t]) for t in range(curves.shape[1])]
        ax.plot(steps, [b["mean"] for b in per_step], color=COLOURS[arm], label=f"{arm} ({len(curves)} seeds)")
        if bands and len(curves) > 1:
            ax.fill_between(steps, [b["low"] for b in per_step], [b["high"] for b in per_step], color=COLOURS[arm],
                            alpha=0.2)
    ax.set_title(f"{setting}: {reward.split('/', 1)[1]}", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=7)


def plot(runs, summary, path, remedies_path):
    """Two figures. The first: GDPO's and GRPO's training reward curves, one row per setting, one panel per reward.
    The second, where the rewards pull apart: each arm's held-out `correct` against `length_ok` (mean and 95% t
    interval over seeds, as the summary's per-arm table has them), and every arm's training curves of those two."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    settings = [s for s in SETTINGS if any(r["setting"] == s for r in runs)]
    width = max(len(next(r for r in runs if r["setting"] == s)["curves"]) for s in settings)
    fig, axes = plt.subplots(len(settings), width, figsize=(3.2 * width, 2.8 * len(settings)), squeeze=False)
    for row, setting in zip(axes, settings):
        rewards = list(next(r for r in runs if r["setting"] == setting)["curves"])
        for ax, reward in zip(row, rewards):
            curve_panel(ax, runs, setting, reward, ("gdpo", "grpo"))
        for ax in row[len(rewards):]:
            ax.axis("off")
    fig.suptitle("GDPO and GRPO: training rewards per step, mean and 95% interval over seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {os.path.relpath(path, ROOT)}")
    per_arm = summary.get("arith_length", {}).get("per_arm", {})
    if set(per_arm) <= {"gdpo", "grpo"}:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 3.8))
    for arm, per in per_arm.items():
        x, y = per["heldout/reward/length_ok"], per["heldout/reward/correct"]
        axes[0].errorbar(x["mean"], y["mean"], xerr=[[x["mean"] - x["low"]], [x["high"] - x["mean"]]],
                         yerr=[[y["mean"] - y["low"]], [y["high"] - y["mean"]]], fmt="o", color=COLOURS[arm],
                         capsize=3, label=f"{arm} ({y['n']} seeds)")
    axes[0].set_xlabel("held-out length_ok")
    axes[0].set_ylabel("held-out correct")
    axes[0].set_title("arith_length: held out, mean and 95% interval over seeds", fontsize=9)
    axes[0].legend(fontsize=7)
    for ax, reward in zip(axes[1:], ("reward/correct", "reward/length_ok")):
        curve_panel(ax, runs, "arith_length", reward, ARMS, bands=False)
    fig.suptitle("where the rewards pull apart: the paper's condition (+cond) and GDPO's successors", fontsize=10)
    fig.tight_layout()
    fig.savefig(remedies_path, dpi=110)
    plt.close(fig)
    print(f"wrote {os.path.relpath(remedies_path, ROOT)}")


def parse_seeds(text):
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", help="seeds, as N or N-M (default 0-5); with --report, summarise only these seeds' runs "
                   "(printed, the results file and the plots left as they are)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, of: " + ", ".join(SETTINGS))
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of: " + ", ".join(ARMS))
    p.add_argument("--report", action="store_true", help="only summarise the runs already done")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each run's checkpoint after its evaluation")
    p.add_argument("--markdown", action="store_true", help="also print the summary as markdown tables")
    args = p.parse_args()
    settings = args.settings.split(",")
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise SystemExit(f"error: --settings: unknown {', '.join(sorted(unknown))} (choose from {', '.join(SETTINGS)})")
    os.makedirs(os.path.join(ROOT, "runs", "study"), exist_ok=True)
    if not args.report:
        for seed in parse_seeds(args.seeds or "0-5"):  # seed-major: a study cut short still holds paired seeds
            for setting in settings:
                for arm in args.arms.split(","):
                    if setting in ARMS[arm][1]:
                        do_run(setting, arm, seed, args.keep_checkpoints)
    # Every run's entry: those of earlier sittings from the results file (their directories may be gone), each
    # replaced by its directory's where that holds a finished run.
    done = {}
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            done = {(r["setting"], r.get("arm", r["estimator"]), r["seed"]): r | {"arm": r.get("arm", r["estimator"])}
                    for r in json.load(f)["runs"]}
    done |= {(s, a, seed): r for s in SETTINGS for a in ARMS for seed in range(100) if (r := read_run(s, a, seed))}
    runs = list(done.values())
    if args.report and args.seeds:  # a part of the study, e.g. its first 6 seeds: printed, nothing written
        part = summarise([r for r in runs if r["seed"] in parse_seeds(args.seeds)])
        report(part, markdown=args.markdown)
        return
    summary = summarise(runs)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump({"runs": runs, "summary": summary}, f, indent=1)
    print(f"wrote {os.path.relpath(RESULTS, ROOT)} ({len(runs)} runs)")
    report(summary)
    if args.markdown:
        report(summary, markdown=True)
    if runs:
        plot(runs, summary, PLOT, REMEDIES_PLOT)


if __name__ == "__main__":
    sys.exit(main())
