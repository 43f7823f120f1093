"""The update eager and with each decoder layer compiled (--compile), on the device at hand: whether compiling pays.

    python benchmarks/compiled_update.py                    # the CPU: SmolLM2-135M's shape, fp32, 4 micro-batches
    python benchmarks/compiled_update.py --layers 28 --hidden 1536 --heads 12 --kv-heads 2 --intermediate 8960 \
        --dtype bf16 --lengths 100,1000 --budget 16384      # on a GPU: Qwen2.5-1.5B's shape (gpu_profile.py has more)

A random model of the shape, packed micro-batches of a spread of completion lengths cut by --budget tokens (or
--micro-batch sequences), grad checkpointing on. For each setting: the first update (compiling, for the compiled
model), then the median of --reps updates, and the log-probs of both models on the same micro-batch, compared.
"""

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from gpu import model_dir  # noqa: E402
from gpu_profile import batches_of, work  # noqa: E402
from gpu_proxies import add_shape_args, shape  # noqa: E402
from minigdpo import dist, policy  # noqa: E402
from minigdpo.config import Config  # noqa: E402
from minigdpo.update import optimizer, scheduler, update  # noqa: E402


def seconds(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p, layers=30, hidden=576, heads=9, kv_heads=3, intermediate=1536)  # SmolLM2-135M's
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=60)
    p.add_argument("--lengths", default="20,200", help="completion lengths, uniform in LO,HI")
    p.add_argument("--seqs", type=int, default=16, help="sequences in the update")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch (without --budget)")
    p.add_argument("--budget", type=int, default=0, help="tokens per micro-batch (--micro-batch-tokens)")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    device = dist.init()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    path = model_dir(*shape(args))
    lengths = tuple(int(x) for x in args.lengths.split(","))
    cfg = Config(num_iterations=1, temperature=1.0, beta=0.04, loss_agg="token_mean", max_new_tokens=lengths[1],
                 micro_batch_size=args.micro_batch, micro_batch_tokens=args.budget, grad_checkpointing=True)
    groups = work(args.seqs, args.group, args.prompt_len, lengths)
    print(f"{device.type}, torch {torch.__version__}, {args.dtype}, {args.layers} layers x {args.hidden}, "
          f"{args.seqs} sequences of {args.prompt_len} + {args.lengths} tokens")
    logps = {}
    for compile in (False, True):
        model = policy.build(path, device, dtype, grad_checkpointing=True, compile=compile)
        opt = optimizer(model, 1e-9, 0.0)
        sched = scheduler(opt, 100, 0.0, "constant")
        batches = batches_of(groups, cfg, device, packed=True)
        with torch.no_grad():
            logps[compile] = model(batches[0], 1.0, cfg.logprob_chunk).float().cpu()
        first = seconds(lambda: update(model, opt, sched, batches, cfg), device)
        median = statistics.median(seconds(lambda: update(model, opt, sched, batches, cfg), device)
                                   for _ in range(args.reps))
        print(f"{'compiled' if compile else 'eager':<9} {len(batches)} micro-batches: first update {first:.2f} s, "
              f"then {median:.3f} s (median of {args.reps})")
        del model, opt, sched, batches
    print(f"log-probs, compiled against eager: max |difference| {(logps[True] - logps[False]).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
    dist.cleanup()
