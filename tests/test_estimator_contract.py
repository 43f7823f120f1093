"""The contract every registered estimator meets (minigdpo/estimators.py's docstring), checked for each entry of
REGISTRY: a new entry is tested here with no other edit, and a wrong twin fails (the last tests show both).

Run: pytest tests/test_estimator_contract.py
"""

import math
import os

import pytest
import torch

import advantages_naive as naive
from minigdpo.advantages import grpo
from minigdpo.config import Config
from minigdpo.estimators import REGISTRY, Estimator
from test_advantages import random_rewards_with_holes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W = [1.0, 0.5, 2.0]


def check_contract(est, twin, twin_group):
    """Every clause of the contract, for one Estimator and its twins (tests/advantages_naive.py); AssertionError
    naming the clause that fails."""
    weights = torch.tensor(W, dtype=torch.float64)
    for seed in range(3):
        r = random_rewards_with_holes(seed)                                                    # (6, 5, 3), NaNs
        lengths = torch.randint(0, 9, r.shape[:2], generator=torch.Generator().manual_seed(seed))
        got = est.advantages(r, weights, lengths=lengths)
        want = torch.tensor(twin(r.tolist(), W, lengths=lengths.tolist()), dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=1e-9, rtol=0, msg="the twin computes other advantages")
        assert got.shape == r.shape[:2] and torch.isfinite(got).all(), "advantages must be finite, (B, G)"
        group = est.group_step(r, weights)
        want_group = torch.tensor(twin_group(r.tolist(), W), dtype=torch.float64)
        torch.testing.assert_close(group, want_group, atol=1e-9, rtol=0, msg="the group step's twin differs")
        dense = torch.rand(r.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        with_lengths = est.advantages(dense, weights, lengths=lengths + 1)
        if est.reads_lengths:
            assert not torch.equal(with_lengths, est.advantages(dense, weights)), "reads_lengths, yet ignores them"
        else:
            torch.testing.assert_close(with_lengths, est.advantages(dense, weights), msg="lengths must be ignored")
        wide = est.advantages(dense, weights, eps=0.5)  # every estimator takes eps=, its std's guard (if it has one)
        assert wide.shape == r.shape[:2] and torch.isfinite(wide).all(), "eps= must be taken"
        for dtype in (torch.float32, torch.float64):
            assert est.advantages(dense.to(dtype), weights).dtype == dtype, "advantages in the rewards' dtype"
    for flat in (torch.zeros(3, 4, 2), torch.ones(1, 2, 3), torch.full((2, 2, 2), math.nan)):
        a = est.advantages(flat.double(), None)
        assert torch.isfinite(a).all() and a.abs().max() < 1e-6, "a batch where nothing differs must give 0"
    same = torch.tensor([[[0.1, 3.0, 1.0]] * 4, [[1.0, 0.0, 0.0], [0.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]],
                        dtype=torch.float64)
    assert est.group_step(same, None)[0].abs().max() < 1e-12, "a group of equal rewards must get 0 from the group step"
    options = est.options(Config())
    assert isinstance(options, dict)
    r = random_rewards_with_holes(7)
    torch.testing.assert_close(est.advantages(r, weights, **options), est.advantages(r, weights),
                               msg="the command line's defaults must be the function's")


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_registered_estimator_meets_the_contract(name):
    assert name in naive.TWINS, f"{name} has no naive twin in tests/advantages_naive.py's TWINS"
    check_contract(REGISTRY[name], *naive.TWINS[name])


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_registered_estimator_has_its_row_in_the_docs_and_the_help(name):
    from minigdpo import cli

    assert f"| `{name}` |" in open(os.path.join(ROOT, "docs", "estimators.md")).read()
    assert name in cli.build_parser().format_help()


def test_a_new_entry_with_its_right_twin_passes_and_with_a_wrong_twin_fails():
    """What registering one estimator takes: a copy of GRPO with its own twin meets the contract; the same entry
    with another estimator's twin (GRPO without the std) does not."""
    check_contract(Estimator(grpo, grpo), naive.grpo_naive, naive.grpo_naive)
    with pytest.raises(AssertionError, match="twin"):
        check_contract(Estimator(grpo, grpo), naive.grpo_no_std_naive, naive.grpo_no_std_naive)
    with pytest.raises(AssertionError, match="reads_lengths"):
        check_contract(Estimator(grpo, grpo, reads_lengths=True), naive.grpo_naive, naive.grpo_naive)
