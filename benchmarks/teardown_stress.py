"""Teardown stress: launch short multi-rank runs many times and count the ones that abort at exit.

    python benchmarks/teardown_stress.py --kind smoke -n 100 --busy        # 2 ranks, beside a CPU hog
    python benchmarks/teardown_stress.py --kind two-node -n 100 --busy     # 2 nodes x 1 rank on 127.0.0.1
    python benchmarks/teardown_stress.py --kind both -n 100 --busy         # both, interleaved
    python benchmarks/teardown_stress.py --kind exits -n 20 --busy         # the error exits (below)

Kinds (each launch is the short smoke run of tests/test_reliability.py and tests/test_cluster.py:
tiny random model, checkpoint every step, about 10 s on 2 idle cores):
  smoke         torchrun --nproc_per_node 2 train.py --preset smoke --max-steps 4 --save-every 1 ...: exits 0
  two-node      the same run as 2 torchrun agents (--nnodes 2, one rank each) sharing an output dir: both exit 0
  config-error  2 ranks, --batch-size 12 (refused once the world size is known): exits 1, rank says "error:"
  save-stop     2 ranks, rank 1's checkpoint write fails at step 2 (MINIGDPO_FAULT=hf@2:enospc): exits 1
  sigterm       2 ranks, SIGTERM to torchrun once step 1 is logged: exits non-zero, nothing hangs
  export        2 ranks, tests/gather_main.py (build a sharded model, gather it for the export, exit: no
                training), the test that aborted this way twice in one full run of the suite under load
  exits         config-error, save-stop and sigterm; both: smoke and two-node

A launch is an abort when a rank died of SIGABRT: its stderr holds "terminate called", "Aborted",
"SIGABRT", "Signal 6" or torchrun's "exitcode  : -6". Any other unexpected exit code (or a hang
past --timeout, or a project traceback) is an "other failure". Each launch prints one line (exit
codes, seconds); an abort or failure prints every stderr of that launch in full. The last lines
are one summary per kind: launches, aborts, other failures, abort rate.

--busy runs CPU-burning processes (one per core unless --busy-procs) for the whole stress, as a
busy CI machine would. --env KEY=VALUE passes variables to the ranks (repeatable).
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.cluster_sim import ROOT, kill_tree, port, torchrun  # noqa: E402

REWARDS = ["--rewards", "tests.helpers:digit_frac,tests.helpers:vowel_frac,format"]
ABORT = re.compile(r"terminate called|Aborted|SIGABRT|Signal 6\b|exitcode\s*:\s*-6\b")
TRACEBACK = f'File "{ROOT}'  # a traceback through the project's own files


def train_args(steps, out):
    return [os.path.join(ROOT, "train.py"), "--preset", "smoke", "--max-steps", str(steps), "--save-every", "1",
            "--keep-checkpoints", "5", "--output-dir", out] + REWARDS


def start(commands, env):
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT, **env}
    return [subprocess.Popen(c, cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True) for c, cwd in commands]


def finish(procs, t0, timeout):
    """Wait for every process; returns ([exit code or 'hung'], [stdout], [stderr])."""
    codes, outs, errs = [], [], []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1, timeout - (time.monotonic() - t0)))
            codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            for q in procs:
                kill_tree(q.pid)
            out, err = p.communicate()
            codes.append("hung")
        outs.append(out)
        errs.append(err)
    return codes, outs, errs


def run_once(kind, tmp, args, env):
    """One launch of `kind` in the empty folder tmp; returns (codes, seconds, stdouts, stderrs, expected)."""
    out = os.path.join(tmp, "run")
    t0 = time.monotonic()
    if kind == "two-node":
        p = port()
        procs = start([(torchrun(2, i, 1, p, train_args(args.steps, out)), tmp) for i in range(2)], env)
        codes, outs, errs = finish(procs, t0, args.timeout)
        return codes, time.monotonic() - t0, outs, errs, lambda c: c == 0
    if kind == "export":
        procs = start([(torchrun(1, 0, 2, port(), [os.path.join(ROOT, "tests", "gather_main.py"),
                                                  os.path.join(tmp, "gather.json"), "fsdp"]), ROOT)], env)
        codes, outs, errs = finish(procs, t0, args.timeout)
        return codes, time.monotonic() - t0, outs, errs, lambda c: c == 0
    extra, env = [], dict(env)
    if kind == "config-error":
        extra = ["--batch-size", "12"]
    elif kind == "save-stop":
        env |= {"MINIGDPO_FAULT": "hf@2:enospc", "MINIGDPO_FAULT_RANK": "1"}
    procs = start([(torchrun(1, 0, 2, port(), train_args(args.steps, out) + extra), ROOT)], env)
    if kind == "sigterm":  # once rank 0 has logged a step, so the group and the bar exist
        metrics = os.path.join(out, "metrics.jsonl")
        while procs[0].poll() is None and time.monotonic() - t0 < args.timeout and not (
                os.path.exists(metrics) and os.path.getsize(metrics)):
            time.sleep(0.05)
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)
    codes, outs, errs = finish(procs, t0, args.timeout)
    expected = {"smoke": lambda c: c == 0, "config-error": lambda c: c == 1, "save-stop": lambda c: c == 1,
                "sigterm": lambda c: c not in (0, "hung")}[kind]
    return codes, time.monotonic() - t0, outs, errs, expected


def classify(kind, codes, outs, errs, expected):
    """'abort', 'failure' or 'ok', and a short note."""
    if any(ABORT.search(e) for e in errs) or -signal.SIGABRT in codes:
        return "abort", ""
    if not all(expected(c) for c in codes):
        return "failure", "unexpected exit code"
    if any(TRACEBACK in e for e in errs) and kind != "sigterm":
        return "failure", "project traceback"
    if kind == "config-error" and "error: " not in "".join(errs):
        return "failure", "no error line"
    if kind == "save-stop" and "stopped at step 2" not in "".join(errs):
        return "failure", "did not stop at step 2"
    return "ok", ""


def burners(n):
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", default="both",
                        choices=["smoke", "two-node", "both", "export", "config-error", "save-stop", "sigterm", "exits",
                                 "all"])
    parser.add_argument("-n", type=int, default=20, help="launches of each kind")
    parser.add_argument("--busy", action="store_true", help="run CPU-burning processes beside the launches")
    parser.add_argument("--busy-procs", type=int, default=os.cpu_count(), help="how many (default: one per core)")
    parser.add_argument("--steps", type=int, default=4, help="--max-steps of each run (a checkpoint at each)")
    parser.add_argument("--timeout", type=float, default=180, help="seconds before a launch counts as hung")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="for the ranks")
    args = parser.parse_args()
    kinds = {"both": ["smoke", "two-node"], "exits": ["config-error", "save-stop", "sigterm"],
             "all": ["smoke", "two-node", "export", "config-error", "save-stop", "sigterm"]}.get(args.kind, [args.kind])
    env = dict(kv.split("=", 1) for kv in args.env)

    def interrupt(signum, frame):  # Ctrl-C or kill (a background job ignores SIGINT): summary, burners gone
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    hogs = burners(args.busy_procs) if args.busy else []
    tally = {k: {"launches": 0, "abort": 0, "failure": 0, "seconds": 0.0} for k in kinds}
    try:
        for i in range(args.n):
            for kind in kinds:  # interleaved, so that every kind sees the same load over time
                with tempfile.TemporaryDirectory(prefix="teardown-") as tmp:
                    codes, seconds, outs, errs, expected = run_once(kind, tmp, args, env)
                verdict, note = classify(kind, codes, outs, errs, expected)
                t = tally[kind]
                t["launches"] += 1
                t["seconds"] += seconds
                if verdict != "ok":
                    t[verdict] += 1
                print(f"{kind:<12} #{i + 1:<4} exit codes {codes}  {seconds:6.1f} s  "
                      f"{verdict.upper() if verdict != 'ok' else 'ok'} {note}", flush=True)
                if verdict != "ok":
                    for j, (o, e) in enumerate(zip(outs, errs)):
                        print(f"----- {kind} #{i + 1} process {j} stderr -----\n{e}\n"
                              f"----- {kind} #{i + 1} process {j} stdout (last 2000) -----\n{o[-2000:]}", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    finally:
        for h in hogs:
            kill_tree(h.pid)
    for kind, t in tally.items():
        n = t["launches"]
        print(f"summary {kind:<12} launches {n:4d}  aborts {t['abort']:3d}  other failures {t['failure']:3d}  "
              f"abort rate {t['abort'] / max(n, 1):6.1%}  mean {t['seconds'] / max(n, 1):5.1f} s"
              f"{'  (busy: ' + str(args.busy_procs) + ' burners)' if args.busy else ''}", flush=True)
    sys.exit(1 if any(t["abort"] or t["failure"] for t in tally.values()) else 0)


if __name__ == "__main__":
    main()
