"""Evaluate a model or a minigdpo checkpoint on a task split, with the task's metrics.

It samples greedy (default) or n completions per prompt through the same sampler interface
as training, scores them with the task's rewards, and reports per-reward means, accuracy,
format rate, pass@k and length statistics, plus the task's own figures (the paper's metrics):

| task        | extra figures                                               |
|-------------|-------------------------------------------------------------|
| toolcall    | exact-match rate of the tool calls                          |
| math_length | exceed ratio: completions over the length limit             |
| code        | pass rate, bug ratio, exceed ratio (the paper's Table 5)    |

It writes every completion to OUT/completions.jsonl and the figures to OUT/summary.json.

  python eval.py --model runs/gdpo/checkpoints/step_000050/hf --task gsm8k --data ../shared/data/gsm8k/test.jsonl
  python eval.py --model Qwen/Qwen2.5-1.5B-Instruct --task gsm8k --n 8 --temperature 0.7   # pass@1..8
  python eval.py --model tiny-random --task arith --limit 8                                   # offline, seconds
"""

import argparse
import json
import math
import os
import sys
import time

import torch

from minigdpo import data, policy
from minigdpo.rewards import RewardScorer
from minigdpo.sampler import SamplingParams, SamplerUnavailable, make_sampler

# task -> (reward that means "solved" and its threshold, reward that means "well formatted")
TASK_METRICS = {
    "gsm8k": ("correct", 1.0, "format"),
    "arith": ("correct", 1.0, "format"),
    "toolcall": ("tool_correct", 3.0, "tool_format"),  # 3 is an exact match of the whole call list
    "math_length": ("correct", 1.0, None),
    "code": ("pass", 1.0, None),
}


def pass_at_k(n, c, k):
    """Unbiased pass@k for c correct among n samples: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarise(task, names, rewards, lengths, truncated, n):
    """Figures from (P, n, R) rewards and (P, n) lengths / truncation flags."""
    out = {"prompts": rewards.shape[0], "samples_per_prompt": n}
    for k, name in enumerate(names):
        col = rewards[..., k]
        out[f"reward/{name}"] = col[~col.isnan()].mean().item() if (~col.isnan()).any() else float("nan")
    solved_name, threshold, format_name = TASK_METRICS[task]
    if solved_name in names:
        solved = (rewards[..., names.index(solved_name)] >= threshold)      # (P, n), NaN counts as unsolved
        out["accuracy"] = solved.float().mean().item()
        counts = solved.sum(1).tolist()
        k = 1
        while k <= n:
            out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in counts) / len(counts)
            k *= 2
    if format_name in names:
        out["format_rate"] = (rewards[..., names.index(format_name)] >= 1).float().mean().item()
    if task == "toolcall" and "tool_correct" in names:
        out["exact_match_rate"] = out.get("accuracy")
    if "length_ok" in names:
        out["exceed_ratio"] = (rewards[..., names.index("length_ok")] < 1).float().mean().item()
    if task == "code":
        if "pass" in names:
            out["pass_rate"] = rewards[..., names.index("pass")].nan_to_num(0).mean().item()
        if "no_bug" in names:
            out["bug_ratio"] = (rewards[..., names.index("no_bug")] < 1).float().mean().item()
    out["length/mean"] = lengths.float().mean().item()
    out["length/median"] = lengths.float().median().item()
    out["length/max"] = lengths.max().item()
    out["length/truncated_frac"] = truncated.float().mean().item()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="hub name, local directory, checkpoint's hf/ directory, or tiny-random")
    p.add_argument("--task", default="gsm8k", choices=sorted(TASK_METRICS))
    p.add_argument("--data", default="", help="local file or hub dataset; empty: the task's default")
    p.add_argument("--split", default="test", help="split for hub datasets (and arith's held-out set)")
    p.add_argument("--rewards", default="", help="comma-separated rewards; empty: the task's default")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (pass@k for k up to n)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--limit", type=int, default=0, help="evaluate only the first N prompts (0: all)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per generate call")
    p.add_argument("--length-limit", type=int, default=4000)
    p.add_argument("--length-unit", default="tokens", choices=["tokens", "words"])
    p.add_argument("--answer-format", default="answer", choices=["answer", "boxed"])
    p.add_argument("--arith-difficulty", type=int, default=2)
    p.add_argument("--sampler", default="auto", choices=["auto", "hf", "vllm"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="", help="output directory (default: runs/eval/<task>)")
    args = p.parse_args(argv)
    if args.n < 1 or args.batch_size < 1 or args.max_new_tokens < 1 or args.temperature < 0:
        p.error("--n, --batch-size and --max-new-tokens must be >= 1 and --temperature >= 0")
    if args.n > 1 and args.temperature == 0:
        p.error("--n > 1 needs --temperature > 0 (greedy samples are all the same)")

    extra = {"length_limit": args.length_limit, "length_unit": args.length_unit, "answer_format": args.answer_format}
    task = data.load_task(args.task, args.data, args.split, False, args.arith_difficulty, extra)
    examples = task.examples[:args.limit] if args.limit else task.examples
    names = [r for r in args.rewards.split(",") if r] or task.rewards
    scorer = RewardScorer(names)

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = policy.resolve_model(args.model)
    tokenizer = policy.load_tokenizer(path)
    from transformers import AutoConfig, GenerationConfig

    try:
        gen_config = GenerationConfig.from_pretrained(path)
    except OSError:
        gen_config = None
    stop_ids = policy.stop_token_ids(AutoConfig.from_pretrained(path), gen_config, tokenizer)
    sampler = make_sampler(args.sampler, path, device, tokenizer, stop_ids, dtype, seed=args.seed,
                           max_model_len=args.max_prompt_len + args.max_new_tokens)
    params = SamplingParams(args.temperature, args.top_p, args.max_new_tokens, seed=args.seed)

    out_dir = args.output or os.path.join("runs", "eval", args.task)
    os.makedirs(out_dir, exist_ok=True)
    all_rewards, lengths, truncated = [], [], []
    t0 = time.perf_counter()
    with open(os.path.join(out_dir, "completions.jsonl"), "w") as f:
        for s in range(0, len(examples), args.batch_size):
            batch = examples[s:s + args.batch_size]
            prompts = [data.encode_prompt(tokenizer, ex["messages"], args.max_prompt_len) for ex in batch]
            completions = [c for group in sampler.generate(prompts, args.n, params) for c in group]
            rewards, _ = scorer([c.text for c in completions], [ex for ex in batch for _ in range(args.n)],
                                [len(c.token_ids) for c in completions])
            for i, c in enumerate(completions):
                f.write(json.dumps({"prompt_index": s + i // args.n, "sample": i % args.n, "completion": c.text,
                                    "tokens": len(c.token_ids), "finish_reason": c.finish_reason,
                                    "rewards": {n: (None if math.isnan(v) else v) for n, v in zip(names, rewards[i].tolist())}}) + "\n")
            all_rewards.append(rewards.view(len(batch), args.n, len(names)))
            lengths.append(torch.tensor([len(c.token_ids) for c in completions]).view(len(batch), args.n))
            truncated.append(torch.tensor([c.finish_reason == "length" for c in completions]).view(len(batch), args.n))
            print(f"evaluated {min(s + args.batch_size, len(examples))}/{len(examples)} prompts", file=sys.stderr)
    summary = summarise(args.task, names, torch.cat(all_rewards), torch.cat(lengths), torch.cat(truncated), args.n)
    summary["seconds"] = time.perf_counter() - t0
    summary["model"] = args.model
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    width = max(len(k) for k in summary)
    print("\n".join(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}" for k, v in summary.items()))
    print(f"wrote {out_dir}/completions.jsonl and summary.json")
    return summary


if __name__ == "__main__":
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        main()
    except (data.DataError, SamplerUnavailable, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
