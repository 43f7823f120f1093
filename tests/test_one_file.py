"""The one-file trainer (examples/gdpo_in_one_file.py) is train.py's algorithm: on the same prompts, completions
and rewards, one update of each gives the same advantages, loss, KL, gradients and updated parameters (fp32).

train.py's side runs its own path: the conditions and the estimator of minigdpo/advantages.py, micro-batches cut
by minigdpo/microbatch.py (groups split across them), the padding-free pass (or the padded shared-prefix pass),
the chunked head, the reference's pass, FSDP2 on one rank and its fused AdamW. Change a line of either side's
advantage, loss or KL, and a case here fails.

Run: pytest tests/test_one_file.py
"""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import gdpo_in_one_file as one_file  # noqa: E402
from minigdpo import microbatch, models, policy  # noqa: E402
from minigdpo.advantages import Condition, apply_conditions  # noqa: E402
from minigdpo.config import Config  # noqa: E402
from minigdpo.estimators import ESTIMATORS  # noqa: E402
from minigdpo.sampler import Completion, left_pad  # noqa: E402
from minigdpo.update import fill_logprobs, optimizer, scheduler, step_metrics, update  # noqa: E402

NAMES = ["correct", "format", "length_ok"]
B, G, PAD, LR = 3, 4, 257, 1e-3


def sampled_batch(seed=0):
    """B prompts of different lengths, G completions of 1-9 tokens each, and (B, G, R) rewards in which the same
    sum hides different combinations, and length_ok sometimes passes where correct fails."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 250, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (B,), generator=g)]
    comps = [[torch.randint(0, 250, (int(n),), generator=g).tolist() for n in torch.randint(1, 10, (G,), generator=g)]
             for _ in range(B)]
    rewards = torch.tensor([[[1, 1, 0], [0, 1, 1], [1, 0, 1], [0, 0, 0]],
                            [[1, 1, 1], [1, 0, 0], [0, 1, 1], [0, 1, 0]],
                            [[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 0, 1]]], dtype=torch.float64)
    return prompts, comps, rewards


def recording(opt, named):
    """{name: gradient} of each parameter as the optimizer step sees it (clipped), whole; `named` its names."""
    names, seen = {id(p): n.removeprefix("lm.") for n, p in named}, {}

    def hook(optimizer, args, kwargs):
        seen.update({names[id(p)]: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for group in optimizer.param_groups for p in group["params"]})

    opt.register_step_pre_hook(hook)
    return seen


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """(policy, reference): the reference is tiny-random, the policy a step away from it, so the KL is not 0."""
    ref = models.resolve_model("tiny-random")
    lm = models.load_model(ref, torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    path = str(tmp_path_factory.mktemp("policy"))
    lm.save_pretrained(path)
    models.load_tokenizer(ref).save_pretrained(path)
    return path, ref


def one_file_update(paths, prompts, comps, rewards, estimator, condition):
    args = one_file.Args(estimator=estimator, condition=condition, lr=LR, temperature=0.8, beta=0.04)
    policy_lm = models.load_model(paths[0], torch.float32).train()
    reference = models.load_model(paths[1], torch.float32).eval()
    opt = torch.optim.AdamW(policy_lm.parameters(), lr=LR, weight_decay=0.0)
    grads = recording(opt, policy_lm.named_parameters())
    prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(G)], PAD, torch.device("cpu"))
    flat = [c for group in comps for c in group]
    T = max(len(c) for c in flat)
    completion_ids = torch.tensor([c + [PAD] * (T - len(c)) for c in flat])
    completion_mask = torch.tensor([[1.0] * len(c) + [0.0] * (T - len(c)) for c in flat])
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
             "completion_mask": completion_mask}
    adv, loss, kl = one_file.update(policy_lm, reference, opt, batch, rewards, NAMES, args)
    params = dict(policy_lm.named_parameters())
    return adv, loss, kl, grads, params


def full_update(paths, prompts, comps, rewards, estimator, condition, agg, size, pack, device):
    cfg = Config(estimator=estimator, condition=[condition] if condition else [], lr=LR, temperature=0.8, beta=0.04,
                 loss_agg=agg, micro_batch_size=size, max_new_tokens=16, weight_decay=0.0, max_grad_norm=1.0)
    conditions = [Condition.parse(c, NAMES) for c in cfg.condition]
    shaped = apply_conditions(rewards, NAMES, conditions)                       # (B, G, R) Eq. 8
    adv = ESTIMATORS[estimator](shaped, torch.ones(len(NAMES), dtype=torch.float64))  # (B, G)
    model = policy.build(paths[0], device, torch.float32)
    ref = policy.build(paths[1], device, torch.float32, frozen=True)
    groups = [(p, [Completion(c, [0.0] * len(c)) for c in cs], a) for p, cs, a in zip(prompts, comps, adv.float())]
    batches = microbatch.cut(groups, cfg, PAD, device, "packed" if pack else "padded")
    assert len(batches) == -(-B * G // size)
    fill_logprobs(ref, batches, "ref_logp", cfg, reshard=True)
    opt = optimizer(model, cfg.lr, cfg.weight_decay)
    grads = recording(opt, model.named_parameters())
    metrics = step_metrics(update(model, opt, scheduler(opt, 1, 0.0, "constant"), batches, cfg))
    params = {name.removeprefix("lm."): p.full_tensor() for name, p in model.named_parameters()}
    return adv, metrics["loss"], metrics["kl"], grads, params


@pytest.mark.parametrize("estimator", ["gdpo", "grpo"])
@pytest.mark.parametrize("condition", ["", "length_ok:correct>=1"])
@pytest.mark.parametrize("agg,size,pack", [("token_mean", 5, True), ("micro_batch_token_mean", B * G, True),
                                           ("token_mean", 5, False)])
def test_one_update_of_the_one_file_trainer_is_one_update_of_train_py(estimator, condition, agg, size, pack, paths,
                                                                     process_group):
    """token_mean (dapo) over micro-batches of 5 (groups split across them) is the one-file trainer's token mean
    of the whole batch; so is the default bnpo when the batch is one micro-batch."""
    prompts, comps, rewards = sampled_batch()
    a1, loss1, kl1, g1, p1 = one_file_update(paths, prompts, comps, rewards, estimator, condition)
    a2, loss2, kl2, g2, p2 = full_update(paths, prompts, comps, rewards, estimator, condition, agg, size, pack,
                                         process_group)
    torch.testing.assert_close(a1, a2, rtol=0, atol=1e-5)
    assert loss1 == pytest.approx(loss2, abs=1e-5) and kl1 == pytest.approx(kl2, abs=1e-5)
    assert kl1 > 0 and a1.abs().max() > 0.5
    scale = max(g.abs().max().item() for g in g1.values())
    assert set(g1) - {"lm_head.weight"} == set(g2)  # tied: the head is the embedding
    for name, grad in g2.items():
        torch.testing.assert_close(g1[name], grad, rtol=0, atol=1e-5 * scale, msg=name)
    # The step: AdamW's first move is lr * g / (|g| + 1e-8), so it equals to 1e-5 wherever |g| > 1e-6; where the
    # gradient is at rounding size (a handful of elements) rounding moves it by up to lr, both ways.
    for name, p in p2.items():
        steady = g1[name].abs() > 1e-6
        assert steady.float().mean() > 0.5, name
        torch.testing.assert_close(p1[name].detach()[steady], p.detach()[steady], rtol=0, atol=1e-5, msg=name)
        assert (p1[name].detach() - p.detach()).abs().max() <= 2 * LR
