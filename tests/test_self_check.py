"""The fast pass's self-check and its fallback, under what a real run brings: LoRA dropout, configs with stray keys,
models that ignore logits_to_keep, bf16 rounding over long completions, windows the check's sequences do not reach,
the fallback's memory, Phi-3's longrope; and the optimizer step a non-finite gradient skips. Each case failed on the
code of commit fcf090c, the sampler's stray window (through train.py) on that of aadb64c.

Run: pytest tests/test_self_check.py   (about 15 seconds, a 2-step run of train.py among them)
"""

import json
import math
import os

import pytest
import torch

from minigdpo import logprobs, microbatch
from minigdpo.sampler import Completion
from test_policy import batches, naive_logprobs, tiny_of


def check(model, mb, dtype=torch.float32, temperature=0.8):
    """The self-check's largest difference (it also sets model.fast)."""
    return logprobs.check_fast_pass(model, mb, temperature, logprobs.FAST_PASS_BOUND[dtype])["max"]


def test_the_self_check_compares_in_eval_mode_so_lora_dropout_does_not_fail_it():
    """LoRA dropout 0.1 with adapters that are no longer 0 (a resumed run): in training mode each pass drops other
    inputs and the two passes differ by far more than rounding; the check runs both without dropout."""
    from minigdpo import lora

    lm = tiny_of("llama")
    lora.attach(lm, lora.Settings(4, 8.0, 0.1, ("q_proj", "v_proj")), None)
    torch.manual_seed(1)
    for _, layer in lora.lora_layers(lm):
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.5)
    model = logprobs.LogProbModel(lm).train()
    (mb,) = batches(seed=7, pack=True)
    worst = check(model, mb)
    assert model.fast and worst < 1e-5 and model.training  # training mode is given back


@pytest.mark.parametrize("arch", ["llama", "olmo2"])
def test_a_stray_sliding_window_in_a_config_whose_attention_has_none_is_ignored(arch):
    """transformers keeps unknown config keys: a Llama or OLMo-2 config with `sliding_window` attends fully, and the
    fast pass must too (it crashed looking up a window bias the attention never asks for)."""
    lm = tiny_of(arch)
    lm.config.sliding_window = 3
    model = logprobs.LogProbModel(lm)
    (mb,) = batches(seed=7, pack=True)
    assert check(model, mb) < 1e-5 and model.fast
    torch.testing.assert_close(model(mb, 0.8), naive_logprobs(lm, mb, 0.8), atol=1e-5, rtol=0)


def test_train_py_samples_a_llama_whose_config_carries_a_stray_sliding_window(tmp_path):
    """The HF sampler too, not only the fast pass: transformers 5.20 built the sampler's KV cache with sliding layers
    from the stray key, which Llama's attention never applies, and train.py crashed in its first generation (a mask
    of every position against the window's keys). The run ends, and the sampler's log-probs are the trainer's."""
    from transformers import AutoConfig

    from conftest import read_jsonl, run
    from minigdpo import models

    path, out = str(tmp_path / "model"), str(tmp_path / "run")
    models._build_tiny(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config | {"sliding_window": 4}, f)  # shorter than every prompt
    assert AutoConfig.from_pretrained(path).sliding_window == 4  # transformers keeps the stray key
    run(["train.py", "--preset", "smoke", "--model", path, "--output-dir", out])
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2] and max(r["sampler/logp_gap"] for r in rows) < 1e-3


class SwallowsLogitsToKeep(torch.nn.Module):
    """A model whose forward takes logits_to_keep in **kwargs and returns the logits of every position."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, position_ids, use_cache=False, **kwargs):
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)


def test_the_textbook_pass_reads_the_last_positions_itself():
    lm = tiny_of("llama")
    (mb,) = batches(seed=3)
    want = naive_logprobs(lm, mb, 0.8)
    torch.testing.assert_close(naive_logprobs(SwallowsLogitsToKeep(lm), mb, 0.8), want, atol=1e-6, rtol=0)


def test_the_fallback_keeps_no_full_vocabulary_logits_for_the_backward():
    """The model's own forward (a model the fast pass refuses, or a failed self-check) keeps, for its backward, no
    (N, T, V) tensor: rows of at most `chunk` tokens at a time, each recomputed in the backward; same values and
    gradients as the textbook formula."""
    lm = tiny_of("llama")
    model = logprobs.LogProbModel(lm)
    model.fast = False
    (mb,) = batches(seed=7, size=9, prompts=3)
    (N, T), V = mb.completion_ids.shape, lm.config.vocab_size
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        got = model(mb, 0.8, chunk=T + 1)
    assert max(saved) < N * T * V / 2, (max(saved), N * T * V)  # the textbook formula keeps (N, T, V) twice
    want = naive_logprobs(lm, mb, 0.8)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    g_got = torch.autograd.grad(got.sum(), lm.model.embed_tokens.weight)[0]
    g_want = torch.autograd.grad(want.sum(), lm.model.embed_tokens.weight)[0]
    torch.testing.assert_close(g_got, g_want, atol=1e-6, rtol=1e-5)


def test_the_fallback_says_what_memory_it_needs():
    lm = tiny_of("gemma2")  # refused by the fast pass: it runs its own forward
    model = logprobs.LogProbModel(lm)
    line = model.fallback_line(chunk=1024, max_new_tokens=100)
    assert "model type 'gemma2'" in line and "MiB" in line


def test_in_bf16_the_check_bounds_the_mean_per_token_too():
    """A fast pass off by 0.3 on every token stays under a bound on the largest difference alone; the mean per token
    catches it."""
    lm = tiny_of("llama")
    model = logprobs.LogProbModel(lm)
    (mb,) = batches(seed=7, pack=True)
    forward = logprobs.LogProbModel.forward

    def off(self, mb, *args, **kwargs):
        out = forward(self, mb, *args, **kwargs)
        return out + 0.3 * mb.mask if self.fast else out

    logprobs.LogProbModel.forward = off
    try:
        check(model, mb, torch.bfloat16)
    finally:
        logprobs.LogProbModel.forward = forward
    assert not model.fast


def test_a_window_longer_than_the_checked_sequences_is_still_checked():
    """The check's sequences reach past the smallest window even when every sampled one is shorter: a fast pass that
    drops a window of 12 is caught on completions of at most 7 tokens."""
    from test_policy import _windowless

    lm = tiny_of("mistral", sliding_window=12)
    model = logprobs.LogProbModel(lm)
    groups = [([5, 6, 7], [Completion([9] * n, [0.0] * n) for n in (3, 5, 7, 2)], torch.zeros(4))]
    mb = logprobs.check_batch(model, groups, 0, torch.device("cpu"), "packed", max_len=64)
    assert mb.prompt_mask.sum(1).max() + mb.completion_ids.shape[1] > 12
    attending = microbatch.Packed.attending
    microbatch.Packed.attending = lambda self, dtype, windows: _windowless(attending(self, dtype, {None}), windows)
    try:
        assert check(model, mb) > 1e-3 and not model.fast
    finally:
        microbatch.Packed.attending = attending


def test_phi3_longrope_is_refused_where_a_sequence_can_pass_its_original_context():
    """Phi-3's longrope picks its factor by the longest sequence of a pass, so a packed micro-batch would give a
    short sequence the long factor of its mates."""
    extra = dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                  "long_factor": [4.0] * 8, "original_max_position_embeddings": 16},
                 original_max_position_embeddings=16)
    lm = tiny_of("phi3", **extra)
    assert "longrope" in logprobs.fast_pass_refusal(lm, context=40)
    assert logprobs.fast_pass_refusal(lm, context=16) == ""


def test_a_non_finite_gradient_skips_the_step_and_the_schedule_moves_on():
    """The optimizer step is skipped on the device (fused AdamW's found_inf: weights and Adam's step count stay), and
    the learning-rate schedule advances: it follows the steps of the run, as a resume and the plots read it."""
    from minigdpo.update import clip_grad, optimizer, scheduler, skip_if_not_finite

    p = torch.nn.Parameter(torch.ones(3))
    model = torch.nn.Module()
    model.p = p
    opt = optimizer(model, 0.1, 0.0)
    sched = scheduler(opt, 4, 0.5, "constant")
    for grad in ([1.0, 1.0, 1.0], [math.nan, 1.0, 1.0]):
        p.grad = torch.tensor(grad)
        skip_if_not_finite(opt, clip_grad(model, 1.0))
        opt.step()
        sched.step()
    assert opt.state[p]["step"].item() == 1.0 and torch.isfinite(p).all()
    assert sched.get_last_lr()[0] == pytest.approx(0.1)  # warmup of 2 steps done: step 2 counted


def test_an_optimizer_that_cannot_skip_on_the_device_is_refused():
    from minigdpo.update import skip_if_not_finite

    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="fused AdamW"):
        skip_if_not_finite(torch.optim.AdamW([p], fused=False), torch.tensor(1.0))
