"""Sandbox cost: the overhead of one program run, and the throughput on a batch of 64 programs.

    python benchmarks/sandbox.py [--workers N]

A "program" is one of the built-in problems' reference solutions with its 3 tests, so one
program is 3 sandboxed runs, as when the code task scores a completion.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rewards.code import problems  # noqa: E402
from rewards.sandbox import SandboxPool, _describe, run_python  # noqa: E402

PROBLEMS = problems()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=os.cpu_count())
    args = p.parse_args()
    print(_describe())
    run_python("print(1)")  # warm the page cache
    sandboxed = [run_python("print(1)").seconds for _ in range(20)]
    t = time.perf_counter()
    for _ in range(20):
        os.system(f"{sys.executable} -I -S -c 'print(1)' > /dev/null")
    bare = (time.perf_counter() - t) / 20
    print(f"one run of print(1): {statistics.median(sandboxed) * 1000:.0f} ms sandboxed (median of 20), "
          f"{bare * 1000:.0f} ms for a bare interpreter start")
    jobs = [(p["solution"], p["tests"]) for p in (PROBLEMS * 3)[:64]]
    pool = SandboxPool(workers=args.workers)
    t = time.perf_counter()
    reports = pool.map_tests(jobs)
    dt = time.perf_counter() - t
    runs = sum(r.total for r in reports)
    print(f"64 programs ({runs} runs) on {args.workers} workers: {dt:.2f} s, {64 / dt:.1f} programs/s, "
          f"{runs / dt:.1f} runs/s; all passed: {all(r.passed == r.total for r in reports)}")


if __name__ == "__main__":
    main()
