"""The benchmark scripts run end to end on shapes small enough for a test (their figures are not
checked here; docs/performance.md has the measured ones).

Run: pytest tests/test_benchmarks.py
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_QWEN2 = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
               "--vocab", "4096"]


def bench(script, *args, env=None):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_gpu_benchmark_reports_step_time_throughput_and_mfu(tmp_path):
    out = bench("gpu.py", *SMALL_QWEN2, "--steps", "3", "--peak-tflops", "0.01", "--dtype", "fp32",
                env=os.environ | {"TMPDIR": str(tmp_path)})
    assert "median of 2 steps after warm-up" in out
    mfu = float(re.search(r"MFU ([\d.]+)%", out).group(1))
    update = float(re.search(r"update tokens/s\s+(\d+)", out).group(1))
    assert mfu > 0 and update > 0
    assert not [d for d in os.listdir(tmp_path) if d.startswith("bench-gpu-")]  # its run's checkpoint removed


def test_the_fast_pass_check_tells_a_right_pass_from_a_wrong_one():
    out = bench("fast_pass_check.py", "--model", "tiny-random")
    rows = {tuple(line.split()[:2]): [float(x) for x in line.split()[2:6]] for line in out.splitlines()[1:5]}
    assert max(rows["float32", "right"]) < 1e-5 and min(rows["float32", "wrong"]) > 1e-4
    assert max(rows["bfloat16", "right"]) < 1.0


def test_the_op_count_per_layer_runs_for_both_layouts():
    out = bench("update_ops.py")
    rows = [line.split() for line in out.splitlines() if line.startswith(("packed", "padded"))]
    assert len(rows) == 4 and all(0 < int(r[3]) < int(r[2]) < int(r[4]) for r in rows)  # attention's < forward < bwd


@pytest.mark.slow
def test_the_compiled_update_benchmark_compares_with_eager():
    out = bench("compiled_update.py", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                "--intermediate", "128", "--vocab", "512", "--seqs", "8", "--reps", "1")
    assert "eager" in out and "compiled" in out
    assert float(re.search(r"max \|difference\| ([\d.e+-]+)", out).group(1)) < 1e-5


def test_logprob_memory_benchmark_compares_chunked_with_naive():
    out = bench("logprob_memory.py", "--vocab", "5000", "--tokens", "256", "--batch", "2", "--chunk", "64", "--reps", "1")
    ratio = float(re.search(r"peak memory: ([\d.]+)%", out).group(1))
    diffs = [float(x) for x in re.findall(r"(?:logp|grad_h|grad_w) ([\d.e+-]+)", out)]
    assert len(diffs) == 3 and max(diffs) < 1e-5
    assert ratio < 100


def test_gpu_proxies_run_end_to_end():
    """The proxies' whole script, one rank (its update once read a micro-batch key that no longer exists)."""
    out = bench("gpu_proxies.py", *SMALL_QWEN2, "--chunk", "32")
    assert "share of matmul FLOPs in fp32" in out and "HF sampler host syncs per generated token" in out


def test_vs_trl_gives_minigdpo_trls_dtype(monkeypatch):
    """vs_trl.py's work is identical on both sides: TRL computes in fp32 on the CPU, so minigdpo must too, whatever
    --dtype auto would pick on this CPU (bf16 where it has the instructions)."""
    import argparse
    import importlib.util

    import torch

    import train
    import plot
    from minigdpo import cli, models

    spec = importlib.util.spec_from_file_location("vs_trl", os.path.join(ROOT, "benchmarks", "vs_trl.py"))
    vs_trl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vs_trl)
    seen = []
    monkeypatch.setattr(train, "main", seen.append)
    monkeypatch.setattr(plot, "read_run", lambda out: [])
    args = argparse.Namespace(group=8, prompts=4, micro_batch_size=16, steps=3, max_new_tokens=64, heap="trim")
    vs_trl.run_minigdpo(args, "tiny-random", "data.jsonl")
    dtype, _ = models.compute_dtype(cli.parse_args(seen[0]).dtype, torch.device("cpu"))
    assert dtype == torch.float32


def test_vs_trl_removes_minigdpo_runs_output_directory(monkeypatch, tmp_path):
    """Each minigdpo run of vs_trl.py ends in a checkpoint (2.2 GB for SmolLM2): the script reads the step times,
    then removes the run's directory, where ten runs once filled the disk."""
    import argparse
    import importlib.util
    import tempfile

    import train
    import plot

    spec = importlib.util.spec_from_file_location("vs_trl", os.path.join(ROOT, "benchmarks", "vs_trl.py"))
    vs_trl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vs_trl)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def fake_train(argv):  # a checkpoint's file where the run writes
        out = argv[argv.index("--output-dir") + 1]
        os.makedirs(os.path.join(out, "checkpoints"))
        open(os.path.join(out, "checkpoints", "model.safetensors"), "w").close()

    monkeypatch.setattr(train, "main", fake_train)
    monkeypatch.setattr(plot, "read_run", lambda out: [{"time/step": 1.5}])
    args = argparse.Namespace(group=8, prompts=4, micro_batch_size=16, steps=1, max_new_tokens=64, heap="trim")
    assert vs_trl.run_minigdpo(args, "tiny-random", "data.jsonl") == [1.5]
    assert os.listdir(tmp_path) == []


def test_vs_trl_gives_back_minigdpos_heap_as_its_heap_flag_says(monkeypatch):
    """--heap: the update's trim before every micro-batch (trim, train.py's own), before each step's first
    (once-a-step: every 2nd of B x G / micro-batch = 32 / 16), or never (keep)."""
    import importlib.util

    from minigdpo import update

    spec = importlib.util.spec_from_file_location("vs_trl", os.path.join(ROOT, "benchmarks", "vs_trl.py"))
    vs_trl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vs_trl)
    for heap, expected in (("trim", 6), ("once-a-step", 3), ("keep", 0)):
        trims = []
        monkeypatch.setattr(update, "trim_host_heap", lambda: trims.append(1))
        vs_trl.heap_policy(heap, 2)
        for _ in range(6):
            update.trim_host_heap()
        assert len(trims) == expected, heap


def test_the_lora_and_sampler_benchmarks_remove_their_runs_output_directories(monkeypatch, tmp_path):
    """lora_cpu.py's runs (the demo model's 2.2 GB checkpoint each) and samplers.py's, their train.py faked: each
    leaves metrics to read and a checkpoint's file, and neither directory outlives the script."""
    import argparse
    import tempfile

    import train
    import plot

    from benchmarks import lora_cpu, samplers

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    row = {f"time/{k}": 1.0 for k in ("step", "generate", "logprob", "update", "reward", "sync")} | {
        "throughput/gen_tokens_per_s": 10.0, "sampler/logp_gap": 0.0}

    def run(argv, **kwargs):  # train.py, in process (lora_cpu) or as a command (samplers)
        out = argv[argv.index("--output-dir") + 1]
        os.makedirs(os.path.join(out, "checkpoints"))
        open(os.path.join(out, "checkpoints", "model.safetensors"), "w").close()
        print("parameters: 10, trainable: 5")
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(train, "main", run)
    monkeypatch.setattr(subprocess, "run", run)
    for module in (plot, samplers):  # lora_cpu imports plot's in its child
        monkeypatch.setattr(module, "read_run", lambda out: [row, row])
    lora_cpu.child(argparse.Namespace(steps=2, child_rank=0))
    samplers.main(["--samplers", "hf", "--steps", "2"])
    assert os.listdir(tmp_path) == []


def test_the_decode_kernel_benchmark_compares_with_sdpa():
    out = bench("decode_attention.py", "--rows", "4", "--lengths", "24")
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [r[:2] for r in rows] == [["24", "float32"], ["24", "bfloat16"]]
    assert float(rows[0][8]) < 1e-5  # fp32: SDPA's output to rounding
    assert all(len(r) == 13 and r[-1] == "ms" for r in rows)  # and the two columns on strided keys


def test_the_async_benchmarks_slow_tool_is_the_agent_presets_tool_after_a_wait(monkeypatch):
    """The agent part's tool must be the one the cpu-agent model was warmed to call, by name, description and schema
    (a call to another name fails at once and waits for nothing), and it must wait."""
    import asyncio
    import inspect
    import time

    from benchmarks import async_rollouts
    from minigdpo import tools
    from rewards import calculator

    monkeypatch.setenv(async_rollouts.TOOL_SECONDS, "0.2")
    for slow in (async_rollouts.calculate, async_rollouts.calculate_async):
        assert slow.__name__ == "calculate"
        assert tools.schema(slow, slow.__name__) == tools.schema(calculator.calculate, "calculate")
        t0 = time.perf_counter()
        result = slow("23*45")
        result = asyncio.run(result) if inspect.iscoroutine(result) else result
        assert result == calculator.calculate("23*45") and time.perf_counter() - t0 >= 0.2
