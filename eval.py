"""Evaluate a model or a minigdpo checkpoint on a task split, with the task's metrics.

It samples greedy (default) or n completions per prompt through the same sampler interface
as training, scores them with the task's rewards, and reports per-reward means, accuracy,
format rate, pass@k and length statistics, plus the task's own figures (the paper's metrics; minigdpo/figures.py
computes them all).

A LoRA checkpoint's adapter/ directory (peft's format) is merged into its base model first (peft's
merge_and_unload, into OUT/merged_model), unless the run wrote the merged model to hf/ (--merge-on-save).

A minigdpo checkpoint (its hf/ or adapter/ directory, or the step directory) carries its run's config in
trainer.json. eval.py takes from it every task setting not given on the command line (task, arith
difficulty, prompt and completion lengths, length limit and unit, answer format, which with the task
fixes the system prompt), and says which. Not the data: a run's training file is not a test set.

--baseline MODEL evaluates a second model on the same prompts with the same settings and seed, and
prints both with model - baseline and a 95% paired bootstrap interval over prompts (10,000 resamples,
seed 0). One sampler serves both when they share their tensors and vocabulary: the baseline's weights
are streamed into it (with vLLM it must: vLLM allows one engine per process). Every completion goes to
OUT/completions.jsonl (and completions_baseline.jsonl), the figures to OUT/summary.json.

  # The CPU demo's checkpoint against the model it started from, on 128 held-out problems
  # (train.py --preset cpu-demo runs this at its end, on 64): task and lengths come from the checkpoint
  python eval.py --model runs/cpu-demo/checkpoints/step_000008/hf --baseline HuggingFaceTB/SmolLM2-135M-Instruct \
      --limit 128
  python eval.py --model runs/gdpo/checkpoints/step_000050/hf --task gsm8k --data ../shared/data/gsm8k/test.jsonl
  python eval.py --model Qwen/Qwen2.5-1.5B-Instruct --task gsm8k --n 8 --temperature 0.7   # pass@1..8
  python eval.py --model tiny-random --task arith --limit 8                                   # offline, seconds

Shape legend: P prompts, n samples per prompt, R rewards, K bootstrap resamples.
"""

import argparse
import json
import math
import os
import sys
import time

import torch
from transformers import TrainerState

from minigdpo import checkpoint, data, dist, lora, models, scoring, tools
from minigdpo.config import Config
from minigdpo.rollout import add_counts
from minigdpo.sampler import SamplingParams
from minigdpo.vllm_sampler import SamplerUnavailable, make_sampler, resolve_kind
from minigdpo.figures import RESAMPLES, TASK_METRICS, compare, comparison_table, pass_at_k, paired_bootstrap, \
    prompt_stats, summarise  # noqa: F401 (the figures, minigdpo/figures.py; tests read some from here)
from minigdpo.scoring import RewardScorer
from rewards import encode_prompt, load_task, metric_names

# The task settings a training run fixes, with the defaults used when neither the command line nor
# a checkpoint gives them: train.py's own defaults, so that a model trained with them is evaluated alike.
RUN_SETTINGS = {name: getattr(Config, name) for name in
                ("task", "arith_difficulty", "max_prompt_len", "max_new_tokens", "length_limit", "length_unit",
                 "answer_format", "environment", "max_tool_calls", "tool_timeout")} | {"tools": [], "rewards": []}


def checkpoint_run(model):
    """(model path, the run's config dict) for a minigdpo checkpoint; (model, None) for anything else. A
    checkpoint's hf/ (or LoRA adapter/) directory sits beside trainer.json (minigdpo/checkpoint.py), so both that
    directory and the step directory above it are recognised; a step directory means hf/ if it has one, else adapter/.
    """
    for sub in ("hf", "adapter"):
        if os.path.isfile(os.path.join(model, "trainer.json")) and os.path.isdir(os.path.join(model, sub)):
            model = os.path.join(model, sub)
            break
    path = os.path.join(os.path.dirname(os.path.normpath(model)), "trainer.json")
    if not os.path.isdir(model) or not os.path.isfile(path):
        return model, None
    try:
        with open(path) as f:
            saved = json.load(f)
        return model, {**saved["config"], "step": saved["step"], "total_steps": saved["derived"]["total_steps"]}
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a minigdpo trainer.json ({e})") from None


def model_path(model, out_dir, label=""):
    """A directory every sampler loads: the model itself, or a LoRA adapter merged into its base model."""
    path = models.resolve_model(model)
    if lora.is_adapter_dir(path):  # base + adapter, merged once into a directory every sampler loads
        path = lora.merge_adapter_dir(path, os.path.join(out_dir, f"merged_model{label}")) if dist.is_main() else None
        path = dist.broadcast_object(path)
        dist.print0(f"{model}: merged with its base model into {path}", file=sys.stderr)
    return path


def new_sampler(path, args):
    """(sampler, tokenizer) for the model at `path`."""
    tokenizer = models.load_tokenizer(path)
    lm = models.empty_model(path, torch.float32)  # its config and generation config, without weights
    stop_ids = models.stop_token_ids(lm.config, lm.generation_config, tokenizer)
    device = dist.device() if dist.is_initialized() else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sampler = make_sampler(args.sampler, path, device, tokenizer, stop_ids, dtype, seed=args.seed,
                           max_model_len=args.max_prompt_len + args.max_new_tokens)
    return sampler, tokenizer


def swap_in(sampler, tokenizer, source, path, args, kind):
    """(sampler, tokenizer) for the model at `path`, after `sampler` served the model at `source`: the same
    sampler with `path`'s weights streamed in when the two share their shapes and vocabulary, else a new
    one. With vLLM it must be the same engine: its CuMem allocator serves one engine per process
    (vllm/v1/worker/gpu_worker.py:413-416)."""
    if getattr(sampler, "adapters_only", False) and path == source:  # a LoRA run's sampler holds its base: adapters off
        sampler.adapters_off()
        return sampler, tokenizer
    shapes = [{name: t.shape for name, t in models.empty_model(p, torch.float32).state_dict().items()}
              for p in (source, path)]  # the same tensors (names and shapes), and below the same vocabulary
    if shapes[0] == shapes[1] and models.load_tokenizer(source).get_vocab() == models.load_tokenizer(path).get_vocab():
        sampler.load_weights(models.checkpoint_tensors(path))  # each sampler casts to its own dtype
        return sampler, tokenizer
    if kind == "vllm":
        raise ValueError(f"--baseline {path} differs from --model {source} in its tensors' shapes or its vocabulary: "
                         "with --sampler vllm one engine serves both (vLLM allows one per process)")
    return new_sampler(path, args)


def evaluate(sampler, tokenizer, label, args, examples, specs, out_file):
    """Sample, score and summarise one model on `examples`; each completion goes to out_file.

    Under a process group every rank samples its own slice of the prompts (rank 0 the first), and rank 0
    gathers them, summarises and writes. Returns (summary, prompt_stats) on rank 0, None elsewhere."""
    box = args.toolbox  # an agent's tools: the same loop as in training (minigdpo/tools.py)
    agent = box and tools.Agent(box, tokenizer, args.max_tool_calls, label, args.max_prompt_len + args.max_new_tokens,
                                args.tool_timeout)
    scorer = RewardScorer(specs, own=box.env_rewards if box else {}, names=metric_names(specs))
    if examples:
        scorer.check_conversation(examples[0]["messages"], tools=bool(box))
    run = args.runs.get(label) or {}  # a checkpoint's optimizer steps, as its run's TRL-style rewards saw them
    scorer.trainer_state = TrainerState(global_step=run.get("step", 0) * run.get("num_iterations", 1),
                                        max_steps=run.get("total_steps", 0) * run.get("num_iterations", 1))
    params = SamplingParams(args.temperature, args.top_p, args.max_new_tokens, seed=args.seed)
    per_rank = -(-len(examples) // dist.world_size())
    offset = dist.rank() * per_rank  # this rank's first prompt
    mine = examples[offset:offset + per_rank]
    names = metric_names(specs)
    rows, all_rewards, lengths, truncated, failures, counts, calls = [], [], [], [], {}, [], []
    t0 = time.perf_counter()
    for s in range(0, len(mine), args.batch_size):
        batch = mine[s:s + args.batch_size]
        if agent:
            _, groups, more = agent.rollouts(batch, args.n, params, sampler, args.max_prompt_len, {})
            counts.append(more)
        else:
            groups = sampler.generate([encode_prompt(tokenizer, ex["messages"], args.max_prompt_len) for ex in batch],
                                      args.n, params)
        completions = [c for group in groups for c in group]
        seen = [ex for ex in batch for _ in range(args.n)]
        if agent:  # the prompt as the model saw it (an environment's reset may extend it), as in training
            seen = [{**ex, "messages": messages} for ex, messages in zip(seen, agent.prompts)]
        rewards, stats = scorer.score(completions, seen, agent and agent.environments)  # (b * n, R)
        failures = RewardScorer.merge([failures, stats])
        for i, c in enumerate(completions):
            rows.append({"prompt_index": offset + s + i // args.n, "sample": i % args.n, "completion": c.text,
                         "tokens": c.written, "finish_reason": c.finish_reason,
                         "rewards": {n: (None if math.isnan(v) else v) for n, v in zip(names, rewards[i].tolist())},
                         **({"conversation": c.messages} if c.messages is not None else {})})
        all_rewards.append(rewards.view(len(batch), args.n, len(names)))                   # (b, n, R)
        lengths.append(torch.tensor([c.written for c in completions]).view(len(batch), args.n))
        truncated.append(torch.tensor([c.finish_reason == "length" for c in completions]).view(len(batch), args.n))
        calls.append(torch.tensor([c.tool_counts for c in completions]).view(len(batch), args.n, 2))
        dist.print0(f"{label}: evaluated {min(s + args.batch_size, len(mine)) * dist.world_size()}/{len(examples)} "
                    "prompts", file=sys.stderr)
    parts = dist.all_gather_object((rows, all_rewards, lengths, truncated, failures, counts, calls))
    RewardScorer.check(RewardScorer.merge([part[4] for part in parts]))  # a broken reward stops every rank alike
    if not dist.is_main():
        return None
    with open(out_file, "w") as f:
        f.writelines(json.dumps(row) + "\n" for part in parts for row in part[0])
    cat = [torch.cat([t for part in parts for t in part[k]]) for k in (1, 2, 3, 6)]
    figures = (args.task, names, *cat[:3], args.n, cat[3] if agent else None)
    counts = add_counts(c for part in parts for c in part[5])  # the tool loop's, every batch's of every rank's
    summary = summarise(*figures) | tools.metrics(counts) | {"seconds": time.perf_counter() - t0, "model": label}
    return summary, prompt_stats(*figures)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run = "a checkpoint's run setting, else"  # help text of the settings a checkpoint can supply
    p.add_argument("--model", required=True,
                   help="hub name, local directory, checkpoint's step, hf/ or adapter/ directory, or tiny-random")
    p.add_argument("--baseline", default="", help="a second model, evaluated the same way and compared with --model")
    p.add_argument("--task", choices=sorted(TASK_METRICS), help=f"default: {run} {RUN_SETTINGS['task']}")
    p.add_argument("--data", default="", help="local file or hub dataset; empty: the task's default")
    p.add_argument("--split", default="test", help="split for hub datasets (and arith's held-out set)")
    p.add_argument("--rewards", type=lambda s: [x for x in s.split(",") if x],
                   help=f"comma-separated rewards; default: {run} the task's own")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (pass@k for k up to n)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--tools", type=lambda s: [x for x in s.split(",") if x], help=f"default: {run} none")
    p.add_argument("--environment", help=f"default: {run} none")
    for name in ("max_new_tokens", "max_prompt_len", "length_limit", "arith_difficulty", "max_tool_calls"):
        p.add_argument("--" + name.replace("_", "-"), type=int, help=f"default: {run} {RUN_SETTINGS[name]}")
    p.add_argument("--length-unit", choices=["tokens", "words"], help=f"default: {run} {RUN_SETTINGS['length_unit']}")
    p.add_argument("--answer-format", choices=["answer", "boxed"],
                   help=f"default: {run} {RUN_SETTINGS['answer_format']}")
    p.add_argument("--limit", type=int, default=0, help="evaluate only the first N prompts (0: all)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per generate call")
    p.add_argument("--sampler", default="auto", choices=["auto", "hf", "vllm"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", "--output-dir", dest="output", default="",
                   help="output directory (default: runs/eval/<task>)")
    p.add_argument("--tool-timeout", type=float, help=f"seconds a tool call may take; default: {run} 60")
    args = p.parse_args(argv)
    args.model, run_config = checkpoint_run(args.model)
    args.baseline, baseline_config = checkpoint_run(args.baseline) if args.baseline else ("", None)
    args.runs = {args.model: run_config, args.baseline: baseline_config}  # each model's trainer_state (evaluate)
    source, run_config = (args.model, run_config) if run_config is not None else (args.baseline, baseline_config)
    explicit = [k for k in RUN_SETTINGS if getattr(args, k) is not None]
    taken = []  # the settings the run's config gave
    for name, default in RUN_SETTINGS.items():  # each one left unset: the run's value, else the default
        if getattr(args, name) is None:
            from_run = run_config is not None and name in run_config
            setattr(args, name, run_config[name] if from_run else default)
            taken += [name] if from_run else []
    agentless = () if args.tools or args.environment else ("tools", "environment", "max_tool_calls", "tool_timeout")
    taken = [k for k in taken if k not in agentless and (k != "rewards" or args.rewards)]  # what the run changed
    if taken:
        given = "; from the command line: " + " ".join(f"{k}={getattr(args, k)}" for k in explicit) if explicit else ""
        dist.print0(f"settings from the run of {source}: " + " ".join(f"{k}={getattr(args, k)}" for k in taken) + given)
    if args.n < 1 or args.batch_size < 1 or args.max_new_tokens < 1 or args.temperature < 0 or args.limit < 0:
        p.error("--n, --batch-size and --max-new-tokens must be >= 1, --temperature and --limit >= 0")
    if not (math.isfinite(args.tool_timeout) and args.tool_timeout > 0):  # config.validate's rule
        p.error(f"--tool-timeout must be > 0, got {args.tool_timeout}")
    if args.n > 1 and args.temperature == 0:
        p.error("--n > 1 needs --temperature > 0 (greedy samples are all the same)")
    return args


def main(argv=None, sampler=None, tokenizer=None, source=None):
    """Evaluate --model (and --baseline) as the command line says; returns the summary (None off rank 0).

    `sampler` (with its `tokenizer`), built for the checkpoint at `source` and now holding --model's
    weights, is used instead of building one: train.py's final evaluation passes its own, under its
    process group, so that every rank takes a slice of the prompts and no second vLLM engine is built."""
    args = parse_args(argv)
    reward_options = {"length_limit": args.length_limit, "length_unit": args.length_unit,
                      "answer_format": args.answer_format}
    task = load_task(args.task, args.data, args.split, False, {"arith_difficulty": args.arith_difficulty},
                     reward_options)
    examples = task.examples[:args.limit] if args.limit else task.examples
    args.toolbox = tools.Toolbox(args.tools, args.environment) if args.tools or args.environment else None
    specs = (args.rewards or task.rewards) + list(args.toolbox.env_rewards if args.toolbox else {})
    out_dir = args.output or os.path.join("runs", "eval", args.task)
    if dist.is_main():
        os.makedirs(out_dir, exist_ok=True)
    kind = resolve_kind(args.sampler)
    if sampler is None:
        source = model_path(args.model, out_dir)
        sampler, tokenizer = new_sampler(source, args)
        try:
            return report(args, sampler, tokenizer, source, kind, examples, specs, out_dir)
        finally:
            sampler.close()  # a vLLM engine shuts down now, not in a finaliser at exit
    return report(args, sampler, tokenizer, source, kind, examples, specs, out_dir)


def report(args, sampler, tokenizer, source, kind, examples, specs, out_dir):
    """Evaluate --model with `sampler`, then --baseline streamed into it; print and write the summary."""
    result = evaluate(sampler, tokenizer, args.model, args, examples, specs, os.path.join(out_dir, "completions.jsonl"))
    if args.baseline:
        baseline = model_path(args.baseline, out_dir, "_baseline")
        sampler, tokenizer = swap_in(sampler, tokenizer, source, baseline, args, kind)
        base = evaluate(sampler, tokenizer, args.baseline, args, examples, specs,
                        os.path.join(out_dir, "completions_baseline.jsonl"))
    if not dist.is_main():
        return None
    if args.baseline:
        rows = compare(result, base)
        summary = {"model": result[0], "baseline": base[0],
                   "difference": {k: {"diff": d, "low": lo, "high": hi} for k, (_, _, d, lo, hi) in rows.items()},
                   "interval": f"95% paired bootstrap over prompts, {RESAMPLES} resamples, seed 0"}
        print(comparison_table(rows, args.model, args.baseline, len(examples), args.n, args.temperature))
    else:
        summary = result[0]
        width = max(len(k) for k in summary)
        print("\n".join(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}"
                        for k, v in summary.items()))
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {out_dir}/completions.jsonl and summary.json")
    return summary


def after_training(cfg, sampler, tokenizer):
    """train.py's final check (cfg.final_eval > 0), on every rank, with the trainer's own sampler, which
    holds the trained weights: the run's last checkpoint against the model it started from, greedy, on
    the first cfg.final_eval problems of the task's held-out split."""
    last = checkpoint.latest(cfg.output_dir)
    if last is None or cfg.task == "prompts":  # your own prompts have no held-out split
        dist.print0("final evaluation skipped: " + ("the run has no complete checkpoint" if last is None else
                    "--task prompts has no held-out split (run eval.py --task prompts --data TEST_FILE)"))
        return None
    dist.print0(f"\nfinal evaluation: held-out {cfg.task} problems, the trained model against {cfg.model}")
    argv = ["--model", last, "--baseline", cfg.model, "--limit", str(cfg.final_eval), "--sampler", cfg.sampler,
            "--output", os.path.join(cfg.output_dir, "final_eval"), "--batch-size", str(min(cfg.final_eval, 64))]
    return main(argv, sampler, tokenizer, source=models.resolve_model(cfg.model))


if __name__ == "__main__":
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        main()
    except (data.DataError, SamplerUnavailable, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        scoring.close_loop()  # the event loop of async rewards and tools, and its thread
