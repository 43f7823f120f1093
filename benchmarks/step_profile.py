"""One step of benchmarks/vs_trl.py's smollm2 work, part by part, with torch.profiler's top ops: where the time goes.

The work: 4 GSM8K questions x 8 completions, SmolLM2-135M-Instruct (the demo model, cached) in fp32 on the CPU
(--dtype bf16: the demo's compute dtype, where this CPU has it).
- generate: the HF sampler, 64 new tokens a completion (--new-tokens), stop tokens ignored;
- update: the reference pass (fill_logprobs) and one update (update.update) over 64 random tokens a completion,
  cut into micro-batches of 16 as train.py cuts them.

    python benchmarks/step_profile.py --part update              # seconds, twice (the first is warm-up)
    python benchmarks/step_profile.py --part generate --new-tokens 200 --profile   # and the top ops by self time
    python benchmarks/step_profile.py --part generate --caches dynamic,roomy --reps 5   # the KV caches, alternating
    python benchmarks/step_profile.py --part head --tokens 1024   # the head's log-probs alone, forward and backward
    python benchmarks/step_profile.py --part update --profile --by-shape   # and the top ops by input shape
    python benchmarks/step_profile.py --part update --grad-checkpointing false   # the update keeping every activation

--caches: the HF sampler's KV cache layers, roomy (sampler.RoomyLayer, written in place) or dynamic (transformers'
DynamicLayer, which grows by concatenation); with both, one run of each in turn, --reps times, and their medians.
--part head: logprobs.chunked_logprobs (entropy included) on --tokens random hidden states and targets, the demo
model's head shape (576 by 49,152), --head-chunk tokens a chunk; the medians of --reps forwards and backwards.
"""

import argparse
import json
import os
import resource
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k", "train.jsonl")

from transformers.cache_utils import DynamicLayer  # noqa: E402

from minigdpo import dist, logprobs, microbatch, models, policy, sampler as sampling  # noqa: E402
from minigdpo.config import Config  # noqa: E402
from minigdpo.sampler import Completion, SamplingParams  # noqa: E402
from minigdpo.update import fill_logprobs, optimizer, scheduler, update  # noqa: E402
from minigdpo.vllm_sampler import make_sampler  # noqa: E402
from rewards import encode_prompt  # noqa: E402

ROOMY = sampling.RoomyLayer
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def prompts(tokenizer):
    with open(GSM8K) as f:
        rows = [json.loads(line) for line, _ in zip(f, range(4))]
    return [encode_prompt(tokenizer, [{"role": "user", "content": r["question"]}], 512) for r in rows]


def use_cache(kind):
    """The HF sampler's KV cache layers from here on: roomy (sampler.RoomyLayer) or dynamic (DynamicLayer)."""
    sampling.RoomyLayer = ROOMY if kind == "roomy" else (lambda room: DynamicLayer())


def generate_part(path, tokenizer, args):
    lm = models.load_model(path, torch.float32)
    stop = models.stop_token_ids(lm.config, lm.generation_config, tokenizer)
    sampler = make_sampler("hf", path, torch.device("cpu"), tokenizer, stop, DTYPES[args.dtype])
    ids, params = prompts(tokenizer)[:args.prompts], SamplingParams(1.0, 1.0, args.new_tokens, seed=1, ignore_eos=True)

    def once():
        t0 = time.perf_counter()
        sampler.generate(ids, 8, params)
        return {"generate_s": time.perf_counter() - t0}

    return once


def update_part(path, tokenizer, args):
    dist.init()
    cfg = Config(model=path, group_size=8, batch_size=32, micro_batch_size=args.micro_batch_size, beta=0.04,
                 max_new_tokens=64, max_prompt_len=512, lr=1e-6, dtype=args.dtype)
    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    groups = [(p, [Completion(torch.randint(0, 49000, (64,), generator=g).tolist(), [-1.0] * 64) for _ in range(8)],
               torch.randn(8, generator=g)) for p in prompts(tokenizer)]
    device = torch.device("cpu")
    model = policy.build(path, device, dtype, args.grad_checkpointing == "true", context=1024)
    ref = policy.build(path, device, dtype, frozen=True, context=1024)
    opt, layout = optimizer(model, 1e-6, 0.0), "packed" if cfg.padding_free else "padded"
    sched = scheduler(opt, 10, 0.0, "constant")

    def once():
        batches = microbatch.cut(groups, cfg, tokenizer.pad_token_id, device, layout)
        t0 = time.perf_counter()
        fill_logprobs(ref, batches, "ref_logp", cfg, reshard=True)
        t1 = time.perf_counter()
        update(model, opt, sched, batches, cfg)
        return {"reference_s": t1 - t0, "update_s": time.perf_counter() - t1}

    return once


def head_part(args):
    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, 576, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(49152, 576, generator=g) * 0.05).to(dtype).requires_grad_()
    targets = torch.randint(0, 49152, (args.tokens,), generator=g)
    seconds = {"forward_s": [], "backward_s": []}
    for _ in range(args.reps):
        t0 = time.perf_counter()
        logp, _ = logprobs.chunked_logprobs(hidden, weight, targets, 1.0, args.head_chunk, entropy=True)
        t1 = time.perf_counter()
        logp.sum().backward()
        seconds["forward_s"].append(t1 - t0)
        seconds["backward_s"].append(time.perf_counter() - t1)
        hidden.grad = weight.grad = None
    print({k: round(sorted(v)[len(v) // 2], 3) for k, v in seconds.items()}, f"(median of {args.reps})", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["generate", "update", "head"], default="update")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--profile", action="store_true", help="then one more under torch.profiler: its top 12 ops")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the compute dtype (bf16: the demo's)")
    p.add_argument("--caches", default="roomy", help="generate: roomy, dynamic or both (comma-separated)")
    p.add_argument("--reps", type=int, default=5, help="with several --caches: runs of each, in turn; head: runs")
    p.add_argument("--prompts", type=int, default=4, help="generate: GSM8K questions, 8 completions each")
    p.add_argument("--micro-batch-size", type=int, default=16, help="update: sequences a micro-batch")
    p.add_argument("--tokens", type=int, default=1024, help="head: completion tokens")
    p.add_argument("--head-chunk", type=int, default=1024, help="head: tokens a chunk (train.py's --logprob-chunk)")
    p.add_argument("--grad-checkpointing", choices=["false", "true"], default="true",
                   help="update: the policy's (train.py's auto on a CPU: true)")
    p.add_argument("--by-shape", action="store_true", help="with --profile: also the top 20 ops by input shape")
    args = p.parse_args()
    if args.part == "head":
        return head_part(args)
    path = models.resolve_model(models.DEMO_MODEL)
    tokenizer = models.load_tokenizer(path)
    caches = args.caches.split(",")
    if args.part == "generate" and len(caches) > 1:
        once = generate_part(path, tokenizer, args)
        once()  # warm-up
        seconds = {c: [] for c in caches}
        for _ in range(args.reps):
            for c in caches:
                use_cache(c)
                seconds[c].append(round(once()["generate_s"], 2))
        print({c: (s, sorted(s)[len(s) // 2]) for c, s in seconds.items()}, "(seconds, median)", flush=True)
        return
    use_cache(caches[0])
    once = (generate_part if args.part == "generate" else update_part)(path, tokenizer, args)
    print(f"threads {torch.get_num_threads()}; warm-up {once()}; timed {once()}; peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=args.by_shape) as prof:
            once()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        if args.by_shape:
            print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
