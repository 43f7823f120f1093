"""train.py with the peers' GDPO variants: completion lengths reach gdpo_verl on 2 gloo ranks.

Run: pytest tests/test_train_estimators.py   (about a minute on 2 cores)
"""

import os

import pytest

from conftest import read_jsonl, run

SMOKE = ["train.py", "--preset", "smoke", "--rewards", "tests.helpers:digit_frac,tests.helpers:vowel_frac,format",
         "--max-steps", "1", "--save-every", "0"]


@pytest.mark.parametrize("estimator,nproc", [pytest.param("gdpo_verl", 2, marks=pytest.mark.slow), ("gdpo_nemo", 1)])
def test_peer_estimators_train(tmp_path, estimator, nproc):
    out = str(tmp_path / "run")
    run(SMOKE + ["--estimator", estimator, "--output-dir", out], nproc=nproc)
    row = read_jsonl(os.path.join(out, "metrics.jsonl"))[0]
    assert row["adv/distinct_per_group"] > 1 and row["grad_norm"] > 0  # a signal, and an update from it
    assert abs(row["adv/mean"]) < 0.5 * row["adv/std"]  # whitened over the batch (token-weighted for verl)
