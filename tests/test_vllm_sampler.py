"""The vLLM backend against a fake engine that mimics the exact vLLM 0.10.2 API it calls
(tests/fake_vllm.py): weight names and shapes, tied embeddings, the order of sleep, wake, load
and reset, served weights never stale, and the conversion of vLLM's outputs.

Run: pytest tests/test_vllm_sampler.py
"""

import pytest
import torch

import fake_vllm
from conftest import run
from minigdpo import policy
from minigdpo.sampler import SamplingParams
from minigdpo.vllm_sampler import VLLMSampler, vllm_name


@pytest.fixture
def vllm(monkeypatch):
    return fake_vllm.install(monkeypatch)


def tiny_qwen2(tmp_path, tied):
    """A tiny Qwen2 (attention biases, optionally untied head) saved like a hub checkpoint."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = policy.tiny_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(1)
    path = str(tmp_path / f"qwen2-tied{tied}")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make(path):
    return VLLMSampler(path, policy.load_tokenizer(path), [256], seed=3, gpu_memory_utilization=0.3, max_model_len=128)


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", True), ("qwen2", False)])
def test_streamed_names_and_shapes_equal_the_hf_state_dict(vllm, process_group, tmp_path, arch, tied):
    path = policy.resolve_model("tiny-random") if arch == "llama" else tiny_qwen2(tmp_path, tied)
    model = policy.build(path, process_group, torch.float32)
    sampler = make(path)
    sampler.load_weights(policy.hf_state(model))
    engine = fake_vllm.LLM.instances[-1]
    hf = policy.load_model(path).state_dict()
    expected = {k: tuple(v.shape) for k, v in hf.items() if not (tied and k == "lm_head.weight")}
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


def test_wrapper_prefixes_are_stripped():
    assert vllm_name("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert vllm_name("_orig_mod.lm_head.weight") == "lm_head.weight"


def test_engine_arguments(vllm):
    make(policy.resolve_model("tiny-random"))
    kw = fake_vllm.LLM.instances[-1].kwargs
    assert kw["enable_sleep_mode"] and kw["distributed_executor_backend"] == "external_launcher"
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["seed"] == 3 and kw["gpu_memory_utilization"] == 0.3
    assert kw["tensor_parallel_size"] == 1 and kw["max_model_len"] == 128


def script(engine):
    engine.script = [([5, 6, 256], [-0.5, -1.0, -0.25], "stop"), ([7, 8, 9, 10], [-2.0, -0.1, -0.3, -0.4], "length")]


def test_output_conversion(vllm):
    path = policy.resolve_model("tiny-random")
    sampler = make(path)
    script(fake_vllm.LLM.instances[-1])
    groups = sampler.generate([[1, 2, 3], [4]], 2, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=4, seed=11))
    engine = fake_vllm.LLM.instances[-1]
    sp = engine.last_params
    assert (sp.n, sp.temperature, sp.top_p, sp.max_tokens, sp.logprobs, sp.seed, sp.stop_token_ids) == (2, 0.7, 0.9, 4, 0, 11, [256])
    assert [len(g) for g in groups] == [2, 2]
    a, b = groups[0]
    assert a.token_ids == [5, 6, 256] and a.logprobs == [-0.5, -1.0, -0.25] and a.finish_reason == "stop"
    assert b.token_ids == [7, 8, 9, 10] and b.logprobs == [-2.0, -0.1, -0.3, -0.4] and b.finish_reason == "length"
    assert a.text == policy.load_tokenizer(path).decode([5, 6, 256], skip_special_tokens=True)


def test_order_of_sleep_wake_load_and_reset_over_two_steps(vllm, process_group):
    path = policy.resolve_model("tiny-random")
    model = policy.build(path, process_group, torch.float32)
    sampler = make(path)
    engine = fake_vllm.LLM.instances[-1]
    script(engine)
    for _ in range(2):  # what train.py does each step
        sampler.wake()
        sampler.generate([[1, 2]], 2, SamplingParams())
        sampler.sleep()
        sampler.load_weights(policy.hf_state(model))
    calls = [c for c in engine.calls if c[0] != "load"]
    assert calls == [("generate", 1, 2), ("sleep", 1), ("wake_up", ("weights",)), ("reset_prefix_cache",),
                     ("wake_up", ("kv_cache",)), ("generate", 1, 2), ("sleep", 1), ("wake_up", ("weights",)),
                     ("reset_prefix_cache",)]
    first_load = next(i for i, c in enumerate(engine.calls) if c[0] == "load")
    assert engine.calls[first_load - 1] == ("wake_up", ("weights",))  # weights awake before any write
    assert not any(c[0] == "collective_rpc" for c in engine.calls)   # never reloads from disk


def test_the_engine_serves_the_synced_weights_not_a_stale_copy(vllm, process_group):
    path = policy.resolve_model("tiny-random")
    model = policy.build(path, process_group, torch.float32)
    opt = policy.optimizer(model, 0.1, 0.0)
    sampler = make(path)
    engine = fake_vllm.LLM.instances[-1]
    script(engine)
    sampler.load_weights(policy.hf_state(model))
    for step in range(2):
        sampler.wake()
        sampler.generate([[1, 2]], 1, SamplingParams())
        sampler.sleep()
        for p in model.parameters():  # an "update"
            p.grad = torch.ones_like(p)
        opt.step()
        sampler.load_weights(policy.hf_state(model))
        sampler.wake()
        live = dict(policy.hf_state(model))
        torch.testing.assert_close(engine.model.params["model.embed_tokens.weight"], live["model.embed_tokens.weight"])
        torch.testing.assert_close(engine.model.params["model.norm.weight"], live["model.norm.weight"])


def test_sampler_vllm_without_vllm_or_cuda_is_one_line(tmp_path):
    proc = run(["train.py", "--preset", "smoke", "--sampler", "vllm", "--output-dir", str(tmp_path)], check=False)
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "--sampler vllm needs" in err
