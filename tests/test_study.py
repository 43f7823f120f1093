"""The study over seeds as committed: docs/results/gdpo_vs_grpo.json's summary is what its run entries give, every
entry can be rerun, and the tables in docs/results.md are the ones its report prints."""

import contextlib
import importlib.util
import io
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    arms = "|".join(re.escape(arm) for arm in study.ARMS)
    rows = [line for line in section.splitlines() if re.match(rf"\| ((heldout|train_last3|adv)/|({arms}) \|)", line)]
    assert rows and all(row in printed for row in rows), [row for row in rows if row not in printed][:3]
