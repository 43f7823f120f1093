"""Where one update's time goes on a CUDA GPU, kernel by kernel, and the update's MFU by micro-batch size.

    python benchmarks/gpu_profile.py                          # Qwen2.5-1.5B's shape (28 layers), bf16, grad checkpointing
    python benchmarks/gpu_profile.py --sizes 8,16,32,64       # the MFU sweep's micro-batch sizes (sequences)
    python benchmarks/gpu_profile.py --json /tmp/profile.json # the figures, for docs/performance.md

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
from minigdpo.microbatch import micro_batches  # noqa: E402
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


def work(n_seqs, group, prompt_len, completion_len, seed=0):
    """n_seqs sequences (n_seqs / group prompts), every completion exactly completion_len tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 250, (prompt_len,), generator=g).tolist() for _ in range(n_seqs // group)]
    prompts = [p for p in prompts for _ in range(group)]
    comps = [Completion(torch.randint(0, 250, (completion_len,), generator=g).tolist(), [-1.0] * completion_len)
             for _ in prompts]
    return prompts, comps, torch.randn(len(comps), generator=g)


def batches_of(prompts, comps, adv, size, group, device):
    out = micro_batches(prompts, comps, adv, size, 257, device, group)
    for mb in out:
        mb.ref_logp = mb.sampler_logp  # the KL term's arithmetic, without a reference model's pass
    return out


def tokens_of(batches):
    """Tokens through the model: each distinct prompt once per micro-batch, every completion token."""
    return sum(mb.prompt_mask.sum().item() + mb.mask.sum().item() for mb in batches)


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p, layers=28, hidden=1536, heads=12, kv_heads=2, intermediate=8960)  # Qwen2.5-1.5B's
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--prompt-len", type=int, default=150)
    p.add_argument("--completion-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch in the profiled update")
    p.add_argument("--profile-seqs", type=int, default=16)
    p.add_argument("--sizes", default="8,16,32,64", help="micro-batch sizes (sequences) of the MFU sweep")
    p.add_argument("--sweep-seqs", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--chunk", type=int, default=1024, help="--logprob-chunk")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 and H200 SXM: 989)")
    p.add_argument("--skip-profile", action="store_true")
    p.add_argument("--json", default="", help="write the figures here too")
    args = p.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    path = model_dir(*shape(args))
    device = dist.init()
    if device.type != "cuda":
        raise SystemExit("gpu_profile.py measures a CUDA GPU")
    cfg = Config(num_iterations=1, temperature=1.0, logprob_chunk=args.chunk, beta=0.04, loss_agg="token_mean",
                 max_new_tokens=args.completion_len)
    model = policy.build(path, device, torch.bfloat16, grad_checkpointing=True)
    n_params = sum(p.numel() for p in model.parameters())
    opt = optimizer(model, 1e-6, 0.0)
    sched = scheduler(opt, 100, 0.0, "constant")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "params": n_params,
           "shape": vars(args)}
    print(f"{out['device']}, torch {torch.__version__}, {n_params / 1e9:.3f}B parameters, bf16, grad checkpointing")

    if not args.skip_profile:
        batches = batches_of(*work(args.profile_seqs, args.group, args.prompt_len, args.completion_len),
                             args.micro_batch, args.group, device)
        timed_update(model, opt, sched, batches, cfg)  # warm-up: kernels chosen, optimizer state allocated
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            seconds = timed_update(model, opt, sched, batches, cfg)
        table = kernel_table(prof, args.top)
        cpu_ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:args.top]
        table["cpu_ops"] = [{"name": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count}
                            for e in cpu_ops]
        table["cpu_self_ms"] = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3
        table["sync_sites"] = sync_sites(model, opt, sched, batches, cfg)
        from gpu_real import matmul_time_by_dtype

        by_dtype = matmul_time_by_dtype(prof)
        table |= {"seconds": seconds, "tokens": tokens_of(batches),
                  "matmul_by_op_dtype_ms": {k: v / 1e3 for k, v in by_dtype.items()}}
        out["profile"] = table
        k = table["kernel_ms"]
        print(f"\nprofiled update: {len(batches)} micro-batches of {args.micro_batch} x ({args.prompt_len} prompt / "
              f"{args.group} + {args.completion_len}) tokens, {seconds:.3f} s wall ({table['span_ms']:.0f} ms profiled), "
              f"GPU idle {100 * table['idle_frac']:.1f}% of the span, kernels {k:.0f} ms")
        print("by kind: " + ", ".join(f"{n} {v:.0f} ms ({100 * v / k:.1f}%)" for n, v in table["by_kind_ms"].items()))
        print(f"matmul ops by input dtype (gpu_real.matmul_time_by_dtype): "
              f"{sum(by_dtype.values()) / 1e3:.0f} ms = {100 * sum(by_dtype.values()) / 1e3 / k:.1f}% of kernel time "
              f"({', '.join(f'{d} {v / 1e3:.0f} ms' for d, v in by_dtype.items())})")
        print(f"{'share':>6} {'ms':>8} {'calls':>6}  {'kind':<10} kernel")
        for r in table["top"]:
            print(f"{100 * r['share']:>5.1f}% {r['ms']:>8.1f} {r['calls']:>6}  {r['kind']:<10} {r['name'][:110]}")
        print(f"CPU: {table['cpu_self_ms']:.0f} ms of self time in ops; the top ones:")
        for r in table["cpu_ops"]:
            print(f"  {r['self_cpu_ms']:>8.1f} ms {r['calls']:>6}  {r['name'][:100]}")
        print(f"host waits for the GPU in one update, by line: {table['sync_sites'] or 'none'}")
        del batches, prof

    sweep = []
    for size in [int(s) for s in args.sizes.split(",") if s]:
        batches = batches_of(*work(args.sweep_seqs, args.group, args.prompt_len, args.completion_len, seed=1),
                             size, args.group, device)
        try:
            timed_update(model, opt, sched, batches, cfg)
            torch.cuda.reset_peak_memory_stats()
            secs = statistics.median(timed_update(model, opt, sched, batches, cfg) for _ in range(args.reps))
        except torch.OutOfMemoryError:
            print(f"micro-batch {size}: out of memory")
            break
        tokens = tokens_of(batches)
        context = args.prompt_len + (args.completion_len + 1) / 2  # keys a completion token sees, on average
        flops = 6 * n_params * tokens
        attn = 12 * args.layers * args.hidden * context * tokens
        row = {"micro_batch": size, "tokens_per_micro_batch": tokens / len(batches), "seconds": secs,
               "tokens_per_s": tokens / secs, "mfu": flops / secs / args.peak_tflops / 1e12,
               "mfu_with_attention": (flops + attn) / secs / args.peak_tflops / 1e12,
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        sweep.append(row)
        print(f"micro-batch {size:>3} seqs = {row['tokens_per_micro_batch']:>6.0f} tokens: {secs:.2f} s, "
              f"{row['tokens_per_s']:.0f} tok/s, MFU {100 * row['mfu']:.1f}% (with attention "
              f"{100 * row['mfu_with_attention']:.1f}%), peak {row['peak_gib']:.1f} GiB")
        del batches
        torch.cuda.empty_cache()
    out["sweep"] = sweep
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
    dist.cleanup()
