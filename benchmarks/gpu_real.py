"""On one CUDA GPU, what benchmarks/gpu_proxies.py counts on the CPU, measured for real.

    python benchmarks/gpu_real.py                     # Qwen2.5-1.5B's shape, random weights, bf16 (~2 min on an H100)
    python benchmarks/gpu_real.py --layers 4          # a quicker look

The proxies count operations; this measures what they stand for, on the device:
- all-gathers per decoder layer per micro-batch, FSDP2's own calls counted during one real update;
- the share of matmul *time* spent on fp32 inputs: the torch profiler's CUDA time of every mm, addmm,
  bmm and baddbmm, split by the dtypes the profiler recorded for its inputs;
- the reference's device memory after its no-grad pass (torch.cuda.memory_allocated, and FSDP2's
  resident bytes as gpu_proxies reads them), against one bf16 copy;
- the HF sampler's host syncs per generated token: CUDA synchronisations (cudaStreamSynchronize,
  cudaDeviceSynchronize, cudaEventSynchronize) seen by the profiler, and the value reads that cause
  them (gpu_proxies.HostSyncs), per decode step: the difference between two lengths cancels set-up;
- the update's peak memory (torch.cuda.max_memory_allocated) and its time.
One process (world size 1): FSDP2 still gathers and reduces through NCCL.
"""

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from gpu_proxies import Collectives, HostSyncs, add_shape_args, batch, model_dir, resident_bytes, shape  # noqa: E402
from minigdpo import dist, models, policy  # noqa: E402
from minigdpo.config import Config  # noqa: E402
from minigdpo.sampler import HFSampler, SamplingParams  # noqa: E402
from minigdpo.update import fill_logprobs, optimizer, scheduler, update  # noqa: E402

GIB = 2**30
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
SYNCS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"}


def matmul_time_by_dtype(prof):
    """CUDA microseconds of the matmul ops' kernels, keyed by the dtype of their first input."""
    dtypes = {e.correlation_id(): (e.dtypes() or ["?"])[0] for e in prof.profiler.kineto_results.events()
              if e.name() in MATMULS}
    out = {}
    for fe in prof.profiler.function_events:
        if fe.name in MATMULS and fe.id in dtypes:
            key = dtypes[fe.id]
            out[key] = out.get(key, 0.0) + fe.device_time_total
    return out


def syncs_per_token(path, device, dtype):
    """(profiler syncs, value reads) per decode step of the HF sampler on `device`."""
    lm = models.load_model(path, dtype)
    sampler = HFSampler(lm, [lm.config.vocab_size], 257, device)  # an unreachable stop id: every row runs to the end
    prompts = [[10, 11, 12], [20, 21]]
    sampler.generate(prompts, 2, SamplingParams(temperature=1.0, max_new_tokens=8, seed=1))  # warm-up
    counts = []
    for length in (16, 48):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, HostSyncs() as reads:
            sampler.generate(prompts, 2, SamplingParams(temperature=1.0, max_new_tokens=length, seed=1))
        counts.append((sum(e.name in SYNCS for e in prof.events()), reads.count))
    del sampler, lm
    return [(b - a) / 32 for a, b in zip(*counts)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p, layers=28, hidden=1536, heads=12, kv_heads=2, intermediate=8960)  # Qwen2.5-1.5B's
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=512)
    p.add_argument("--chunk", type=int, default=1024, help="--logprob-chunk")
    args = p.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    path = model_dir(*shape(args))
    device = dist.init()
    if device.type != "cuda":
        raise SystemExit("gpu_real.py measures a CUDA GPU; on the CPU run benchmarks/gpu_proxies.py")
    dtype, rows = torch.bfloat16, []
    cfg = Config(num_iterations=1, temperature=1.0, logprob_chunk=args.chunk, beta=0.04, loss_agg="token_mean",
                 max_new_tokens=args.completion_len)
    model = policy.build(path, device, dtype, grad_checkpointing=True)
    ref = policy.build(path, device, dtype, frozen=True)
    n_params = sum(p.numel() for p in model.parameters())
    batches = batch(args, device)

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    fill_logprobs(ref, batches, "ref_logp", cfg, reshard=True)
    torch.cuda.synchronize()
    held, whole = resident_bytes(ref)
    rows.append(("reference: device memory after its pass, GiB", f"{held / GIB:.2f} resident ({whole / GIB:.2f} "
                 f"unsharded), allocated {(torch.cuda.memory_allocated() - before) / GIB:+.3f} by the pass",
                 f"{n_params * 2 / GIB:.2f} (one bf16 copy)"))

    opt = optimizer(model, 1e-6, 0.0)
    sched = scheduler(opt, 10, 0.0, "constant")
    update(model, opt, sched, batches, cfg)  # warm-up: kernels chosen, optimizer state allocated
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    update(model, opt, sched, batches, cfg)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    rows.append(("update: seconds, peak allocated GiB", f"{seconds:.3f} s, {torch.cuda.max_memory_allocated() / GIB:.2f}",
                 f"{len(batches)} micro-batches of {args.micro_batch}, grad checkpointing"))
    with Collectives() as coll, profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                        record_shapes=True) as prof:
        update(model, opt, sched, batches, cfg)
        torch.cuda.synchronize()
    n_mb = len(batches)
    rows.append(("all-gathers / reduce-scatters per decoder layer per micro-batch",
                 f"{coll.per_layer(coll.gathers) / n_mb:g} / {coll.per_layer(coll.reduces) / n_mb:g}",
                 "proxy (gpu_proxies.py, 2 gloo ranks): 2 / 1 per step"))
    by_dtype = matmul_time_by_dtype(prof)
    total = sum(by_dtype.values())
    fp32 = by_dtype.get("float", 0.0)
    rows.append(("share of matmul CUDA time on fp32 inputs", f"{100 * fp32 / max(total, 1e-9):.2f}% of {total / 1e3:.1f} ms "
                 f"({', '.join(f'{k} {v / 1e3:.1f} ms' for k, v in sorted(by_dtype.items()))})", "proxy: FLOP share <= 1%"))
    kernels = sum(e.self_device_time_total for e in prof.key_averages())
    rows.append(("matmul share of all CUDA kernel time in the update", f"{100 * total / max(kernels, 1e-9):.1f}%", ""))
    del model, ref, opt, sched, batches, prof
    torch.cuda.empty_cache()

    syncs, reads = syncs_per_token(path, device, dtype)
    rows.append(("HF sampler: CUDA syncs / value reads per generated token", f"{syncs:g} / {reads:g}", "proxy: <= 1/16"))

    print(f"\nQwen2 {args.layers} layers x {args.hidden}, vocab {args.vocab}: {n_params / 1e9:.2f}B parameters, bf16, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    w = max(len(r[0]) for r in rows)
    for figure, value, note in rows:
        print(f"{figure:<{w}}  {value}   [{note}]")


if __name__ == "__main__":
    main()
    dist.cleanup()
