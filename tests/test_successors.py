"""GDPO's successors, GD2PO and SAW (minigdpo/successors.py), against their official code's arithmetic.

The expected values of the two `OFFICIAL_*` tables were computed by running the official functions on
these rewards, in float32 as the code runs: for GD2PO, compute_advantage of Qwen-Applications/GD2PO
tool-calling/verl/trainer/ppo/ray_trainer.py (commit f1ad765) with adv_estimator gdpo_filter_group_ratio
(mode "hard") and gdpo_filter_ratio_conflict_group_ratio (mode "snr", gdpo_filter_ratio_conflict_threshold
= tau), rewards correctness and format; for SAW, compute_advantage of Zhaolutuan/SAW
verl/trainer/ppo/ray_trainer.py (commit 2da50f0) with adv_estimator gdpo-h and grpo-h, whose +3.0 on
correctness is shift (3, 0) here. Each reward sat on the completion's last response token, as verl's
reward managers put it, and a completion of L tokens had L ones in its response mask.

Run: pytest tests/test_successors.py
"""

import math

import pytest
import torch

from minigdpo.advantages import VERL_STD_EPS, Condition, apply_conditions, gdpo_group
from conftest import informative_groups_naive
from advantages_naive import TWINS
from minigdpo.estimators import REGISTRY, informative_groups
from minigdpo.successors import gd2po, gd2po_group, saw_gdpo, saw_grpo, saw_weights

# Two prompts, G = 4, rewards (correctness, format).
REWARDS = torch.tensor([[[1, 0], [0, 1], [1, 1], [0, 0]], [[1, 1], [1, 0], [0, 0], [1, 1]]], dtype=torch.float64)
LENGTHS = {"one token each": [[1, 1, 1, 1], [1, 1, 1, 1]], "lengths 1-4": [[1, 2, 3, 4], [4, 3, 2, 1]]}
OFFICIAL_GD2PO = {  # (lengths, mode, tau): the official advantages
    ("one token each", "hard", 0.2): [[0, 0, 0.6251838, -0.7098196], [0.7473450, 0, -1.4100542, 0.7473450]],
    ("one token each", "snr", 0.2): [[0, 0, 0.5848294, -0.5848293], [0.9224806, -0.2471780, -1.5977832, 0.9224806]],
    ("one token each", "snr", 0.8): [[0, 0, 0.6251838, -0.7098196], [0.7473450, 0, -1.4100542, 0.7473450]],
    ("lengths 1-4", "hard", 0.2): [[0, 0, 0.7182050, -0.8072231], [0.8577912, 0, -1.6073390, 0.8577912]],
    ("lengths 1-4", "snr", 0.2): [[0, 0, 0.6709024, -0.6832250], [1.0618051, -0.2923222, -1.8559333, 1.0618051]],
    ("lengths 1-4", "snr", 0.8): [[0, 0, 0.7182050, -0.8072231], [0.8577912, 0, -1.6073390, 0.8577912]],
}
OFFICIAL_SAW = {  # (lengths, estimator): the official advantages, shift (3, 0)
    ("one token each", "saw_gdpo"): [[-0.7745535, 0.7745535, 1.0133271, -1.0133271],
                                     [0.9628683, -0.8250124, -1.1007242, 0.9628683]],
    ("one token each", "saw_grpo"): [[-0.7437625, 0.7437624, 0.9730440, -0.9730440],
                                     [0.8626512, -0.7546546, -0.9706476, 0.8626512]],
    ("lengths 1-4", "saw_gdpo"): [[-0.7886725, 0.7990156, 1.0437360, -1.0333928],
                                  [0.9920204, -0.8403881, -1.1229665, 0.9920204]],
    ("lengths 1-4", "saw_grpo"): [[-0.7437625, 0.7437624, 0.9730440, -0.9730440],
                                  [0.8626512, -0.7546546, -0.9706476, 0.8626512]],
}


@pytest.mark.parametrize("lengths,mode,tau", list(OFFICIAL_GD2PO))
def test_gd2po_equals_the_official_code(lengths, mode, tau):
    got = gd2po(REWARDS, lengths=torch.tensor(LENGTHS[lengths]), mode=mode, tau=tau)
    want = torch.tensor(OFFICIAL_GD2PO[lengths, mode, tau], dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)


@pytest.mark.parametrize("lengths,name", list(OFFICIAL_SAW))
def test_saw_equals_the_official_code(lengths, name):
    got = REGISTRY[name].advantages(REWARDS, lengths=torch.tensor(LENGTHS[lengths]), shift=[3.0, 0.0])
    want = torch.tensor(OFFICIAL_SAW[lengths, name], dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)


def test_gd2po_by_hand_on_one_group():
    """(1,0), (0,1), (1,1), (0,0): each reward's z-scores are +-sqrt(3)/2 (mean 1/2, Bessel std 1/sqrt(3)).
    The first two samples have one positive and one negative reward advantage that cancel (rho = 0): both
    modes drop them. The group keeps half its samples, q = 1/2, so the others get S = +-sqrt(3)/2, whitened
    over those two: +-1/sqrt(2) (Bessel over 2 values)."""
    r = REWARDS[:1]
    s, keep = gd2po_group(r)
    assert keep.tolist() == [[False, False, True, True]]
    torch.testing.assert_close(s, torch.tensor([[0, 0, math.sqrt(3) / 2, -math.sqrt(3) / 2]], dtype=torch.float64),
                               atol=1e-5, rtol=0)
    for mode in ("hard", "snr"):
        torch.testing.assert_close(gd2po(r, mode=mode), torch.tensor([[0, 0, 1, -1]], dtype=torch.float64) / math.sqrt(2),
                                   atol=1e-6, rtol=0)


def test_gd2po_modes_part_on_a_conflict_that_does_not_cancel():
    """(1,1,0) against (0,0,1), twice: each sample's reward advantages pull apart (+,+,- and -,-,+), so hard drops
    all four, but they cancel only partly, |rho| = 1/3: snr keeps them at tau 0.2 and drops them at tau 0.8."""
    r = torch.tensor([[[1, 1, 0], [0, 0, 1], [1, 1, 0], [0, 0, 1]]], dtype=torch.float64)
    assert not gd2po_group(r, mode="hard")[1].any()
    assert gd2po_group(r, mode="snr", tau=0.2)[1].all()
    assert not gd2po_group(r, mode="snr", tau=0.8)[1].any()
    assert gd2po(r, mode="hard").abs().max() == 0  # nothing kept: every advantage is 0, as in the code
    torch.testing.assert_close(gd2po(r, mode="snr", tau=0.2), gdpo_like(r))
    # tau is clamped to [0, 1] as the code does: above 1 every conflicting rollout goes, below 0 none
    assert torch.equal(gd2po_group(r, tau=5.0)[1], gd2po_group(r, mode="hard")[1])
    assert gd2po_group(r, tau=-1.0)[1].all()
    assert bool(informative_groups(r, None, "gd2po", mode="snr", tau=0.2))
    assert not bool(informative_groups(r, None, "gd2po", mode="hard"))


def gdpo_like(r):
    """When nothing is dropped GD2PO is verl's GDPO with q = 1, whitened with masked_mean over N + 1e-8."""
    return REGISTRY["gdpo_verl"].advantages(r)


def test_query_reweighting_scales_a_group_by_its_kept_share():
    """Group 0 keeps 2 of 4 samples, group 1 3 of 4 (its last sample, (1,0), conflicts): S is 1/2 and 3/4
    of GDPO's group sum."""
    r = torch.cat([REWARDS[:1], torch.tensor([[[1, 1], [0, 0], [1, 1], [1, 0]]], dtype=torch.float64)])
    s, keep = gd2po_group(r, mode="hard")
    assert keep.sum(1).tolist() == [2, 3]
    full = gdpo_group(r, None, VERL_STD_EPS)                                     # GDPO's group step, verl's eps
    torch.testing.assert_close(s[0, 2:], full[0, 2:] / 2)
    torch.testing.assert_close(s[1, :3], full[1, :3] * 3 / 4)
    assert s[0, :2].tolist() == [0, 0] and s[1, 3] == 0


def test_saw_weights():
    """CV_k = std_k / |mean_k| over the batch; w_k = R CV_k / sum CV. The shift moves the mean only."""
    r = torch.tensor([[[1.0, 3.0], [0.0, 1.0]], [[1.0, 2.0], [0.0, 2.0]]], dtype=torch.float64)
    cv = [math.sqrt(1 / 3) / 0.5, math.sqrt(2 / 3) / 2.0]
    want = [2 * c / sum(cv) for c in cv]
    torch.testing.assert_close(saw_weights(r), torch.tensor(want, dtype=torch.float64), atol=1e-7, rtol=0)
    cv = [math.sqrt(1 / 3) / 3.5, math.sqrt(2 / 3) / 2.0]  # shift (3, 0): the first mean becomes 3.5
    want = [2 * c / sum(cv) for c in cv]
    torch.testing.assert_close(saw_weights(r, [3.0, 0.0]), torch.tensor(want, dtype=torch.float64), atol=1e-7, rtol=0)
    # equal CVs give weight 1 each; a constant reward weighs 0; three rewards sum to 3
    w = saw_weights(torch.tensor([[[1.0, 2.0, 5.0], [0.0, 0.0, 5.0]]], dtype=torch.float64))
    torch.testing.assert_close(w, torch.tensor([1.5, 1.5, 0.0], dtype=torch.float64), atol=1e-7, rtol=0)
    with pytest.raises(ValueError, match="one per reward"):
        saw_weights(r, [3.0])


def test_saw_is_gdpo_verl_and_grpo_with_its_weights():
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 3, (5, 4, 3), generator=g).double()
    L = torch.randint(1, 9, (5, 4), generator=g)
    u = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    w = saw_weights(r, [1.0, 0.0, 2.0]) * u
    torch.testing.assert_close(saw_gdpo(r, u, lengths=L, shift=[1.0, 0.0, 2.0]), REGISTRY["gdpo_verl"].advantages(r, w, lengths=L))
    torch.testing.assert_close(saw_grpo(r, u, shift=[1.0, 0.0, 2.0]), REGISTRY["grpo"].advantages(r, w, eps=1e-6))


OPTIONS = [("gd2po", dict(mode="hard")), ("gd2po", dict(mode="snr", tau=0.2)), ("gd2po", dict(mode="snr", tau=0.8)),
           ("saw_gdpo", dict(shift=[3.0, 0.0, 1.0])), ("saw_grpo", dict(shift=[3.0, 0.0, 1.0])), ("saw_gdpo", {})]


@pytest.mark.parametrize("name,options", OPTIONS)
@pytest.mark.parametrize("seed", range(4))
def test_vectorised_equals_naive_with_options_nans_weights_and_lengths(name, options, seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(-1, 3, (6, 5, 3), generator=g).double()
    r[torch.rand(6, 5, 3, generator=g) < 0.15] = math.nan
    r[1, 2, :] = math.nan                                   # a sample with no applicable reward
    lengths = torch.randint(0, 7, (6, 5), generator=g)      # some completions of 0 tokens
    w = [1.0, 0.5, 2.0]
    got = REGISTRY[name].advantages(r, torch.tensor(w, dtype=torch.float64), lengths=lengths, **options)
    want = TWINS[name][0](r.tolist(), w, lengths=lengths.tolist(), **options)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-9, rtol=0)
    assert got[1, 2] == 0 and torch.isfinite(got).all()
    binary = torch.randint(0, 2, (32, 4, 3), generator=g).double()
    assert informative_groups(binary, None, name, **options).tolist() == informative_groups_naive(
        binary.tolist(), None, name, **options)


def test_conditions_apply_before_them():
    """length_ok:correct>=1 (Eq. 8) zeroes length_ok where correct fails; the successors see the result."""
    r = torch.tensor([[[1, 1], [0, 1], [1, 0], [0, 0]]], dtype=torch.float64)
    shaped = apply_conditions(r, ["correct", "length_ok"], [Condition.parse("length_ok:correct>=1")])
    assert shaped[0, :, 1].tolist() == [1, 0, 0, 0]
    for name in ("gd2po", "saw_gdpo", "saw_grpo"):
        a = REGISTRY[name].advantages(shaped)
        assert a[0, 0] > a[0, 2] > a[0, 3] and a[0, 1] == pytest.approx(a[0, 3].item(), abs=1e-6), name


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="mode must be 'hard' or 'snr'"):
        gd2po(REWARDS, mode="soft")
