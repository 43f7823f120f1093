"""Soak test: about 300 training steps of the tiny model, watching the trainer's memory and files.

    python benchmarks/soak.py [--steps 300] [--nproc 1]

It runs train.py as a user would (checkpoints every 50 steps, samples every 10, misbehaving
rewards included so the error paths run too) and reads the trainer's resident memory (VmRSS)
and open file descriptors from /proc at step 50 (after warm-up) and at the last step.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    out = tempfile.mkdtemp(prefix="minigdpo-soak-")
    rewards = "correct,format,tests.helpers:digit_frac,tests.helpers:raises,tests.helpers:nan_or_inf"
    cmd = [sys.executable, "train.py", "--preset", "smoke", "--max-steps", str(args.steps + 5), "--save-every", "50",
           "--samples-every", "10", "--rewards", rewards, "--output-dir", out]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marks, seen, t0 = {}, 0, time.time()
    metrics = os.path.join(out, "metrics.jsonl")
    while proc.poll() is None and len(marks) < 4:
        if os.path.exists(metrics):
            with open(metrics) as f:
                seen = sum(1 for _ in f)
        for mark in (10, 50, args.steps // 2, args.steps):
            if seen >= mark and mark not in marks:
                marks[mark] = (rss_mb(proc.pid), fds(proc.pid), time.time() - t0)
        time.sleep(0.05)
    proc.wait()
    with open(metrics) as f:
        rows = [json.loads(line) for line in f]
    print(f"{len(rows)} steps in {time.time() - t0:.0f} s, exit code {proc.returncode}")
    print(f"{'step':>6} {'RSS MB':>8} {'open fds':>9} {'seconds':>8}")
    for mark, (rss, n, t) in sorted(marks.items()):
        print(f"{mark:>6} {rss:>8.1f} {n:>9} {t:>8.1f}")
    a, b = marks.get(50), marks.get(args.steps)
    if a and b:
        print(f"RSS growth from step 50 to {args.steps}: {100 * (b[0] - a[0]) / a[0]:+.1f}%; fds {a[1]} -> {b[1]}")


if __name__ == "__main__":
    main()
