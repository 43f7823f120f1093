"""Asynchronous rollouts against a slow judge and a slow tool: wall-clock and s/step at --async-steps 0, 1 and 2.

- demo: `python train.py --preset cpu-demo --max-steps 5 --no-final-eval`, its three rewards plus a TRL-style judge
  that waits --judge-seconds (10) per call, as an API judge does (one call per rank and step, TRL's batch call);
- agent: the calculator task with a tool that waits --tool-seconds (2) per call before it answers, as a sandbox or a
  network tool does, on the model --agent-model names (default: the cpu-agent preset's), --agent-steps steps; a sync
  tool by default (its calls wait one after another), `--tool-kind async` for the same tool as `async def`.

Each run is a fresh train.py process on this machine, one after the other; the wall-clock is the training command's
own, start-up and checkpoint included. The table's ratio is each run's wall-clock over the K = 0 run's.
`--placements colocated,split` adds the split placement: 2 ranks under torchrun, one training and one sampling
(`--sampler-ranks 1`), one thread each (torchrun's default), against the same colocated K = 0 run.

    python benchmarks/async_rollouts.py                           # both parts (about 30 minutes on 2 cores)
    python benchmarks/async_rollouts.py --parts demo --json out.json
    python benchmarks/async_rollouts.py --parts demo --placements colocated,split
    python benchmarks/async_rollouts.py --parts agent --tool-kind async
"""

import argparse
import asyncio
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

from rewards import calculator  # the installed project's (pip install -e .)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JUDGE_SECONDS = "MINIGDPO_BENCH_JUDGE_SECONDS"
TOOL_SECONDS = "MINIGDPO_BENCH_TOOL_SECONDS"


def waiting_judge(completions, **kwargs):
    """A TRL-style judge that waits a fixed time per call, then gives every completion 1 (it adds nothing to learn:
    a constant reward's z-scores are 0), as a remote judge's latency would hold a step."""
    time.sleep(float(os.environ.get(JUDGE_SECONDS, "10")))
    return [1.0] * len(completions)


# The calculator task's tool after a wait (a sandbox's or a network's), under the tool's own name, description and
# schema: the cpu-agent model was warmed to call `calculate`, and a call to any other name fails at once, unwaited.
@functools.wraps(calculator.calculate)
def calculate(expression):
    time.sleep(float(os.environ.get(TOOL_SECONDS, "2")))
    return calculator.calculate(expression)


# The same as an async tool (--tool-kind async): a round's calls wait side by side on the run's event loop.
@functools.wraps(calculator.calculate)
async def calculate_async(expression):
    await asyncio.sleep(float(os.environ.get(TOOL_SECONDS, "2")))
    return calculator.calculate(expression)


TOOLS = {"sync": "calculate", "async": "calculate_async"}
PARTS = {
    "demo": lambda args: ["--preset", "cpu-demo", "--max-steps", str(args.demo_steps), "--no-final-eval",
                          "--rewards", "correct,integer,format,benchmarks.async_rollouts:waiting_judge"],
    "agent": lambda args: ["--preset", "cpu-agent", *(["--model", args.agent_model] if args.agent_model else []),
                           "--tools", f"benchmarks.async_rollouts:{TOOLS[args.tool_kind]}",
                           "--max-steps", str(args.agent_steps),
                           "--no-final-eval", "--rewards", "solved,answer_tag,tool_economy"],
}


def one(part, K, args, work, placement="colocated"):
    """(wall-clock seconds, metrics rows) of one training command."""
    out = os.path.join(work, f"{part}-k{K}-{placement}")
    env = {**os.environ, JUDGE_SECONDS: str(args.judge_seconds), TOOL_SECONDS: str(args.tool_seconds)}
    launch = [sys.executable] if placement == "colocated" else [sys.executable, "-m", "torch.distributed.run",
                                                                "--nproc_per_node", "2"]
    cmd = [*launch, "train.py", *PARTS[part](args), "--async-steps", str(K), "--output-dir", out, "--save-every", "0",
           *(["--sampler-ranks", "1"] if placement == "split" else [])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return wall, [json.loads(line) for line in f]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="demo,agent")
    p.add_argument("--ks", default="0,1,2")
    p.add_argument("--placements", default="colocated", help="colocated, split, or both (comma-separated)")
    p.add_argument("--judge-seconds", type=float, default=10.0)
    p.add_argument("--tool-seconds", type=float, default=2.0)
    p.add_argument("--tool-kind", choices=sorted(TOOLS), default="sync", help="the agent part's tool: def or async def")
    p.add_argument("--demo-steps", type=int, default=5)
    p.add_argument("--agent-steps", type=int, default=5)
    p.add_argument("--agent-model", default="", help="the agent part's model (default: the cpu-agent preset's)")
    p.add_argument("--json", default="")
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as work:
        for part in args.parts.split(","):
            base = None
            for placement, K in [(pl, K) for pl in args.placements.split(",") for K in map(int, args.ks.split(","))]:
                wall, rows = one(part, K, args, work, placement)
                base = base or wall
                per_step = [r["time/step"] for r in rows]
                row = {"part": part, "placement": placement, "K": K, "wall_s": wall, "ratio": wall / base, "steps": len(rows),
                       "s_per_step": sum(per_step) / len(per_step),
                       "wait_sampler_s": sum(r.get("time/wait_sampler", 0) for r in rows),
                       "wait_trainer_s": sum(r.get("time/wait_trainer", 0) for r in rows),
                       "staleness_max": max(r.get("async/staleness_max", 0) for r in rows)}
                results.append(row)
                print(f"{part:<6} {placement:<9} K={K}  {wall:7.1f} s  ({row['ratio']:.2f}x of K=0)  {row['s_per_step']:6.1f} s/step  "
                      f"trainer waited {row['wait_sampler_s']:6.1f} s, sampler {row['wait_trainer_s']:6.1f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"judge_seconds": args.judge_seconds, "tool_seconds": args.tool_seconds, "runs": results}, f,
                      indent=2)


if __name__ == "__main__":
    main()
