"""What a GPU would pay, counted on CPU (benchmarks/gpu_proxies.py's counters): matmul FLOPs by dtype,
parameters left unsharded, host syncs per generated token, the export's dtype, all-gathers per layer.
Each test also checks that the cheaper path computes the same thing.

Run: pytest tests/test_gpu_proxies.py
"""

from types import SimpleNamespace

import pytest
import torch

from benchmarks.gpu_proxies import MatmulFlops
from minigdpo import logprobs, models, policy
from minigdpo.update import fill_logprobs, optimizer, scheduler


def naive_head(hidden, weight, targets):
    """log softmax(hidden @ weight.T)[targets] in fp32, the oracle for chunked_logprobs."""
    logits = hidden.float() @ weight.float().T                             # (K, V)
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


def test_head_weight_gradient_runs_in_the_compute_dtype_with_fp32_accumulation():
    g = torch.Generator().manual_seed(0)
    K, H, V, chunk = 40, 32, 3000, 16
    hidden = torch.randn(K, H, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).bfloat16().requires_grad_()
    targets = torch.randint(0, V, (K,), generator=g)
    coef = torch.randn(K, generator=g)
    with MatmulFlops() as flops:
        logp, _ = logprobs.chunked_logprobs(hidden, weight, targets, chunk=chunk)
        (logp * coef).sum().backward()
    assert flops.flops.get(torch.float32, 0) == 0, flops.fp32_shapes  # every (V, H)-sized matmul in bf16
    assert weight.grad.dtype == torch.bfloat16
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    (naive_head(h32, w32, targets) * coef).sum().backward()
    # bf16 logits and a bf16 product per chunk, summed over chunks in fp32: bf16's own rounding
    for got, want in ((weight.grad, w32.grad), (hidden.grad, h32.grad)):
        torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2 * want.abs().max().item())


def test_reference_pass_leaves_only_its_shards_resident(process_group):
    from benchmarks.gpu_proxies import resident_bytes, step_cfg
    from tests.test_policy import batches

    path = models.resolve_model("tiny-random")
    cfg = step_cfg(SimpleNamespace(chunk=4, completion_len=8))
    for offload in (False, True):
        ref = policy.build(path, process_group, torch.bfloat16, frozen=True, offload=offload)
        mbs = batches(0, size=3)
        shards, _ = resident_bytes(ref)
        fill_logprobs(ref, mbs, "ref_logp", cfg, reshard=True)
        total, whole = resident_bytes(ref)
        assert (total, whole) == (shards, 0)
        before = [mb.ref_logp for mb in mbs]
        fill_logprobs(ref, mbs, "ref_logp", cfg, reshard=True)  # a second pass gathers again, the same
        assert all(torch.equal(a, mb.ref_logp) for a, mb in zip(before, mbs))


def test_export_keeps_the_source_checkpoints_dtype(process_group, tmp_path):
    import json
    import os

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from minigdpo import checkpoint

    tiny = models.resolve_model("tiny-random")
    source = str(tmp_path / "bf16-source")  # a checkpoint stored in bf16, as Qwen2.5's are
    models.load_model(tiny).to(torch.bfloat16).save_pretrained(source)
    tok = models.load_tokenizer(tiny)
    tok.save_pretrained(source)
    assert models.source_dtype(source) == torch.bfloat16 and models.source_dtype(tiny) == torch.float32
    model = policy.build(source, process_group, torch.float32)  # fp32 master weights
    opt = optimizer(model, 1e-2, 0.0)
    where = checkpoint.save(str(tmp_path / "run"), 1, model, opt, scheduler(opt, 2, 0.0, "constant"), tok,
                            {"cursor": 0}, models.source_dtype(source), keep=1)
    hf = os.path.join(where, "hf")
    with open(os.path.join(hf, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    with safe_open(os.path.join(hf, "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    loaded = AutoModelForCausalLM.from_pretrained(hf)
    assert loaded.dtype == torch.bfloat16
    live = dict(model.whole_weights())
    for name, t in loaded.state_dict().items():
        torch.testing.assert_close(t, live[model.tied_names().get(name, name)].bfloat16().cpu(), rtol=0, atol=0)


def test_hf_sampler_syncs_the_host_once_per_16_tokens_with_identical_output():
    from benchmarks.gpu_proxies import HostSyncs
    from minigdpo.sampler import HFSampler, SamplingParams, sync_every

    assert sync_every(torch.device("cpu")) == 1  # on the CPU a check is free and extra steps are not
    path = models.resolve_model("tiny-random")
    lm = models.load_model(path)
    prompts = [[10, 11, 12, 13, 14, 15], [20], [30, 31, 32]]  # left padding: the decode steps need a mask
    counts = []
    for length in (16, 48):
        sampler = HFSampler(lm, [lm.config.vocab_size], 257, torch.device("cpu"))  # a stop id no row draws
        sampler.sync_every = sync_every(torch.device("cuda"))  # what it does on a GPU
        with HostSyncs() as syncs:
            sampler.generate(prompts, 2, SamplingParams(temperature=1.0, max_new_tokens=length, seed=1))
        counts.append(syncs.count)
    assert counts[1] - counts[0] <= 32 // 16
    # stopping as soon as every row is done, or up to 15 tokens later, gives the same completions
    sampler = HFSampler(lm, [65, 66, 67, 68, 69, 70], 257, torch.device("cpu"))
    params = SamplingParams(temperature=1.0, max_new_tokens=30, seed=5)
    sampler.sync_every = sync_every(torch.device("cuda"))
    lazy = sampler.generate(prompts, 3, params)
    sampler.sync_every = 1
    eager = sampler.generate(prompts, 3, params)
    assert {c.finish_reason for g in eager for c in g} == {"stop", "length"}
    assert [(c.token_ids, c.logprobs, c.finish_reason) for g in lazy for c in g] == \
        [(c.token_ids, c.logprobs, c.finish_reason) for g in eager for c in g]


def test_hf_sampler_loads_weights_asleep_straight_onto_its_device():
    from minigdpo.sampler import HFSampler

    path = models.resolve_model("tiny-random")
    sampler = HFSampler(models.load_model(path), [256], 257, torch.device("cpu"))
    new = {k: torch.randn_like(v) for k, v in models.load_model(path).state_dict().items() if k != "lm_head.weight"}
    sampler.offloaded = True  # as after sleep() on an accelerator: the host copy is about to be replaced
    sampler.load_weights(new.items())
    assert not sampler.offloaded  # awake already: wake() has no whole-model copy left to make
    for name, t in sampler.model.state_dict().items():
        torch.testing.assert_close(t, new[{"lm_head.weight": "model.embed_tokens.weight"}.get(name, name)], rtol=0, atol=0)


def test_hf_sampler_drops_its_weights_asleep_and_refuses_to_generate_until_a_sync():
    """sleep() comes only where a weight sync follows, which rewrites every weight: they go (the memory counts in the
    update's peak, on the CPU too), as vLLM's level-2 sleep; generate() refuses until a sync brings them back. A LoRA
    sampler's copy moves to the host instead (a sync sends only the adapters): generate() wakes it, on its device
    (offloaded set by hand on the CPU)."""
    from minigdpo.sampler import HFSampler, SamplingParams, WeightSyncError

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = models.resolve_model("tiny-random")
    sampler = HFSampler(models.load_model(path), [256], 257, device)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=1)
    want = sampler.generate([[10, 11, 12]], 2, params)
    sampler.sleep()
    sampler.sleep()  # train.py may sleep twice before the sync
    assert sum(p.numel() for p in sampler.model.parameters()) == 0
    with pytest.raises(WeightSyncError, match="after sleep"):
        sampler.generate([[10, 11, 12]], 2, params)
    sampler.load_weights((k, v) for k, v in models.load_model(path).state_dict().items() if k != "lm_head.weight")
    assert [c.token_ids for c in sampler.generate([[10, 11, 12]], 2, params)[0]] == [c.token_ids for c in want[0]]
    sampler.adapters_only, sampler.offloaded = True, True  # what sleep() sets for a LoRA sampler on an accelerator
    out = sampler.generate([[10, 11, 12]], 2, params)
    assert len(out[0]) == 2 and not sampler.offloaded
    assert next(sampler.model.parameters()).device.type == device.type


def test_build_reads_only_shards_into_a_meta_model_with_the_same_weights(process_group, monkeypatch):
    from tests.test_policy import batches, model_logprobs

    path = models.resolve_model("tiny-random")
    whole = logprobs.LogProbModel(models.load_model(path))  # the oracle: every weight loaded the usual way
    (mb,) = batches(5)
    want = model_logprobs(whole, mb, 0.8, 4)

    def no_whole_load(*args, **kwargs):
        raise AssertionError("build loaded the whole model on this rank")

    monkeypatch.setattr(policy, "load_model", no_whole_load)
    for frozen, dtype in ((False, torch.float32), (True, torch.float32), (True, torch.bfloat16)):
        model = policy.build(path, process_group, dtype, frozen=frozen)
        live = dict(model.whole_weights())
        for name, t in whole.lm.state_dict().items():
            if name not in model.tied_names():
                torch.testing.assert_close(live[name].cpu(), t.to(dtype).cpu(), rtol=0, atol=0)
        for name, b in whole.lm.named_buffers():  # rotary tables are computed, not read
            torch.testing.assert_close(model.lm.get_buffer(name), b, rtol=0, atol=0)
        if dtype == torch.float32:
            with torch.no_grad():
                torch.testing.assert_close(model_logprobs(model, mb, 0.8, 4), want.detach(), rtol=0, atol=1e-6)
    assert model.lm.generation_config.eos_token_id == whole.lm.generation_config.eos_token_id


@pytest.mark.slow
def test_shared_prefix_gathers_each_layer_once_forward_and_once_backward(tmp_path):
    """On 2 ranks: the shared-prefix pass costs each decoder layer one all-gather each way, as full
    sequences do (two passes over the model, prompts then completions, cost two each way)."""
    import json

    from conftest import run

    out = tmp_path / "gathers.json"
    run(["tests/prefix_gathers.py", str(out)], nproc=2, timeout=240)
    result = json.loads(out.read_text())
    for share in ("True", "False"):
        for way in ("forward", "backward"):
            layers = {k: v for k, v in result[share][way].items() if k.startswith("layer")}
            assert layers == {"layer0": 1, "layer1": 1}, (share, way, result)
    assert result["grad_diff"] <= 1e-5 * result["grad_max"], result


@pytest.mark.slow
@pytest.mark.parametrize("sharding,mesh", [("fsdp", [2]), ("hsdp", [2, 1])])
def test_export_gathers_whole_tensors_on_rank_0_alone(tmp_path, sharding, mesh):
    import json

    from conftest import run

    out = tmp_path / "gather.json"
    run(["tests/gather_main.py", str(out), sharding], nproc=2, timeout=240)
    rank0, rank1 = json.loads(out.read_text())
    assert rank0["mesh"] == mesh and rank0["names"] == rank1["names"] == rank0["expected"]
    assert rank0["received"] == rank0["expected"] and rank0["mismatched"] == []  # the same whole tensors
    assert rank1["received"] == 0
