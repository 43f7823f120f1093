"""Peak memory and time of minigdpo's per-token log-probs against the naive computation.

    python benchmarks/logprob_memory.py [--vocab 151936] [--tokens 1024] [--batch 4] [--hidden 64]

The naive way materialises the logits (B, T, V) in float32 and their log_softmax, then gathers
the target tokens. minigdpo's `ChunkedLogProbs` (minigdpo/policy.py) keeps one (chunk, V) block
at a time, forward and backward. Both run forward and backward (the training case) in their own
process; peak memory is the rise of the process's peak RSS (VmHWM, reset once the inputs exist).
Values and gradients are compared at the end.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minigdpo.logprobs import chunked_logprobs  # noqa: E402  (imported before any measurement)


def peak_rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def inputs(args):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.batch * args.tokens, args.hidden, generator=g)      # (B*T, H)
    weight = torch.randn(args.vocab, args.hidden, generator=g) * 0.05             # (V, H)
    targets = torch.randint(0, args.vocab, (args.batch * args.tokens,), generator=g)
    return hidden.requires_grad_(), weight.requires_grad_(), targets


def naive(hidden, weight, targets, args):
    logits = (hidden.view(args.batch, args.tokens, -1) @ weight.T).float()       # (B, T, V)
    return torch.log_softmax(logits, -1).gather(-1, targets.view(args.batch, args.tokens, 1)).view(-1)


def chunked(hidden, weight, targets, args):
    return chunked_logprobs(hidden, weight, targets, 1.0, args.chunk)[0]


def child(args):
    torch.set_num_threads(2)
    fn = {"naive": naive, "chunked": chunked}[args.child]
    times = []
    for _ in range(args.reps):
        hidden, weight, targets = inputs(args)
        base = peak_rss_mb()
        reset_peak()
        base = min(base, peak_rss_mb())
        t = time.perf_counter()
        logp = fn(hidden, weight, targets, args)
        logp.sum().backward()
        times.append(time.perf_counter() - t)
        peak = peak_rss_mb() - base
    torch.save({"logp": logp.detach(), "grad_h": hidden.grad, "grad_w": weight.grad}, args.out)
    print("RESULT " + json.dumps({"peak_mb": peak, "seconds": sorted(times)[len(times) // 2]}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--chunk", type=int, default=1024, help="minigdpo's --logprob-chunk")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--child", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    results, outputs = {}, {}
    for name in ("naive", "chunked"):
        out = f"/tmp/logprob_{name}_{os.getpid()}.pt"
        cmd = [sys.executable, __file__, "--child", name, "--out", out] + [
            f"--{k}={v}" for k, v in vars(args).items() if k in ("vocab", "tokens", "batch", "hidden", "chunk", "reps")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        results[name] = json.loads(line[7:])
        outputs[name] = torch.load(out)
        os.remove(out)
    print(f"vocab {args.vocab}, {args.batch} x {args.tokens} tokens, hidden {args.hidden}, chunk {args.chunk}, "
          f"forward + backward, float32 on the CPU")
    print(f"{'':<10} {'peak MB':>9} {'seconds':>9}")
    for name, r in results.items():
        print(f"{name:<10} {r['peak_mb']:>9.0f} {r['seconds']:>9.2f}")
    ratio = results["chunked"]["peak_mb"] / results["naive"]["peak_mb"]
    diffs = {k: (outputs["naive"][k] - outputs["chunked"][k]).abs().max().item() for k in outputs["naive"]}
    print(f"chunked / naive peak memory: {100 * ratio:.1f}%; max abs difference: "
          + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))


if __name__ == "__main__":
    main()
