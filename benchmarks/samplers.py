"""The two samplers on the CPU demo's work, in one run: seconds per step by phase, tokens/s, log-prob gap.

    python benchmarks/samplers.py                 # cpu-demo, 4 steps per sampler (~3 minutes on 2 cores)
    python benchmarks/samplers.py --steps 6 --samplers hf,vllm,hf

Each sampler trains the cpu-demo recipe (SmolLM2-135M-Instruct, 4 prompts x 8 samples, 48 new tokens,
T=0.7; beta 0.04, as docs/results.md's figures were measured) for --steps steps from the same start, one
train.py after the other, their output captured; the
table gives the median over every step but the first (warm-up). --sampler vllm needs vLLM: the CPU
build here (tests/test_vllm_real.py says how to install it). Any other train.py flag passes through.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from plot import read_run  # noqa: E402

PHASES = ("generate", "reward", "logprob", "update", "sync", "step")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="train.py steps per sampler; the first is warm-up")
    p.add_argument("--samplers", default="hf,vllm", help="comma-separated, run in this order")
    p.add_argument("--preset", default="cpu-demo")
    args, train_args = p.parse_known_args(argv)
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step is warm-up)")
    rows = []
    for kind in args.samplers.split(","):
        out = tempfile.mkdtemp(prefix=f"bench-sampler-{kind}-")
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--preset", args.preset, "--sampler", kind,
               "--max-steps", str(args.steps), "--no-final-eval", "--save-every", "0", "--samples-every", "0",
               "--beta", "0.04", "--output-dir", out] + train_args
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-3000:]}")
        steps = read_run(out)[1:]
        med = {k: statistics.median(r[f"time/{k}"] for r in steps) for k in PHASES}
        rows.append((kind, med, statistics.median(r["throughput/gen_tokens_per_s"] for r in steps),
                     max(r["sampler/logp_gap"] for r in read_run(out)), time.perf_counter() - t0))
        shutil.rmtree(out, ignore_errors=True)  # the run's last checkpoint
    print(f"\n{args.preset}, median of {args.steps - 1} steps after warm-up (seconds per step)")
    print(f"{'sampler':<8}" + "".join(f"{k:>10}" for k in PHASES) + f"{'gen tok/s':>11}{'max gap':>10}{'run s':>8}")
    for kind, med, tps, gap, wall in rows:
        print(f"{kind:<8}" + "".join(f"{med[k]:>10.2f}" for k in PHASES) + f"{tps:>11.0f}{gap:>10.1e}{wall:>8.0f}")


if __name__ == "__main__":
    main()
