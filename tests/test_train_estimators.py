"""train.py with the peers' GDPO variants and GDPO's successors: completion lengths reach gdpo_verl on 2 gloo
ranks, each successor's flags reach it, and bad values of them are refused in one line.

Run: pytest tests/test_train_estimators.py   (about a minute on 2 cores)
"""

import os

import pytest

from conftest import read_jsonl, refusal, run

SMOKE = ["train.py", "--preset", "smoke", "--rewards", "tests.helpers:digit_frac,tests.helpers:vowel_frac,format",
         "--max-steps", "1", "--save-every", "0"]


@pytest.mark.parametrize("estimator,nproc", [pytest.param("gdpo_verl", 2, marks=pytest.mark.slow), ("gdpo_nemo", 1)])
def test_peer_estimators_train(tmp_path, estimator, nproc):
    out = str(tmp_path / "run")
    run(SMOKE + ["--estimator", estimator, "--output-dir", out], nproc=nproc)
    row = read_jsonl(os.path.join(out, "metrics.jsonl"))[0]
    assert row["adv/distinct_per_group"] > 1 and row["grad_norm"] > 0  # a signal, and an update from it
    assert abs(row["adv/mean"]) < 0.5 * row["adv/std"]  # whitened over the batch (token-weighted for verl)


@pytest.mark.parametrize("flags", [["--estimator", "gd2po", "--gd2po-mode", "snr", "--gd2po-tau", "0.5"],
                                   ["--estimator", "saw_gdpo", "--saw-shift", "1,0,0"],
                                   pytest.param(["--estimator", "saw_grpo"], marks=pytest.mark.slow)])
def test_successors_train(tmp_path, flags):
    """GD2PO and SAW through train.py, with their own flags."""
    out = str(tmp_path / "run")
    run(SMOKE + flags + ["--output-dir", out])
    row = read_jsonl(os.path.join(out, "metrics.jsonl"))[0]
    assert row["adv/std"] > 0 and row["grad_norm"] > 0


@pytest.mark.parametrize("flags,message", [
    (["--estimator", "gd2po", "--gd2po-tau", "1.5"], "--gd2po-tau must be in [0, 1], got 1.5"),
    (["--estimator", "gd2po", "--gd2po-mode", "soft"], "--gd2po-mode 'soft' is not one of hard, snr"),
    (["--estimator", "saw_gdpo", "--saw-shift", "3,0"], "--saw-shift has 2 values for 3 rewards"),
    (["--estimator", "saw_gdpo", "--saw-shift", "3,nan,0"], "--saw-shift must be finite")])
def test_successor_flags_are_checked(tmp_path, flags, message):
    assert message in refusal(SMOKE[1:] + flags + ["--output-dir", str(tmp_path / "run")])
