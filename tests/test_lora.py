"""LoRA (minigdpo/lora.py, through peft): only the adapters train; the reference with the adapters off
is the base model; merged weights reproduce the adapted model in a plain Hugging Face model, the HF
sampler and the fake vLLM engine; adapter checkpoints load with peft; resume is exact; the update on
2 gloo ranks equals the 1-rank one; bad LoRA input is one line before any weights load.

Run: pytest tests/test_lora.py   (about 2 minutes on 2 cores)
"""

import json
import os
import tempfile

import pytest
import torch
from safetensors.torch import load_file

from conftest import mounted_tmpfs, read_jsonl, refusal, refused, run
from minigdpo import checkpoint, cli, config, dist, fsdp, logprobs, lora, microbatch, models, policy
from minigdpo.sampler import HFSampler, SamplingParams
from minigdpo.update import optimizer, scheduler
from minigdpo.sampler import WeightSyncError
from minigdpo.vllm_sampler import make_sampler
from test_policy import batches, model_logprobs
from test_vllm_sampler import vllm  # noqa: F401 (the fake engine, installed for a test, as a fixture)

peft = pytest.importorskip("peft")

SETTINGS = lora.Settings(rank=4, alpha=8.0, dropout=0.0, targets=("q_proj", "v_proj", "up_proj", "down_proj"), seed=0)
# fp32 on a GPU too (auto would be bf16 there), so that the log-prob gaps checked here are rounding's
SMOKE = ["train.py", "--preset", "smoke", "--rewards", "tests.helpers:digit_frac,tests.helpers:vowel_frac,format",
         "--dtype", "fp32", "--lora-rank", "4", "--lora-alpha", "8"]


@pytest.fixture(scope="module")
def tiny():
    path = models.resolve_model("tiny-random")
    return path, models.load_tokenizer(path)


def full(model):
    """{name: whole tensor} of every parameter, under the model's own (peft) names."""
    return {n: p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for n, p in model.named_parameters()}


def trained(path, device, steps=2, lr=1e-2):
    """A LoRA policy after `steps` optimizer steps that push the sampled tokens' log-probs up."""
    model = policy.build(path, device, torch.float32, lora_settings=SETTINGS)
    opt = optimizer(model, lr, 0.0)
    for seed in range(steps):
        (mb,) = batches(seed)
        opt.zero_grad()
        (-model_logprobs(model, mb).sum()).backward()
        opt.step()
    return model, opt


def test_only_the_adapters_train_and_the_optimizer_holds_only_them(tiny, process_group):
    path, _ = tiny
    model = policy.build(path, process_group, torch.float32, lora_settings=SETTINGS)
    before = full(model)
    # The first forward is the reference pass, as on step 1 of train.py: the adapters must still train after it.
    with torch.no_grad(), lora.adapters_off(model):
        model_logprobs(model, batches(0)[0])
    opt = optimizer(model, 1e-2, 0.0)
    for seed in range(2):
        (mb,) = batches(seed)
        opt.zero_grad()
        (-model_logprobs(model, mb).sum()).backward()
        opt.step()
    after = full(model)
    adapters = {n for n in before if ".lora_A." in n or ".lora_B." in n}
    assert len(adapters) == 2 * 2 * len(SETTINGS.targets)  # A and B, 2 layers, each target
    for n in before:
        if n in adapters:
            assert not torch.equal(before[n], after[n]), n
            assert torch.count_nonzero(before[n]) == 0 or ".lora_A." in n  # B starts at 0, A does not
        else:
            assert torch.equal(before[n], after[n]), n
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters() if p.requires_grad}
    trainable, total = lora.trainable_count(model)
    assert trainable == sum(before[n].numel() for n in adapters) and trainable < total / 10


def test_a_reference_pass_first_keeps_fp32_gradient_accumulation(tiny, process_group):
    """FSDP2 fixes how a layer's gradients are accumulated and reduced at the model's first forward; on
    step 1 that is the reference pass, with the adapters switched off. The adapters' gradients must still
    add up in fp32 over micro-batches: bf16 compute, two micro-batches reduced once, give exactly the sum
    of the two micro-batches' own gradients (in bf16 the sum would be rounded)."""
    path, _ = tiny
    model = policy.build(path, process_group, torch.bfloat16, lora_settings=SETTINGS)  # bf16 compute, fp32 adapters
    with torch.no_grad(), lora.adapters_off(model):  # step 1's first forward
        model_logprobs(model, batches(0)[0])
    mbs = [batches(1)[0], batches(2)[0]]

    def adapter_grads():
        return {n: dist.full_tensor(p.grad).clone() for n, p in model.named_parameters() if ".lora_" in n}

    alone = []
    for mb in mbs:
        model.zero_grad()
        (-model_logprobs(model, mb).sum()).backward()
        alone.append(adapter_grads())
    model.zero_grad()
    for i, mb in enumerate(mbs):  # as the update accumulates: one reduction, after the last micro-batch
        fsdp.reduce_gradients(model, reduce_scatter=i == 1, all_reduce=i == 1)
        (-model_logprobs(model, mb).sum()).backward()
    together = adapter_grads()
    assert together and all(g.dtype == torch.float32 for g in together.values())
    for n, g in together.items():
        assert torch.equal(g, alone[0][n] + alone[1][n]), n
    assert any(not torch.equal(g, (alone[0][n].bfloat16() + alone[1][n].bfloat16()).float()) for n, g in together.items())


def test_adapters_off_is_the_base_model(tiny, process_group):
    path, _ = tiny
    model, _ = trained(path, process_group)
    base = policy.build(path, process_group, torch.float32, frozen=True)
    mb = batches(7)[0]
    with torch.no_grad():
        with lora.adapters_off(model):
            off = model_logprobs(model, mb)
        on = model_logprobs(model, mb)
        want = model_logprobs(base, mb)
    torch.testing.assert_close(off, want, rtol=0, atol=1e-6)
    assert (on - want).abs().max() > 1e-3  # the adapters did move the policy
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)  # restored after the pass


def assert_samples_carry_the_trainers_logprobs(sampler, model, tok):
    """What `sampler` samples (T = 1) has, token by token, the log-probs the trainer's `model` gives it (1e-5)."""
    prompts = [[10, 11, 12], [20, 21]]
    for prompt, group in zip(prompts, sampler.generate(prompts, 2, SamplingParams(max_new_tokens=6, seed=1))):
        for c in group:
            mb = microbatch.build([(prompt, [c], torch.zeros(1))], tok.pad_token_id, torch.device("cpu"))
            with torch.no_grad():
                trainer = model_logprobs(model, mb)[0]
            torch.testing.assert_close(torch.tensor(c.logprobs), trainer, rtol=0, atol=1e-5)


def test_merged_weights_reproduce_the_adapted_model(tiny, process_group):
    path, tok = tiny
    model, _ = trained(path, process_group)
    merged = dict(model.whole_weights())
    plain = models.load_model(path)
    assert set(merged) == set(plain.state_dict()) - {"lm_head.weight"}  # base names, tied head once
    plain.load_state_dict(merged, strict=False)
    mb = batches(5)[0]
    with torch.no_grad():
        want = model_logprobs(model, mb)
        got = logprobs.LogProbModel(plain)(mb)
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0, atol=1e-5)
    # The HF sampler's log-probs of what it samples with the merged weights equal the trainer's on the same tokens.
    sampler = HFSampler(models.load_model(path), [256], tok.pad_token_id, process_group, tok)
    sampler.load_weights(model.whole_weights())
    assert_samples_carry_the_trainers_logprobs(sampler, model, tok)


def test_the_sampler_applies_the_adapters_as_the_trainer_does_and_a_sync_sends_only_them(tiny, process_group):
    """The HF sampler holds the base weights once and peft's adapters; a sync moves the adapters alone, in the
    compute dtype, and the sampler's log-probs of what it samples are the trainer's. One left out is refused."""
    path, tok = tiny
    model, _ = trained(path, process_group)
    sampler = make_sampler("hf", path, torch.device("cpu"), tok, [256], torch.float32, lora_settings=SETTINGS)
    sent = list(model.whole_weights(torch.float32, adapters_only=sampler.adapters_only))
    assert sampler.adapters_only and {n for n, _ in sent} == {n[3:] for n in full(model) if ".lora_" in n}  # less "lm."
    with pytest.raises(WeightSyncError, match="stale"):
        sampler.load_weights(sent[1:])
    sampler.load_weights(sent)
    assert_samples_carry_the_trainers_logprobs(sampler, model, tok)


def test_in_bf16_an_update_smaller_than_a_bf16_step_still_reaches_the_sampler(tiny, process_group):
    """A merged bf16 weight W + s B A rounds every change under half a bf16 step back to W: after one step of lr 1e-4
    the merge keeps little of the change s B A the trainer computes with; the sampler's own adapters keep all of it,
    bit for bit the trainer's bf16 adapters."""
    path, tok = tiny
    model = policy.build(path, process_group, torch.bfloat16, lora_settings=SETTINGS)
    opt = optimizer(model, 1e-4, 0.0)
    (mb,) = batches(0)
    (-model_logprobs(model, mb).sum()).backward()
    opt.step()
    merged, master = dict(model.whole_weights(torch.bfloat16)), full(model)
    base = models.load_model(path, torch.bfloat16).state_dict()
    sampler = make_sampler("hf", path, torch.device("cpu"), tok, [256], torch.bfloat16, lora_settings=SETTINGS)
    sampler.load_weights(model.whole_weights(torch.bfloat16, adapters_only=True))
    held = sampler.model.state_dict()
    scale = SETTINGS.alpha / SETTINGS.rank
    for layer in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        A, B = (master[f"lm.{layer}.lora_{x}.default.weight"].to(torch.bfloat16) for x in "AB")  # what the trainer uses
        delta = scale * (B.float() @ A.float())                                                   # (out, in)
        kept = ((merged[f"{layer}.weight"].float() - base[f"{layer}.weight"].float()) * delta).sum() / delta.square().sum()
        assert kept < 0.7, kept  # the merge: a share of the change
        assert torch.equal(held[f"{layer}.lora_A.default.weight"], A) and torch.equal(held[f"{layer}.lora_B.default.weight"], B)
        assert torch.equal(held[f"{layer}.base_layer.weight"], base[f"{layer}.weight"])  # the base, once, unchanged


def test_fake_vllm_engine_receives_merged_weights_under_base_names(tiny, process_group, vllm):
    from minigdpo.vllm_sampler import VLLMSampler

    path, tok = tiny
    model, _ = trained(path, process_group)
    sampler = VLLMSampler(path, tok, [256], seed=3, max_model_len=128)
    sampler.load_weights(model.whole_weights())
    engine = vllm.LLM.instances[-1]
    hf = models.load_model(path).state_dict()
    assert dict(engine.model.received) == {k: tuple(v.shape) for k, v in hf.items()}  # the tied head under its name too
    merged = {k: t.cpu() for k, t in model.whole_weights()}  # the fake engine keeps host tensors
    layer = "model.layers.1."
    q, v = merged[layer + "self_attn.q_proj.weight"], merged[layer + "self_attn.v_proj.weight"]
    torch.testing.assert_close(engine.model.params[layer + "self_attn.qkv_proj.weight"],
                               torch.cat([q, merged[layer + "self_attn.k_proj.weight"], v]))
    assert not torch.equal(q, hf[layer + "self_attn.q_proj.weight"])  # merged, not the base weight
    torch.testing.assert_close(engine.model.params[layer + "mlp.down_proj.weight"], merged[layer + "mlp.down_proj.weight"])


def test_vllm_serves_the_adapters_a_new_one_per_sync_and_sleeps_keeping_its_base(tiny, process_group, vllm):
    """With LoRA the vLLM sampler sends the adapters alone, in peft's format, as a new adapter per sync (the fake
    engine refuses an id reused with another path: the worker would serve the cached, stale one), and sleeps at
    level 1: no sync rewrites the base weights, so a level-2 sleep would leave them discarded for good (the fake
    refuses to generate from those)."""
    from minigdpo.vllm_sampler import VLLMSampler

    path, tok = tiny
    model, _ = trained(path, process_group)
    sampler = VLLMSampler(path, tok, [256], seed=3, max_model_len=128, lora_settings=SETTINGS)
    engine = vllm.LLM.instances[-1]
    assert engine.kwargs["enable_lora"] and engine.kwargs["max_lora_rank"] == 8  # the smallest of vLLM's ranks >= 4
    folders = []
    for step in range(2):
        sampler.generate([[10, 11, 12]], 2, SamplingParams(max_new_tokens=4, seed=step))
        sampler.sleep()
        sampler.load_weights(model.whole_weights(adapters_only=sampler.adapters_only))
        folders.append(sampler.lora_request.lora_path)
        saved = load_file(os.path.join(folders[-1], "adapter_model.safetensors"))
        assert set(saved) == {"base_model.model." + n[3:].replace(".default.", ".") for n in full(model) if ".lora_" in n}
    sampler.generate([[10, 11, 12]], 2, SamplingParams(max_new_tokens=4, seed=5))
    assert [c for c in engine.calls if c[0] in ("lora", "sleep")] == [("sleep", 1), ("lora", 1), ("sleep", 1), ("lora", 2)]
    assert not any(c[0] == "collective_rpc" for c in engine.calls)  # the base weights never moved
    assert not os.path.exists(folders[0]) and os.path.exists(folders[1])  # one adapter's folder at a time
    sampler.close()
    assert not os.path.exists(folders[1])


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MB tmpfs: smaller than two of the tiny model's adapters and 1 MiB."""
    yield from mounted_tmpfs(str(tmp_path / "shm"), "1m")


def test_vllm_adapter_folders_go_on_every_exit_path_and_not_into_a_small_shm(tiny, process_group, vllm, small_tmpfs,
                                                                             monkeypatch):
    """No adapter folder outlives its sampler: after adapters_off() (every --final-eval of a LoRA run), at close(),
    and when a crash drops the sampler without close() (weakref.finalize, which also runs at exit). A /dev/shm
    without room for two adapters (Docker's 64 MB at 7B) sends them to the temporary directory."""
    import gc

    from minigdpo import vllm_sampler

    path, tok = tiny
    model, _ = trained(path, process_group, steps=1)
    monkeypatch.setattr(vllm_sampler, "SHM", small_tmpfs)
    roots = []
    for ending in ("adapters_off", "close", "dropped"):
        vllm.LLM.instances.clear()  # one engine per process: each of these stands for a run of its own
        sampler = vllm_sampler.VLLMSampler(path, tok, [256], seed=3, max_model_len=128, lora_settings=SETTINGS)
        sampler.load_weights(model.whole_weights(adapters_only=sampler.adapters_only))
        sampler.load_weights(model.whole_weights(adapters_only=sampler.adapters_only))
        root = sampler.adapter_root
        assert os.path.dirname(root) == tempfile.gettempdir() and len(os.listdir(root)) == 1  # one folder at a time
        roots.append(root)
        if ending == "adapters_off":
            sampler.adapters_off()
            sampler.generate([[10, 11, 12]], 1, SamplingParams(max_new_tokens=2))
            sampler.close()
        elif ending == "close":
            sampler.close()
        else:
            sampler.llm = None  # a crash: no close(), the sampler is dropped
            del sampler
            gc.collect()
        assert not os.path.exists(root), ending
    monkeypatch.setattr(vllm_sampler, "SHM", str(os.path.dirname(small_tmpfs)))  # a roomy one: used
    vllm.LLM.instances.clear()
    sampler = vllm_sampler.VLLMSampler(path, tok, [256], seed=3, max_model_len=128, lora_settings=SETTINGS)
    sampler.load_weights(model.whole_weights(adapters_only=sampler.adapters_only))
    assert os.path.dirname(sampler.adapter_root) == os.path.dirname(small_tmpfs)
    sampler.close()


def test_adapter_checkpoint_loads_with_peft_and_the_merged_export_with_transformers(tiny, process_group, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, tok = tiny
    model, opt = trained(path, process_group)
    sched = scheduler(opt, 4, 0.0, "constant")
    where = checkpoint.save(str(tmp_path), 1, model, opt, sched, tok, {"cursor": 0}, torch.float32, keep=2)
    assert os.path.isdir(os.path.join(where, "hf"))  # export_hf: the merged model (--merge-on-save)
    adapter = os.path.join(where, "adapter")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        saved = json.load(f)
    assert (saved["r"], saved["lora_alpha"], saved["base_model_name_or_path"]) == (4, 8.0, path)
    mb = batches(3)[0]
    with torch.no_grad():
        want = model_logprobs(model, mb)
        for lm in (PeftModel.from_pretrained(models.load_model(path), adapter).get_base_model(),  # adapters in place
                   AutoModelForCausalLM.from_pretrained(os.path.join(where, "hf"))):
            got = logprobs.LogProbModel(lm)(mb)
            torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0, atol=1e-5)
    # Without the export, hf/ is absent and eval.py merges base + adapter itself.
    where = checkpoint.save(str(tmp_path), 2, model, opt, sched, tok, {"cursor": 0}, torch.float32, keep=2, export_hf=False)
    assert sorted(os.listdir(where)) == ["COMPLETE", "adapter", "rng", "state", "trainer.json"]
    out = lora.merge_adapter_dir(os.path.join(where, "adapter"), str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, t in model.whole_weights():
        torch.testing.assert_close(merged[name], t, rtol=0, atol=1e-6)


def test_the_final_evaluation_of_a_lora_run_compares_with_its_base_in_the_same_sampler(tmp_path):
    """The trainer's sampler holds the base once under its adapters: the baseline (the run's own base model) is that
    sampler with its adapters off, and samples what the base model alone samples."""
    out = str(tmp_path / "run")
    run(SMOKE + ["--max-steps", "1", "--final-eval", "2", "--output-dir", out])
    base = str(tmp_path / "base")
    run(["eval.py", "--model", "tiny-random", "--task", "arith", "--limit", "2", "--max-new-tokens", "8",
         "--max-prompt-len", "64", "--sampler", "hf", "--output", base])
    baseline = read_jsonl(os.path.join(out, "final_eval", "completions_baseline.jsonl"))
    assert [r["completion"] for r in baseline] == [r["completion"] for r in read_jsonl(os.path.join(base, "completions.jsonl"))]


def test_resume_reaches_the_same_adapters_and_the_state_holds_only_them(tmp_path):
    common = SMOKE + ["--lr-schedule", "constant", "--save-every", "1", "--keep-checkpoints", "5"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run(common + ["--max-steps", "4", "--output-dir", a, "--merge-on-save"])  # the export draws no RNG
    run(common + ["--max-steps", "2", "--output-dir", b])
    proc = run(common + ["--max-steps", "4", "--output-dir", b, "--resume"])
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout
    wa, wb = [load_file(os.path.join(o, "checkpoints", "step_000004", "adapter", "adapter_model.safetensors")) for o in (a, b)]
    assert wa.keys() == wb.keys() and len(wa) == 2 * 2 * 7  # A and B, 2 layers, the 7 default targets
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert any(torch.count_nonzero(t) for k, t in wa.items() if ".lora_B." in k)  # the adapters trained
    rows = read_jsonl(os.path.join(b, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["sampler/logp_gap"] < 1e-4 for r in rows)  # the sampler gets the merged weights, also after resume
    assert rows[-1]["kl"] > 0  # the reference (adapters off) differs from the trained policy
    step = os.path.join(b, "checkpoints", "step_000004")
    assert not os.path.exists(os.path.join(step, "hf"))  # no --merge-on-save here
    state = open(os.path.join(step, "state", ".metadata"), "rb").read()
    assert b"lora_A" in state and b"base_layer" not in state  # the frozen base is not copied
    # A checkpoint with adapters does not resume a run without them (or with others): one line.
    proc = run(SMOKE[:-4] + ["--max-steps", "4", "--output-dir", b, "--resume"], check=False)
    refused(proc)
    assert "was trained with --lora-rank 4 --lora-targets down_proj,gate_proj" in proc.stderr
    assert proc.stderr.strip().endswith("this run has --lora-rank 0")
    # eval.py takes the step directory: its adapter/, merged into the base model, with the run's settings.
    import eval as evaluate

    summary = evaluate.main(["--model", step, "--limit", "2", "--sampler", "hf", "--output", str(tmp_path / "eval")])
    assert summary["prompts"] == 2 and summary["length/max"] <= 8  # the smoke run's max_new_tokens
    merged = load_file(os.path.join(tmp_path, "eval", "merged_model", "model.safetensors"))  # merged by peft
    export = load_file(os.path.join(a, "checkpoints", "step_000004", "hf", "model.safetensors"))  # by the trainer
    assert set(export) <= set(merged) and set(merged) - set(export) <= {"lm_head.weight"}  # tied: saved once or twice
    for name, t in export.items():
        torch.testing.assert_close(merged[name], t, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_update_on_two_ranks_equals_one_rank(tmp_path):
    one, two = str(tmp_path / "one.pt"), str(tmp_path / "two.pt")
    run(["tests/dist_update.py", one, "token_mean", "auto", "lora"], nproc=1)
    run(["tests/dist_update.py", two, "token_mean", "auto", "lora"], nproc=2)
    a, b = torch.load(one), torch.load(two)
    assert a["stats"]["kl"] < 1e-7 and b["stats"]["kl"] < 1e-7  # B starts at 0: the first pass is the base model
    for key in ["loss", "kl", "loss/pg", "grad_norm"]:
        assert a["stats"][key] == pytest.approx(b["stats"][key], rel=1e-4, abs=1e-6), key
    base = models.load_model(models.resolve_model("tiny-random")).state_dict()
    moved = [n for n in a["params"] if not torch.equal(a["params"][n], base[n])]
    assert moved and all(n.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight")) for n in moved)
    for name, t in a["params"].items():
        torch.testing.assert_close(t, b["params"][name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_two_rank_run_trains_saves_and_merges(tmp_path):
    out = str(tmp_path / "run")
    run(SMOKE + ["--merge-on-save", "--output-dir", out], nproc=2)
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["sampler/logp_gap"] < 1e-4
    step = os.path.join(out, "checkpoints", "step_000002")
    from peft import PeftModel

    merged = PeftModel.from_pretrained(models.load_model(models.resolve_model("tiny-random")),
                                       os.path.join(step, "adapter")).merge_and_unload().state_dict()
    export = load_file(os.path.join(step, "hf", "model.safetensors"))
    for name, t in export.items():
        torch.testing.assert_close(t, merged[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("flags,message", [
    (["--lora-rank", "-1"], "--lora-rank must be >= 1 (or 0 for full fine-tuning), got -1"),
    (["--lora-rank", "4", "--lora-targets", "q_proj,qproj"], "--lora-targets 'qproj' matches no linear layer of LlamaForCausalLM"),
    (["--lora-rank", "4", "--lora-targets", "lm_head"], "'lm_head' matches lm_head, outside the decoder layers"),
])
def test_bad_lora_input_is_one_line_before_any_weights_load(tmp_path, capsys, flags, message):
    assert message in refusal(["--preset", "smoke", "--output-dir", str(tmp_path)] + flags)
    assert "parameters:" not in capsys.readouterr().out  # stopped before the model was built


def test_lora_values_are_checked():
    for flags, message in [(["--lora-alpha", "16"], "--lora-alpha needs --lora-rank R >= 1 (0: off)"),
                           (["--merge-on-save", "--lora-dropout", "0.1"], "--lora-dropout, --merge-on-save need --lora-rank"),
                           (["--lora-rank", "4", "--ref-offload"], "--ref-offload does nothing with --lora-rank")]:
        with pytest.raises(config.ConfigError) as e:
            config.validate(cli.parse_args(["--preset", "smoke"] + flags))
        assert message in str(e.value)
    for name, value, message in [("lora_alpha", 0.0, "--lora-alpha must be > 0"),
                                 ("lora_dropout", 1.0, "--lora-dropout must be in [0, 1)"),
                                 ("lora_targets", [], "--lora-targets must name at least one layer")]:
        cfg = config.Config(preset="smoke", lora_rank=4)
        setattr(cfg, name, value)
        with pytest.raises(config.ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            config.validate(cfg)
    config.validate(config.Config(lora_rank=8, sampler="vllm"))  # vLLM is fine: it gets merged weights
    assert cli.parse_args(["--preset", "a100-lora"]).lora_rank == 32


def test_memory_plan_counts_the_7b_adapters_exactly():
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import memory_plan

    rows, s = memory_plan.plan(cli.parse_args(["--preset", "a100-lora"]))
    # Qwen2.5-7B: per layer, rank 32 x (in + out) of q (3584+3584), k and v (3584+512), o (3584+3584),
    # gate and up (3584+18944) and down (18944+3584); 28 layers.
    assert s["adapters"] == 28 * 32 * (2 * 7168 + 2 * 4096 + 3 * 22528) == 80_740_352
    assert s["parameters"] == 7_615_616_512  # the hub's 7.62 B
    assert dict((what, size) for what, size, _ in rows)["base weights, bf16, frozen (no master copy)"] == 2 * s["parameters"]
