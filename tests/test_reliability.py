"""Fault injection: kills mid-step and mid-checkpoint (1 process and 2 gloo ranks), a full disk,
misbehaving rewards, degenerate batches and bad input. Every fault must cost nothing: the
resumed run reaches exactly the weights of an uninterrupted one.

Run: pytest tests/test_reliability.py   (about 3 minutes)
"""

import math
import os
from dataclasses import fields

import pytest
import torch
from safetensors.torch import load_file

from conftest import mounted_tmpfs, read_jsonl, refusal, refused, run
from minigdpo import cli, config, models
from minigdpo.estimators import REGISTRY
from minigdpo.update import optimizer, policy_loss, scheduler
from minigdpo.sampler import Completion

BASE = ["train.py", "--preset", "smoke", "--max-steps", "4", "--save-every", "1", "--keep-checkpoints", "5",
        "--rewards", "tests.helpers:digit_frac,tests.helpers:vowel_frac,format"]


def weights(out, step=4):
    return load_file(os.path.join(out, "checkpoints", f"step_{step:06d}", "hf", "model.safetensors"))


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference runs, one per world size."""
    outs = {}
    for nproc in (1, 2):
        out = str(tmp_path_factory.mktemp(f"clean{nproc}"))
        run(BASE + ["--output-dir", out], nproc=nproc)
        outs[nproc] = out
    return outs


@pytest.mark.parametrize("nproc,fault,rank", [
    (1, "prepare@3", "0"),   # killed between the update and the save of step 3
    (1, "state@2", "0"),     # killed inside a checkpoint write: weights written, state not
    (1, "rename@3", "0"),    # killed with a complete but unrenamed checkpoint
    (2, "prepare@3", "1"),   # rank 1 dies; torchrun takes rank 0 down with it
    (2, "finish@2", "0"),    # rank 0 dies after the sharded state, before COMPLETE
])
@pytest.mark.slow
def test_kill_then_resume_reaches_the_uninterrupted_weights(tmp_path, uninterrupted, nproc, fault, rank):
    out = str(tmp_path / "run")
    killed = run(BASE + ["--output-dir", out], nproc=nproc, env={"MINIGDPO_FAULT": fault, "MINIGDPO_FAULT_RANK": rank},
                 check=False)
    assert killed.returncode != 0
    step = int(fault.split("@")[1])
    ckpts = os.listdir(os.path.join(out, "checkpoints"))
    assert f"step_{step:06d}" not in ckpts  # the interrupted step left no complete checkpoint
    resumed = run(BASE + ["--output-dir", out, "--resume"], nproc=nproc)
    assert "resumed from" in resumed.stdout
    assert not any(n.endswith(".partial") for n in os.listdir(os.path.join(out, "checkpoints")))
    assert_same_weights(out, uninterrupted[nproc])
    assert [r["step"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3, 4]


@pytest.mark.slow
def test_resuming_from_a_checkpoint_that_lost_a_shard_is_refused_in_one_line(tmp_path):
    out = str(tmp_path / "run")
    run(BASE + ["--output-dir", out, "--max-steps", "2"])
    os.remove(os.path.join(out, "checkpoints", "step_000002", "state", "__0_0.distcp"))
    err = refused(run(BASE + ["--output-dir", out, "--resume"], check=False))
    assert "step_000002 is not whole: state/__0_0.distcp missing" in err, err


@pytest.mark.slow
def test_injected_full_disk_keeps_the_previous_checkpoint_and_stops_cleanly(tmp_path):
    out = str(tmp_path / "run")
    proc = run(BASE + ["--output-dir", out], env={"MINIGDPO_FAULT": "hf@2:enospc"}, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "could not write checkpoint" in proc.stderr and "step_000002.partial" in proc.stderr  # names the path
    assert "No space left on device" in proc.stderr and "last complete checkpoint is" in proc.stderr
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step_000001"]
    weights(out, 1)  # intact and loadable


@pytest.mark.slow
def test_injected_full_disk_can_continue(tmp_path):
    out = str(tmp_path / "run")
    proc = run(BASE + ["--output-dir", out, "--on-save-error", "continue"], env={"MINIGDPO_FAULT": "hf@2:enospc"})
    assert "could not write checkpoint" in proc.stderr + proc.stdout
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step_000001", "step_000003", "step_000004"]


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 3 MB filesystem: room for one tiny checkpoint (about 1.4 MB), not for two."""
    yield from mounted_tmpfs(str(tmp_path / "disk"), "3m")


@pytest.mark.slow
def test_a_really_full_disk(tiny_disk):
    out = os.path.join(tiny_disk, "run")
    proc = run(BASE + ["--output-dir", out], check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "could not write checkpoint" in proc.stderr and "No space left on device" in proc.stderr
    done = sorted(os.listdir(os.path.join(out, "checkpoints")))
    assert done and not any(n.endswith(".partial") for n in done)
    weights(out, int(done[-1].split("_")[1]))  # the last complete checkpoint loads


def fill(disk, leave):
    """Take all but `leave` bytes of a tmpfs with a ballast file."""
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with open(os.path.join(disk, "ballast"), "wb") as f:
        f.write(b"\0" * (free - leave))


@pytest.mark.slow
@pytest.mark.parametrize("on_error", ["stop", "continue"])
def test_a_disk_that_fills_during_the_hugging_face_export(tiny_disk, on_error):
    """safetensors reports a full disk as its own SafetensorError, not as an OSError: still one line, and
    --on-save-error is honoured."""
    fill(tiny_disk, 64 * 1024)  # the export's one safetensors file takes about 130 kB
    out = os.path.join(tiny_disk, "run")
    proc = run(BASE + ["--output-dir", out, "--max-steps", "2", "--on-save-error", on_error], check=False)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "could not write checkpoint" in proc.stderr and "step_000001.partial" in proc.stderr, proc.stderr[-3000:]
    assert "No space left on device" in proc.stderr
    assert proc.returncode == (1 if on_error == "stop" else 0), proc.stderr[-3000:]
    steps = [r["step"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))]
    assert steps == ([1] if on_error == "stop" else [1, 2])
    assert os.listdir(os.path.join(out, "checkpoints")) == []


@pytest.mark.slow
def test_misbehaving_rewards_do_not_stop_training(tmp_path):
    out = str(tmp_path / "run")
    rewards = ",".join(f"tests.helpers:{n}" for n in ["digit_frac", "raises", "nan_or_inf", "text", "hangs", "never_applies"])
    proc = run(["train.py", "--preset", "smoke", "--rewards", rewards, "--reward-timeout", "0.2", "--output-dir", out,
                "--save-every", "0"])
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2]
    r = rows[0]
    assert r["reward/raises/errors"] == 8
    assert r["reward/nan_or_inf/invalid"] == 8 and r["reward/text/invalid"] == 8
    assert r["reward/hangs/timeouts"] == 8        # 3 timed out, the rest skipped
    assert r["reward/never_applies/none"] == 8
    assert r["reward/raises/mean"] is None        # NaN is written as null
    assert r["grad_norm"] > 0 and math.isfinite(r["loss"])       # the good reward still trains
    assert proc.stderr.count("'raises' raised RuntimeError") == 1  # warned once over two steps, by its name
    assert proc.stderr.count("ran past its 0.2 s limit") == 1


def batch_of(completions, prompts=None):
    from microbatches import micro_batches

    prompts = prompts or [[1, 2, 3]] * len(completions)
    return micro_batches(prompts, completions, torch.zeros(len(completions)), 4, 257, torch.device("cpu"), len(completions))


@pytest.mark.parametrize("case", ["identical", "constant_rewards", "empty", "truncated"])
def test_degenerate_batches_give_finite_zero_advantages_and_finite_loss(case):
    G = 4
    rewards = {"identical": torch.tensor([[[1.0, 0.0]] * G]), "constant_rewards": torch.zeros(1, G, 2),
               "empty": torch.full((1, G, 2), float("nan")), "truncated": torch.tensor([[[0.0, 1.0]] * G])}[case]
    for fn in (e.advantages for e in REGISTRY.values()):
        adv = fn(rewards)
        assert torch.isfinite(adv).all() and adv.abs().max() == 0
    comps = {"empty": [Completion([], [], "stop")] * G, "truncated": [Completion([7] * 6, [-1.0] * 6, "length")] * G}.get(
        case, [Completion([5, 6], [-1.0, -1.0], "stop")] * G)
    (mb,) = batch_of(comps)
    logp = torch.zeros_like(mb.mask, requires_grad=True)
    loss, stats = policy_loss(logp, logp.detach(), logp.detach(), torch.zeros(G), mb.mask)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()


def test_a_nan_gradient_skips_the_step_and_keeps_the_weights(process_group):
    from minigdpo import policy
    from minigdpo.update import update

    path = models.resolve_model("tiny-random")
    model = policy.build(path, process_group, torch.float32)
    opt = optimizer(model, 1e-2, 0.0)
    sched = scheduler(opt, 4, 0.0, "constant")
    (mb,) = batch_of([Completion([5, 6], [-1.0, -1.0])] * 2)
    mb.adv = torch.tensor([float("nan"), 1.0], device=process_group)
    before = {k: v.clone() for k, v in model.whole_weights()}
    cfg = config.Config(num_iterations=1, temperature=1.0, logprob_chunk=64, importance_sampling_cap=0.0, clip_low=0.2, clip_high=0.2,
                        beta=0.0, loss_agg="token_mean", max_new_tokens=4, max_grad_norm=1.0, grad_checkpointing="false")
    totals = update(model, opt, sched, [mb], cfg)
    assert totals["skipped_steps"] == 1
    for k, v in model.whole_weights():
        assert torch.equal(v, before[k])


def test_bad_rows_stop_by_default_and_are_skipped_on_request(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b'{"question": "1+1?", "answer": "#### 2"}\n{broken\n\xff\xfe\n{"question": "2+2?"}\n'
                     + b'{"question": "3+3?", "answer": "#### 6"}\n' * 4)
    args = ["train.py", "--preset", "smoke", "--task", "gsm8k", "--data", str(data), "--output-dir", str(tmp_path / "o"),
            "--save-every", "0"]
    proc = run(args, check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (f"error: {data}:2: invalid JSON (Expecting property name "
                                                            f"enclosed in double quotes at column 2) (pass --skip-bad-rows "
                                                            f"to skip such rows)")
    proc = run(args + ["--skip-bad-rows"])
    assert "3 malformed rows skipped" in proc.stdout


BAD_VALUES = {  # every config field, with a value it must refuse (the test below checks the list is complete)
    "preset": "huge", "model": " ", "task": "chess", "data": None, "rewards": None, "reward_weights": [float("nan")] * 3,
    "tools": None, "environment": None, "max_tool_calls": -1, "tool_timeout": 0.0, "async_steps": -1,
    "importance_sampling_level": "batch",
    "condition": None, "estimator": "ppo", "group_size": 1, "batch_size": 9, "micro_batch_size": 0, "num_iterations": 0,
    "micro_batch_tokens": -1, "padding_free": None, "compile": "maybe",
    "dynamic_sampling": None, "max_sample_rounds": 0,
    "lr": float("nan"), "lr_schedule": "linear", "warmup_ratio": 1.0, "weight_decay": -0.1, "max_grad_norm": -1.0,
    "beta": float("inf"), "clip_low": 1.0, "clip_high": -0.1, "loss_agg": "sum", "epochs": 0.0, "max_steps": -1,
    "seed": -1, "max_prompt_len": 0, "max_new_tokens": 0, "temperature": 0.0, "top_p": 1.5, "ignore_eos": None, "sampler": "tgi",
    "vllm_gpu_memory_utilization": 1.0, "importance_sampling_cap": 0.5, "sampler_ranks": -1, "logp_gap_warn": -1.0, "vllm_kv_cache_gib": -1.0, "length_limit": 0, "length_unit": "chars",
    "answer_format": "latex", "arith_difficulty": 7, "reward_timeout": 0.0, "skip_bad_rows": None, "dtype": "fp8",
    "grad_checkpointing": "sometimes", "ref_offload": None, "logprob_chunk": 0, "output_dir": "", "save_every": -1,
    "keep_checkpoints": 0, "on_save_error": "ignore", "sharding": "zero3", "reduce_grads": "never", "final_eval": -1,
    "resume": None, "samples_every": -1, "wandb": None,
    "gd2po_mode": "soft", "gd2po_tau": 1.5, "saw_shift": [float("inf")],
    "reward_model_placement": "everywhere", "reward_model_batch_size": 0,
    # LoRA: a negative rank; at rank 0 (smoke's) any other LoRA flag is refused; see tests/test_lora.py for rank > 0
    "lora_rank": -1, "lora_alpha": float("nan"), "lora_dropout": 1.0, "lora_targets": [], "merge_on_save": True,
}
CHECKED_ELSEWHERE = {  # fields whose bad values are only known once data, rewards or the machine are consulted
    "data": "a missing file (test_train)", "rewards": "an unknown name (test_train)",
    "tools": "a missing or untyped tool (test_tools)", "environment": "a missing class or one without reset (test_tools)",
    "condition": "a malformed or unknown condition (test_train)", "skip_bad_rows": "a boolean",
    "padding_free": "a boolean", "ignore_eos": "a boolean",
    "ref_offload": "a boolean", "resume": "a boolean", "dynamic_sampling": "a boolean",
    "wandb": "refused when wandb is not installed",
}


def test_every_config_field_refuses_a_bad_value():
    assert set(BAD_VALUES) == {f.name for f in fields(config.Config)}
    for name, value in BAD_VALUES.items():
        if value is None:
            assert name in CHECKED_ELSEWHERE
            continue
        cfg = config.Config(preset="smoke")
        setattr(cfg, name, value)
        with pytest.raises(config.ConfigError) as e:
            config.validate(cfg)
        assert "\n" not in str(e.value), name


def test_bad_booleans_and_context_are_one_line_before_any_model_loads(tmp_path):
    for flags, message in [(["--resume", "maybe"], "expected true or false"),
                           (["--max-new-tokens", "4000"], "exceeds the model's context of 2048 tokens"),
                           (["--model", str(tmp_path / "nope")], "cannot read its config")]:
        assert message in refusal(["--preset", "smoke", "--output-dir", str(tmp_path / "o")] + flags)


@pytest.mark.parametrize("flag", [f.name for f in fields(config.Config) if f.type is int])
def test_every_integer_flag_refuses_a_fraction(flag):
    """"3.0" is not an integer: a step count or a size that silently dropped its fraction would be a
    different run than the one asked for."""
    with pytest.raises(config.ConfigError, match="invalid int value: '3.5'"):
        cli.parse_args([f"--{flag.replace('_', '-')}", "3.5"])
    with pytest.raises(config.ConfigError, match="invalid int value: '3.0'"):
        cli.parse_args([f"--{flag.replace('_', '-')}", "3.0"])


def test_resume_on_a_node_with_fewer_gpus_restores_the_rng(process_group, tmp_path, monkeypatch):
    """A checkpoint saved where the node had 8 GPUs resumes where it has 1. Each rank keeps its own GPU's
    RNG state only: torch.cuda.set_rng_state_all(8 states) would address GPUs 1-7, which do not exist.
    The CUDA RNG calls are stood in for on this CPU machine; torch's own set_rng_state_all calls the
    stand-in set_rng_state(state, i) for each i, as it does on GPUs. CUDA shows as available to
    minigdpo/checkpoint.py's own calls only (DCP's writer would look for a GPU otherwise)."""
    import sys

    from minigdpo import checkpoint, policy

    path = models.resolve_model("tiny-random")
    model = policy.build(path, process_group, torch.float32)
    opt = optimizer(model, 1e-3, 0.0)
    sched = scheduler(opt, 10, 0.0, "constant")
    gpu_state = torch.arange(16, dtype=torch.uint8)
    restored = []

    def set_rng_state(state, device="cuda"):
        index = device if isinstance(device, int) else torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            raise RuntimeError("CUDA error: invalid device ordinal")
        restored.append(state)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: sys._getframe(1).f_globals["__name__"] == checkpoint.__name__)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)           # the saving node
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": gpu_state.clone())
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [gpu_state.clone() for _ in range(8)])
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(torch.cuda.random, "set_rng_state", set_rng_state)  # what set_rng_state_all calls
    where = checkpoint.save(str(tmp_path), 1, model, opt, sched, models.load_tokenizer(path),
                            {"cursor": 0, "derived": {"world_size": 1}}, torch.float32, keep=2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)           # the resuming node
    checkpoint.load(where, model, opt, sched)
    assert len(restored) == 1 and torch.equal(restored[0], gpu_state)


def test_each_preset_lists_only_what_it_changes():
    """A preset that repeats a default hides which values it really sets."""
    defaults = config.Config()
    for name, values in config.PRESETS.items():
        assert [k for k, v in values.items() if getattr(defaults, k) == v] == [], name


def test_help_shows_what_to_train_first_and_the_systems_knobs_last():
    text = cli.build_parser().format_help()
    heads = [line for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert heads.index("What to train:") < heads.index("Batch shape:") < heads.index("Output:")
    assert heads[-1].startswith("Systems")
    systems = text[text.index(heads[-1]):]
    for flag in ("--dtype", "--sharding", "--reduce-grads", "--sampler", "--vllm-kv-cache-gib", "--logp-gap-warn"):
        assert flag in systems, flag
