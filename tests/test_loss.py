"""The clipped-surrogate + k3-KL policy loss against hand-computed numbers.

Run: pytest tests/test_loss.py
"""

import math

import pytest
import torch

from minigdpo.update import policy_loss


def one_token(ratio, adv, ref_delta=0.0, **kw):
    """A single valid token whose ratio and reference gap are given."""
    logp = torch.tensor([[0.0]], requires_grad=True)
    old = torch.tensor([[-math.log(ratio)]])
    ref = torch.tensor([[ref_delta]])
    loss, m = policy_loss(logp, old, ref, torch.tensor([adv]), torch.ones(1, 1), **kw)
    loss.backward()
    return loss.item(), logp.grad.item(), m


def test_inside_the_clip_the_loss_is_minus_ratio_times_advantage():
    loss, grad, m = one_token(1.1, 2.0, beta=0.0)
    assert loss == pytest.approx(-2.2)
    assert grad == pytest.approx(-2.2)  # d(-r A)/dlogp = -r A
    assert m["clip_high"].item() == 0 and m["clip_low"].item() == 0


def test_clip_high_binds_for_positive_advantage_and_kills_the_gradient():
    loss, grad, m = one_token(1.5, 1.0, beta=0.0)
    assert loss == pytest.approx(-1.2)
    assert grad == 0.0
    assert m["clip_high"].item() == 1


def test_clip_low_binds_for_negative_advantage():
    loss, grad, m = one_token(0.5, -1.0, beta=0.0)
    assert loss == pytest.approx(0.8)
    assert grad == 0.0
    assert m["clip_low"].item() == 1


def test_clip_does_not_bind_on_the_unbounded_side():
    loss, grad, _ = one_token(1.5, -1.0, beta=0.0)  # ratio above 1+eps with A < 0: min picks r*A
    assert loss == pytest.approx(1.5) and grad == pytest.approx(1.5)
    loss, grad, _ = one_token(0.5, 1.0, beta=0.0)
    assert loss == pytest.approx(-0.5) and grad == pytest.approx(-0.5)


def test_asymmetric_clip_boundaries():
    assert one_token(1.25, 1.0, beta=0.0, clip_high=0.28)[1] != 0.0  # 1.25 < 1.28: still free
    assert one_token(1.3, 1.0, beta=0.0, clip_high=0.28)[0] == pytest.approx(-1.28)
    assert one_token(0.85, -1.0, beta=0.0, clip_low=0.1)[0] == pytest.approx(0.9)


def test_k3_kl_value_and_gradient():
    d = 0.3  # ref - logp
    loss, grad, m = one_token(1.0, 0.0, ref_delta=d, beta=0.5)
    kl = math.exp(d) - d - 1
    assert loss == pytest.approx(0.5 * kl)
    assert m["kl"].item() == pytest.approx(kl)
    assert grad == pytest.approx(0.5 * (-math.exp(d) + 1))  # d/dlogp of exp(ref-logp) - (ref-logp) - 1


def test_aggregations():
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, 3.0])  # per token loss is -A on every valid token
    kw = dict(beta=0.0)
    tm, _ = policy_loss(logp, logp, None, adv, mask, agg="token_mean", **kw)
    assert tm.item() == pytest.approx(-(3 * 1 + 3) / 4)
    sm, _ = policy_loss(logp, logp, None, adv, mask, agg="seq_mean_token_mean", **kw)
    assert sm.item() == pytest.approx(-(1 + 3) / 2)
    dr, _ = policy_loss(logp, logp, None, adv, mask, agg="seq_mean_token_sum_norm", norm=2 * 10, **kw)  # 2 x max_len
    assert dr.item() == pytest.approx(-(3 / 10 + 3 / 10) / 2)
    with pytest.raises(ValueError, match="max_len"):
        policy_loss(logp, logp, None, adv, mask, agg="seq_mean_token_sum_norm", **kw)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        policy_loss(logp, logp, None, adv, mask, agg="sum", **kw)


def test_micro_batch_token_mean_weighs_micro_batches_alike():
    """bnpo: each micro-batch is divided by its own token count, then by the micro-batches per step."""
    logp = torch.zeros(1, 3)
    a, _ = policy_loss(logp, logp, None, torch.tensor([1.0]), torch.tensor([[1.0, 1.0, 1.0]]), beta=0.0,
                       agg="micro_batch_token_mean", norm=2)  # its own token mean, over 2 micro-batches
    b, _ = policy_loss(logp, logp, None, torch.tensor([3.0]), torch.tensor([[1.0, 0.0, 0.0]]), beta=0.0,
                       agg="micro_batch_token_mean", norm=2)
    assert (a + b).item() == pytest.approx(-(3 / 3 + 3 / 1) / 2)  # token_mean over both would give -6 / 4


@pytest.mark.parametrize("trl,ours", [("bnpo", "micro_batch_token_mean"), ("dapo", "token_mean"),
                                      ("grpo", "seq_mean_token_mean"), ("dr_grpo", "seq_mean_token_sum_norm")])
def test_trl_loss_type_names_select_the_same_aggregation(trl, ours):
    g = torch.Generator().manual_seed(1)
    logp, adv = torch.randn(3, 4, generator=g), torch.randn(3, generator=g)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    kw = dict(beta=0.1, norm=9.0)
    assert policy_loss(logp, logp - 0.1, logp + 0.2, adv, mask, agg=trl, **kw)[0].item() == \
        policy_loss(logp, logp - 0.1, logp + 0.2, adv, mask, agg=ours, **kw)[0].item()


def test_global_normaliser_makes_accumulation_equal_one_big_batch():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(6, 5, generator=g, requires_grad=True)
    old = logp.detach() + 0.1 * torch.randn(6, 5, generator=g)
    ref = logp.detach() + 0.1 * torch.randn(6, 5, generator=g)
    adv = torch.randn(6, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    # the whole batch's normaliser: its tokens, its 6 sequences, or 6 sequences x max_len 5
    for agg, norm in [("token_mean", mask.sum()), ("seq_mean_token_mean", 6), ("seq_mean_token_sum_norm", 6 * 5)]:
        logp.grad = None
        full, _ = policy_loss(logp, old, ref, adv, mask, agg=agg, norm=norm if agg == "seq_mean_token_sum_norm" else None)
        full.backward()
        want = logp.grad.clone()
        logp.grad = None
        for sl in (slice(0, 2), slice(2, 6)):
            part, _ = policy_loss(logp[sl], old[sl], ref[sl], adv[sl], mask[sl], agg=agg, norm=norm)
            part.backward()
        torch.testing.assert_close(logp.grad, want)


def test_padding_tokens_do_not_count():
    logp = torch.zeros(1, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0]])
    old = torch.tensor([[0.0, -5.0, -5.0]])  # huge ratios on padding must not show up
    loss, m = policy_loss(logp, old, logp.detach(), torch.tensor([1.0]), mask)
    assert loss.item() == pytest.approx(-1.0)
    assert m["ratio_max"].item() == 1.0 and m["clip_high"].item() == 0


def test_importance_weight_scales_the_surrogate_only():
    """--importance-sampling-cap: the surrogate times min(pi_trainer / pi_sampler, cap) on each token; the KL untouched."""
    logp = torch.zeros(1, 2)
    ref = torch.full((1, 2), 0.3)
    sampler = torch.tensor([[math.log(2.0), -math.log(4.0)]])  # weights 1/2, and 4 capped at 3
    base, _ = policy_loss(logp, logp, ref, torch.tensor([1.0]), torch.ones(1, 2), beta=0.1)
    w, _ = policy_loss(logp, logp, ref, torch.tensor([1.0]), torch.ones(1, 2), beta=0.1, sampler_logp=sampler, importance_sampling_cap=3.0)
    kl = 0.1 * (math.exp(0.3) - 0.3 - 1)
    assert base.item() == pytest.approx(-1.0 + kl) and w.item() == pytest.approx(-(0.5 + 3.0) / 2 + kl)
