"""The one-file trainer (examples/gdpo_in_one_file.py) is train.py's algorithm: on the same prompts, completions
and rewards, three updates of each give the same advantages, loss, KL, gradients and parameters (fp32), each side
with its own optimizer, its own defaults and its own functions (build, update, sample, main, apply_condition).

train.py's side runs its own path: the conditions and the estimator of minigdpo/advantages.py, micro-batches cut
by minigdpo/microbatch.py (groups split across them), the padding-free pass (or the padded shared-prefix pass),
the chunked head, the reference's pass, FSDP2 on one rank and its fused AdamW. Change a line of either side's
advantage, loss, KL, optimizer (betas, weight decay) or stop mask, and a case here fails.

Run: pytest tests/test_one_file.py
"""

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import gdpo_in_one_file as one_file  # noqa: E402
from minigdpo import config, microbatch, models, policy  # noqa: E402
from minigdpo.advantages import Condition, apply_conditions  # noqa: E402
from minigdpo.config import Config  # noqa: E402
from minigdpo.estimators import REGISTRY  # noqa: E402
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
    """(a policy, tiny-random): the policy is tiny-random moved a little, so its log-probs are not uniform."""
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


def as_batch(prompts, comps):
    """The one-file trainer's padded batch of B prompts x G completions (lists of ids)."""
    prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(G)], PAD, torch.device("cpu"))
    flat = [c for group in comps for c in group]
    T = max(len(c) for c in flat)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
            "completion_ids": torch.tensor([c + [PAD] * (T - len(c)) for c in flat]),
            "completion_mask": torch.tensor([[1.0] * len(c) + [0.0] * (T - len(c)) for c in flat])}


def one_file_steps(path, steps, estimator, condition):
    """The one-file trainer's own build (policy, reference, AdamW at its Args' defaults) and update(), one step per
    (prompts, completions, rewards); returns each step's (advantages, loss, KL, gradients) and the final weights."""
    args = one_file.Args(estimator=estimator, condition=condition)
    policy_lm, reference, opt = one_file.build(path, args)
    grads, out = recording(opt, policy_lm.named_parameters()), []
    for prompts, comps, rewards in steps:
        adv, loss, kl = one_file.update(policy_lm, reference, opt, as_batch(prompts, comps), rewards, NAMES, args)
        out.append((adv, loss, kl, dict(grads)))
    return out, {name: p.detach().clone() for name, p in policy_lm.named_parameters()}


def train_py_steps(path, steps, estimator, condition, agg, size, pack, device):
    """train.py's path at the cpu-demo preset's values, one update per step: conditions and estimator, micro-batches,
    the fast pass, the reference's pass, FSDP2 on one rank, its own optimizer and schedule."""
    cfg = Config(**{**config.PRESETS["cpu-demo"], "estimator": estimator, "condition": [condition] if condition else [],
                    "loss_agg": agg, "micro_batch_size": size, "padding_free": pack,
                    "beta": 0.04})  # the one-file's KL weight (the demo's is 0): the binding covers the KL term too
    model = policy.build(path, device, torch.float32)
    ref = policy.build(path, device, torch.float32, frozen=True)
    opt = optimizer(model, cfg.lr, cfg.weight_decay)
    sched = scheduler(opt, len(steps), cfg.warmup_ratio, cfg.lr_schedule)
    grads, out = recording(opt, model.named_parameters()), []
    for prompts, comps, rewards in steps:
        shaped = apply_conditions(rewards, NAMES, [Condition.parse(c, NAMES) for c in cfg.condition])  # Eq. 8
        adv = REGISTRY[estimator].advantages(shaped, torch.ones(len(NAMES), dtype=torch.float64))            # (B, G)
        groups = [(p, [Completion(c, [0.0] * len(c)) for c in cs], a) for p, cs, a in zip(prompts, comps, adv.float())]
        batches = microbatch.cut(groups, cfg, PAD, device, "packed" if pack else "padded")
        assert len(batches) == -(-B * G // size)
        fill_logprobs(ref, batches, "ref_logp", cfg, reshard=True)
        metrics = step_metrics(update(model, opt, sched, batches, cfg))
        out.append((adv, metrics["loss"], metrics["kl"], dict(grads)))
    return out, {name.removeprefix("lm."): p.full_tensor().detach().clone() for name, p in model.named_parameters()}


STEPS = 3


@pytest.mark.parametrize("estimator", ["gdpo", "grpo"])
@pytest.mark.parametrize("condition", ["", "length_ok:correct>=1"])
@pytest.mark.parametrize("agg,size,pack", [("token_mean", 5, True), ("micro_batch_token_mean", B * G, True),
                                           ("token_mean", 5, False)])
def test_three_steps_of_the_one_file_trainer_are_three_steps_of_train_py(estimator, condition, agg, size, pack, paths,
                                                                         process_group):
    """token_mean (dapo) over micro-batches of 5 (groups split across them) is the one-file trainer's token mean
    of the whole batch; so is the default bnpo when the batch is one micro-batch. Three steps, each side with its
    own AdamW: its state (the betas) counts from the second step on."""
    steps = [sampled_batch(seed) for seed in range(STEPS)]
    (mine, p1), (theirs, p2) = (one_file_steps(paths[0], steps, estimator, condition),
                                train_py_steps(paths[0], steps, estimator, condition, agg, size, pack, process_group))
    for step, ((a1, loss1, kl1, g1), (a2, loss2, kl2, g2)) in enumerate(zip(mine, theirs)):
        torch.testing.assert_close(a1, a2, rtol=0, atol=1e-5)
        assert loss1 == pytest.approx(loss2, abs=1e-5) and kl1 == pytest.approx(kl2, abs=1e-6), step
        assert set(g1) - {"lm_head.weight"} == set(g2)  # tied: the head is the embedding
        scale = max(g.abs().max().item() for g in g1.values())
        for name, grad in g2.items():
            torch.testing.assert_close(g1[name], grad, rtol=0, atol=1e-5 * scale, msg=f"step {step}: {name}")
    assert mine[-1][2] > 0 and mine[0][0].abs().max() > 0.5  # the policy moved from its reference; a signal
    lr = config.PRESETS["cpu-demo"]["lr"]
    # Adam's first moves are lr * m / (sqrt(v) + eps), about lr * sign(g): equal to 1e-8 wherever the gradients were
    # never at rounding size; where they were (a handful of elements), rounding moves them by up to lr a step.
    for name, p in p2.items():
        steady = torch.stack([step[3][name].abs() > 1e-6 for step in mine]).all(0)
        assert steady.float().mean() > 0.5, name
        torch.testing.assert_close(p1[name][steady], p[steady], rtol=0, atol=lr / 100, msg=name)
        assert (p1[name] - p).abs().max() <= 2 * lr * STEPS


def test_its_sampler_keeps_each_completion_to_its_first_stop_token(paths):
    """sample(): G completions of each prompt from generate(), each masked to its first stop token, which it keeps,
    as train.py's samplers end a completion; the update then runs on what it sampled."""
    args = one_file.Args(max_new_tokens=24, group_size=G)
    tokenizer = models.load_tokenizer(paths[0])
    policy_lm, reference, opt = one_file.build(paths[0], args)
    prompts = [tokenizer(text).input_ids for text in ("2 + 2 =", "The sky is", "abc")]
    torch.manual_seed(0)
    batch, texts = one_file.sample(policy_lm.eval(), tokenizer, prompts, args)
    eos = tokenizer.eos_token_id
    stopped = 0
    for ids, mask in zip(batch["completion_ids"].tolist(), batch["completion_mask"].tolist()):
        n = int(sum(mask))
        assert mask == [1.0] * n + [0.0] * (len(mask) - n)
        assert eos not in ids[:n - 1] and (ids[n - 1] == eos or n == args.max_new_tokens)
        stopped += ids[n - 1] == eos
    assert stopped > 0 and len(texts) == len(prompts) * G
    rewards = torch.rand(len(prompts), G, len(NAMES), generator=torch.Generator().manual_seed(0)).round().double()
    adv, loss, kl = one_file.update(policy_lm.train(), reference, opt, batch, rewards, NAMES, args)
    assert adv.shape == (len(prompts), G) and kl == 0.0  # one step from the reference: the KL starts at 0


def test_its_main_trains_and_logs(tmp_path):
    one_file.main(["--model", "tiny-random", "--max-steps", "2", "--batch-size", "8", "--group-size", "4",
                   "--max-new-tokens", "8", "--output-dir", str(tmp_path)])
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and all(k in rows[0] for k in ("loss", "kl", "reward/correct/mean"))


def test_its_condition_takes_reward_names_with_a_colon():
    names = ["tests.helpers:digit_frac", "model:/rm@safe", "correct"]
    r = torch.tensor([[[0.5, 0.9, 0.0], [0.7, 0.1, 1.0]]], dtype=torch.float64)
    out = one_file.apply_condition(r, names, "tests.helpers:digit_frac:correct>=1")
    assert out[..., 0].tolist() == [[0.0, 0.7]] and torch.equal(out[..., 1:], r[..., 1:])
    cond = [Condition.parse("model:/rm@safe:tests.helpers:digit_frac>0.6", names)]
    torch.testing.assert_close(one_file.apply_condition(r, names, "model:/rm@safe:tests.helpers:digit_frac>0.6"),
                               apply_conditions(r, names, cond))
