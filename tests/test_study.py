"""The study over seeds as committed: docs/results/gdpo_vs_grpo.json's summary is what its run entries give, every
entry can be rerun, and the tables in docs/results.md are the ones its report prints; the study's tests (paired t,
sign flip, Holm) against hand-computed numbers and a naive oracle. Run: python -m pytest -q tests/test_study.py"""

import contextlib
import importlib.util
import io
import itertools
import json
import math
import os
import re
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))  # the study imports its statistics (study_stats.py) from there
spec = importlib.util.spec_from_file_location("gdpo_vs_grpo", os.path.join(ROOT, "examples", "gdpo_vs_grpo.py"))
study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(study)

with open(study.RESULTS) as f:
    RESULTS = json.load(f)


def test_every_entry_is_complete_and_its_command_is_the_scripts():
    for run in RESULTS["runs"]:
        assert {"command", "heldout", "train_last3", "curves", "wall_s"} <= set(run), run.get("command")
        assert run["command"] == study.command(run["setting"], run["arm"], run["seed"])
        assert f"--seed {run['seed']} " in run["command"] and run["heldout"]["prompts"] == study.HELDOUT
        if run["arm"].endswith("+cond"):
            assert "--condition 'length_ok:correct>=1'" in run["command"]


def test_the_summary_is_recomputed_from_the_entries():
    again = json.loads(json.dumps(study.summarise(RESULTS["runs"])))
    assert again == RESULTS["summary"]


@pytest.mark.parametrize("arm", ["gdpo+cond", "grpo+cond", "gd2po", "saw_gdpo"])
def test_each_new_arm_has_at_least_six_seeds_paired_with_its_baselines(arm):
    seeds = RESULTS["summary"]["arith_length"]["seeds"]
    assert set(range(6)) <= set(seeds[arm])
    for name, diffs in RESULTS["summary"]["arith_length"]["paired"].items():
        a, b = name.split(" - ")
        if arm in (a, b):
            assert next(iter(diffs.values()))["n"] == len(set(seeds[a]) & set(seeds[b]))


def test_the_tables_in_docs_results_are_the_reports():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        study.report(RESULTS["summary"], markdown=True)
    printed = {line for line in out.getvalue().splitlines() if line.startswith("| ")}
    with open(os.path.join(ROOT, "docs", "results.md")) as f:
        text = f.read()
    section = text[text.index("## GDPO against GRPO over seeds"):text.index("## A CPU experiment")]
    names = "|".join(re.escape(name) for name in [*study.ARMS, *study.HOLM_FAMILIES["arith_length"]])
    rows = [line for line in section.splitlines() if re.match(rf"\| ((heldout|train_last3|adv)/|({names}) \|)", line)]
    assert rows and all(row in printed for row in rows), [row for row in rows if row not in printed][:3]


def test_the_sign_flip_p_value_counts_every_assignment():
    # 12 differences of one sign: only all + and all - reach the observed |mean|, so p = 2 / 2^12.
    assert study.paired([0.7] * 12, [0.5] * 12)["p_signflip"] == 2 / 4096
    # Eleven +1 and one -1: |sum| >= 10 needs at most one sign against the rest: 1 + 12 + 12 + 1 = 26 assignments.
    assert study.sign_flip_p([1.0] * 11 + [-1.0]) == 26 / 4096
    # 1, 2, 3: the sums +-1 +-2 +-3 are 6, 4, 2, 0, 0, -2, -4, -6; two reach |6|.
    assert study.sign_flip_p([1.0, 2.0, 3.0]) == 2 / 8
    assert study.sign_flip_p([0.0] * 12) == 1.0  # no difference: every assignment ties it
    assert study.sign_flip_p([1.0] * 20) <= 3 / 65_537  # above 16 seeds, drawn: (1 + hits) / (1 + draws)


def test_the_paired_t_interval_and_p_value_by_hand():
    # d = 1, 2, 3: mean 2, sd 1, df 2, t = 2 sqrt(3); the interval 2 +- 4.303 / sqrt(3); with 2 degrees of freedom
    # P(|T| >= t) = 1 - t / sqrt(2 + t^2) = 1 - sqrt(6/7).
    d = study.paired([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    half = 4.303 / math.sqrt(3)
    assert (d["t_low"], d["t_high"]) == pytest.approx((2 - half, 2 + half))
    assert d["p_t"] == pytest.approx(1 - math.sqrt(6 / 7), abs=1e-12)
    assert study.paired([0.5] * 4, [0.5] * 4)["p_t"] == 1.0 and study.paired([0.6] * 4, [0.5] * 4)["p_t"] == 0.0


@pytest.mark.parametrize("t", [0.0, 1e-8, 0.3, 1.0, 2.5, 7.0, 40.0])
def test_the_t_distribution_against_its_closed_forms(t):
    # df 1 (Cauchy): P(|T| >= t) = 1 - 2 atan(t) / pi; df 2: 1 - t / sqrt(2 + t^2); df 4: A&S 26.7.3's finite sum.
    assert study.t_test_p(t, 1) == pytest.approx(1 - 2 * math.atan(t) / math.pi, rel=1e-12, abs=1e-15)
    assert study.t_test_p(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-12, abs=1e-15)
    theta = math.atan(t / 2)
    a4 = math.sin(theta) * (1 + math.cos(theta) ** 2 / 2)
    assert study.t_test_p(t, 4) == pytest.approx(1 - a4, rel=1e-12, abs=1e-15)


def test_the_t_table_gives_p_of_five_percent():
    for df, q in study.T975.items():  # the table's three decimals move p by at most a few 1e-5
        assert study.t_test_p(q, df) == pytest.approx(0.05, abs=1e-4), df


def test_the_t_distribution_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 3, 11, 30):
        for t in (0.01, 0.5, 2.2, 5.0, 20.0):
            assert study.t_test_p(t, df) == pytest.approx(2 * stats.t.sf(t, df), rel=1e-7)


def test_holm_by_hand():
    # Sorted: 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> 0.06 (never below the one before).
    assert study.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert study.holm([0.2, 0.6, 0.01]) == pytest.approx([0.4, 0.6, 0.03])
    assert study.holm([0.5, 0.6]) == [1.0, 1.0]  # capped at 1


def test_the_holm_families_are_the_comparisons_fixed_in_advance():
    families = study.HOLM_FAMILIES["arith_length"]
    assert [c for f in families.values() for c in f] == study.COMPARISONS["arith_length"]
    assert len(families["conflict"]) == 5 and all("gdpo_verl" in pair for pair in families["gdpo_verl"])


def test_one_comparison_recomputed_by_hand_from_the_entries():
    """gdpo - grpo on held-out correct in arith_length: the differences read off the entries, the t interval from
    statistics.stdev, the sign flip by a loop over every assignment (the naive oracle of sign_flip_p's matrix)."""
    runs = {(r["arm"], r["seed"]): r["heldout"]["reward/correct"]
            for r in RESULTS["runs"] if r["setting"] == "arith_length"}
    seeds = sorted({s for arm, s in runs if arm == "gdpo"} & {s for arm, s in runs if arm == "grpo"})
    d = [runs["gdpo", s] - runs["grpo", s] for s in seeds]
    n, mean = len(d), sum(d) / len(d)
    half = study.T975[n - 1] * statistics.stdev(d) / math.sqrt(n)
    reach = sum(abs(sum(s * x for s, x in zip(signs, d))) / n >= abs(mean) - 1e-12
                for signs in itertools.product((1, -1), repeat=n))
    summary = study.summarise(RESULTS["runs"])["arith_length"]
    got = summary["paired"]["gdpo - grpo"]["heldout/reward/correct"]
    assert got["n"] == n and got["mean"] == pytest.approx(mean)
    assert (got["t_low"], got["t_high"]) == pytest.approx((mean - half, mean + half))
    assert got["p_signflip"] == reach / 2 ** n
    t = mean / (statistics.stdev(d) / math.sqrt(n))
    assert got["p_t"] == pytest.approx(study.t_test_p(t, n - 1))


def test_the_holm_table_is_the_paired_tests_adjusted():
    summary = study.summarise(RESULTS["runs"])["arith_length"]
    for family, comparisons in study.HOLM_FAMILIES["arith_length"].items():
        tests = summary["holm"][family]
        assert list(tests) == [f"{a} - {b} / {k}" for a, b in comparisons for k in study.HOLM_METRICS]
        for kind in ("p_t", "p_signflip"):
            raw = []
            for name, row in tests.items():
                pair, metric = name.split(" / ", 1)
                d = summary["paired"].get(pair, {}).get(metric)
                assert row[kind] == (d[kind] if d else None) and row["n"] == (d["n"] if d else 0)
                raw.append(1.0 if row[kind] is None else row[kind])
            for row, q in zip(tests.values(), study.holm(raw)):
                assert row[f"{kind}_holm"] == (None if row[kind] is None else q)
