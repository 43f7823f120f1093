"""The cluster's rules, simulated on this CPU machine: exit codes and seconds for each scenario.

    python benchmarks/cluster_sim.py            # every scenario, about 5 minutes on 2 cores
    python benchmarks/cluster_sim.py --only full_disk

Scenarios (the short versions of each run in tests/test_cluster.py):
  nccl_rule        every collective wrapper places its tensors on the training device ("meta:gloo" group)
  per_node_dirs    2 nodes x 1 rank, each node with its own output dir: both stop before any weights load
  shared_dir       2 nodes sharing one output dir: train, save, SIGKILL on node 1, --resume, finish; the
                   weights equal an uninterrupted 2-node run's
  full_disk        2 nodes, node 1's checkpoint folder on a real 1 MB tmpfs (room for one checkpoint's shard, not two) in its own mount namespace
                   (needs root): every rank stops together, the previous checkpoint intact
  bf16             --dtype bf16 on 2 gloo ranks: train, save, resume, finish
  hsdp             4 ranks as 2 nodes x 2: one update under HSDP and under the flat mesh; parameter difference
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = [os.path.join(ROOT, "train.py"), "--preset", "smoke", "--max-steps", "4", "--save-every", "1",
         "--keep-checkpoints", "5"]


def port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nnodes, node_rank, nproc, master_port, args):
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node_rank", str(node_rank),
            "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(master_port)] + args


def kill_tree(pid):
    """SIGKILL a process and all its descendants. torchrun starts each rank in a session of its
    own, so killing torchrun's process group would leave the ranks running, holding our pipes."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launch(commands, env=None, timeout=300):
    """Run the commands at once; returns ([exit code per command], seconds, [stderr]). A hang is exit 'hung'."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **(env or {})}
    t0 = time.monotonic()
    procs = [subprocess.Popen(c, cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for c, cwd in commands]
    codes, errs = [], []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1, timeout - (time.monotonic() - t0)))
            codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            for q in procs:
                kill_tree(q.pid)
            _, err = p.communicate()
            codes.append("hung")
        errs.append(err)
    return codes, time.monotonic() - t0, errs


def two_nodes(args, cwds, nproc=1, wrap=(None, None)):
    p = port()
    return [((w or []) + torchrun(2, i, nproc, p, args), cwd) for i, (cwd, w) in enumerate(zip(cwds, wrap))]


def first_error(errs):
    lines = [ln for e in errs for ln in e.splitlines() if ln.startswith("error:")]
    return lines[0] if lines else "(no error line)"


def report(name, codes, seconds, note=""):
    print(f"{name:<28} exit codes {codes}  {seconds:6.1f} s  {note}", flush=True)


def nccl_rule(tmp):
    codes, s, _ = launch([(torchrun(1, 0, 2, port(), ["tests/nccl_rule.py"]), ROOT)])
    report("nccl_rule", codes, s)


def per_node_dirs(tmp):
    cwds = [os.path.join(tmp, "node0"), os.path.join(tmp, "node1")]
    for c in cwds:
        os.makedirs(c)
    codes, s, errs = launch(two_nodes(TRAIN + ["--output-dir", "run"], cwds))
    report("per_node_dirs", codes, s, first_error(errs))


def shared_dir(tmp):
    shared, clean = os.path.join(tmp, "shared"), os.path.join(tmp, "clean")
    cwds = [tmp, tmp]
    codes, s, _ = launch(two_nodes(TRAIN + ["--output-dir", shared], cwds),
                         env={"MINIGDPO_FAULT": "prepare@3", "MINIGDPO_FAULT_RANK": "1"})
    report("shared_dir: kill at step 3", codes, s)
    codes, s, _ = launch(two_nodes(TRAIN + ["--output-dir", shared, "--resume"], cwds))
    report("shared_dir: --resume", codes, s)
    codes, s, _ = launch(two_nodes(TRAIN + ["--output-dir", clean], cwds))
    a, b = (load_file(os.path.join(d, "checkpoints", "step_000004", "hf", "model.safetensors")) for d in (shared, clean))
    same = all(torch.equal(a[k], b[k]) for k in a)
    report("shared_dir: uninterrupted", codes, s, f"resumed weights {'identical' if same else 'DIFFER'}")


def full_disk(tmp):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        print("full_disk: skipped (needs root and unshare)")
        return
    out = os.path.join(tmp, "run")
    ckpt = os.path.join(out, "checkpoints")
    os.makedirs(ckpt)
    # Node 1 sees its own 1 MB tmpfs (room for one checkpoint's shard, not two) at the checkpoint folder; node 0 and the rest of out/ are shared.
    small = ["unshare", "-m", "--propagation", "private", "sh", "-c",
             f'mount -t tmpfs -o size=1m tmpfs "{ckpt}" && exec "$0" "$@"']
    codes, s, errs = launch(two_nodes(TRAIN + ["--output-dir", out], [tmp, tmp], wrap=(None, small)))
    kept = sorted(os.listdir(ckpt))
    report("full_disk on node 1", codes, s, f"{first_error(errs)} | node 0 keeps {kept}")


def bf16(tmp):
    out = os.path.join(tmp, "bf16")
    args = TRAIN + ["--dtype", "bf16", "--output-dir", out, "--max-steps", "2"]
    codes, s, _ = launch([(torchrun(1, 0, 2, port(), args), ROOT)])
    report("bf16: 2 steps", codes, s)
    codes, s, _ = launch([(torchrun(1, 0, 2, port(), args[:-2] + ["--max-steps", "4", "--resume"]), ROOT)])
    report("bf16: --resume to step 4", codes, s)


def hsdp(tmp):
    outs = {}
    for sharding in ("hsdp", "fsdp"):
        path = os.path.join(tmp, f"{sharding}.pt")
        codes, s, _ = launch(two_nodes(["tests/dist_update.py", path, "token_mean", sharding], [ROOT, ROOT], nproc=2))
        report(f"hsdp: one update, {sharding}", codes, s)
        outs[sharding] = torch.load(path)
    a, b = outs["hsdp"]["params"], outs["fsdp"]["params"]
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"hsdp: meshes {outs['hsdp']['mesh']} vs {outs['fsdp']['mesh']}, max |param difference| {diff:.3e}")


SCENARIOS = {f.__name__: f for f in (nccl_rule, per_node_dirs, shared_dir, full_disk, bf16, hsdp)}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=list(SCENARIOS), action="append")
    args = parser.parse_args()
    for name in args.only or SCENARIOS:
        with tempfile.TemporaryDirectory() as tmp:
            SCENARIOS[name](tmp)
