"""The verl and NeMo-RL GDPO variants against their peers' formulas, written here as math.

Run: pytest tests/test_peer_estimators.py
"""

import math

import pytest
import torch

from minigdpo.advantages import gdpo, gdpo_nemo, gdpo_verl, grpo, grpo_no_std, leave_one_out_zscore
from minigdpo.estimators import REGISTRY


def verl_formula(rewards, lengths):
    """verl-GDPO's arithmetic spelled out on a token grid.

    Per reward, a group z-score with torch.std (Bessel) + 1e-6; their sum is copied onto
    every response token of a (B*G, T) grid; the grid is whitened under the response mask:
    mean = sum(x m) / N, var = sum((x - mean)^2 m) / N * N / (N - 1), (x - mean) / sqrt(var + 1e-8).
    Returns the value on each completion's first token (0 for an empty completion).
    """
    B, G, R = rewards.shape
    x = rewards.double()
    total = sum((x[..., k] - x[..., k].mean(1, keepdim=True)) / (x[..., k].std(1, keepdim=True) + 1e-6)
                for k in range(R)).reshape(B * G)
    T = int(lengths.max())
    mask = (torch.arange(T) < lengths.reshape(B * G, 1)).double()      # (B*G, T) response mask
    grid = total.unsqueeze(1) * mask                                   # each token carries its sample's value
    N = mask.sum()
    mean = (grid * mask).sum() / N
    var = ((grid - mean) ** 2 * mask).sum() / N * (N / (N - 1))
    white = (grid - mean) * torch.rsqrt(var + 1e-8) * mask
    return white[:, 0].view(B, G)


def nemo_formula(rewards, weights):
    """NeMo-RL's arithmetic spelled out: leave-one-out moments E[x], E[x^2] over the other
    G-1 samples, std = sqrt((E[x^2] - E[x]^2) * m / (m - 1)) with m = G - 1 (0 when m = 1),
    A_k = (r - b) / (std + 1e-6) where std > 0 else r - b, A = sum_k w_k A_k, then
    (A - mean) / std over the batch (Bessel, no eps)."""
    B, G, R = rewards.shape
    m = G - 1
    total = torch.zeros(B, G, dtype=torch.float64)
    for k in range(R):
        x = rewards[..., k].double()
        b = (x.sum(1, keepdim=True) - x) / m
        sq = ((x**2).sum(1, keepdim=True) - x**2) / m
        std = ((sq - b**2) * (m / (m - 1))).sqrt().nan_to_num(0.0) if m > 1 else torch.zeros_like(x)
        total += float(weights[k]) * torch.where(std > 0, (x - b) / (std + 1e-6), x - b)
    s = total.std()
    return (total - total.mean()) / s if s > 0 else total - total.mean()


def mixed_rewards(seed, B, G, R):
    """Random floats, with one group of 0/1 rewards where some samples face all-equal others."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 3, (B, G, R), generator=g).double() + torch.rand(B, G, R, generator=g, dtype=torch.float64)
    r[0] = 0.0
    r[0, 0] = 1.0                      # rewards (1, 0, 0, ...): sample 0's others are all 0
    if B > 1:
        r[1, :, 0] = 2.0               # a constant reward in one group
    return r


@pytest.mark.parametrize("B,G,R", [(3, 2, 2), (4, 4, 2), (5, 7, 3), (8, 16, 4)])
def test_gdpo_verl_matches_verl_token_whitening(B, G, R):
    r = mixed_rewards(B * G, B, G, R)
    lengths = torch.randint(0, 40, (B, G), generator=torch.Generator().manual_seed(R))
    lengths[0, 0] = 0  # an empty completion
    torch.testing.assert_close(gdpo_verl(r, lengths=lengths), verl_formula(r, lengths), atol=1e-9, rtol=0)


@pytest.mark.parametrize("B,G,R", [(3, 2, 2), (4, 4, 2), (5, 7, 3), (8, 16, 4)])
def test_gdpo_nemo_matches_nemo_leave_one_out(B, G, R):
    r = mixed_rewards(B * G + 1, B, G, R)
    w = torch.rand(R, generator=torch.Generator().manual_seed(G), dtype=torch.float64) + 0.5
    torch.testing.assert_close(gdpo_nemo(r, w), nemo_formula(r, w), atol=1e-9, rtol=0)


def test_gdpo_verl_longer_completions_weigh_more():
    # Two groups of G=2, one reward, (1, 0) in both. Group step: +-z with z = 0.5 / (sqrt(0.5) + 1e-6).
    r = torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64).unsqueeze(-1)
    # Two tokens each: 8 tokens +-z in equal numbers, mean 0, var = 8 z^2 / 7 (Bessel over tokens).
    even = gdpo_verl(r, lengths=torch.full((2, 2), 2))
    assert even.flatten().tolist() == pytest.approx([math.sqrt(7 / 8), -math.sqrt(7 / 8)] * 2, abs=1e-6)
    # No lengths: one token each, var = 4 z^2 / 3.
    assert gdpo_verl(r).flatten().tolist() == pytest.approx([math.sqrt(3 / 4), -math.sqrt(3 / 4)] * 2, abs=1e-6)
    # Lengths (1, 3) and (2, 2): 3 of 8 tokens are group 0's wrong answer, so the mean is
    # -z/4 and var = (3 (5z/4)^2 + 5 (3z/4)^2) / 7 = 15 z^2 / 14: correct 1.25 / sqrt(15/14), wrong -0.75 / sqrt(15/14).
    a = gdpo_verl(r, lengths=torch.tensor([[1, 3], [2, 2]]))
    up, down = 1.25 / math.sqrt(15 / 14), -0.75 / math.sqrt(15 / 14)
    assert a.flatten().tolist() == pytest.approx([up, down, up, down], abs=1e-6)


def test_gdpo_nemo_keeps_raw_differences_where_the_others_agree():
    # G=2: each sample's only other is constant by definition, so nothing is scaled.
    # Group 0 rewards (1,1) vs (0,0); group 1 rewards (3,0) vs (0,0).
    r = torch.tensor([[[1.0, 1.0], [0.0, 0.0]], [[3.0, 0.0], [0.0, 0.0]]], dtype=torch.float64)
    pre = [2.0, -2.0, 3.0, -3.0]                        # raw leave-one-out differences, summed
    std = math.sqrt(sum(p * p for p in pre) / 3)          # batch mean 0, Bessel
    assert gdpo_nemo(r).flatten().tolist() == pytest.approx([p / std for p in pre], abs=1e-9)
    # TRL's GDPO z-scores each reward first: (1,1) outranks (3,0) there, and not here.
    a = gdpo(r)
    assert a[0, 0] > a[1, 0]


def test_leave_one_out_zscore_by_hand():
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    # Sample 0: others (0,0,0) agree, raw 1 - 0 = 1. Sample 1: others (1,0,0), b = 1/3,
    # s = sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3), z = (0 - 1/3) / (sqrt(1/3) + eps).
    z = -1 / 3 / (math.sqrt(1 / 3) + 1e-6)
    assert leave_one_out_zscore(x).flatten().tolist() == pytest.approx([1.0, z, z, z], abs=1e-12)
    assert leave_one_out_zscore(torch.tensor([[0.1, 0.1, 0.1, 0.1]])).abs().max().item() == 0.0
    assert leave_one_out_zscore(torch.tensor([[1.0, math.nan]])).tolist() == [[0.0, 0.0]]  # one value: no signal


def test_gdpo_nemo_without_leave_one_out_is_a_group_zscore():
    r = mixed_rewards(3, 4, 5, 2)
    z = sum((r[..., k] - r[..., k].mean(1, keepdim=True)) / (r[..., k].std(1, keepdim=True) + 1e-6) for k in range(2))
    torch.testing.assert_close(gdpo_nemo(r, leave_one_out=False), (z - z.mean()) / z.std(), atol=1e-9, rtol=0)


def test_gdpo_nemo_refuses_one_reward():
    with pytest.raises(ValueError, match="two or more rewards"):
        gdpo_nemo(torch.zeros(2, 4, 1))


def test_lengths_are_ignored_by_the_others_and_checked():
    r = mixed_rewards(5, 3, 4, 2)
    lengths = torch.randint(1, 9, (3, 4), generator=torch.Generator().manual_seed(0))
    for name, est in REGISTRY.items():  # the rule for every entry: tests/test_estimator_contract.py
        if not est.reads_lengths:
            torch.testing.assert_close(est.advantages(r, lengths=lengths), est.advantages(r))
    with pytest.raises(ValueError, match="lengths has shape"):
        gdpo_verl(r, lengths=torch.ones(4, 3))
    assert {n for n, e in REGISTRY.items() if e.reads_lengths} == {"gdpo_verl", "gd2po", "saw_gdpo"}  # verl's step
