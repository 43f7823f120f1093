"""The update with and without padding, side by side: its time, its peak memory and its loss, on the CPU.

    python benchmarks/padding_free.py                   # both workloads below, 3 runs of each variant (~10 min)
    python benchmarks/padding_free.py --workload demo   # the CPU demo's first step only (needs the demo model)
    python benchmarks/padding_free.py --workload spread --runs 1 --layers 2 --hidden 64   # seconds

Workloads:
- demo: the CPU demo's first-step completions (SmolLM2-135M-Instruct, 4 arith prompts x G=8 sampled as
  `train.py --preset cpu-demo` samples its step 1), micro-batches of 16 sequences, as the demo runs them;
- spread: a GSM8K-like spread of lengths on a random Qwen2 small enough for this CPU (--layers x --hidden):
  2 prompts of 150 tokens x G=8 completions of 100-1,000 tokens (uniform), micro-batches of 8 sequences.

Variants, each run in a process of its own from the same starting weights: `padded` (--padding-free false: rows
padded to the longest completion, each prompt once, the shared-prefix pass), `packed` (--padding-free true), and
on the spread `packed, tokens` (--micro-batch-tokens: whole groups up to the tokens 8 sequences hold on average).
Each process builds the policy (fp32), runs the reference pass, then times one update (--loss-agg dapo, whose loss
does not depend on how the tokens are cut); peak memory is the rise of its peak RSS over the update (VmHWM, reset
first). The table gives the medians over --runs runs, the padding share of the positions computed, and the loss.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from minigdpo import dist, models, policy  # noqa: E402
from minigdpo.cli import parse_args  # noqa: E402
from minigdpo.config import Config, resolve  # noqa: E402
from minigdpo.microbatch import cut  # noqa: E402
from minigdpo.sampler import Completion  # noqa: E402
from minigdpo.update import fill_logprobs, optimizer, scheduler, update  # noqa: E402


def peak_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def demo_workload(path):
    """The CPU demo's step 1, sampled as train.py samples it (minigdpo/rollout.py), with its GDPO advantages."""
    from minigdpo.advantages import gdpo
    from minigdpo.rollout import rollout, step_prompts
    from minigdpo.vllm_sampler import make_sampler
    from minigdpo.scoring import RewardScorer
    from rewards import PromptOrder, load_task

    cfg = parse_args(["--preset", "cpu-demo", "--beta", "0.04"])
    task = load_task(cfg.task, cfg.data, "train", False, {"arith_difficulty": cfg.arith_difficulty})
    sizes = resolve(cfg, 1, len(task.examples), (1,))
    tokenizer = models.load_tokenizer(path)
    lm = models.load_model(path)
    stop = models.stop_token_ids(lm.config, lm.generation_config, tokenizer)
    torch.manual_seed(cfg.seed)
    sampler = make_sampler("hf", path, torch.device("cpu"), tokenizer, stop, torch.float32, seed=cfg.seed)
    examples, seed = step_prompts(1, 0, PromptOrder(len(task.examples), cfg.seed), task, cfg, sizes)
    sampled = rollout(examples, seed, tokenizer, sampler, RewardScorer(task.rewards), cfg, {})
    adv = gdpo(sampled.rewards, None).float()
    return {"pad_id": tokenizer.pad_token_id, "max_new_tokens": cfg.max_new_tokens, "size": cfg.micro_batch_size,
            "groups": [(p, [(c.token_ids, c.logprobs) for c in cs], a.tolist())
                       for p, cs, a in zip(sampled.prompts, sampled.completions, adv)]}


def spread_workload(seed=0):
    g = torch.Generator().manual_seed(seed)
    groups = []
    for _ in range(2):
        prompt = torch.randint(0, 250, (150,), generator=g).tolist()
        comps = [torch.randint(0, 250, (int(n),), generator=g).tolist() for n in torch.randint(100, 1001, (8,), generator=g)]
        groups.append((prompt, [(c, [-1.0] * len(c)) for c in comps], torch.randn(8, generator=g).tolist()))
    return {"pad_id": 257, "max_new_tokens": 1000, "size": 8, "groups": groups}


def child(path, work, padding_free, budget):
    """One update in this process; prints its figures as one JSON line."""
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", torch.get_num_threads())))
    device = dist.init()
    cfg = Config(num_iterations=1, temperature=1.0, beta=0.04, loss_agg="token_mean", micro_batch_size=work["size"],
                 micro_batch_tokens=budget, max_new_tokens=work["max_new_tokens"])
    model = policy.build(path, device, torch.float32)
    ref = policy.build(path, device, torch.float32, frozen=True)
    groups = [(p, [Completion(ids, lps) for ids, lps in cs], torch.tensor(a)) for p, cs, a in work["groups"]]
    batches = cut(groups, cfg, work["pad_id"], device, "packed" if padding_free else "padded")
    t0 = time.perf_counter()
    fill_logprobs(ref, batches, "ref_logp", cfg, reshard=True)
    ref_s = time.perf_counter() - t0
    opt = optimizer(model, 1e-5, 0.0)
    sched = scheduler(opt, 1, 0.0, "constant")
    reset_peak()
    before = peak_mb()
    t0 = time.perf_counter()
    totals = update(model, opt, sched, batches, cfg)
    seconds = time.perf_counter() - t0
    real = sum(mb.real_tokens() for mb in batches)
    computed = sum(mb.model_tokens() for mb in batches)
    print(json.dumps({"update_s": seconds, "ref_s": ref_s, "peak_mb": peak_mb() - before, "loss": totals["loss"].item(),
                      "kl": totals["kl"].item(), "micro_batches": len(batches), "padding": 1 - real / computed,
                      "tokens_per_micro_batch": computed / len(batches)}))


def run_variants(name, path, work, variants, runs, out):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(work, f)
    results = {v[0]: [] for v in variants}
    for _ in range(runs):  # alternate the variants, so that a slower minute of the machine hits both
        for label, padding_free, budget in variants:
            proc = subprocess.run([sys.executable, __file__, "--child", path, f.name, str(int(padding_free)), str(budget)],
                                  capture_output=True, text=True, cwd=ROOT)
            if proc.returncode:
                raise SystemExit(proc.stderr[-3000:])
            results[label].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    os.unlink(f.name)
    base = statistics.median(r["update_s"] for r in results[variants[0][0]])
    print(f"\n{name}: {len(work['groups'])} groups, {runs} run(s) per variant, medians")
    print(f"{'variant':<16} {'update s':>9} {'speed-up':>9} {'ref pass s':>10} {'peak MB':>8} {'padding':>8} "
          f"{'tok/mb':>7} {'mbs':>4} {'loss':>12} {'kl':>10}")
    for label, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"{label:<16} {med['update_s']:>9.2f} {base / med['update_s']:>8.2f}x {med['ref_s']:>10.2f} "
              f"{med['peak_mb']:>8.0f} {100 * med['padding']:>7.1f}% {med['tokens_per_micro_batch']:>7.0f} "
              f"{med['micro_batches']:>4.0f} {rows[0]['loss']:>12.8f} {rows[0]['kl']:>10.3g}")
        out[f"{name}/{label}"] = rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["demo", "spread", "both"], default="both")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--layers", type=int, default=8, help="spread: the random Qwen2's layers")
    p.add_argument("--hidden", type=int, default=256, help="spread: its hidden size")
    p.add_argument("--json", default="", help="write every run's figures here too")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    if args.child:
        path, work_file, padding_free, budget = args.child
        with open(work_file) as f:
            child(path, json.load(f), padding_free == "1", int(budget))
        return
    out = {}
    if args.workload in ("demo", "both"):
        path = models.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
        run_variants("demo step 1 (SmolLM2-135M)", path, demo_workload(path), [("padded", False, 0), ("packed", True, 0)],
                     args.runs, out)
    if args.workload in ("spread", "both"):
        from gpu_proxies import model_dir

        path = model_dir(args.layers, args.hidden, 4, 2, 4 * args.hidden, 4096)
        work = spread_workload()
        per_seq = sum(len(p) / 8 + sum(len(c) for c, _ in cs) / 8 for p, cs, _ in work["groups"]) / len(work["groups"])
        run_variants(f"spread 100-1000 (Qwen2 {args.layers} x {args.hidden})", path, work,
                     [("padded", False, 0), ("packed", True, 0), ("packed, tokens", True, int(8 * per_seq))],
                     args.runs, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
