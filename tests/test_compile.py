"""--compile: each decoder layer compiled (torch.compile, dynamic shapes, inductor on the CPU) computes what the
eager layer computes: the same log-probs and gradients in fp32, packed and padded, with and without activation
checkpointing, a sliding window included; and train.py gives the same update compiled and eager, on 1 rank and on
2 gloo ranks (FSDP2's hooks around the compiled region). What auto resolves to, for --compile and
--grad-checkpointing, on a CPU and on a GPU.

Run: pytest tests/test_compile.py   (about 2 minutes on 2 cores: compiling is most of it)
"""

import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import read_jsonl, run
from minigdpo import logprobs
from test_policy import batches, tiny_of


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_compiled_layer_gives_the_eager_log_probs_and_gradients(layout, checkpointing):
    lm = tiny_of("qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1)  # both kinds of layer
    if checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.train()
    model = logprobs.LogProbModel(lm)
    mbs = batches(seed=7, size=4, prompts=3, pack=layout == "packed")  # 3 micro-batches of other shapes

    def run_all():
        out = []
        for mb in mbs:
            logp = model(mb, 0.8, 5)
            (logp * torch.arange(logp.shape[1])).sum().backward()
            out.append((logp.detach(), [p.grad.clone() for p in lm.parameters()]))
            lm.zero_grad()
        return out

    eager = run_all()
    model.compile_layers()
    for (want, want_grads), (got, grads) in zip(eager, run_all()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def step_of(tmp_path, name, compile, nproc):
    out = str(tmp_path / name)
    run(["train.py", "--preset", "smoke", "--max-steps", "2", "--compile", compile, "--output-dir", out,
         "--save-every", "0", "--grad-checkpointing", "true", "--rewards", "tests.helpers:digit_frac,tests.helpers:vowel_frac"],
        nproc=nproc, timeout=600)
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    return rows, load_file(os.path.join(out, "checkpoints", "step_000002", "hf", "model.safetensors"))


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_train_compiled_takes_the_eager_steps(tmp_path, nproc):
    (eager, we), (compiled, wc) = step_of(tmp_path, "eager", "false", nproc), step_of(tmp_path, "compiled", "true", nproc)
    for a, b in zip(eager, compiled):
        for key in ("loss", "kl", "grad_norm", "entropy", "sampler/logp_gap"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    for name in we:
        torch.testing.assert_close(wc[name], we[name], atol=1e-5, rtol=1e-4)


def built_with(monkeypatch, tmp_path, device, flags=()):
    """(compile, gradient checkpointing) as train.py builds the policy on `device`: run as far as the build."""
    import train
    from minigdpo import dist, policy

    asked = []

    class Built(Exception):
        pass

    def build(path, device, dtype, grad_checkpointing, compile=False, **kwargs):
        asked.append((compile, grad_checkpointing))
        raise Built

    real_init = dist.init

    def init_calling_itself(*args, **kwargs):  # the process group is the CPU's; the device train.py sees may not be
        real_init(*args, **kwargs)
        return torch.device(device)

    monkeypatch.setattr(dist, "init", init_calling_itself)
    monkeypatch.setattr(policy, "build", build)
    with pytest.raises(Built):
        train.run_training(["--preset", "smoke", "--output-dir", str(tmp_path), "--no-final-eval", *flags])
    dist.cleanup()
    return asked[0]


def test_auto_leaves_the_layers_eager_on_a_gpu_too(monkeypatch, tmp_path):
    """--compile auto compiles nowhere: on an H200 the first compiled update of an 8-layer model had not finished
    when the benchmark's call ended, against 12.8 s eager (docs/performance.md). train.py is run as far as the
    policy's build, on a device that calls itself CUDA."""
    assert built_with(monkeypatch, tmp_path, "cuda")[0] is False


@pytest.mark.parametrize("device,flags,recompute", [("cpu", [], True), ("cuda", [], False),
                                                    ("cuda", ["--grad-checkpointing", "true"], True),
                                                    ("cpu", ["--grad-checkpointing", "false"], False)])
def test_gradient_checkpointing_auto_is_on_on_a_cpu_only(monkeypatch, tmp_path, device, flags, recompute):
    """--grad-checkpointing auto: on where it was measured smaller and no slower (a CPU: docs/performance.md), off
    on a GPU; a value given is kept."""
    assert built_with(monkeypatch, tmp_path, device, flags)[1] is recompute
