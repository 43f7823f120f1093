"""Presets: plain dicts of Config field values (minigdpo/config.py), which explicit flags override.

    python train.py --preset a100 --estimator gdpo     # the preset, then the flags given
"""

PRESETS = {
    # The paper's released GSM8K recipe: 512 completions (32 prompts x G=16) a step, on 8 GPUs x 16 x 4 accumulations.
    "paper-gsm8k": dict(),
    # One 80 GB A100: G=8, 256 completions per step, micro-batches that fit with vLLM colocated.
    "a100": dict(group_size=8, batch_size=256, micro_batch_tokens=16384, grad_checkpointing="true",
                 vllm_gpu_memory_utilization=0.35),
    # Qwen2.5-7B on one 80 GB A100: frozen bf16 base, rank-32 adapters, no reference copy; lr 5e-5 untuned.
    "a100-lora": dict(model="Qwen/Qwen2.5-7B-Instruct", group_size=8, batch_size=256, micro_batch_tokens=16384,
                      grad_checkpointing="true", lora_rank=32, lora_alpha=64.0, lr=5e-5,
                      vllm_gpu_memory_utilization=0.55),
    # An agent on one 80 GB A100: Qwen2.5-1.5B-Instruct (a template that takes tools) with the calculator task's tool,
    # 4-digit products; economy weighs half (rewards/calculator.py says why).
    "a100-agent": dict(task="calculator", tools=["rewards.calculator:calculate"], reward_weights=[1.0, 1.0, 0.5],
                       arith_difficulty=4, group_size=8, batch_size=256, max_new_tokens=512, max_tool_calls=4,
                       micro_batch_tokens=16384, grad_checkpointing="true", vllm_gpu_memory_utilization=0.35,
                       output_dir="runs/a100-agent"),
    # Offline, 2 CPU cores: SmolLM2-135M learns arithmetic in 8 steps (beta 0: no reference), then meets its base.
    "cpu-demo": dict(model="HuggingFaceTB/SmolLM2-135M-Instruct", task="arith", group_size=8, batch_size=32,
                     lr=2e-5, warmup_ratio=0.0, lr_schedule="constant", max_prompt_len=256, max_new_tokens=48,
                     max_steps=8, beta=0.0, temperature=0.7, arith_difficulty=1, save_every=0, samples_every=4,
                     output_dir="runs/cpu-demo", sampler="hf", final_eval=64),
    # Offline, 2 CPU cores: an agent. SmolLM2-135M warmed to call the calculator on some problems
    # (rewards/calculator_warmup.py, built once) learns by RL to call it on products, then meets the warmed model on
    # held-out ones (three digits: right only through the tool). Rewards and weights as a100-agent's. 4 problems a
    # step (2 drew too few products for RL to settle), 4 steps, lr 3e-5 (at 5e-5 one seed of two learnt to call with
    # the first factor alone); 64 new tokens fit one call, its result and the answer.
    "cpu-agent": dict(model="smollm2-135m-agent", task="calculator", tools=["rewards.calculator:calculate"],
                      reward_weights=[1.0, 1.0, 0.5], arith_difficulty=3, group_size=8, batch_size=32, lr=3e-5,
                      warmup_ratio=0.0, lr_schedule="constant", max_prompt_len=128, max_new_tokens=64,
                      max_tool_calls=1, max_steps=4, beta=0.0, temperature=0.7, save_every=0, samples_every=2,
                      output_dir="runs/cpu-agent", sampler="hf", final_eval=48),
    # A tiny random model for tests and smoke runs; fp32 on every CPU, the precision the tests' bounds are written for.
    "smoke": dict(model="tiny-random", task="arith", group_size=4, batch_size=8, micro_batch_size=4, lr=1e-3,
                  max_prompt_len=64, max_new_tokens=8, max_steps=2, save_every=1, samples_every=1,
                  output_dir="runs/smoke", sampler="hf", warmup_ratio=0.0, reward_timeout=5.0, dtype="fp32"),
}
