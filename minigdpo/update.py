"""The policy update: PPO's clipped surrogate with a k3 KL penalty to a frozen reference, accumulated over
micro-batches and applied with FSDP2; the optimizer (AdamW) and its learning-rate schedule.

Shape legend: N sequences in the micro-batch, b distinct prompts in it, P prompt columns, T completion tokens.

    ratio   = exp(logp - old_logp)
    pg      = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    kl      = exp(ref - logp) - (ref - logp) - 1          (k3, unbiased and >= 0)
    loss_t  = pg + beta * kl                              per token, then aggregated

Aggregations (`agg`), each also known by its TRL `loss_type` name (TRL 1.16's names, which the oracle test
runs; the paper's trl-0.18 code has all but dapo):

| agg                       | TRL      | one micro-batch's loss                                   |
|---------------------------|----------|----------------------------------------------------------|
| "micro_batch_token_mean"  | bnpo     | sum / this micro-batch's tokens / micro-batches per step |
| "token_mean"              | dapo     | sum / tokens of the whole global batch                   |
| "seq_mean_token_mean"     | grpo     | sum_i (sum_t / T_i) / sequences of the global batch      |
| "seq_mean_token_sum_norm" | dr_grpo  | sum_i (sum_t / max_len) / sequences of the global batch  |

- micro_batch_token_mean is the paper's: the default `loss_type="bnpo"` of its released trl-0.18 code
  (NVlabs/GDPO trl-GDPO). Each micro-batch weighs the same whatever its token count, so the result
  depends on how a batch is cut: TRL cuts a random permutation of the sequences; minigdpo cuts --micro-batch-size
  sequences at a time, prompts in order of length (microbatch.by_count: a group may straddle two micro-batches),
  or whole groups by tokens (--micro-batch-tokens).
- token_mean (DAPO) divides by the global token count, so gradient accumulation over micro-batches
  (and ranks) gives exactly the gradient of one large batch.
- seq_mean_token_mean is the original GRPO objective; seq_mean_token_sum_norm is Dr. GRPO, whose
  constant `max_len` weighs long and short answers alike.

`update` computes the one normaliser its aggregation needs (the last column's divisor) and passes it to
`policy_loss` as `norm`, as this rank's share: FSDP2 averages the gradients over ranks, as DDP does for TRL.
The asymmetric clip (`clip_high` > `clip_low`) is DAPO's "clip-higher"; both default to 0.2.
"""

import ctypes
import math
import re

import torch
import torch.nn as nn

from minigdpo import dist, fsdp

AGGREGATIONS = ("micro_batch_token_mean", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
TRL_NAMES = {"bnpo": "micro_batch_token_mean", "dapo": "token_mean", "grpo": "seq_mean_token_mean",
             "dr_grpo": "seq_mean_token_sum_norm"}  # TRL's loss_type -> ours


def aggregation(name):
    """Our name for an aggregation given by our name or by TRL's loss_type; ValueError otherwise."""
    if name in AGGREGATIONS or name in TRL_NAMES:
        return TRL_NAMES.get(name, name)
    raise ValueError(f"unknown loss aggregation {name!r}; choose from {', '.join(AGGREGATIONS + tuple(TRL_NAMES))}")


def policy_loss(logp, old_logp, ref_logp, advantages, mask, *, clip_low=0.2, clip_high=0.2, beta=0.04,
                agg="micro_batch_token_mean", norm=None, sampler_logp=None, importance_sampling_cap=0.0,
                importance_sampling_level="token"):
    """Return (loss, metrics) for one micro-batch: a pure function of its tensors. With --num-iterations 1 old_logp is
    logp detached: the ratio is 1, the clip never binds (the gradient is adv * grad(logp)); it acts from a 2nd pass.

    logp, old_logp, ref_logp, mask: (N, T); advantages: (N,). ref_logp may be None when beta == 0.
    norm: the aggregation's normaliser (module docstring's table): micro-batches per step for
    micro_batch_token_mean (after its own token mean), tokens for token_mean, sequences for
    seq_mean_token_mean, sequences x max_len for seq_mean_token_sum_norm; default, this micro-batch alone.
    importance_sampling_cap > 0 multiplies the surrogate (not the KL) by the truncated importance weight
    min(exp(old_logp - sampler_logp), importance_sampling_cap), which corrects for the sampler/trainer mismatch
    (Yao et al., 2025) and, old_logp being the proximal policy's, for stale sampler weights too: the decoupled
    objective of asynchronous training (AReaL; docs/estimators.md). importance_sampling_level "sequence" gives every
    token of a sequence its sequence's weight, exp of the summed log-ratio (TRL's sequence_truncate). Metrics are
    0-dim tensors (no host sync): sums over this micro-batch's valid tokens, except ratio_min and ratio_max.
    """
    agg = aggregation(agg)
    mask = mask.to(logp.dtype)                                      # (N, T)
    adv = advantages.to(logp.dtype).unsqueeze(1)                    # (N, 1)
    ratio = torch.exp(logp - old_logp)                              # (N, T)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)       # (N, T)
    pg = -torch.min(ratio * adv, clipped * adv)                     # (N, T)
    importance_sampling_cap = max(importance_sampling_cap, 0.0)  # config's -1 ("auto") unresolved: off
    if importance_sampling_cap:
        log_w = (old_logp - sampler_logp) * mask                    # (N, T) pi_old / mu, in logs
        if importance_sampling_level == "sequence":
            log_w = log_w.sum(dim=1, keepdim=True).expand_as(log_w) # (N, T) the sequence's, on each of its tokens
        raw = torch.exp(log_w)                                      # (N, T)
        is_weight = raw.clamp(max=importance_sampling_cap)          # (N, T)
        is_clipped = raw > importance_sampling_cap                  # (N, T)
        pg = pg * is_weight                                         # (N, T)
    per_token = pg                                                  # (N, T)
    if beta != 0.0:
        delta = ref_logp - logp                                     # (N, T)
        kl = torch.exp(delta) - delta - 1                           # (N, T) k3
        per_token = per_token + beta * kl                           # (N, T)

    masked = per_token * mask                                       # (N, T)
    if agg == "micro_batch_token_mean":  # the micro-batch's own token mean, over `norm` micro-batches
        loss = masked.sum() / mask.sum().clamp(min=1) / (norm if norm is not None else 1)
    elif agg == "seq_mean_token_mean":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # (N,) each sequence's token mean
        loss = per_seq.sum() / (norm if norm is not None else logp.shape[0])
    else:  # a sum over tokens, divided by a count of tokens (or Dr. GRPO's sequences x max_len)
        if norm is None and agg == "seq_mean_token_sum_norm":
            raise ValueError("seq_mean_token_sum_norm needs norm = sequences x max_len (the completion length limit)")
        loss = masked.sum() / (norm if norm is not None else mask.sum().clamp(min=1))

    with torch.no_grad():
        m = mask.bool()                                             # (N, T)
        metrics = {
            "tokens": mask.sum(),
            "pg_loss": (pg * mask).sum(),
            "clip_low": ((ratio < 1 - clip_low) & (adv < 0) & m).sum(),    # the clip binds from below
            "clip_high": ((ratio > 1 + clip_high) & (adv > 0) & m).sum(),  # ... from above
            "ratio": (ratio * mask).sum(),
            "ratio_min": ratio.masked_fill(~m, float("inf")).min(),
            "ratio_max": ratio.masked_fill(~m, float("-inf")).max(),
            "kl": (kl * mask).sum() if beta != 0.0 else torch.zeros((), device=logp.device),
            "is_weight": (is_weight * mask).sum() if importance_sampling_cap else mask.sum(),  # 1 per token when off
            "is_clipped": (is_clipped & m).sum() if importance_sampling_cap else torch.zeros((), device=logp.device),
        }
    return loss, metrics


@torch.no_grad()
def fill_logprobs(model, batches, key, cfg, reshard=False):
    """Store a no-grad log-prob pass (reference or old policy) in each micro-batch's `key` field;
    reshard=True then frees the parameters FSDP2 keeps gathered for a backward (none for the reference)."""
    for mb in batches:
        setattr(mb, key, model(mb, cfg.temperature, cfg.logprob_chunk))  # (N, T) log-probs
    if reshard:
        fsdp.reshard(model)


# The update --------------------------------------------------------------------------------------

UPDATE_SUMS = ("tokens", "loss", "pg_loss", "kl", "clip_low", "clip_high", "ratio", "entropy", "gap", "is_weight",
               "is_clipped")


def normaliser(batches, cfg):
    """The aggregation's one divisor (the module docstring's last column), as this rank's share of it.

    Each rank divides its micro-batches' sums by a global count over the world size, and FSDP2 averages the
    gradients over the ranks (their sum / world size): together, each sum is divided by the global count, so
    accumulation over micro-batches and ranks equals one big batch, however the groups are spread over ranks."""
    counts = torch.tensor([float(sum(mb.tokens for mb in batches)), float(sum(mb.seqs for mb in batches)),
                           float(sum(mb.seqs > 0 for mb in batches))], dtype=torch.float64)
    tokens, seqs, micro = (max(1.0, n) / dist.world_size() for n in dist.all_reduce(counts).tolist())
    return {"micro_batch_token_mean": micro, "token_mean": tokens, "seq_mean_token_mean": seqs,
            "seq_mean_token_sum_norm": seqs * cfg.max_new_tokens}[aggregation(cfg.loss_agg)]


def update(model, opt, sched, batches, cfg):
    """num_iterations optimizer steps over the micro-batches; returns this rank's statistics by name
    (sums over the first pass, as UPDATE_SUMS lists, and ratio_min, ratio_max, grad_norm, skipped_steps)."""
    device = dist.device()  # every statistic stays there: the update waits for the device only where it must
    totals = {k: torch.zeros((), device=device) for k in UPDATE_SUMS + ("skipped_steps",)}
    totals |= {"ratio_min": torch.full((), math.inf, device=device),
               "ratio_max": torch.full((), -math.inf, device=device)}
    agg, norm = aggregation(cfg.loss_agg), normaliser(batches, cfg)
    for it in range(cfg.num_iterations):
        opt.zero_grad(set_to_none=True)
        for i, mb in enumerate(batches):
            trim_host_heap()
            last = i == len(batches) - 1  # --reduce-grads step: across ranks at the last; micro_batch: at each
            fsdp.reduce_gradients(model, reduce_scatter=last or cfg.reduce_grads == "micro_batch", all_reduce=last)
            logp, entropy = model(mb, cfg.temperature, cfg.logprob_chunk, entropy=True)  # (N, T) each
            old = logp.detach() if mb.old_logp is None else mb.old_logp  # 1 iteration: the sampling policy is this one
            loss, stats = policy_loss(logp, old, mb.ref_logp, mb.adv, mb.mask, clip_low=cfg.clip_low,
                                      clip_high=cfg.clip_high, beta=cfg.beta, agg=agg, norm=norm,
                                      sampler_logp=mb.sampler_logp, importance_sampling_cap=cfg.importance_sampling_cap,
                                      importance_sampling_level=cfg.importance_sampling_level)
            loss.backward()
            if it == 0:
                stats |= {"loss": loss.detach(), "entropy": (entropy * mb.mask).sum(),
                          "gap": ((old - mb.sampler_logp).abs() * mb.mask).sum()}  # sampler vs trainer
                for k in UPDATE_SUMS:
                    totals[k] = totals[k] + stats[k]
                totals["ratio_min"] = torch.minimum(totals["ratio_min"], stats["ratio_min"])
                totals["ratio_max"] = torch.maximum(totals["ratio_max"], stats["ratio_max"])
        grad_norm = clip_grad(model, cfg.max_grad_norm)
        totals["skipped_steps"] = totals["skipped_steps"] + skip_if_not_finite(opt, grad_norm)
        opt.step()
        sched.step()  # the schedule follows the run's steps, a skipped one too
        totals["grad_norm"] = grad_norm
    opt.zero_grad(set_to_none=True)  # free the gradients before the sampler wakes up
    return totals


# Parameters the Hugging Face Trainer exempts from weight decay, by name (Trainer.get_decay_parameter_names,
# transformers 5.20): biases and normalisation weights. TRL's trainers, and so the paper's runs, use its optimizer.
NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def optimizer(model, lr, weight_decay):
    """AdamW over the parameters that require grad; biases and normalisation weights (by name, or inside an
    nn.LayerNorm) get no weight decay, as in the Hugging Face Trainer."""
    in_layernorm = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if NO_DECAY.search(name.lower()) or id(p) in in_layernorm else decay).append(p)
    groups = [{"params": ps, "weight_decay": wd} for ps, wd in ((decay, weight_decay), (no_decay, 0.0)) if ps]
    # fused: one kernel per step, no foreach temporaries the size of the model
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=True)


def trim_host_heap(libc=ctypes.CDLL(None)):
    """Give glibc's free heap back to the system (malloc_trim) before a pass: a micro-batch's freed temporaries stay in
    a heap whose holes the next one's do not fit, and on the CPU the update's peak memory grew by that. Trimmed before
    each micro-batch, it fell from 8.4 to 7.3 GB at the same speed (docs/performance.md). Nothing without glibc."""
    getattr(libc, "malloc_trim", lambda pad: None)(0)


def skip_if_not_finite(opt, grad_norm):
    """Have opt's next step skip itself on the device where the gradient norm is NaN or inf, instead of poisoning
    the weights: fused AdamW reads found_inf as under a GradScaler (its step count stays too), so no host waits for
    the norm. Returns found_inf, 1.0 for a step that will be skipped. Only fused AdamW reads it (the others assert
    it is None): anything else is refused. The learning-rate schedule still moves on: it follows the run's steps."""
    if not opt.defaults.get("fused"):
        raise ValueError(f"a step that skips itself needs a fused AdamW (update.optimizer), not {type(opt).__name__} "
                         "without fused=True")
    opt.found_inf = (~torch.isfinite(grad_norm)).float()
    return opt.found_inf


def lr_lambda(total_steps, warmup_ratio, schedule):
    """Linear warmup to the peak, then constant or cosine decay to 0."""
    warmup = math.ceil(warmup_ratio * total_steps)

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def scheduler(opt, total_steps, warmup_ratio, schedule):
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total_steps, warmup_ratio, schedule))


def clip_grad(model, max_norm):
    """Clip the global gradient norm across all shards; returns the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    return dist.full_tensor(norm).float()


def step_metrics(totals):
    """The update's statistics, reduced over ranks, as the per-token means metrics.jsonl logs."""
    sums = dict(zip(UPDATE_SUMS, dist.all_reduce(torch.stack([totals[k].float() for k in UPDATE_SUMS])).tolist()))
    tokens = max(sums["tokens"], 1.0)
    return {"loss": sums["loss"] / dist.world_size(),  # each rank's loss carries the 1/world of its normaliser
            "loss/pg": sums["pg_loss"] / tokens, "kl": sums["kl"] / tokens,
            "loss/clip_low_frac": sums["clip_low"] / tokens, "loss/clip_high_frac": sums["clip_high"] / tokens,
            "loss/ratio_mean": sums["ratio"] / tokens,
            "loss/ratio_min": dist.all_reduce(totals["ratio_min"].float(), op="min").item(),
            "loss/ratio_max": dist.all_reduce(totals["ratio_max"].float(), op="max").item(),
            "entropy": sums["entropy"] / tokens, "grad_norm": totals["grad_norm"].item(),
            "sampler/logp_gap": sums["gap"] / tokens, "loss/skipped_steps": int(totals["skipped_steps"].item()),
            "async/is_weight_mean": sums["is_weight"] / tokens, "async/is_clipped_frac": sums["is_clipped"] / tokens}


def throughput(batches, model, cfg, flops_per_token, attention_flops, seconds):
    """The update's work, every rank's: real tokens (each prompt once where the model shares it, every completion
    token) and the positions computed, padding included, whose difference is throughput/padding_frac; TFLOP/s
    on the real tokens only, with attention's 12 x layers x hidden per causal (query, key) pair."""
    shared = model.fast
    real, computed, pairs = dist.all_reduce(torch.tensor([[mb.real_tokens(shared), mb.model_tokens(), mb.pairs]
                                                          for mb in batches], dtype=torch.float64).sum(0)).tolist()
    passes, secs = cfg.num_iterations, max(seconds["update"], 1e-9)
    return {"throughput/update_tokens_per_s": passes * real / secs,
            "throughput/padding_frac": 1 - real / max(computed, 1),
            "throughput/tokens_per_micro_batch": computed / max(1, len(batches) * dist.world_size()),
            "throughput/update_tflops_per_device": passes * (flops_per_token * real + attention_flops * pairs) / secs
            / 1e12 / dist.world_size(), "throughput/attention_flops_frac": attention_flops * pairs
            / max(flops_per_token * real + attention_flops * pairs, 1)}
