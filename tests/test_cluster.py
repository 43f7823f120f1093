"""The rules GPUs and clusters enforce, simulated on CPU: NCCL's device rule, a save failing on one
rank, two nodes with and without a shared output directory, HSDP over 2 simulated nodes x 2 ranks,
bf16 on 2 gloo ranks, and clean exits.

Every multi-rank run here has a deadline: a hang is a failure, never a stuck test.

Run: pytest tests/test_cluster.py   (about 4 minutes on 2 cores)
"""

import ast
import glob
import os
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.cluster_sim import kill_tree, torchrun
from conftest import ROOT, free_port, read_jsonl, run
from minigdpo import checkpoint, dist


SMOKE = ["--preset", "smoke", "--rewards", "tests.helpers:digit_frac,tests.helpers:vowel_frac,format"]


def launch(commands, timeout=120, env=None):
    """Start every command at once (one per simulated node), wait for all, kill all at the deadline.

    Returns [(returncode, stdout, stderr)] and the seconds the slowest took; a command still
    running at the deadline fails the test with what it printed."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT, **(env or {})}
    procs = [subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for cmd, cwd in commands]
    start, results = time.monotonic(), []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for q in procs:
                kill_tree(q.pid)
            out, err = p.communicate()
            pytest.fail(f"hung past {timeout} s: {' '.join(p.args)}\n{out[-2000:]}\n{err[-3000:]}")
        results.append((p.returncode, out, err))
    return results, time.monotonic() - start


def no_project_traceback(stderr):
    """torchrun prints its own traceback when a rank exits non-zero; the ranks themselves must not. A virtual
    environment inside the checkout (.venv, which .gitignore expects) holds torchrun's own frames."""
    import re

    return re.search(rf'File "{re.escape(ROOT)}/(?!\.venv/)', stderr) is None


def two_nodes(args, cwds, nproc=1):
    port = free_port()
    return [(torchrun(2, i, nproc, port, args), cwd) for i, cwd in enumerate(cwds)]


def hf_weights(out, step):
    return load_file(os.path.join(out, "checkpoints", f"step_{step:06d}", "hf", "model.safetensors"))


# NCCL's device rule -------------------------------------------------------------------------------

def project_files():
    """The trainer's code; benchmarks and tests probe FSDP2's and gloo's internals to measure them."""
    files = [os.path.join(ROOT, f) for f in ("train.py", "eval.py")]
    for folder in ("minigdpo", "rewards", "examples"):
        files += glob.glob(os.path.join(ROOT, folder, "*.py"))
    return files


def test_only_dist_py_touches_torch_distributed():
    """dist.py is the one door to collectives, so its placement rule covers the whole trainer. fsdp.py may use FSDP2's
    API (torch.distributed.fsdp, .tensor), whose collectives run inside torch, and nothing else of it."""
    offenders = []
    fsdp_api = ("torch.distributed.fsdp", "torch.distributed.tensor")
    for path in project_files():
        if path.endswith(os.path.join("minigdpo", "dist.py")):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
                names = [f"torch.{node.attr}"]
            if path.endswith(os.path.join("minigdpo", "fsdp.py")):
                names = [n for n in names if not n.startswith(fsdp_api)]
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
                offenders.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not offenders, offenders


@pytest.mark.slow  # launches torchrun or train.py
def test_every_collective_puts_its_tensors_on_the_training_device():
    (result,), _ = launch([(torchrun(1, 0, 2, free_port(), ["tests/nccl_rule.py"]), ROOT)], timeout=90)
    rc, out, err = result
    assert rc == 0, out + err[-3000:]
    assert out.split() == ["all_gather:", "ok", "all_reduce:", "ok", "barrier:", "ok", "full_tensor:", "ok", "bridge:",
                           "ok"]


# A save that fails on one rank --------------------------------------------------------------------

STEPS4 = ["train.py"] + SMOKE + ["--max-steps", "4", "--save-every", "1", "--keep-checkpoints", "5"]


@pytest.mark.parametrize("fault,rank", [
    ("hf@2:enospc", "1"),     # rank 1 fails in the Hugging Face export, which rank 0 writes
    ("hf@2:enospc", "0"),     # rank 0's export fails while rank 1 is ready for the sharded state
    ("state@2:enospc", "1"),  # rank 1's part of the sharded state cannot be written
])
@pytest.mark.slow  # launches torchrun or train.py
def test_a_save_failing_on_one_rank_stops_every_rank_within_seconds(tmp_path, fault, rank):
    out = str(tmp_path / "run")
    (result,), seconds = launch([(torchrun(1, 0, 2, free_port(), STEPS4 + ["--output-dir", out]), ROOT)],
                                env={"MINIGDPO_FAULT": fault, "MINIGDPO_FAULT_RANK": rank}, timeout=150)
    rc, stdout, stderr = result
    assert rc != 0 and seconds < 100
    errors = [line for line in stderr.splitlines() if "could not write checkpoint" in line]
    assert errors, stderr[-3000:]
    assert f"rank {rank}" in errors[0] and "step_000002.partial" in errors[0] and "No space left" in errors[0]
    assert no_project_traceback(stderr)
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step_000001"]  # the previous one, intact
    hf_weights(out, 1)
    assert [r["step"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))] == [1, 2]


@pytest.mark.slow  # launches torchrun or train.py
def test_a_save_failing_on_one_rank_can_continue_on_every_rank(tmp_path):
    out = str(tmp_path / "run")
    (result,), _ = launch([(torchrun(1, 0, 2, free_port(), STEPS4 + ["--output-dir", out, "--on-save-error",
                                                                       "continue"]), ROOT)],
                          env={"MINIGDPO_FAULT": "hf@2:enospc", "MINIGDPO_FAULT_RANK": "1"}, timeout=150)
    assert result[0] == 0, result[2][-3000:]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step_000001", "step_000003", "step_000004"]


# Two nodes ----------------------------------------------------------------------------------------

@pytest.mark.slow  # launches torchrun or train.py
def test_two_nodes_without_a_shared_output_dir_stop_before_any_weights_load(tmp_path):
    cwds = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    for c in cwds:
        os.makedirs(c)
    args = [os.path.join(ROOT, "train.py")] + SMOKE + ["--output-dir", "run"]  # relative: each node's own disk
    results, seconds = launch(two_nodes(args, cwds), timeout=120)
    for rc, _, stderr in results:
        assert rc != 0 and no_project_traceback(stderr), stderr[-3000:]
    errors = [line for _, _, e in results for line in e.splitlines() if line.startswith("error:")]
    assert errors and "is not the same directory on every node" in errors[0] and "rank 1" in errors[0], errors
    for c in cwds:
        assert not os.path.exists(os.path.join(c, "run", "checkpoints"))
        assert not os.path.exists(os.path.join(c, "run", "metrics.jsonl"))


@pytest.mark.slow  # launches torchrun or train.py
def test_two_nodes_given_different_output_dirs_stop_before_any_weights_load(tmp_path):
    """Each rank checks its own --output-dir, not rank 0's path: two directories on one machine are
    two directories, even when both nodes can read rank 0's."""
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    args = [os.path.join(ROOT, "train.py")] + SMOKE + ["--max-steps", "1"]
    commands = [(cmd + ["--output-dir", d], str(tmp_path)) for (cmd, _), d in zip(two_nodes(args, [None, None]), dirs)]
    results, _ = launch(commands, timeout=120)
    for rc, _, stderr in results:
        assert rc != 0 and no_project_traceback(stderr), stderr[-3000:]
    errors = [line for _, _, e in results for line in e.splitlines() if line.startswith("error:")]
    assert errors and "is not the same directory on every node" in errors[0] and "rank 1" in errors[0], errors
    for d in dirs:
        assert not os.path.exists(os.path.join(d, "checkpoints"))


@pytest.mark.slow  # launches torchrun or train.py
@pytest.mark.parametrize("sharding", ["fsdp", "hsdp"])
def test_gradients_cross_ranks_once_per_optimizer_step(tmp_path, sharding):
    """4 micro-batches: --reduce-grads micro_batch (the default) reduce-scatters after every micro-batch and holds
    a rank's shard of the gradients; step reduce-scatters each FSDP2 module's gradients once and holds them whole
    until then; HSDP all-reduces across nodes once in either mode. Both give the same update."""
    import json

    out = tmp_path / "counts.json"
    (result,), _ = launch([(torchrun(1, 0, 2, free_port(), ["tests/grad_reductions.py", str(out), sharding]), ROOT)])
    assert result[0] == 0, result[2][-3000:]
    counts = json.loads(out.read_text())
    assert counts["step"]["micro_batches"] == 4
    if sharding == "fsdp":
        assert {k: counts["step"][k] for k in ("reduce_scatter", "all_reduce")} == {"reduce_scatter": 1, "all_reduce": 0}
        assert counts["micro_batch"]["reduce_scatter"] == 4
        whole = counts["param_bytes_fp32"]  # rank 0: the whole fp32 gradient in step mode, half of it sharded
        assert counts["step"]["peak_grad_bytes"] >= whole and counts["micro_batch"]["peak_grad_bytes"] < 0.6 * whole
        from minigdpo.config import Config

        assert counts[Config().reduce_grads]["peak_grad_bytes"] < 0.6 * whole  # the default keeps them sharded
    else:  # 2 nodes of 1 rank: nothing to scatter within a node
        assert counts["step"]["all_reduce"] == counts["micro_batch"]["all_reduce"] == 1
    assert counts["param_diff"] < 1e-5


@pytest.mark.slow  # launches torchrun or train.py
def test_hsdp_mesh_groups_keep_the_world_timeout():
    """A mesh dimension's group gets the 30 minutes dist.init gives the world, not the backend's
    default (NCCL's is 10 minutes; tests/mesh_timeouts.py makes it so for gloo too)."""
    results, _ = launch(two_nodes(["tests/mesh_timeouts.py"], [ROOT, ROOT], nproc=2), timeout=120)
    assert all(rc == 0 for rc, _, _ in results), [e[-2000:] for _, _, e in results]
    assert results[0][1].split() == ["world=30", "replicate=30", "shard=30"], results[0][1]


@pytest.mark.slow  # launches torchrun or train.py
def test_a_checkpoint_missing_another_ranks_shards_is_never_marked_complete(tmp_path):
    """Rank 0 marks a checkpoint complete only once it sees every file DCP's metadata lists."""
    (result,), _ = launch([(torchrun(1, 0, 2, free_port(), ["tests/split_save.py", str(tmp_path)]), ROOT)], timeout=120)
    rc, out, err = result
    assert rc == 0, err[-3000:]
    lines = sorted(out.splitlines())
    assert len(lines) == 2 and all("error: could not write checkpoint" in line for line in lines), out
    assert "rank 0: rng/rank1.pt, state/__1_0.distcp missing" in lines[0], lines[0]
    assert checkpoint.latest(str(tmp_path / "rank0")) is None
    assert not os.path.exists(tmp_path / "rank0" / "checkpoints" / "step_000001")


@pytest.mark.slow  # launches torchrun or train.py
def test_two_nodes_sharing_an_output_dir_train_save_kill_and_resume(tmp_path):
    shared, clean = str(tmp_path / "shared"), str(tmp_path / "clean")
    args = [os.path.join(ROOT, "train.py")] + STEPS4[1:]
    cwds = [str(tmp_path), str(tmp_path)]
    killed, _ = launch(two_nodes(args + ["--output-dir", shared], cwds), timeout=150,
                       env={"MINIGDPO_FAULT": "prepare@3", "MINIGDPO_FAULT_RANK": "1"})
    assert all(rc != 0 for rc, _, _ in killed)
    assert "step_000003" not in os.listdir(os.path.join(shared, "checkpoints"))
    resumed, _ = launch(two_nodes(args + ["--output-dir", shared, "--resume"], cwds), timeout=150)
    assert all(rc == 0 for rc, _, _ in resumed), [(rc, e[-3000:]) for rc, _, e in resumed if rc]
    assert "resumed from" in resumed[0][1] and "at step 2" in resumed[0][1] and "mesh=(2, 1)" in resumed[0][1]
    uninterrupted, _ = launch(two_nodes(args + ["--output-dir", clean], cwds), timeout=150)
    assert all(rc == 0 for rc, _, _ in uninterrupted)
    a, b = hf_weights(shared, 4), hf_weights(clean, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in read_jsonl(os.path.join(shared, "metrics.jsonl"))] == [1, 2, 3, 4]


# HSDP ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sharding,world,local,shape", [
    ("auto", 8, 8, (8,)), ("auto", 16, 8, (2, 8)), ("auto", 4, 2, (2, 2)), ("fsdp", 16, 8, (16,)),
    ("hsdp", 16, 8, (2, 8)), ("hsdp", 8, 8, (1, 8)), ("auto", 1, 1, (1,)),
])
def test_mesh_shape_replicates_across_nodes_and_shards_within(sharding, world, local, shape):
    assert dist.mesh_shape(sharding, world, local) == shape


@pytest.mark.slow  # launches torchrun or train.py
def test_hsdp_over_two_nodes_gives_the_same_update_as_the_flat_mesh(tmp_path):
    outs = {}
    for sharding in ("hsdp", "fsdp"):
        out = str(tmp_path / f"{sharding}.pt")
        results, _ = launch(two_nodes(["tests/dist_update.py", out, "token_mean", sharding], [ROOT, ROOT], nproc=2),
                            timeout=180)
        assert all(rc == 0 for rc, _, _ in results), results[0][2][-3000:] + results[1][2][-3000:]
        outs[sharding] = torch.load(out)
    assert outs["hsdp"]["mesh"] == (2, 2) and outs["fsdp"]["mesh"] == (4,)
    a, b = outs["hsdp"]["params"], outs["fsdp"]["params"]
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert a.keys() == b.keys() and diff < 1e-5, diff
    print(f"HSDP vs flat mesh, max |param difference| after one update: {diff:.2e}")


# bf16, clean exits, CPU offload --------------------------------------------------------------------

@pytest.mark.slow  # launches torchrun or train.py
def test_bf16_on_two_ranks_trains_saves_and_resumes(tmp_path):
    out = str(tmp_path / "run")
    common = ["train.py"] + SMOKE + ["--dtype", "bf16", "--save-every", "1", "--output-dir", out]
    fresh = {"MINIGDPO_CACHE": str(tmp_path / "cache")}  # both ranks build the tiny model at once
    run(common, nproc=2, env=fresh)
    proc = run(common + ["--max-steps", "3", "--resume"], nproc=2, env=fresh)
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["grad_norm"] > 0 and r["loss"] == r["loss"] for r in rows)
    assert all(t.dtype == torch.float32 for t in hf_weights(out, 3).values())  # fp32 master weights, exactly saved


CLEANUP_CHECK = r"""
import os, sys, torch.distributed, train


def group_threads():  # gloo's pt_gloo_runloop worker threads still alive in this process (Linux)
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop" for t in os.listdir("/proc/self/task"))


try:
    train.main(sys.argv[1:])
except (SystemExit, Exception) as e:
    sys.stdout.write(f"exited: {type(e).__name__}\n")
# One write: ranks share the pipe. The group's worker threads must be gone too: one alive at
# interpreter exit can abort the process (dist.cleanup says how).
sys.stdout.write(f"group alive: {torch.distributed.is_initialized()}, worker threads: {group_threads()}\n")
"""


@pytest.mark.parametrize("nproc,flags,fault", [
    (2, ["--max-steps", "2"], None),             # the normal end
    (2, ["--batch-size", "12"], None),           # a config error found once the world size is known
    (1, ["--save-every", "1"], "hf@1:enospc"),   # a failed save that stops the run
    (2, ["--save-every", "1"], "hf@1:enospc"),   # the same on 2 ranks (rank 0's save fails)
])
@pytest.mark.slow  # launches torchrun or train.py
def test_every_exit_destroys_the_process_group_and_its_threads(tmp_path, nproc, flags, fault):
    script = tmp_path / "check.py"
    script.write_text(CLEANUP_CHECK)
    args = [str(script)] + SMOKE + ["--output-dir", str(tmp_path / "run")] + flags
    proc = run(args, nproc=nproc, env={"PYTHONPATH": ROOT, **({"MINIGDPO_FAULT": fault} if fault else {})}, check=False)
    assert proc.stdout.count("group alive: False, worker threads: 0") == nproc, proc.stdout + proc.stderr[:3000]


@pytest.mark.slow  # launches torchrun or train.py
def test_ref_offload_works_without_an_accelerator(tmp_path):
    proc = run(["train.py"] + SMOKE + ["--ref-offload", "--output-dir", str(tmp_path / "run")], check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow  # launches torchrun
def test_exchange_objects_delivers_each_object_to_its_rank_alone(tmp_path):
    """Dynamic sampling deals the chosen groups out with dist.exchange_objects: rank r gets only what was sent
    to it (all_gather_object, before, gave every rank every chosen group)."""
    script = tmp_path / "exchange.py"
    script.write_text(f"import sys; sys.path.insert(0, {ROOT!r})\n" + (
        "from minigdpo import dist\n"
        "dist.init()\n"
        "r, w = dist.rank(), dist.world_size()\n"
        "got = dist.exchange_objects([{'from': r, 'to': d, 'pad': 'x' * (1000 * r + d)} for d in range(w)])\n"
        "assert got == [{'from': s, 'to': r, 'pad': 'x' * (1000 * s + r)} for s in range(w)], got\n"
        "print('ok')\n"
        "dist.cleanup()\n"))
    (result,), _ = launch([(torchrun(1, 0, 2, free_port(), [str(script)]), ROOT)], timeout=90)
    assert result[0] == 0 and result[1].count("ok") == 2, result[2][-3000:]  # one line from each rank
