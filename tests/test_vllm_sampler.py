"""The vLLM backend against a fake engine written from the vLLM 0.33.0 source (tests/fake_vllm.py):
the install pins, weight names and shapes, tied embeddings, the order of sleep, wake, load and reset,
served weights never stale, the conversion of vLLM's outputs, one sample stream per (rank, prompt,
sample), and the fake's own vLLM behaviours, one test each (the `test_fake_*` tests).

Run: pytest tests/test_vllm_sampler.py
"""

import ast
import json
import os
import random

import numpy as np
import pytest
import torch

import fake_vllm
from conftest import ROOT, refusal, run
from minigdpo import config, models, policy, vllm_sampler
from minigdpo.sampler import SamplingParams, WeightSyncError
from minigdpo.vllm_sampler import VLLMSampler
from minigdpo.update import optimizer

STOP = 256  # tiny-random's <|im_end|>, its EOS


@pytest.fixture
def vllm(monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # restored after each test
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    return fake_vllm.install(monkeypatch)


def tiny_qwen2(tmp_path, tied):
    """A tiny Qwen2 (attention biases, optionally untied head) saved like a hub checkpoint."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = models.tiny_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(1)
    path = str(tmp_path / f"qwen2-tied{tied}")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make(path=None):
    path = path or models.resolve_model("tiny-random")
    return VLLMSampler(path, models.load_tokenizer(path), [STOP], seed=3, gpu_memory_utilization=0.3, max_model_len=128)


def forced(pick):
    """Toy-LM logits that all but force the token pick(prompt, output) at every step."""
    def logits(prompt, output):
        return torch.zeros(STOP + 3).index_fill_(0, torch.tensor([pick(prompt, output)]), 40.0)
    return logits


# Install --------------------------------------------------------------------------------------

def setup_requirements():
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: k.value for k in call.keywords}
    return ast.literal_eval(kw["install_requires"]), ast.literal_eval(kw["extras_require"])


def bounds(specifiers):
    """(lowest allowed, first excluded) versions of a >=/</== specifier set."""
    from packaging.version import Version

    lo = hi = None
    for s in specifiers:
        v = Version(s.version)
        if s.operator in (">=", "=="):
            lo = v if lo is None else max(lo, v)
        if s.operator == "<":
            hi = v if hi is None else min(hi, v)
        if s.operator == "==":
            hi = Version(f"{v}.post999999")
    return lo, hi


def test_install_resolves_to_the_stack_the_sampler_is_written_for():
    import transformers
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    requires, extras = setup_requirements()
    ours = {Requirement(r).name: Requirement(r).specifier for r in requires}
    for name, build in vllm_sampler.VLLM_BUILDS.items():
        pin = f"{name}=={build['version']}"
        assert extras[name] == [pin]
        theirs = {k: SpecifierSet(v) for k, v in build.items() if k != "version"}
        (lo, hi), (vlo, vhi) = bounds(ours["transformers"]), bounds(theirs["transformers"])
        if name == "vllm":  # a closed range inside the GPU build's, so `.[test]` and `.[vllm]` resolve alike
            assert None not in (lo, hi) and vlo <= lo and hi <= vhi, (ours["transformers"], theirs["transformers"])
        else:  # the CPU build caps transformers lower: pip resolves inside both ranges
            assert max(lo, vlo) < min(hi, vhi), (ours["transformers"], theirs["transformers"])
        assert ours["torch"].contains(str(bounds(theirs["torch"])[0]).split("+")[0])
    assert "vllm==0.33.0" in extras["gpu"] and "datasets" in extras["gpu"]  # the default recipe reads GSM8K from the hub
    assert ours["transformers"].contains(transformers.__version__)  # the stack the tests run on
    assert ours["torch"].contains("2.13.0")  # CI's
    assert Version(torch.__version__).release[:2] in ((2, 13), (2, 14))


def test_settings_vllm_cannot_honour_are_refused_before_any_model_loads():
    with pytest.raises(config.ConfigError, match="--top-p 0.9 needs --sampler hf"):
        vllm_sampler.check_sampler(config.Config(top_p=0.9), "vllm")
    for t in (0.005, 2.5):  # vLLM would sample at 0.01, or refuse: the trainer's log-probs would use t
        with pytest.raises(config.ConfigError, match=f"--temperature {t} needs --sampler hf"):
            vllm_sampler.check_sampler(config.Config(temperature=t), "vllm")
        vllm_sampler.check_sampler(config.Config(temperature=t, top_p=0.9), "hf")
    vllm_sampler.check_sampler(config.Config(temperature=0.01), "vllm")


def test_fake_raises_small_temperatures_to_one_hundredth_and_refuses_large_ones(vllm):
    assert vllm.SamplingParams(temperature=0.005).temperature == 0.01
    with pytest.raises(fake_vllm.VLLMValidationError):
        vllm.SamplingParams(temperature=2.5)
    assert not issubclass(fake_vllm.VLLMValidationError, ValueError)


# Weights --------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", True), ("qwen2", False)])
def test_streamed_names_and_shapes_equal_the_hf_state_dict(vllm, process_group, tmp_path, arch, tied):
    path = models.resolve_model("tiny-random") if arch == "llama" else tiny_qwen2(tmp_path, tied)
    model = policy.build(path, process_group, torch.float32)
    sampler = make(path)
    sampler.load_weights(model.whole_weights())
    engine = fake_vllm.LLM.instances[-1]
    hf = models.load_model(path).state_dict()
    expected = {k: tuple(v.shape) for k, v in hf.items()}    # a tied head too: the reload does not see the tie
    assert dict(engine.model.received) == expected            # every weight once, HF names, HF shapes
    assert len(engine.model.received) == len(expected)
    # and they landed in vLLM's stacked layout
    p = engine.model.params
    layer = "model.layers.1."
    qkv = torch.cat([hf[layer + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    torch.testing.assert_close(p[layer + "self_attn.qkv_proj.weight"], qkv)
    torch.testing.assert_close(p[layer + "mlp.gate_up_proj.weight"],
                               torch.cat([hf[layer + "mlp.gate_proj.weight"], hf[layer + "mlp.up_proj.weight"]]))
    if arch == "qwen2":
        torch.testing.assert_close(p[layer + "self_attn.qkv_proj.bias"],
                                   torch.cat([hf[layer + f"self_attn.{x}_proj.bias"] for x in "qkv"]))
    assert ("lm_head.weight" in p) is (not tied)
    assert engine.calls[-1] == ("reset_prefix_cache",)


def test_engine_arguments(vllm):
    make()
    kw = fake_vllm.LLM.instances[-1].kwargs
    assert kw["enable_sleep_mode"] and kw["distributed_executor_backend"] == "external_launcher"
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["seed"] == 3 and kw["gpu_memory_utilization"] == 0.3
    assert kw["tensor_parallel_size"] == 1 and kw["max_model_len"] == 128


def test_order_of_sleep_wake_load_and_reset_over_two_steps(vllm, process_group):
    model = policy.build(models.resolve_model("tiny-random"), process_group, torch.float32)
    sampler = make()
    engine = fake_vllm.LLM.instances[-1]
    for _ in range(2):  # what train.py does each step
        sampler.wake()
        sampler.generate([[1, 2]], 2, SamplingParams(max_new_tokens=2))
        sampler.sleep()
        sampler.load_weights(model.whole_weights())
    calls = [c for c in engine.calls if c[0] != "load"]
    # level 2: the sync rewrites every weight, so nothing is copied to the host; the reload streams from the trainer
    step = [("sleep", 2), ("reset_prefix_cache",), ("wake_up", ("weights",)), ("collective_rpc", "reload_weights"),
            ("reset_prefix_cache",)]
    assert calls == [("generate", 1, 2)] + step + [("wake_up", ("kv_cache",)), ("generate", 1, 2)] + step
    first_load = next(i for i, c in enumerate(engine.calls) if c[0] == "load")
    assert engine.calls[first_load - 2] == ("wake_up", ("weights",))  # weights awake before any write
    assert not any(p.isnan().any() for p in engine.model.params.values())  # every weight rewritten after level 2


def test_the_engine_serves_the_synced_weights_not_a_stale_copy(vllm, process_group):
    model = policy.build(models.resolve_model("tiny-random"), process_group, torch.float32)
    opt = optimizer(model, 0.1, 0.0)
    sampler = make()
    engine = fake_vllm.LLM.instances[-1]
    sampler.load_weights(model.whole_weights())
    for step in range(2):
        sampler.wake()
        sampler.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2))
        sampler.sleep()
        for p in model.parameters():  # an "update"
            p.grad = torch.ones_like(p)
        opt.step()
        sampler.load_weights(model.whole_weights())
        sampler.wake()
        live = {k: t.cpu() for k, t in model.whole_weights()}  # the fake engine keeps host tensors
        torch.testing.assert_close(engine.model.params["model.embed_tokens.weight"], live["model.embed_tokens.weight"])
        torch.testing.assert_close(engine.model.params["model.norm.weight"], live["model.norm.weight"])


def test_cuda_cache_is_emptied_before_every_wake_up(vllm, process_group, monkeypatch):
    model = policy.build(models.resolve_model("tiny-random"), process_group, torch.float32)
    sampler = make()
    engine = fake_vllm.LLM.instances[-1]
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: engine.calls.append(("empty_cache",)))
    sampler.sleep()
    sampler.load_weights(model.whole_weights())
    sampler.wake()
    wakes = [i for i, c in enumerate(engine.calls) if c[0] == "wake_up"]
    assert len(wakes) == 2 and all(engine.calls[i - 1] == ("empty_cache",) for i in wakes)


def test_building_the_engine_leaves_the_trainer_rngs_alone(vllm, monkeypatch):
    cuda = {"state": torch.tensor([7])}  # a stand-in CUDA generator, so that its state is checked on CPU too
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: cuda.update(state=torch.tensor([seed])))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [cuda["state"].clone()])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: cuda.update(state=states[0]))
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    cuda["state"] = torch.tensor([7])
    before = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    make()
    assert fake_vllm.LLM.instances[-1].kwargs["seed"] == 3  # the engine did reseed everything to 3 ...
    assert random.getstate() == before[0]                    # ... and the trainer's states came back
    assert np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])
    assert int(cuda["state"]) == 7


# Sampling -------------------------------------------------------------------------------------

def test_output_conversion(vllm):
    sampler = make()
    engine = fake_vllm.LLM.instances[-1]
    engine.logits = forced(lambda prompt, out: STOP if prompt[0] == 1 and len(out) == 2 else 5 + len(out))
    groups = sampler.generate([[1, 2, 3], [4]], 2, SamplingParams(temperature=0.7, max_new_tokens=4, seed=11))
    sp = engine.last_params
    assert [(p.n, p.temperature, p.top_p, p.max_tokens, p.logprobs, p.stop_token_ids, p.ignore_eos) for p in sp] == \
        [(2, 0.7, 1.0, 4, 0, [STOP], False)] * 2
    assert [p.seed for p in sp] == [44, 46]  # (11 * 2 + i) * 2
    assert [len(g) for g in groups] == [2, 2]
    for group, out in zip(groups, engine.last_outputs):
        for c, o in zip(group, out.outputs):
            assert c.token_ids == o.token_ids and c.logprobs == [step[t].logprob for t, step in zip(o.token_ids, o.logprobs)]
    a, b = groups[0][0], groups[1][0]
    assert a.token_ids == [5, 6, STOP] and a.finish_reason == "stop"
    assert b.token_ids == [5, 6, 7, 8] and b.finish_reason == "length"
    assert a.text == models.load_tokenizer(models.resolve_model("tiny-random")).decode([5, 6, STOP], skip_special_tokens=True)


def test_512_completions_on_8_ranks_draw_512_distinct_streams(vllm):
    sampler = make()
    engine = fake_vllm.LLM.instances[-1]
    seed, B, G = 42, 4, 16  # the paper's recipe: 32 prompts x G=16 over 8 ranks
    for step in (1, 2):
        for rank in range(8):
            params = SamplingParams(max_new_tokens=1, seed=seed * 1_000_003 + step * 1_009 + rank)  # as train.py
            sampler.generate([[1 + i] for i in range(B)], G, params)
        streams = {s for _, _, s in engine.streams}
        assert len(engine.streams) == step * 512 and len(streams) == step * 512  # across steps too


def test_ignore_eos_passes_no_stop_ids_and_runs_to_max_new_tokens(vllm):
    sampler = make()
    engine = fake_vllm.LLM.instances[-1]
    engine.logits = forced(lambda prompt, out: STOP)
    (c,), = sampler.generate([[1]], 1, SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert engine.last_params[0].stop_token_ids == []
    assert c.token_ids == [STOP] * 5 and c.finish_reason == "length"
    (c,), = sampler.generate([[1]], 1, SamplingParams(max_new_tokens=5))
    assert c.token_ids == [STOP] and c.finish_reason == "stop"


def test_sampler_vllm_without_vllm_or_cuda_is_one_line(tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    assert "--sampler vllm needs" in refusal(["--preset", "smoke", "--sampler", "vllm", "--output-dir", str(tmp_path)])


# The fake engine's vLLM behaviours ------------------------------------------------------------

def fake_engine(vllm, **kwargs):
    return vllm.LLM(models.resolve_model("tiny-random"), **kwargs)


def one(vllm, llm, prompt=(1, 2, 3), **sampling):
    (out,) = llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=list(prompt))],
                          vllm.SamplingParams(logprobs=0, **sampling), use_tqdm=False)
    return out.outputs


def test_fake_sample_j_draws_from_stream_seed_plus_j(vllm):
    llm = fake_engine(vllm)
    a = [c.token_ids for c in one(vllm, llm, n=3, seed=100, max_tokens=6)]
    b = [c.token_ids for c in one(vllm, llm, n=2, seed=101, max_tokens=6)]
    assert b == a[1:]                      # seed 101's samples 0 and 1 are seed 100's samples 1 and 2
    assert len({tuple(t) for t in a}) == 3


def test_fake_stop_ids_stop_even_with_ignore_eos(vllm):
    llm = fake_engine(vllm)
    llm.logits = forced(lambda prompt, out: STOP)
    (c,) = one(vllm, llm, max_tokens=4, ignore_eos=True, stop_token_ids=[STOP])
    assert (c.token_ids, c.finish_reason, c.stop_reason) == ([STOP], "stop", STOP)
    (c,) = one(vllm, llm, max_tokens=4, ignore_eos=True)
    assert (c.token_ids, c.finish_reason) == ([STOP] * 4, "length")
    (c,) = one(vllm, llm, max_tokens=4)    # EOS stops only without ignore_eos
    assert (c.token_ids, c.finish_reason, c.stop_reason) == ([STOP], "stop", None)


def test_fake_logprobs_zero_gives_one_entry_per_generated_token(vllm):
    (c,) = one(vllm, fake_engine(vllm), max_tokens=7, seed=1)
    assert len(c.logprobs) == len(c.token_ids) == 7
    assert all(list(step) == [t] and isinstance(step[t], fake_vllm.Logprob) for t, step in zip(c.token_ids, c.logprobs))


def test_fake_processed_logprobs_are_renormalised_after_top_p(vllm):
    llm = fake_engine(vllm, logprobs_mode="processed_logprobs")
    raw = torch.randn(STOP + 3, generator=torch.Generator().manual_seed(4)) * 3
    llm.logits = lambda prompt, out: raw
    scaled = raw / 0.7
    probs = scaled.softmax(-1)
    # vLLM's nucleus: a token stays when the tokens no more likely than it carry more than 1 - top_p
    keep = torch.tensor([bool(probs[probs <= probs[u]].sum() > 1 - 0.5) for u in range(len(raw))])
    (c,) = one(vllm, llm, max_tokens=20, seed=2, temperature=0.7, top_p=0.5)
    for t, step in zip(c.token_ids, c.logprobs):
        assert keep[t]
        expected = scaled[t] - scaled[keep].logsumexp(-1)
        assert step[t].logprob == pytest.approx(float(expected), abs=1e-5)
        assert step[t].logprob > float(scaled.log_softmax(-1)[t])  # above the trainer's full-vocabulary value
    (c,) = one(vllm, llm, max_tokens=5, seed=2, temperature=0.7)  # top_p = 1: the trainer's log-probs exactly
    for t, step in zip(c.token_ids, c.logprobs):
        assert step[t].logprob == pytest.approx(float(scaled.log_softmax(-1)[t]), abs=1e-5)


def test_fake_sleep_also_resets_the_prefix_cache(vllm):
    llm = fake_engine(vllm, enable_sleep_mode=True)
    llm.sleep(level=1)
    llm.sleep(level=1)  # already asleep: the weights stay put, the prefix cache is reset again
    assert llm.calls == [("sleep", 1), ("reset_prefix_cache",)] * 2 and llm.sleeping_tags == {"weights", "kv_cache"}


def test_fake_wake_up_on_a_tag_that_is_not_asleep_does_nothing(vllm):
    llm = fake_engine(vllm, enable_sleep_mode=True)
    norm = llm.model.params["model.norm.weight"]
    assert llm.wake_up(tags=["weights"]) is True       # nothing asleep
    llm.sleep(level=1)
    assert llm.wake_up(tags=["weights"]) is False      # weights back (from the CPU copy), KV cache still asleep
    norm.fill_(3.0)                                    # a weight written after waking
    llm.wake_up(tags=["weights"])                      # not asleep: the CPU copy is not restored again
    assert bool((norm == 3.0).all()) and llm.sleeping_tags == {"kv_cache"}
    assert llm.wake_up(tags=["weights", "kv_cache"]) is False and llm.sleeping_tags == {"kv_cache"}  # whole call ignored
    with pytest.raises(AssertionError, match="paused"):
        one(vllm, llm, max_tokens=1)
    assert llm.wake_up(tags=["kv_cache"]) is True


def test_fake_external_launcher_needs_rank_and_a_default_process_group(vllm, monkeypatch):
    launcher = dict(distributed_executor_backend="external_launcher")
    with pytest.raises(KeyError):
        fake_engine(vllm, **launcher)
    monkeypatch.setenv("RANK", "1"), monkeypatch.setenv("LOCAL_RANK", "1"), monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="no default process group"):
        fake_engine(vllm, **launcher)
    with pytest.raises(RuntimeError, match="dist.init"):  # the sampler says so before vLLM would hang
        make()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    fake_engine(vllm, **launcher)  # joins the trainer's group


def test_fake_write_into_sleeping_weights_is_a_cuda_error(vllm):
    llm = fake_engine(vllm, enable_sleep_mode=True)
    llm.sleep(level=1)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        llm.model.load_weights([("model.norm.weight", torch.ones(llm.model.params["model.norm.weight"].shape))])


def test_fake_level_2_sleep_discards_the_weights(vllm):
    llm = fake_engine(vllm, enable_sleep_mode=True)
    llm.model.params["model.norm.weight"].fill_(2.0)
    llm.sleep(level=1)
    llm.wake_up()
    assert bool((llm.model.params["model.norm.weight"] == 2.0).all())   # level 1: the CPU copy came back
    llm.sleep(level=2)
    llm.wake_up()
    assert bool(llm.model.params["model.norm.weight"].isnan().all())    # level 2: nothing to restore


def test_fake_refuses_to_generate_from_discarded_weights(vllm):
    """The real engine samples noise from them without a word (cumem.py:361-364); the fake refuses, so every test
    that drives it checks that no path generates between a level-2 sleep and the next reload."""
    llm = fake_engine(vllm, enable_sleep_mode=True)
    prompt = [vllm.inputs.TokensPrompt(prompt_token_ids=[1, 2])]
    llm.sleep(level=2)
    llm.wake_up()
    with pytest.raises(AssertionError, match="discarded by sleep"):
        llm.generate(prompt, vllm.SamplingParams(max_tokens=2))


def test_the_sampler_refuses_to_generate_after_a_sleep_with_no_sync(vllm, process_group):
    """A step that sleeps and then has no update to sync (dynamic sampling with nothing to learn) must not reach
    the engine: the wrapper refuses before vLLM would sample from uninitialised memory."""
    model = policy.build(models.resolve_model("tiny-random"), process_group, torch.float32)
    sampler = make()
    sampler.generate([[1, 2]], 2, SamplingParams(max_new_tokens=2))
    sampler.sleep()
    with pytest.raises(WeightSyncError, match="discarded"):
        sampler.generate([[1, 2]], 2, SamplingParams(max_new_tokens=2))
    sampler.load_weights(model.whole_weights())
    sampler.generate([[1, 2]], 2, SamplingParams(max_new_tokens=2))  # reloaded: allowed again


def test_fake_model_chain_exists_only_under_external_launcher(vllm):
    assert not hasattr(fake_engine(vllm).llm_engine, "model_executor")  # the engine core runs in another process
    make()  # the sampler asks for external_launcher, and finds its model
    assert fake_vllm.LLM.instances[-1].llm_engine.model_executor.driver_worker.model_runner.model is not None


def test_fake_one_sleep_mode_engine_per_process(vllm):
    make()
    with pytest.raises(AssertionError, match="one instance per process"):
        make()


def test_fake_generation_config_eos_ids_stop_unless_ignore_eos(vllm, tmp_path):
    from transformers import GenerationConfig

    path = tiny_qwen2(tmp_path, tied=True)
    GenerationConfig(eos_token_id=[STOP, 7]).save_pretrained(path)   # Qwen2.5's lists two EOS ids, too
    llm = vllm.LLM(path)
    llm.logits = forced(lambda prompt, out: 7)
    (c,) = one(vllm, llm, max_tokens=4)
    assert (c.token_ids, c.finish_reason, c.stop_reason) == ([7], "stop", 7)
    (c,) = one(vllm, llm, max_tokens=4, ignore_eos=True)
    assert (c.token_ids, c.finish_reason) == ([7] * 4, "length")


def test_fake_max_model_len_refuses_long_prompts_and_caps_completions(vllm):
    llm = fake_engine(vllm, max_model_len=6)
    llm.logits = forced(lambda prompt, out: 5)
    (c,) = one(vllm, llm, prompt=(1, 2, 3, 4), max_tokens=10)
    assert (len(c.token_ids), c.finish_reason) == (2, "length")        # 4 + 2 = max_model_len
    with pytest.raises(fake_vllm.VLLMValidationError, match="maximum model length"):
        one(vllm, llm, prompt=(1, 2, 3, 4, 5, 6), max_tokens=1)


def test_fake_load_weights_returns_what_it_loaded_and_refuses_unknown_names(vllm):
    llm = fake_engine(vllm)
    norm = torch.ones(llm.model.params["model.norm.weight"].shape)
    assert llm.model.load_weights([("model.norm.weight", norm), ("model.layers.0.self_attn.q_proj.bias", norm)]) \
        == {"model.norm.weight"}                                         # an unexpected bias is ignored
    with pytest.raises(ValueError, match="no module or parameter named 'model.nrom.weight'"):
        llm.model.load_weights([("model.nrom.weight", norm)])


@pytest.mark.parametrize("lost", ["model.layers.1.self_attn.k_proj.weight", "model.norm.weight"])
@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_a_weight_the_sync_leaves_out_is_an_error_that_names_it(vllm, process_group, backend, lost):
    """k_proj is one shard of vLLM's stacked qkv_proj, which shows as loaded once q arrived: the sender's
    side must notice. norm is a whole vLLM parameter: vLLM's returned set shows it missing."""
    from minigdpo.sampler import HFSampler, WeightSyncError

    path = models.resolve_model("tiny-random")
    model = policy.build(path, process_group, torch.float32)
    sampler = make() if backend == "vllm" else HFSampler(models.load_model(path), [STOP], 0, torch.device("cpu"))
    sampler.load_weights(model.whole_weights())
    with pytest.raises(WeightSyncError, match=lost.replace(".", r"\.").replace("k_proj", "(k_proj|qkv_proj)")
                       if backend == "hf" else "(k_proj|norm)"):
        sampler.load_weights((n, t) for n, t in model.whole_weights() if n != lost)


# One engine per process: eval.py --baseline and train.py's final evaluation ---------------------------

def test_eval_with_a_baseline_serves_both_models_from_one_engine(vllm, monkeypatch, tmp_path):
    """vLLM allows one sleep-mode engine per process: the baseline's weights are streamed into the engine
    built for --model, and the engine samples with them."""
    import eval as evaluation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)       # --sampler vllm needs CUDA
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: None)
    base = models.resolve_model("tiny-random")
    other = str(tmp_path / "other")
    lm = models.load_model(base)
    with torch.no_grad():
        lm.model.norm.weight.fill_(0.5)
    lm.save_pretrained(other)
    models.load_tokenizer(base).save_pretrained(other)
    summary = evaluation.main(["--model", other, "--baseline", base, "--task", "arith", "--limit", "2", "--sampler",
                               "vllm", "--max-new-tokens", "3", "--max-prompt-len", "48", "--output", str(tmp_path / "e")])
    assert len(fake_vllm.LLM.instances) == 1 and summary["model"]["prompts"] == summary["baseline"]["prompts"] == 2
    engine = fake_vllm.LLM.instances[0]
    assert bool((engine.model.params["model.norm.weight"] == lm.model.norm.weight.new_ones(1)).all())  # the baseline's
    fake_vllm.LLM.instances.clear()  # as in a new process
    with pytest.raises(ValueError, match="one engine serves both"):  # another shape cannot share the engine
        evaluation.main(["--model", base, "--baseline", tiny_qwen2(tmp_path, tied=True), "--task", "arith", "--limit",
                         "1", "--sampler", "vllm", "--max-new-tokens", "2", "--output", str(tmp_path / "f")])


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_train_with_vllm_runs_its_final_evaluation_on_its_own_engine(tmp_path, nproc):
    """The final evaluation runs on every rank with the trainer's engine, while the process group is up
    (a second engine would fail vLLM's one-per-process assertion; a rank without the group could not
    build one under external_launcher)."""
    proc = run(["tests/vllm_train.py", "--preset", "smoke", "--max-steps", "1", "--final-eval", "3", "--save-every", "0",
                "--output-dir", str(tmp_path)], nproc=nproc)
    assert proc.stdout.count("engines built: 1") == nproc
    assert proc.stdout.count("95% paired bootstrap") == 1
    summary = json.load(open(tmp_path / "final_eval" / "summary.json"))
    assert summary["model"]["prompts"] == summary["baseline"]["prompts"] == 3
