"""One flat config dataclass: every field with its docstring, checked once.

The command line is generated from it (minigdpo/cli.py): `python train.py --help` prints the docstrings. A preset
(minigdpo/presets.py) is a plain dict of field values; explicit flags override it. `validate` checks every value
once, before any model loads, and `resolve` computes the sizes that train.py prints and logs (saved as "derived",
the key checkpoints have always held).
"""

import importlib.util
import math
from dataclasses import asdict, dataclass, field

from minigdpo.estimators import REGISTRY
from minigdpo.presets import PRESETS
from minigdpo.update import AGGREGATIONS, TRL_NAMES
from rewards import TASKS


# The attention and MLP projections of Llama, Qwen2 and Mistral (and SmolLM2, a Llama).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ConfigError(ValueError):
    """A bad config value; train.py prints it as one line and exits with status 2."""


@dataclass
class Config:
    # What to train
    preset: str = "paper-gsm8k"
    """Starting values: paper-gsm8k, a100, a100-lora, a100-agent, cpu-demo or smoke (minigdpo/presets.py).
    Explicit flags override them."""
    model: str = "Qwen/Qwen2.5-1.5B-Instruct"
    """Policy: a Hugging Face hub name, a local directory, or tiny-random (a 2-layer random Llama, offline)."""
    task: str = "gsm8k"
    """Prompt set and its default rewards: gsm8k, arith, toolcall, math_length, code, or prompts (your --data with a
    `prompt` column in TRL's formats, and your --rewards: docs/tasks.md)."""
    data: str = ""
    """Training data: a local .jsonl/.json/.parquet file or a hub dataset name. Empty: the task's default."""
    rewards: list = field(default_factory=list)
    """Rewards, comma-separated: built-in names, module:function (fn(completion, example), or TRL-style, unchanged),
    or reward models model:PATH[@LABEL]. Empty: the task's."""
    reward_weights: list = field(default_factory=list)
    """One weight per reward, comma-separated (paper Eq. 7). Empty: all 1."""
    condition: list = field(default_factory=list)
    """Conditioned rewards (paper Eq. 8), e.g. length_ok:correct>=1. Repeat the flag or separate with commas."""

    # Agents: tools over several turns (minigdpo/tools.py), as TRL's tools= and environment_factory=
    tools: list = field(default_factory=list)
    """Tools the model may call, module:function (typed, with a Google-style docstring; async ones too)."""
    environment: str = ""
    """An environment class, module:Class: one per concurrent rollout, reset(**row) each; its public methods are
    tools, its get_reward() one more reward named after it. Empty: none."""
    max_tool_calls: int = 0
    """Rounds of tool calls per rollout at most (TRL's max_tool_calling_iterations); 0: only --max-new-tokens,
    which counts every token after the prompt, the tools' included, bounds them."""
    tool_timeout: float = 60.0
    """Seconds a tool call may take before it becomes {"error": "... timed out"}, counted as a failure. 60: a
    sandbox's or a web API's slow call fits, and a tool that hangs costs a minute a round (its later calls that round
    fail at once), not the run."""
    estimator: str = "gdpo"
    """Advantage estimator: gdpo (the paper's TRL code), grpo, gdpo_verl and gdpo_nemo (verl's and NeMo-RL's GDPO),
    GDPO's successors, ... (minigdpo/estimators.py's REGISTRY; docs/estimators.md compares them)."""
    gd2po_mode: str = "snr"
    """gd2po: drop every rollout whose rewards pull apart (hard), or those that nearly cancel, |rho| < tau (snr)."""
    gd2po_tau: float = 0.8
    """gd2po with --gd2po-mode snr: the threshold tau, in [0, 1] (0.8 in GD2PO's scripts, 0.2 in its yaml)."""
    saw_shift: list = field(default_factory=list)
    """saw_*: one offset per reward added before SAW's batch statistics (SAW: +3 on a [-3, 3] reward). Empty: 0."""

    # Batch shape
    group_size: int = 16
    """G: completions sampled per prompt."""
    batch_size: int = 512
    """Completions per step over all ranks (prompts per step x group_size). Must divide by world size x group_size."""
    micro_batch_size: int = 16
    """Sequences per forward/backward pass on one rank; gradient accumulation covers the rest."""
    micro_batch_tokens: int = 0
    """Tokens per pass instead (a prompt once, then its completions), whole groups, longest first; 0: by count.
    Under bnpo (the default loss_agg) each micro-batch weighs the same, so the budget moves the loss; dapo's not."""
    num_iterations: int = 1
    """Optimizer passes over each sampled batch (mu in GRPO). 1 skips the old log-prob pass."""
    dynamic_sampling: bool = False
    """Train only on groups the estimator can learn from, sampling more prompts until there are batch_size."""
    max_sample_rounds: int = 4
    """With --dynamic-sampling: rounds of sampling per step at most. At the cap the step trains on the groups it
    found, rounded down to a multiple of the world size, and skips its update if none (sampling/skipped_update)."""

    # Optimisation
    lr: float = 5e-6
    """Peak learning rate of AdamW."""
    lr_schedule: str = "cosine"
    """cosine or constant, after linear warmup."""
    warmup_ratio: float = 0.1
    """Fraction of optimizer steps spent warming up linearly from 0."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping threshold (global L2 norm); 0 disables clipping."""
    beta: float = 0.04
    """KL coefficient to the frozen reference (k3 estimator). 0 skips the reference model entirely."""
    clip_low: float = 0.2
    """Lower clip of the ratio: 1 - clip_low."""
    clip_high: float = 0.2
    """Upper clip of the ratio: 1 + clip_high (DAPO's clip-higher uses 0.28)."""
    loss_agg: str = "micro_batch_token_mean"
    """Loss aggregation (TRL's loss_type names work too): micro_batch_token_mean (bnpo, the paper's released
    default), token_mean (dapo), seq_mean_token_mean (grpo) or seq_mean_token_sum_norm (dr_grpo) (update.py)."""
    epochs: float = 1.0
    """Passes over the prompt set, used when max_steps is 0."""
    max_steps: int = 0
    """Run exactly this many steps, wrapping around the prompt set as needed (0: run `epochs` epochs)."""
    seed: int = 42
    """Seed for data order, sampling and initialisation."""

    # Sequences and sampling
    max_prompt_len: int = 512
    """Prompt tokens kept (longer prompts are cut from the left)."""
    max_new_tokens: int = 1024
    """Completion tokens at most."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are computed at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    ignore_eos: bool = False
    """Keep sampling past stop tokens up to max_new_tokens (benchmarks compare fixed-length completions)."""

    # Task parameters
    length_limit: int = 4000
    """length_ok's limit (tokens unless length_unit says words). The paper's math setting uses 4000."""
    length_unit: str = "tokens"
    """Unit of length_limit: tokens or words."""
    answer_format: str = "answer"
    """math_length: where the final answer goes, answer (<answer> tags) or boxed (\\boxed{})."""
    arith_difficulty: int = 2
    """arith: number of operations per problem (1 to 6)."""
    reward_timeout: float = 10.0
    """Seconds a reward may take per completion before it counts as None (a TRL-style one, called once per batch:
    this times the batch's completions)."""
    skip_bad_rows: bool = False
    """Skip malformed data rows (and report how many) instead of stopping at the first."""

    # LoRA (needs peft: pip install 'minigdpo[lora]')
    lora_rank: int = 0
    """LoRA rank R: rank-R adapters on the frozen base, whose adapters-off self is the reference. 0: full tuning."""
    lora_alpha: float = 32.0
    """LoRA scale numerator: each adapted layer computes W x + (alpha / R) B A x."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input in the update passes (the sampler never uses it)."""
    lora_targets: list = field(default_factory=lambda: list(LORA_TARGETS))
    """Linear layers inside the decoder layers that get adapters, by name (peft's target_modules)."""
    merge_on_save: bool = False
    """With LoRA: also write each checkpoint's merged model (base + adapters) to hf/, loadable without peft."""

    # Output
    output_dir: str = "runs/gdpo"
    """Directory for metrics.jsonl, samples.jsonl and checkpoints."""
    save_every: int = 50
    """Checkpoint every this many steps (and at the end); 0 saves only at the end."""
    keep_checkpoints: int = 2
    """Complete checkpoints to keep; older ones are deleted."""
    on_save_error: str = "stop"
    """What a failed checkpoint write does: stop (cleanly, with the previous checkpoint intact) or continue."""
    resume: bool = False
    """Continue from the latest complete checkpoint in output_dir."""
    samples_every: int = 10
    """Write a few completions with their rewards to samples.jsonl every this many steps."""
    wandb: str = ""
    """Weights & Biases project to log to; empty disables it (wandb is imported only when set)."""
    final_eval: int = 0
    """After training, evaluate the last checkpoint against the start on this many held-out problems (eval.py)."""

    # Systems: hardware, memory and the rollout backend (the defaults fit; change them for speed or memory)
    dtype: str = "auto"
    """Compute dtype: auto (bf16 on a GPU, and on a CPU with bf16 instructions, else fp32), bf16 or fp32. Master
    weights stay fp32."""
    grad_checkpointing: str = "auto"
    """Recompute each decoder layer's forward in the backward pass, keeping only its input: true, false, or auto: true
    on a CPU, where it measured smaller and no slower (docs/performance.md); false on a GPU (not measured there)."""
    padding_free: bool = True
    """Pack a micro-batch's prompts (once) and completions into one row, no padding, for all but attention, in the
    models the fast pass accepts (Llama, Mistral, Qwen2/3, Phi-3, OLMo-2, sliding windows included; others run their
    own forward: docs/performance.md, "Which models"). throughput/padding_frac shows the padding left."""
    compile: str = "auto"
    """Compile each decoder layer (torch.compile, dynamic shapes): true, false, or auto: eager, as measured so far (a
    CPU: slower compiled; an H200: the first compiled update outlasted the benchmark; docs/performance.md)."""
    ref_offload: bool = False
    """Keep the frozen reference model's shards in CPU memory."""
    sharding: str = "auto"
    """FSDP2 layout: fsdp over all ranks; hsdp shards in a node, replicates across nodes; auto: hsdp on nodes > 1."""
    logprob_chunk: int = 1024
    """Tokens per chunk of the head's log-softmax: (chunk, V) fp32 logits at a time (a model's own forward: rows of
    about this many completion tokens, one row at least), never a micro-batch's (N, T, V)."""
    reduce_grads: str = "micro_batch"
    """FSDP2's gradient reduction: micro_batch (each, a rank keeps its shard) or step (once; whole fp32 grads)."""
    sampler: str = "auto"
    """Rollout backend: hf, vllm, or auto (vllm with CUDA). On a CPU, vllm needs its CPU build (docs/gpus.md)."""
    vllm_gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory vLLM may take for weights and KV cache (colocated with training)."""
    vllm_kv_cache_gib: float = 0.0
    """vLLM's KV cache per rank in GiB instead of a share of memory. 0: that share on a GPU, 1 GiB on the CPU."""
    reward_model_placement: str = "auto"
    """Reward models' weights: resident, offload (CPU between scorings), shard (FSDP2), auto (shard on ranks > 1)."""
    reward_model_batch_size: int = 8
    """Conversations a reward model scores per forward pass."""
    async_steps: int = 0
    """K: batches sampled and scored ahead of the update, while it trains (minigdpo/pipeline.py); step s is sampled by
    the weights of update s - 1 - K at the oldest. 0: each step samples, then trains (no overlap)."""
    sampler_ranks: int = 0
    """N: the last N ranks of the job only sample, each with a whole copy of the weights, which the others, training,
    send them after each update (minigdpo/split.py). 0: every rank samples and trains (colocated)."""
    importance_sampling_cap: float = -1.0
    """C of the truncated importance weight min(pi_old / pi_sampler, C) on the surrogate: the decoupled objective,
    which corrects for stale and mismatched sampler weights (docs/estimators.md). -1: 2 with --async-steps >= 1
    (verl's and slime's choice), off without; 0: off."""
    importance_sampling_level: str = "token"
    """The importance weight per token, or per sequence (exp of the sequence's summed log-ratio; TRL's variant)."""
    logp_gap_warn: float = 0.0
    """Warn when the mean |sampler log-prob - trainer log-prob| exceeds this (a stale weight sync shows here).
    0: by dtype, 1e-3 in fp32 (rounding gives about 1e-6) and 0.05 in bf16 (0.013 seen with the HF sampler, H100)."""


CHOICES = {"estimator": tuple(REGISTRY), "task": tuple(TASKS), "loss_agg": AGGREGATIONS + tuple(TRL_NAMES),
           "preset": tuple(PRESETS), "lr_schedule": ("cosine", "constant"), "sampler": ("auto", "hf", "vllm"),
           "dtype": ("auto", "bf16", "fp32"), "length_unit": ("tokens", "words"), "answer_format": ("answer", "boxed"),
           "on_save_error": ("stop", "continue"), "sharding": ("auto", "fsdp", "hsdp"), "gd2po_mode": ("hard", "snr"),
           "reduce_grads": ("step", "micro_batch"), "compile": ("auto", "true", "false"),
           "grad_checkpointing": ("auto", "true", "false"),
           "reward_model_placement": ("auto", "resident", "offload", "shard"),
           "importance_sampling_level": ("token", "sequence")}


def _check(ok, message):
    if not ok:
        raise ConfigError(message)


def flag(name):
    return name.replace("_", "-")


def validate(cfg):
    """Raise ConfigError on the first bad value. Needs no model, data or GPU."""
    for name, choices in CHOICES.items():
        value = getattr(cfg, name)
        _check(value in choices, f"--{flag(name)} {value!r} is not one of {', '.join(choices)}")
    positive = ["group_size", "batch_size", "micro_batch_size", "num_iterations", "max_sample_rounds", "max_prompt_len",
                "max_new_tokens", "length_limit", "logprob_chunk", "keep_checkpoints", "reward_model_batch_size"]
    for name in positive:
        _check(getattr(cfg, name) >= 1, f"--{flag(name)} must be >= 1, got {getattr(cfg, name)}")
    for name in ["max_steps", "micro_batch_tokens", "max_tool_calls", "save_every", "samples_every", "weight_decay",
                 "max_grad_norm", "beta", "final_eval", "logp_gap_warn", "vllm_kv_cache_gib"]:
        value = getattr(cfg, name)
        _check(math.isfinite(value) and value >= 0, f"--{flag(name)} must be >= 0, got {value}")
    _check(cfg.group_size >= 2, f"--group-size must be at least 2 (a group compares two samples), got {cfg.group_size}")
    _check(cfg.batch_size % cfg.group_size == 0,
           f"--batch-size {cfg.batch_size} must be a multiple of --group-size {cfg.group_size}")
    _check(math.isfinite(cfg.lr) and 0 < cfg.lr < 1, f"--lr must be in (0, 1), got {cfg.lr}")
    _check(0 <= cfg.warmup_ratio < 1, f"--warmup-ratio must be in [0, 1), got {cfg.warmup_ratio}")
    _check(0 <= cfg.clip_low < 1, f"--clip-low must be in [0, 1), got {cfg.clip_low}")
    _check(0 <= cfg.clip_high, f"--clip-high must be >= 0, got {cfg.clip_high}")
    _check(math.isfinite(cfg.temperature) and cfg.temperature > 0, f"--temperature must be > 0, got {cfg.temperature}")
    _check(0 < cfg.top_p <= 1, f"--top-p must be in (0, 1], got {cfg.top_p}")
    _check(math.isfinite(cfg.epochs) and cfg.epochs > 0, f"--epochs must be > 0, got {cfg.epochs}")
    _check(0 < cfg.vllm_gpu_memory_utilization < 1,
           f"--vllm-gpu-memory-utilization must be in (0, 1), got {cfg.vllm_gpu_memory_utilization}")
    for name in ("reward_timeout", "tool_timeout"):
        _check(math.isfinite(getattr(cfg, name)) and getattr(cfg, name) > 0,
               f"--{flag(name)} must be > 0, got {getattr(cfg, name)}")
    _check(1 <= cfg.arith_difficulty <= 6, f"--arith-difficulty must be in 1..6, got {cfg.arith_difficulty}")
    _check(cfg.async_steps >= 0, f"--async-steps must be >= 0, got {cfg.async_steps}")
    _check(cfg.importance_sampling_cap in (-1, 0) or cfg.importance_sampling_cap >= 1,
           f"--importance-sampling-cap must be -1 (auto), 0 (off) or >= 1, got {cfg.importance_sampling_cap}")
    if cfg.importance_sampling_cap == -1:  # resolved once, here: config.json shows the value the run used
        cfg.importance_sampling_cap = 2.0 if cfg.async_steps else 0.0
    _check(not (cfg.async_steps and cfg.reward_model_placement == "shard"),
           "--reward-model-placement shard cannot run with --async-steps: a sharded reward model gathers its layers "
           "over the ranks while the trainer's FSDP2 does too, from another thread (use resident or offload)")
    _check(cfg.sampler_ranks >= 0, f"--sampler-ranks must be >= 0, got {cfg.sampler_ranks}")
    for refused, setting, why in ((cfg.sharding == "hsdp", "--sharding hsdp", "the trainers' mesh is flat"),
                                  (cfg.reward_model_placement == "shard", "--reward-model-placement shard",
                                   "the sampling ranks, which score, hold no mesh")):
        _check(not (refused and cfg.sampler_ranks), f"{setting} cannot run with --sampler-ranks ({why})")
    _check(bool(cfg.model.strip()), "--model must not be empty")
    _check(bool(cfg.output_dir.strip()), "--output-dir must not be empty")
    _check(cfg.seed >= 0, f"--seed must be >= 0, got {cfg.seed}")
    _check(not cfg.wandb or importlib.util.find_spec("wandb"), "--wandb needs wandb: pip install 'minigdpo[wandb]'")
    validate_lora(cfg)
    for name in ("reward_weights", "saw_shift"):
        _check(all(map(math.isfinite, getattr(cfg, name))), f"--{flag(name)} must be finite, got {getattr(cfg, name)}")
    _check(0 <= cfg.gd2po_tau <= 1, f"--gd2po-tau must be in [0, 1], got {cfg.gd2po_tau}")
    return cfg


def validate_lora(cfg):
    """LoRA's flags: a rank of 0 is off, and then no other LoRA flag may be set; --ref-offload has no
    reference model to offload under LoRA. Target names are checked against the model in policy.py."""
    _check(cfg.lora_rank >= 0, f"--lora-rank must be >= 1 (or 0 for full fine-tuning), got {cfg.lora_rank}")
    if cfg.lora_rank == 0:
        defaults = Config()
        given = [f"--{flag(n)}" for n in ("lora_alpha", "lora_dropout", "lora_targets", "merge_on_save")
                 if getattr(cfg, n) != getattr(defaults, n)]
        _check(not given, f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --lora-rank R >= 1 (0: off)")
        return
    _check(importlib.util.find_spec("peft") is not None, "--lora-rank needs peft: pip install 'minigdpo[lora]'")
    _check(math.isfinite(cfg.lora_alpha) and cfg.lora_alpha > 0, f"--lora-alpha must be > 0, got {cfg.lora_alpha}")
    _check(0 <= cfg.lora_dropout < 1, f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout}")
    _check(bool(cfg.lora_targets), "--lora-targets must name at least one layer")
    _check(not cfg.ref_offload, "--ref-offload does nothing with --lora-rank: the reference is the policy with its "
                                "adapters switched off, with no weights of its own to offload")


@dataclass
class Sizes:
    """Sizes computed from the config and the world size, printed and logged with it."""

    world_size: int
    prompts_per_step: int      # B over all ranks
    prompts_per_rank: int
    seqs_per_rank: int         # prompts_per_rank * G
    grad_accum: int            # micro-batches per optimizer step on one rank (0: by tokens, it depends on lengths)
    total_steps: int           # RL steps (each is num_iterations optimizer steps)
    mesh: tuple = ()           # FSDP2 device mesh: (ranks,) flat, or (nodes, ranks per node) for HSDP
    groups_unit: int = 1       # a step's groups come in multiples of this (dynamic sampling): whole shares per rank


def resolve(cfg, world_size, num_prompts, mesh=(), others=0):
    """Derive sizes for `world_size` ranks and a prompt set of `num_prompts` from a validated config; others: with
    --sampler-ranks, the other role's ranks (world_size is this role's), which must hold whole groups too."""
    for world in (world_size, others or 1):
        _check(cfg.batch_size % (world * cfg.group_size) == 0,
               f"--batch-size {cfg.batch_size} must divide by world size x group size = {world} x {cfg.group_size}, "
               "so that every rank holds whole groups" + (" (trainers and samplers alike)" if others else ""))
    prompts = cfg.batch_size // cfg.group_size
    per_rank = prompts // world_size
    seqs = per_rank * cfg.group_size
    _check(num_prompts >= 1, "the prompt set is empty")
    steps = cfg.max_steps or max(1, int(cfg.epochs * num_prompts) // prompts)
    accum = 0 if cfg.micro_batch_tokens else math.ceil(seqs / cfg.micro_batch_size)
    return Sizes(world_size, prompts, per_rank, seqs, accum, steps, tuple(mesh), math.lcm(world_size, others or 1))


def describe(cfg, derived):
    """The whole config and the derived sizes, as printed at start-up and saved with checkpoints."""
    return {"config": asdict(cfg), "derived": asdict(derived)}
