"""Shared test setup: an isolated model cache, helpers to run train.py, and a one-process group."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process simulations (torchrun, several nodes, kills) and peer "
                                       "oracles; `pytest -m 'not slow'` leaves them out for a quick loop")


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """tiny-random is built once per test session into a private cache (subprocesses inherit it)."""
    os.environ.setdefault("MINIGDPO_CACHE", str(tmp_path_factory.mktemp("cache")))
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(2)
    return os.environ["MINIGDPO_CACHE"]


def mounted_tmpfs(path, size):
    """A real tmpfs of `size` (mount's size=, "3m") at `path`, yielded and unmounted after; skips without root."""
    os.makedirs(path)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path]).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    yield path
    subprocess.run(["umount", path])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, nproc=1, env=None, timeout=300, check=True):
    """Run train.py (or another script) as a user would: python or torchrun, from the repo root."""
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(free_port())] + args
    else:
        cmd = [sys.executable] + args
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def refused(proc):
    """The one-line error of a run that stopped with exit status 2 and no traceback."""
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def refusal(argv):
    """train.py's one-line refusal, in this process: the error its __main__ prints before exiting with status 2
    (test_train.py keeps one end-to-end launch that checks the exit status and the single line)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import train
    from minigdpo.config import ConfigError
    from minigdpo.data import DataError
    from minigdpo.vllm_sampler import SamplerUnavailable

    with pytest.raises((ConfigError, DataError, SamplerUnavailable)) as refused_with:
        train.run_training(argv)
    assert "\n" not in str(refused_with.value), str(refused_with.value)
    return str(refused_with.value)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def process_group():
    """A world-size-1 process group for in-process tests of FSDP2 code."""
    from minigdpo import dist

    return dist.init()


LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def process_group_survives():
    """What an in-process vLLM engine changes for the whole process, undone after each test: the sampler sets
    torchrun's variables when they are missing (vllm_sampler._ensure_launcher_env), which train.py launched
    by a later test would inherit; and the engine's shutdown destroys the default process group (eval.py shuts
    its engine down; the fake engine does what vLLM does, tests/fake_vllm.py), which is made again."""
    from minigdpo import dist

    env = {k: os.environ.get(k) for k in LAUNCHER_ENV}
    had = dist.mesh() is not None and dist.is_initialized()
    yield
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if had and not dist.is_initialized():
        dist.init()


def informative_groups_naive(rewards, weights, estimator, tol=1e-6, **options):
    """estimators.informative_groups' twin on nested lists: does some sample's group-level advantage exceed tol?"""
    from advantages_naive import TWINS

    groups = TWINS[estimator][1](rewards, weights, **options)
    return [any(abs(a) > tol for a in group) for group in groups]
