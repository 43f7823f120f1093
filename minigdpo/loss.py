"""The policy loss: PPO's clipped surrogate plus a k3 KL penalty to a frozen reference.

Shape legend: N sequences in the micro-batch, T completion tokens.

    ratio   = exp(logp - old_logp)
    pg      = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    kl      = exp(ref - logp) - (ref - logp) - 1          (k3, unbiased and >= 0)
    loss_t  = pg + beta * kl                              per token, then aggregated

Aggregations (`agg`), each also known by its TRL `loss_type` name:

| agg                       | TRL 1.16 | one micro-batch's loss                                   |
|---------------------------|----------|----------------------------------------------------------|
| "micro_batch_token_mean"  | bnpo     | sum / this micro-batch's tokens / micro-batches per step |
| "token_mean"              | dapo     | sum / tokens of the whole global batch                   |
| "seq_mean_token_mean"     | grpo     | sum_i (sum_t / T_i) / sequences of the global batch      |
| "seq_mean_token_sum_norm" | dr_grpo  | sum_i (sum_t / max_len) / sequences of the global batch  |

- micro_batch_token_mean is the paper's: the default `loss_type="bnpo"` of its released trl-0.18
  code (NVlabs/GDPO trl-GDPO/trl-0.18.0-gdpo), whose Trainer then divides by the accumulation steps.
  Each micro-batch weighs the same whatever its token count, so the result depends on how the batch
  is cut: TRL cuts a random permutation of the sequences, minigdpo cuts whole groups in order of
  prompt length (train.micro_batches), so the same batch gives a slightly different gradient.
  Pass `num_micro_batches`, this rank's count (every rank has the same).
- token_mean (DAPO) divides by the global token count `num_tokens`, so gradient accumulation over
  micro-batches (and ranks) gives exactly the gradient of one large batch.
- seq_mean_token_mean is the original GRPO objective; seq_mean_token_sum_norm is Dr. GRPO, whose
  constant `max_len` weighs long and short answers alike. Pass the global sequence count `num_seqs`.

Every normaliser is this rank's share: FSDP2 averages the gradients over ranks, as DDP does for TRL.
The asymmetric clip (`clip_high` > `clip_low`) is DAPO's "clip-higher"; both default to 0.2.
"""

import torch

AGGREGATIONS = ("micro_batch_token_mean", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
TRL_NAMES = {"bnpo": "micro_batch_token_mean", "dapo": "token_mean", "grpo": "seq_mean_token_mean",
             "dr_grpo": "seq_mean_token_sum_norm"}  # TRL's loss_type -> ours


def aggregation(name):
    """Our name for an aggregation given by our name or by TRL's loss_type; ValueError otherwise."""
    if name in AGGREGATIONS:
        return name
    if name in TRL_NAMES:
        return TRL_NAMES[name]
    raise ValueError(f"unknown loss aggregation {name!r}; choose from {', '.join(AGGREGATIONS + tuple(TRL_NAMES))}")


def policy_loss(
    logp,
    old_logp,
    ref_logp,
    advantages,
    mask,
    *,
    clip_low=0.2,
    clip_high=0.2,
    beta=0.04,
    agg="micro_batch_token_mean",
    num_tokens=None,
    num_seqs=None,
    max_len=None,
    num_micro_batches=1,
    is_weight=None,
):
    """Return (loss, metrics) for one micro-batch.

    logp, old_logp, ref_logp, mask: (N, T); advantages: (N,). ref_logp may be None when beta == 0.
    num_tokens / num_seqs / num_micro_batches: this rank's share of the batch being accumulated
    (default: this micro-batch alone). is_weight: optional (N, T) truncated importance weight that corrects
    for the sampler/trainer mismatch; it multiplies the surrogate, not the KL.
    Metrics are 0-dim tensors (no host sync): sums over this micro-batch's valid tokens, to be
    divided by metrics["tokens"] once the step is done, except ratio_min and ratio_max.
    """
    agg = aggregation(agg)
    mask = mask.to(logp.dtype)                                      # (N, T)
    adv = advantages.to(logp.dtype).unsqueeze(1)                    # (N, 1)
    ratio = torch.exp(logp - old_logp)                              # (N, T)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)       # (N, T)
    pg = -torch.min(ratio * adv, clipped * adv)                     # (N, T)
    if is_weight is not None:
        pg = pg * is_weight                                         # (N, T)
    per_token = pg                                                  # (N, T)
    if beta != 0.0:
        delta = ref_logp - logp                                     # (N, T)
        kl = torch.exp(delta) - delta - 1                           # (N, T) k3
        per_token = per_token + beta * kl                           # (N, T)

    masked = per_token * mask                                       # (N, T)
    if agg == "micro_batch_token_mean":
        loss = masked.sum() / mask.sum().clamp(min=1) / num_micro_batches
    elif agg == "token_mean":
        denom = num_tokens if num_tokens is not None else mask.sum().clamp(min=1)
        loss = masked.sum() / denom
    else:
        if agg == "seq_mean_token_mean":
            per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # (N,)
        else:
            if max_len is None:
                raise ValueError("seq_mean_token_sum_norm needs max_len (the completion length limit)")
            per_seq = masked.sum(dim=1) / max_len                      # (N,)
        loss = per_seq.sum() / (num_seqs if num_seqs is not None else logp.shape[0])

    with torch.no_grad():
        m = mask.bool()                                             # (N, T)
        low = (ratio < 1 - clip_low) & (adv < 0) & m                # (N, T) the clip binds from below
        high = (ratio > 1 + clip_high) & (adv > 0) & m              # (N, T) the clip binds from above
        metrics = {
            "tokens": mask.sum(),
            "pg_loss": (pg * mask).sum(),
            "clip_low": low.sum(),
            "clip_high": high.sum(),
            "ratio": (ratio * mask).sum(),
            "ratio_min": ratio.masked_fill(~m, float("inf")).min(),
            "ratio_max": ratio.masked_fill(~m, float("-inf")).max(),
            "kl": (kl * mask).sum() if beta != 0.0 else torch.zeros((), device=logp.device),
        }
    return loss, metrics
