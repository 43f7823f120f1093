"""Where one update's time goes on a CUDA GPU, kernel by kernel, and the update's MFU by micro-batch size.

    python benchmarks/gpu_profile.py                          # Qwen2.5-1.5B's shape (28 layers), bf16, grad checkpointing
    python benchmarks/gpu_profile.py --sizes 8,16,32,64       # the MFU sweep's micro-batch sizes (sequences)
    python benchmarks/gpu_profile.py --json /tmp/profile.json # the figures, for docs/performance.md
    python benchmarks/gpu_profile.py --compile false,true     # eager, then each decoder layer compiled

A random model built from the shape (no download), the offline byte-level tokenizer's ids, one rank (FSDP2 still
gathers and reduces through NCCL). Completions all run to --completion-len, so no micro-batch holds padding here.

1. One update of --profile-seqs sequences in micro-batches of --micro-batch, under the torch profiler: every CUDA
   kernel's total time, the top --top by total with their share of kernel time, the share of the update's wall time
   in which no kernel, copy or memset ran on the GPU (the union of their intervals against the profiled span), and
   the matmul share counted by kernel name (cutlass, cublas, gemm, cuBLASLt's nvjet and xmma kernels), attention
   kernels (flash, fmha, efficient attention, flex) apart. Beside it, gpu_real.matmul_time_by_dtype's figure (op
   ids matched to correlation ids), which the name count checks.
2. The update's MFU with micro-batches of each --sizes count: --sweep-seqs sequences, one warm-up update, then the
   median of --reps timed ones. MFU = 6 x parameters x tokens / seconds / --peak-tflops (train.py's count), and the
   same with the attention term 12 x layers x hidden x context per token added (context: the tokens a completion
   token attends to on average, prompt included).
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from gpu import model_dir  # noqa: E402  (the checklist's model: one build serves both)
from gpu_proxies import add_shape_args, shape  # noqa: E402
from minigdpo import dist, policy  # noqa: E402
from minigdpo.config import Config  # noqa: E402
from minigdpo.sampler import Completion  # noqa: E402
from minigdpo.microbatch import cut  # noqa: E402
from minigdpo.update import optimizer, scheduler, update  # noqa: E402

MATMUL_WORDS = ("gemm", "cutlass", "cublas", "nvjet", "xmma", "wgmma")
ATTENTION_WORDS = ("flash", "fmha", "attention", "attn", "flex")


def kind(name):
    low = name.lower()
    if any(w in low for w in ATTENTION_WORDS):
        return "attention"
    if any(w in low for w in MATMUL_WORDS):
        return "matmul"
    if "nccl" in low:
        return "nccl"
    if low.startswith("memcpy") or low.startswith("memset"):
        return "copy/memset"
    return "other"


def work(n_seqs, group, prompt_len, lengths, seed=0):
    """n_seqs sequences (n_seqs / group prompts of prompt_len tokens), as [(prompt, completions, adv)] groups:
    completion lengths drawn uniformly from lengths = (lo, hi) (lo == hi: every completion that long)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_seqs // group):
        prompt = torch.randint(0, 250, (prompt_len,), generator=g).tolist()
        ns = torch.randint(lengths[0], lengths[1] + 1, (group,), generator=g).tolist()
        comps = [Completion(torch.randint(0, 250, (n,), generator=g).tolist(), [-1.0] * n) for n in ns]
        out.append((prompt, comps, torch.randn(group, generator=g)))
    return out


def batches_of(groups, cfg, device, packed):
    out = cut(groups, cfg, 257, device, "packed" if packed else "padded")
    for mb in out:
        mb.ref_logp = mb.sampler_logp  # the KL term's arithmetic, without a reference model's pass
    return out


def union(intervals):
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def kernel_table(prof, top):
    events = prof.profiler.kineto_results.events()
    gpu = [e for e in events if e.device_type() == DeviceType.CUDA and e.duration_ns() > 0
           and not e.is_user_annotation()]  # a range such as Optimizer.step, not a kernel
    span = (max(e.end_ns() for e in events) - min(e.start_ns() for e in events))
    busy = union([(e.start_ns(), e.end_ns()) for e in gpu])
    by_name = {}
    for e in gpu:
        t, c = by_name.get(e.name(), (0, 0))
        by_name[e.name()] = (t + e.duration_ns(), c + 1)
    total = sum(t for t, _ in by_name.values())
    by_kind = {}
    for name, (t, _) in by_name.items():
        by_kind[kind(name)] = by_kind.get(kind(name), 0) + t
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"span_ms": span / 1e6, "busy_ms": busy / 1e6, "idle_frac": 1 - busy / span, "kernel_ms": total / 1e6,
            "by_kind_ms": {k: v / 1e6 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n, "kind": kind(n), "ms": t / 1e6, "calls": c, "share": t / total} for n, (t, c) in rows]}


def sync_sites(model, opt, sched, batches, cfg):
    """{file:line: count} of the Python lines whose op made the host wait for the GPU, during one update
    (torch.cuda.set_sync_debug_mode warns once per synchronizing call, at the caller's line)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            timed_update(model, opt, sched, batches, cfg)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sites = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{os.path.relpath(w.filename, ROOT) if w.filename.startswith(ROOT) else w.filename}:{w.lineno}"
            sites[key] = sites.get(key, 0) + 1
    return sites


def timed_update(model, opt, sched, batches, cfg):
    torch.cuda.synchronize()
    t = time.perf_counter()
    update(model, opt, sched, batches, cfg)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def profile_update(model, opt, sched, batches, cfg, top):
    """One update under the profiler (after a warm-up): the kernel table, the CPU ops, the host's waits."""
    timed_update(model, opt, sched, batches, cfg)  # warm-up: kernels chosen, optimizer state allocated
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        seconds = timed_update(model, opt, sched, batches, cfg)
    table = kernel_table(prof, top)
    cpu_ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    table["cpu_ops"] = [{"name": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in cpu_ops]
    table["cpu_self_ms"] = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3
    table["sync_sites"] = sync_sites(model, opt, sched, batches, cfg)
    from gpu_real import matmul_time_by_dtype

    by_dtype = matmul_time_by_dtype(prof)
    table |= {"seconds": seconds, "matmul_by_op_dtype_ms": {k: v / 1e3 for k, v in by_dtype.items()}}
    k = table["kernel_ms"]
    print(f"{seconds:.3f} s wall ({table['span_ms']:.0f} ms profiled), GPU idle {100 * table['idle_frac']:.1f}% of the "
          f"span, kernels {k:.0f} ms")
    print("by kind: " + ", ".join(f"{n} {v:.0f} ms ({100 * v / k:.1f}%)" for n, v in table["by_kind_ms"].items()))
    print(f"matmul ops by input dtype (gpu_real.matmul_time_by_dtype): {sum(by_dtype.values()) / 1e3:.0f} ms = "
          f"{100 * sum(by_dtype.values()) / 1e3 / k:.1f}% of kernel time "
          f"({', '.join(f'{d} {v / 1e3:.0f} ms' for d, v in by_dtype.items())})")
    print(f"{'share':>6} {'ms':>8} {'calls':>6}  {'kind':<10} kernel")
    for r in table["top"]:
        print(f"{100 * r['share']:>5.1f}% {r['ms']:>8.1f} {r['calls']:>6}  {r['kind']:<10} {r['name'][:110]}")
    print(f"CPU: {table['cpu_self_ms']:.0f} ms of self time in ops; the top ones:")
    for r in table["cpu_ops"][:8]:
        print(f"  {r['self_cpu_ms']:>8.1f} ms {r['calls']:>6}  {r['name'][:100]}")
    print(f"host waits for the GPU in one update, by line: {table['sync_sites'] or 'none'}")
    return table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p, layers=28, hidden=1536, heads=12, kv_heads=2, intermediate=8960)  # Qwen2.5-1.5B's
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--prompt-len", type=int, default=150)
    p.add_argument("--lengths", default="512,512", help="completion lengths, uniform in LO,HI (the profile: LO)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch in the profiled update")
    p.add_argument("--profile-seqs", type=int, default=16)
    p.add_argument("--profile", default="padded,packed", help="which passes to profile")
    p.add_argument("--sizes", default="8,16,32,64", help="micro-batch sizes (sequences) of the MFU sweep")
    p.add_argument("--budgets", default="", help="micro-batch token budgets of the MFU sweep (--micro-batch-tokens)")
    p.add_argument("--passes", default="padded,packed", help="the sweep's passes")
    p.add_argument("--sweep-seqs", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--chunk", type=int, default=1024, help="--logprob-chunk")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 and H200 SXM: 989)")
    p.add_argument("--json", default="", help="write the figures here too")
    p.add_argument("--compile", default="false", help="false, true or false,true: each layer compiled (--compile)")
    args = p.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    lengths = tuple(int(x) for x in args.lengths.split(","))
    path = model_dir(*shape(args))
    device = dist.init()
    if device.type != "cuda":
        raise SystemExit("gpu_profile.py measures a CUDA GPU")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": vars(args)}
    for compile in [x == "true" for x in args.compile.split(",")]:
        model = policy.build(path, device, torch.bfloat16, grad_checkpointing=True, compile=compile)
        out[f"compile={compile}"] = measure(model, args, device, lengths, compile)
        del model
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def measure(model, args, device, lengths, compile):
    """The profile and the sweep of one model: {"params", "packed_vs_padded_max_abs_logp", "profile/...", "sweep"}."""
    n_params = sum(p.numel() for p in model.parameters())
    opt = optimizer(model, 1e-6, 0.0)
    sched = scheduler(opt, 100, 0.0, "constant")
    out = {"params": n_params}
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {n_params / 1e9:.3f}B parameters, bf16, "
          f"grad checkpointing, {'compiled' if compile else 'eager'} layers")

    def config(size=8, budget=0):
        return Config(num_iterations=1, temperature=1.0, logprob_chunk=args.chunk, beta=0.04, loss_agg="token_mean",
                      max_new_tokens=lengths[1], micro_batch_size=size, micro_batch_tokens=budget)

    groups = work(args.profile_seqs, args.group, args.prompt_len, (lengths[0], lengths[0]))
    if {"padded", "packed"} <= set(args.passes.split(",") + args.profile.split(",")):  # both measured: compare them
        with torch.no_grad():  # the two passes on the same weights, before any update moves them
            check = {name: model(batches_of(groups, config(args.micro_batch), device, name == "packed")[0], 1.0,
                                 args.chunk) for name in ("padded", "packed")}
        out["packed_vs_padded_max_abs_logp"] = (check["packed"] - check["padded"]).abs().max().item()
        print(f"packed vs padded log-probs, bf16: max |difference| {out['packed_vs_padded_max_abs_logp']:.3g}")
    for name in [x for x in args.profile.split(",") if x]:
        batches = batches_of(groups, config(args.micro_batch), device, name == "packed")
        print(f"\nprofiled update, {name}: {len(batches)} micro-batches of {args.micro_batch} x ({args.prompt_len} prompt "
              f"/ {args.group} + {lengths[0]}) tokens")
        out[f"profile/{name}"] = profile_update(model, opt, sched, batches, config(args.micro_batch), args.top)
        del batches

    sweep = []
    groups = work(args.sweep_seqs, args.group, args.prompt_len, lengths, seed=1)
    runs = [(f"{size} seqs", config(size=size)) for size in [int(x) for x in args.sizes.split(",") if x]]
    runs += [(f"{budget} tokens", config(budget=budget)) for budget in [int(x) for x in args.budgets.split(",") if x]]
    for label, cfg in runs:
        for name in [x for x in args.passes.split(",") if x]:
            batches = batches_of(groups, cfg, device, name == "packed")
            try:
                first = timed_update(model, opt, sched, batches, cfg)  # kernels chosen; a compiled layer compiles
                torch.cuda.reset_peak_memory_stats()
                secs = statistics.median(timed_update(model, opt, sched, batches, cfg) for _ in range(args.reps))
            except torch.OutOfMemoryError:
                print(f"{label}, {name}: out of memory")
                continue
            real = sum(mb.real_tokens() for mb in batches)
            computed = sum(mb.model_tokens() for mb in batches)
            pairs = sum(mb.pairs for mb in batches)
            flops, attn = 6 * n_params * real, 12 * args.layers * args.hidden * pairs
            row = {"micro_batches": label, "pass": name, "tokens_per_micro_batch": computed / len(batches),
                   "padding_frac": 1 - real / computed, "seconds": secs, "real_tokens_per_s": real / secs,
                   "mfu": flops / secs / args.peak_tflops / 1e12,
                   "mfu_with_attention": (flops + attn) / secs / args.peak_tflops / 1e12,
                   "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "first_update_seconds": first}
            sweep.append(row)
            print(f"{label:>12} {name:<7} {len(batches):>3} micro-batches of {row['tokens_per_micro_batch']:>6.0f} tokens "
                  f"({100 * row['padding_frac']:.0f}% padding): {secs:.2f} s, {row['real_tokens_per_s']:.0f} real tok/s, "
                  f"MFU {100 * row['mfu']:.1f}% ({100 * row['mfu_with_attention']:.1f}% with attention), "
                  f"peak {row['peak_gib']:.1f} GiB; the first update {first:.1f} s")
            del batches
            torch.cuda.empty_cache()
    out["sweep"] = sweep
    return out


if __name__ == "__main__":
    main()
    dist.cleanup()
