"""LoRA against full fine-tuning on the CPU demo model: trainable parameters, peak memory, seconds per step.

    python benchmarks/lora_cpu.py                    # SmolLM2-135M-Instruct, --preset cpu-demo, rank 16
    python benchmarks/lora_cpu.py --rank 8 --reps 3

Both sides run train.py's --preset cpu-demo (B=4 prompts x G=8, 48 new tokens) with beta 0.04 (so the
reference pass runs) for --steps steps, each in its own process, alternating --reps times. Reported:
the trainable and total parameter counts train.py prints, the process's peak resident memory, and
the median of each timed phase over the steps after the first (warm-up). Sampling dominates a CPU step
and is the same work on both sides; the update phase is where LoRA differs (no gradients of the base
weights, AdamW over the adapters alone), and the reference pass (the policy with its adapters off,
no second model) is where memory differs.
"""

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PHASES = ("step", "generate", "logprob", "update")


def child(args):
    import contextlib
    import io

    import train
    from plot import read_run

    out = tempfile.mkdtemp(prefix="bench-lora-")
    argv = ["--preset", "cpu-demo", "--beta", "0.04", "--max-steps", str(args.steps), "--final-eval", "0",
            "--samples-every", "0", "--output-dir", out] + (["--lora-rank", str(args.child_rank)] if args.child_rank else [])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train.main(argv)
    counts = re.search(r"parameters: ([\d,]+), trainable: ([\d,]+)", printed.getvalue())
    rows = read_run(out)
    shutil.rmtree(out, ignore_errors=True)  # the run's last checkpoint: 2.2 GB for the demo model
    print("RESULT " + json.dumps({
        "total": int(counts.group(1).replace(",", "")), "trainable": int(counts.group(2).replace(",", "")),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "times": {k: [row[f"time/{k}"] for row in rows] for k in PHASES}}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=16, help="the LoRA rank to compare with full fine-tuning")
    p.add_argument("--steps", type=int, default=4, help="steps per run (the first is warm-up)")
    p.add_argument("--reps", type=int, default=2, help="alternating runs of each side")
    p.add_argument("--child-rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_rank is not None:
        return child(args)
    sides = {"full": 0, f"lora r{args.rank}": args.rank}
    results = {name: [] for name in sides}
    for rep in range(args.reps):
        for name in sides if rep % 2 == 0 else reversed(list(sides)):
            cmd = [sys.executable, __file__, "--child-rank", str(sides[name]), "--steps", str(args.steps)]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            r = json.loads(line[len("RESULT "):])
            results[name].append(r)
            print(f"rep {rep + 1} {name:<9} s/step {[round(t, 1) for t in r['times']['step']]}  "
                  f"peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
    print(f"\nSmolLM2-135M-Instruct, --preset cpu-demo, {args.reps} runs x {args.steps - 1} timed steps per side "
          f"(medians; the first step of each run left out)")
    print("| | trainable parameters | peak RSS | s/step | generate | logprob (reference) | update |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        med = {k: statistics.median(t for r in runs for t in r["times"][k][1:]) for k in PHASES}
        r = runs[0]
        print(f"| {name} | {r['trainable']:,} of {r['total']:,} ({100 * r['trainable'] / r['total']:.2f}%) | "
              f"{max(x['peak_rss_mb'] for x in runs):.0f} MB | {med['step']:.1f} | {med['generate']:.1f} | "
              f"{med['logprob']:.2f} | {med['update']:.2f} |")


if __name__ == "__main__":
    main()
