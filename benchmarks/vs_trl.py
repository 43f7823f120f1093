"""minigdpo against TRL's GRPOTrainer on identical work, in the same run, alternating.

    pip install trl            # in the benchmark's environment only; never a minigdpo dependency
    python benchmarks/vs_trl.py --model tiny       # a tiny random Llama with the SmolLM2 tokenizer
    python benchmarks/vs_trl.py --model smollm2    # SmolLM2-135M-Instruct from the cached demo model

Identical work on both sides: the same model directory, the same GSM8K prompts (B per step) and
G completions each, exactly --max-new-tokens tokens per completion (stop tokens ignored on both
sides), the same three rewards (minigdpo's correct/integer/format functions, wrapped for TRL),
GDPO on both (TRL: multi_objective_aggregation="normalize_then_sum"), minigdpo's default loss
normaliser on both (TRL: loss_type="bnpo"), beta 0.04, one iteration, one optimizer step per batch,
the same micro-batch size, fp32 on the CPU. Everything else is each side's default (both use gradient
checkpointing on the CPU; minigdpo shares each prompt's forward pass among its G completions). Each
side runs in its own process; the script alternates them --reps times and reports the median seconds per step (the first step of every
run is warm-up and left out), the peak resident memory, and the ratio TRL / minigdpo.
"""

import argparse
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from minigdpo import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k", "train.jsonl")


def model_dir(kind):

    demo = models.resolve_model(models.DEMO_MODEL)  # the SmolLM2 tokenizer (and model), offline
    if kind == "smollm2":
        return demo

    def build(path):
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
        import torch

        tok = AutoTokenizer.from_pretrained(demo)
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(path)
        tok.save_pretrained(path)

    return models.build_once("bench-tiny-llama-smollm2-tokenizer", build)


def prompts_file(n, out):
    """The first n GSM8K questions (or arith problems offline without the shared data) as jsonl."""
    from rewards.arith import generate

    with open(out, "w") as f:
        if os.path.exists(GSM8K):
            with open(GSM8K) as src:
                for _, line in zip(range(n), src):
                    f.write(line)
        else:
            for ex in generate(2, count=n):
                f.write(json.dumps({"question": ex["messages"][-1]["content"], "answer": f"#### {ex['answer']}"}) + "\n")
    return out


def run_minigdpo(args, model, data):
    import train
    from plot import read_run

    out = tempfile.mkdtemp(prefix="bench-minigdpo-")
    heap_policy(args.heap, args.prompts * args.group // args.micro_batch_size)
    try:
        train.main(["--model", model, "--task", "gsm8k", "--data", data, "--rewards", "correct,integer,format",
                    "--estimator", "gdpo", "--group-size", str(args.group),
                    "--batch-size", str(args.prompts * args.group),
                    "--micro-batch-size", str(args.micro_batch_size), "--beta", "0.04", "--lr", "1e-6",
                    "--max-steps", str(args.steps), "--max-new-tokens", str(args.max_new_tokens),
                    "--max-prompt-len", "512", "--ignore-eos", "--temperature", "1.0", "--sampler", "hf",
                    "--save-every", "0", "--samples-every", "0", "--warmup-ratio", "0",
                    "--dtype", "fp32", "--output-dir", out])  # TRL's dtype on the CPU
        return [row["time/step"] for row in read_run(out)]
    finally:
        shutil.rmtree(out, ignore_errors=True)  # the run's last checkpoint: 2.2 GB for SmolLM2


def heap_policy(heap, per_step):
    """update.trim_host_heap as --heap says: before each micro-batch (trim, as train.py runs), before each step's
    first of `per_step` (once-a-step), or never (keep); docs/performance.md's page faults."""
    from minigdpo import update

    trim, calls = update.trim_host_heap, itertools.count()
    if heap == "keep":
        update.trim_host_heap = lambda: None
    elif heap == "once-a-step":
        update.trim_host_heap = lambda: trim() if next(calls) % per_step == 0 else None


def run_trl(args, model, data):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rewards import get, load_task

    examples = load_task("gsm8k", data).examples
    dataset = Dataset.from_list([{"prompt": ex["messages"], "answer": ex["answer"]} for ex in examples])

    def wrap(name):
        fn = get(name).fn

        def reward(completions, answer, **kwargs):
            return [fn(c[0]["content"], {"answer": a}) for c, a in zip(completions, answer)]

        reward.__name__ = name
        return reward

    class StepTimer(TrainerCallback):
        times = []

        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    config = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="bench-trl-"), per_device_train_batch_size=args.micro_batch_size,
                        gradient_accumulation_steps=args.prompts * args.group // args.micro_batch_size,
                        num_generations=args.group, max_completion_length=args.max_new_tokens, beta=0.04,
                        multi_objective_aggregation="normalize_then_sum", loss_type="bnpo", num_iterations=1, learning_rate=1e-6,
                        max_steps=args.steps, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                        temperature=1.0, generation_kwargs={"min_new_tokens": args.max_new_tokens}, seed=42,
                        lr_scheduler_type="constant", disable_tqdm=True)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=[wrap("correct"), wrap("integer"), wrap("format")], args=config,
                          train_dataset=dataset, callbacks=[timer])
    trainer.train()
    return timer.times


def child(args):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    model = model_dir(args.model)
    data = prompts_file(64, os.path.join(tempfile.mkdtemp(), "prompts.jsonl"))
    times = (run_minigdpo if args.child == "minigdpo" else run_trl)(args, model, data)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps({"times": times, "peak_rss_mb": peak}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--reps", type=int, default=3, help="alternating runs of each side")
    p.add_argument("--steps", type=int, default=4, help="steps per run (the first is warm-up)")
    p.add_argument("--prompts", type=int, default=4, help="B: prompts per step")
    p.add_argument("--group", type=int, default=8, help="G: completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=16,
                   help="sequences per forward/backward on both sides (TRL: per_device_train_batch_size, with "
                        "gradient accumulation making up B x G, so each side takes one optimizer step per batch)")
    p.add_argument("--heap", choices=["trim", "once-a-step", "keep"], default="trim",
                   help="minigdpo's freed heap: given back before each micro-batch (as train.py runs), each step, never")
    p.add_argument("--child", choices=["minigdpo", "trl"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    model_dir(args.model)  # build the model once, outside the timed runs
    results = {"minigdpo": [], "trl": []}
    peaks = {"minigdpo": [], "trl": []}
    for rep in range(args.reps):
        for side in ("trl", "minigdpo") if rep % 2 else ("minigdpo", "trl"):
            cmd = [sys.executable, __file__, "--child", side, "--model", args.model, "--steps", str(args.steps),
                   "--prompts", str(args.prompts), "--group", str(args.group), "--max-new-tokens", str(args.max_new_tokens),
                   "--micro-batch-size", str(args.micro_batch_size), "--heap", args.heap]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{side} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            r = json.loads(line[len("RESULT "):])
            results[side] += r["times"][1:]
            peaks[side].append(r["peak_rss_mb"])
            print(f"rep {rep + 1} {side:<9} s/step {[round(t, 2) for t in r['times']]}  peak RSS {r['peak_rss_mb']:.0f} MB",
                  flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nmodel {args.model}, B={args.prompts} prompts x G={args.group}, {args.max_new_tokens} new tokens, "
          f"micro-batches of {args.micro_batch_size}, "
          f"{args.reps} runs x {args.steps - 1} timed steps per side, torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}")
    print(f"{'':<10} {'median s/step':>14} {'peak RSS MB':>12}")
    for side in ("trl", "minigdpo"):
        print(f"{side:<10} {med[side]:>14.3f} {max(peaks[side]):>12.0f}")
    print(f"TRL / minigdpo: {med['trl'] / med['minigdpo']:.2f}x time, {max(peaks['trl']) / max(peaks['minigdpo']):.2f}x peak RSS")


if __name__ == "__main__":
    main()
