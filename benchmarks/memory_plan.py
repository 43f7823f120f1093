"""The memory plans of docs/gpus.md for one 80 GB GPU, computed from the models' config.json numbers.

    python benchmarks/memory_plan.py                 # --preset a100 (Qwen2.5-1.5B) and --preset a100-lora (Qwen2.5-7B)
    python benchmarks/memory_plan.py --preset a100-lora --lora-rank 64
    python benchmarks/memory_plan.py --preset a100 --reward-model resident   # with one reward model of the policy's size

Nothing is downloaded and no GPU is needed: the model is built on the meta device from its
config (copied below from the hub's config.json), and with LoRA, minigdpo/lora.py injects peft's
adapters into it exactly as train.py does, so the parameter counts are exact. Activation sizes
are estimates (see `activations`); vLLM's share is what --vllm-gpu-memory-utilization gives it.
Sizes are in GB (1e9 bytes).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minigdpo import cli, lora  # noqa: E402

# From each model's config.json on the hub (Qwen/Qwen2.5-1.5B-Instruct, Qwen/Qwen2.5-7B-Instruct).
MODELS = {
    "Qwen/Qwen2.5-1.5B-Instruct": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                       num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                       tie_word_embeddings=True),
    "Qwen/Qwen2.5-7B-Instruct": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                     tie_word_embeddings=False),
}
GPU_GB = 80
GB = 1e9


def meta_model(numbers):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        return Qwen2ForCausalLM(Qwen2Config(**numbers))


def activations(numbers, n, chunk):
    """Bytes of the update's activations with gradient checkpointing, bf16, one micro-batch of n tokens:
    each layer's input kept (L x n x H), one layer's recomputed forward and its gradient
    (about 8 H + 3 I values per token, twice), and the log-softmax's (chunk, V) fp32 block and its gradient."""
    H, I, L, V = (numbers[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    return L * n * H * 2 + 2 * n * (8 * H + 3 * I) * 2 + 2 * chunk * V * 4


def plan(cfg, reward_model="", gpus=8):
    """[(what, bytes, when resident)] and a summary for a config (a preset plus flags); reward_model: "" for none,
    or where one reward model of the policy's shape lives (resident, offload, or shard over `gpus` GPUs)."""
    numbers = MODELS[cfg.model]
    lm = meta_model(numbers)
    if cfg.lora_rank:
        lora.attach(lm, lora.settings(cfg), read=lambda *a: None)  # the trainer's own injection, on the meta device
    params = dict(lm.named_parameters())
    N = sum(p.numel() for n, p in params.items() if ".lora_" not in n)
    n = sum(p.numel() for n, p in params.items() if ".lora_" in n)
    layer = sum(p.numel() for p in lm.model.layers[0].parameters())
    root = sum(p.numel() for n, p in params.items() if ".layers." not in n)  # embeddings, final norm, untied head
    L, kv, hd = numbers["num_hidden_layers"], numbers["num_key_value_heads"], numbers["hidden_size"] // numbers["num_attention_heads"]
    kv_per_token = 2 * L * kv * hd * 2                                   # K and V, every layer, bf16
    T = cfg.max_prompt_len + cfg.max_new_tokens
    # A micro-batch's tokens: its budget (each group's prompt once, its completions without padding), or by count
    # the sequences padded to the longest, at most max_prompt_len + max_new_tokens each.
    micro = cfg.micro_batch_tokens or cfg.micro_batch_size * T
    vllm = cfg.vllm_gpu_memory_utilization * GPU_GB * GB
    rows = []
    if cfg.lora_rank:
        rows += [("base weights, bf16, frozen (no master copy)", 2 * N, "always"),
                 (f"adapters (rank {cfg.lora_rank}, {n / 1e6:.1f} M parameters), fp32", 4 * n, "always"),
                 ("AdamW moments of the adapters, fp32", 8 * n, "always"),
                 ("adapter gradients, fp32", 4 * n, "update only"),
                 ("reference model: none, the policy with its adapters off", 0, f"(saves {2 * N / GB:.1f} GB)")]
    else:
        rows += [("policy master weights, fp32", 4 * N, "always"),
                 ("AdamW moments, fp32", 8 * N, "always"),
                 ("gradients, fp32", 4 * N, "update only"),
                 ("reference model, bf16 (no master copy)", 2 * N, "always (`--ref-offload` moves it to CPU)")]
    rows += [("FSDP2 bf16 working copies (root + one layer)", 2 * (root + layer), "update only"),
             (f"activations: {micro} tokens with checkpointing, one {cfg.logprob_chunk}-token log-softmax chunk",
              activations(numbers, micro, cfg.logprob_chunk), "update only"),
             (f"vLLM: weights {2 * N / GB:.1f} GB, KV cache and workspace in the rest of "
              f"{cfg.vllm_gpu_memory_utilization} x {GPU_GB} GB", vllm, "sampling only")]
    scoring = reward_host = 0
    if reward_model:  # a sequence classifier of the policy's shape: its layers and embeddings, a (1, H) head
        rm = 2 * (N - (0 if numbers["tie_word_embeddings"] else numbers["vocab_size"] * numbers["hidden_size"]))
        rows += [{"resident": ("reward model, bf16, resident", rm, "always"),
                  "offload": ("reward model, bf16, offloaded", rm, "scoring only (in CPU RAM between scorings)"),
                  "shard": (f"reward model, bf16, sharded over {gpus} GPUs", rm / gpus, "always")}[reward_model],
                 (f"reward model's activations: {cfg.reward_model_batch_size} x {T} tokens, no grad, one layer at a time",
                  cfg.reward_model_batch_size * T * (4 * numbers["hidden_size"] + 3 * numbers["intermediate_size"]) * 2,
                  "scoring only")]
        scoring = sum(b for _, b, when in rows if when.startswith("scoring only"))
        reward_host = rm if reward_model == "offload" else 0
    always = sum(b for _, b, when in rows if when.startswith("always"))
    update = always + sum(b for what, b, when in rows if when == "update only")
    # The scorer runs once vLLM sleeps, so its peak replaces sampling's; with --dynamic-sampling a round is scored
    # before the next one samples, with vLLM awake, and its peak adds to sampling's.
    sampling = always + vllm + (scoring if cfg.dynamic_sampling else 0)
    summary = dict(parameters=N, adapters=n, always=always, sampling=sampling, scoring=always + scoring, update=update,
                   reward_host=reward_host, kv_per_token=kv_per_token, kv_batch=cfg.batch_size * T * kv_per_token,
                   kv_room=vllm - 2 * N, full_ft=16 * N + 2 * N)
    return rows, summary


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", action="append", choices=["a100", "a100-lora"])
    p.add_argument("--lora-rank", type=int)
    p.add_argument("--reward-model", choices=["resident", "offload", "shard"], default="",
                   help="add one reward model of the policy's shape, placed so (shard: over 8 GPUs)")
    p.add_argument("--dynamic-sampling", action="store_true", help="score each round beside vLLM, as it does")
    args = p.parse_args(argv)
    for preset in args.preset or ["a100", "a100-lora"]:
        flags = ["--preset", preset] + (["--lora-rank", str(args.lora_rank)] if args.lora_rank and preset == "a100-lora" else [])
        cfg = cli.parse_args(flags + (["--dynamic-sampling"] if args.dynamic_sampling else []))
        rows, s = plan(cfg, args.reward_model)
        print(f"\n{cfg.model}, --preset {preset}: {s['parameters'] / 1e9:.2f} B parameters"
              + (f", {s['adapters'] / 1e6:.1f} M trainable ({100 * s['adapters'] / s['parameters']:.2f}%)" if s["adapters"] else ""))
        print("| what | size | resident |\n|---|---|---|")
        for what, size, when in rows:
            print(f"| {what} | {size / GB:.1f} GB | {when} |")
        scoring = " and scoring" if args.reward_model and cfg.dynamic_sampling else ""
        print(f"peak while sampling{scoring}: {s['sampling'] / GB:.1f} GB; "
              + (f"while scoring (vLLM asleep): {s['scoring'] / GB:.1f} GB; " if args.reward_model and not scoring else "")
              + f"during the update: {s['update'] / GB:.1f} GB (of which {s['always'] / GB:.1f} GB always resident)")
        if args.reward_model == "offload":
            print(f"offload keeps a whole host copy of the reward model on every rank: {s['reward_host'] / GB:.1f} GB of "
                  f"CPU memory per rank, 8 x that on a node of 8 GPUs")
        print(f"KV cache: {s['kv_per_token'] / 1e3:.1f} KB per token; {cfg.batch_size} sequences of "
              f"{cfg.max_prompt_len + cfg.max_new_tokens} tokens need {s['kv_batch'] / GB:.1f} GB; vLLM's share has "
              f"{s['kv_room'] / GB:.1f} GB beyond the weights")
        print(f"full fine-tuning of this model: master weights, moments, gradients and a bf16 reference "
              f"= {s['full_ft'] / GB:.1f} GB before activations")


if __name__ == "__main__":
    main()
