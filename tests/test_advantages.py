"""Advantage estimators against hand-computed numbers, the paper's formula and the naive oracle.

Run: pytest tests/test_advantages.py
"""

import math

import pytest
import torch

from minigdpo.advantages import STD_EPS, Condition, apply_conditions, gdpo, grpo, grpo_no_std
from advantages_naive import TWINS
from minigdpo.estimators import REGISTRY

S2 = math.sqrt(0.5)  # Bessel std of {0, 1}


def test_paper_two_sample_example_grpo_collapses_gdpo_separates():
    # Two groups of G=2 with two binary rewards. Group 0: (1,1) vs (0,0); group 1: (1,0) vs (0,0).
    r = torch.tensor([[[1.0, 1.0], [0.0, 0.0]], [[1.0, 0.0], [0.0, 0.0]]])
    # GRPO: sums (2,0) and (1,0); both z-score to +-d/2 / (d/sqrt2 + eps), i.e. about +-0.7071.
    a = grpo(r)
    assert a[0, 0].item() == pytest.approx(1.0 / (2 * S2 + STD_EPS), abs=1e-6)
    assert a[1, 0].item() == pytest.approx(0.5 / (S2 + STD_EPS), abs=1e-6)
    assert round(a[0, 0].item(), 3) == round(a[1, 0].item(), 3) == 0.707  # collapsed
    # GDPO: per reward z = 0.5 / (S2 + eps) = z1; group 0 sums to +-2 z1, group 1 to +-z1.
    z1 = 0.5 / (S2 + STD_EPS)
    pre = [2 * z1, -2 * z1, z1, -z1]
    std = math.sqrt(sum(p * p for p in pre) / 3)  # batch mean is 0; Bessel over 4 samples
    a = gdpo(r)
    assert a.flatten().tolist() == pytest.approx([p / (std + STD_EPS) for p in pre], abs=1e-6)
    assert a[0, 0] > a[1, 0] > 0  # "both right" now outranks "one right"


def test_gdpo_with_one_reward_falls_back_to_grpo():
    # The released TRL code applies GDPO only when there are two or more rewards
    # (`apply_gdpo and len(reward_weights) > 1`); one reward goes through plain GRPO.
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]]).unsqueeze(-1)  # (B=2, G=4, R=1)
    # Group 0: mean 1/4, Bessel std sqrt((9/16 + 3/16) / 3) = 1/2; group 1 mirrors it.
    hi, lo = 0.75 / (0.5 + STD_EPS), 0.25 / (0.5 + STD_EPS)
    want = [hi, -lo, -lo, -lo, lo, lo, lo, -hi]
    assert gdpo(r).flatten().tolist() == pytest.approx(want, abs=1e-6)
    assert (round(hi, 4), round(-lo, 4)) == (1.4997, -0.4999)
    torch.testing.assert_close(gdpo(r, torch.tensor([2.0])), grpo(r, torch.tensor([2.0])))
    # Without the fallback the batch step (Eq. 6) rescales these to 1.620 / -0.540.
    assert gdpo(r, single_reward_grpo=False)[0, :2].tolist() == pytest.approx([1.620, -0.540], abs=1e-3)


def test_grpo_no_std_is_mean_centred_sum():
    r = torch.tensor([[[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]])
    assert grpo_no_std(r)[0].tolist() == pytest.approx([1.0, 0.0, -1.0])


def paper_formula(rewards, weights, name):
    """The released recipe's arithmetic on a flat (B*G, R) batch, written independently.

    It runs in float64: in float32 a constant group's mean can miss its value by one ulp,
    and the formula then divides that rounding error by (~0 + 1e-4).
    """
    B, G, R = rewards.shape
    flat, weights = rewards.reshape(B * G, R).double(), weights.double()
    if name == "gdpo" and R > 1:  # one reward goes through GRPO, as `len(reward_weights) > 1` decides there
        cols = []
        for k in range(R):
            x = flat[:, k].view(-1, G)
            cols.append(((x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + 1e-4)).reshape(-1))
        pre = (torch.stack(cols, 1) * weights).sum(1)
        return ((pre - pre.mean()) / (pre.std() + 1e-4)).view(B, G).to(rewards.dtype)
    s = (flat * weights).sum(1).view(-1, G)
    centred = s - s.mean(1, keepdim=True)
    out = centred if name == "grpo_no_std" else centred / (s.std(1, keepdim=True) + 1e-4)
    return out.to(rewards.dtype)


@pytest.mark.parametrize("name", ["grpo", "grpo_no_std", "gdpo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_paper_formula_on_nan_free_input(name, dtype):
    g = torch.Generator().manual_seed(0)
    for B, G, R in [(1, 2, 1), (3, 4, 2), (8, 16, 3), (5, 7, 4)]:
        r = torch.randint(0, 3, (B, G, R), generator=g).to(dtype) + torch.rand(B, G, R, generator=g).to(dtype)
        r[0] = r[0, :1].floor()  # a group where every reward is constant (exact in floating point): 0 advantage
        w = torch.rand(R, generator=g).to(dtype) + 0.5
        got = REGISTRY[name].advantages(r, w)
        assert got.dtype == dtype and got.shape == (B, G)
        torch.testing.assert_close(got, paper_formula(r, w, name), atol=1e-6, rtol=0)


def random_rewards_with_holes(seed, B=6, G=5, R=3):
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 2, (B, G, R), generator=g).double()
    r[torch.rand(B, G, R, generator=g) < 0.2] = math.nan
    r[0, :, 0] = 1.0           # constant reward in one group
    r[1, 2, :] = math.nan      # a sample with no applicable reward
    r[2, :, 1] = math.nan      # a reward that applies to no sample of a group
    r[3, 1:, 2] = math.nan     # a reward with one value in its group
    return r


@pytest.mark.parametrize("name", list(REGISTRY))
@pytest.mark.parametrize("seed", range(5))
def test_vectorised_equals_naive_reference_with_nans(name, seed):
    r = random_rewards_with_holes(seed)
    w = [1.0, 0.5, 2.0]
    lengths = torch.randint(0, 9, r.shape[:2], generator=torch.Generator().manual_seed(seed))  # some 0-token samples
    got = REGISTRY[name].advantages(r, torch.tensor(w, dtype=torch.float64), lengths=lengths)
    want = torch.tensor(TWINS[name][0](r.tolist(), w, lengths=lengths.tolist()), dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=1e-9, rtol=0)
    assert torch.isfinite(got).all()


def test_nan_is_left_out_of_group_statistics_and_gives_zero():
    r = torch.tensor([[[1.0], [0.0], [math.nan]]])
    a = grpo(r)
    z = 0.5 / (S2 + STD_EPS)  # statistics of {1, 0} only
    assert a[0].tolist() == pytest.approx([z, -z, 0.0], abs=1e-6)


@pytest.mark.parametrize("name", ["grpo", "grpo_no_std", "saw_grpo"])
def test_summing_estimators_add_a_nan_reward_as_zero(name):
    """GRPO sums the rewards first (TRL's nansum): (NaN, 1) is compared as (0, 1); GDPO leaves it out instead."""
    r = torch.tensor([[[math.nan, 1.0], [0.0, 1.0], [1.0, 1.0]]], dtype=torch.float64)
    a = REGISTRY[name].advantages(r, None)
    assert a[0, 0].item() == a[0, 1].item() != 0.0
    g = REGISTRY["gdpo"].advantages(r, None)
    assert g[0, 0].item() != g[0, 1].item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gdpo_nemo_keeps_a_singletons_raw_difference_when_its_others_agree(dtype):
    """7 against 1 on a reward float32 cannot hold: the others' spread is 0, which E[x^2] - E[x]^2 rounds to about
    1.5e-4 in float32, and dividing by it gave NeMo-RL advantages in the thousands before its #4158. minigdpo's
    exact test keeps r - b = 0.4, in float32 and float64."""
    from minigdpo.advantages import gdpo_nemo_group

    r = torch.tensor([[[0.35, 0.0]] * 7 + [[0.75, 0.0]]], dtype=dtype)
    a = gdpo_nemo_group(r)
    assert a[0, 7].item() == pytest.approx(0.4, abs=1e-6)
    assert a.abs().max().item() < 1.0


def test_constant_reward_gives_exact_zero_for_that_reward():
    r = torch.tensor([[[0.1, 1.0], [0.1, 0.0], [0.1, 1.0]]])  # 0.1 does not sum exactly in floating point
    a_k_only_second = gdpo(r[..., 1:], single_reward_grpo=False)  # the same batch step, one reward
    torch.testing.assert_close(gdpo(r), a_k_only_second)
    assert grpo(torch.full((2, 4, 1), 0.1)).abs().max().item() == 0.0


def test_all_nan_sample_gets_zero_and_stays_out_of_batch_statistics():
    r = torch.tensor([[[1.0], [0.0], [math.nan]], [[1.0], [0.0], [0.0]]])
    a = gdpo(r, single_reward_grpo=False)  # one reward, so keep the batch step explicitly
    assert a[0, 2].item() == 0.0
    # The batch statistics are those of the 5 other samples, as if the NaN sample were absent.
    z = 0.5 / (S2 + STD_EPS)
    zs = [2 / 3 / (math.sqrt(1 / 3) + STD_EPS), -1 / 3 / (math.sqrt(1 / 3) + STD_EPS)]  # group {1, 0, 0}
    pre = [z, -z, zs[0], zs[1], zs[1]]
    mean = sum(pre) / 5
    std = math.sqrt(sum((p - mean) ** 2 for p in pre) / 4)
    want = [(p - mean) / (std + STD_EPS) for p in pre]
    assert [a[0, 0].item(), a[0, 1].item(), *a[1].tolist()] == pytest.approx(want, abs=1e-6)


def test_degenerate_batches_give_finite_zero_advantages():
    for r in [torch.zeros(3, 4, 2), torch.ones(1, 2, 3), torch.full((2, 2, 2), math.nan)]:
        for fn in (e.advantages for e in REGISTRY.values()):
            a = fn(r)
            assert torch.isfinite(a).all() and a.abs().max().item() < 1e-6


def test_weights_scale_the_per_reward_advantages():
    r = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0]]])
    a = gdpo(r, torch.tensor([2.0, 0.0]))
    one = dict(single_reward_grpo=False)  # keep the batch step with one reward left
    torch.testing.assert_close(a, gdpo(r[..., :1], torch.tensor([2.0]), **one))  # a zero weight removes a reward
    torch.testing.assert_close(a, gdpo(r[..., :1], **one), atol=1e-3, rtol=0)     # and Eq. 6 undoes the scale (up to eps)
    with pytest.raises(ValueError, match="expected \\(2,\\)"):
        gdpo(r, torch.tensor([1.0, 2.0, 3.0]))


def test_batch_step_uses_the_whole_batch():
    g = torch.Generator().manual_seed(1)
    r = torch.randint(0, 2, (4, 4, 3), generator=g).float()
    whole = gdpo(r)
    halves = torch.cat([gdpo(r[:2]), gdpo(r[2:])])
    assert not torch.allclose(whole, halves)  # so multi-rank runs must all-gather rewards first


def test_condition_parse_and_apply():
    c = Condition.parse("length_ok:correct>=1")
    assert (c.target, c.source, c.op, c.threshold) == ("length_ok", "correct", ">=", 1.0)
    assert str(c) == "length_ok:correct>=1"
    names = ["correct", "length_ok"]
    r = torch.tensor([[[1.0, 1.0], [0.0, 1.0], [math.nan, 1.0], [1.0, math.nan]]])
    out = apply_conditions(r, names, [c])
    assert out[0, :, 1].tolist()[:3] == [1.0, 0.0, 0.0]
    assert math.isnan(out[0, 3, 1].item())             # a NaN target stays NaN
    assert torch.equal(out[..., 0].nan_to_num(-1), r[..., 0].nan_to_num(-1))  # the source is untouched
    assert torch.equal(apply_conditions(r, names, [Condition.parse("length_ok:correct>0.5")]).nan_to_num(-1),
                       out.nan_to_num(-1))


@pytest.mark.parametrize("spec", ["length_ok", "length_ok:correct", "a:b=>1", "a:b>=x", "a:a>=1", ":b>=1"])
def test_condition_parse_errors(spec):
    with pytest.raises(ValueError, match="bad condition"):
        Condition.parse(spec)


def test_condition_unknown_reward():
    with pytest.raises(ValueError, match="not among"):
        apply_conditions(torch.zeros(1, 2, 1), ["correct"], [Condition.parse("length_ok:correct>=1")])
