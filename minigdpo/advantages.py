"""Advantage estimators: GRPO, GRPO without std, and GDPO (arXiv 2601.05242).

Every estimator is a pure function with one signature:

    advantages = estimator(rewards, weights)      # rewards (B, G, R), weights (R,) -> (B, G)

Shape legend: B prompts, G samples per prompt (the group), R reward functions.

Rules shared by all three (they match the paper's released TRL code, NVlabs/GDPO
trl-0.18.0-gdpo/trl/trainer/grpo_trainer.py, on NaN-free input):
- every std is the unbiased (Bessel) one, as `torch.std` computes it;
- every normalisation divides by (std + 1e-4);
- `weights` multiply the rewards (GRPO) or the per-reward advantages (GDPO, Eq. 7);
- the batch step of GDPO runs over the whole global batch, so multi-rank callers
  all-gather the rewards first.

NaN marks a reward that does not apply to a sample. It is left out of its group's
statistics and contributes 0 to that sample's advantage. A group in which a reward is
constant (or has fewer than two values) carries no signal for it and gives exactly 0.

Conditioned rewards (Eq. 8) rewrite the reward tensor before any estimator runs:
see `Condition` and `apply_conditions` at the end of the file.
"""

import math
import operator
import re
from dataclasses import dataclass

import torch

EPS = 1e-4  # added to every std, as in the released code


def _weights(rewards, weights):
    """Default weights are 1 per reward; check the shape once."""
    R = rewards.shape[-1]
    if weights is None:
        return torch.ones(R, dtype=rewards.dtype, device=rewards.device)  # (R,)
    weights = torch.as_tensor(weights, dtype=rewards.dtype, device=rewards.device)  # (R,)
    if weights.shape != (R,):
        raise ValueError(f"weights has shape {tuple(weights.shape)}, expected ({R},) for {R} rewards")
    return weights


def group_zscore(x, eps=EPS, scale=True):
    """(x - mean_g) / (std_g + eps) over dim 1, ignoring NaN entries.

    x: (B, G) or (B, G, R). NaN entries, constant groups and groups with fewer than two
    values give 0. With scale=False it only centres: x - mean_g.
    """
    valid = ~torch.isnan(x)                                          # (B, G, ...)
    n = valid.sum(dim=1, keepdim=True)                               # (B, 1, ...)
    x0 = torch.where(valid, x, 0.0)                                  # (B, G, ...)
    mean = x0.sum(dim=1, keepdim=True) / n.clamp(min=1)              # (B, 1, ...)
    dev = torch.where(valid, x - mean, 0.0)                          # (B, G, ...)
    lo = torch.where(valid, x, math.inf).amin(dim=1, keepdim=True)   # (B, 1, ...)
    hi = torch.where(valid, x, -math.inf).amax(dim=1, keepdim=True)  # (B, 1, ...)
    signal = valid & (hi > lo)                                       # (B, G, ...) False for constant groups
    if not scale:
        return torch.where(signal, dev, 0.0)
    var = dev.pow(2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)  # (B, 1, ...) Bessel
    z = dev / (var.sqrt() + eps)                                     # (B, G, ...)
    return torch.where(signal, z, 0.0)


def _weighted_sum(rewards, weights):
    """sum_k w_k r_k per sample; NaN rewards add nothing, a sample with no reward is NaN."""
    s = torch.nansum(rewards * weights, dim=-1)                      # (B, G)
    return torch.where(torch.isnan(rewards).all(dim=-1), math.nan, s)


def grpo(rewards, weights=None, eps=EPS):
    """GRPO on the summed reward (the paper's baseline, Sec. 2).

        s_i = sum_k w_k r_k,i
        A_i = (s_i - mean_g(s)) / (std_g(s) + eps)

    Different reward combinations with the same sum s get the same advantage: this is
    the "reward collapse" that GDPO removes.
    """
    s = _weighted_sum(rewards, _weights(rewards, weights))          # (B, G)
    return group_zscore(s, eps)                                      # (B, G)


def grpo_no_std(rewards, weights=None, eps=EPS):
    """GRPO without the std division: the paper's "GRPO w/o std" ablation.

        A_i = s_i - mean_g(s),   s_i = sum_k w_k r_k,i
    """
    s = _weighted_sum(rewards, _weights(rewards, weights))          # (B, G)
    return group_zscore(s, eps, scale=False)                         # (B, G)


def gdpo(rewards, weights=None, eps=EPS, single_reward_grpo=True):
    """GDPO: normalise each reward within its group, sum, then normalise over the batch.

        A_k,i  = (r_k,i - mean_g(r_k)) / (std_g(r_k) + eps)          Eq. 4, per reward k
        A_sum,i = sum_k w_k A_k,i                                     Eq. 5, weighted as in Eq. 7
        A_i    = (A_sum,i - mean_batch) / (std_batch + eps)          Eq. 6, over all B*G samples

    The batch step counts every sample that has at least one applicable reward; a
    sample whose rewards are all NaN gets 0 and stays out of the batch statistics.

    With a single reward (R = 1) this is `grpo`, as in the released TRL code, which applies
    GDPO only `if apply_gdpo and len(reward_weights) > 1`. single_reward_grpo=False keeps
    the batch step for R = 1, which rescales every advantage by one batch-wide factor.
    """
    if single_reward_grpo and rewards.shape[-1] == 1:
        return grpo(rewards, weights, eps)                           # (B, G)
    w = _weights(rewards, weights)                                   # (R,)
    a_k = group_zscore(rewards, eps)                                 # (B, G, R)  Eq. 4
    a_sum = (a_k * w).sum(dim=-1)                                    # (B, G)     Eq. 5, 7
    has_reward = ~torch.isnan(rewards).all(dim=-1)                   # (B, G)
    flat = a_sum[has_reward]                                         # (M,)
    if flat.numel() < 2:
        return torch.zeros_like(a_sum)
    a = (a_sum - flat.mean()) / (flat.std() + eps)                   # (B, G)     Eq. 6, Bessel std
    return torch.where(has_reward, a, 0.0)


ESTIMATORS = {"grpo": grpo, "grpo_no_std": grpo_no_std, "gdpo": gdpo}


# Naive references: one group at a time, in plain Python floats. Tests use them as the
# oracle for the vectorised estimators above; they are deliberately slow and obvious.

def _mean_std(values):
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, std


def _zscore_list(values, eps, scale=True):
    """values: floats or None; returns one advantage per entry (0 for None)."""
    present = [v for v in values if v is not None]
    if len(present) < 2 or max(present) == min(present):
        return [0.0] * len(values)
    mean, std = _mean_std(present)
    return [0.0 if v is None else (v - mean) / (std + eps) if scale else v - mean for v in values]


def _nan_to_none(x):
    return None if math.isnan(x) else x


def _naive_sums(rewards, weights):
    R = len(rewards[0][0])
    weights = [1.0] * R if weights is None else list(weights)
    out = []
    for group in rewards:
        sums = []
        for sample in group:
            present = [w * r for w, r in zip(weights, sample) if not math.isnan(r)]
            sums.append(sum(present) if present else None)
        out.append(sums)
    return out


def grpo_naive(rewards, weights=None, eps=EPS):
    """Loop-over-groups GRPO; rewards is a nested list (B, G, R) of floats."""
    return [_zscore_list(sums, eps) for sums in _naive_sums(rewards, weights)]


def grpo_no_std_naive(rewards, weights=None, eps=EPS):
    """Loop-over-groups GRPO w/o std."""
    return [_zscore_list(sums, eps, scale=False) for sums in _naive_sums(rewards, weights)]


def gdpo_naive(rewards, weights=None, eps=EPS):
    """Loop-over-groups GDPO: Eq. 4 per reward, Eq. 5/7 sum, Eq. 6 over the batch (GRPO for one reward)."""
    R = len(rewards[0][0])
    if R == 1:
        return grpo_naive(rewards, weights, eps)
    weights = [1.0] * R if weights is None else list(weights)
    summed, applies = [], []
    for group in rewards:
        per_reward = [_zscore_list([_nan_to_none(s[k]) for s in group], eps) for k in range(R)]
        summed.append([sum(weights[k] * per_reward[k][i] for k in range(R)) for i in range(len(group))])
        applies.append([not all(math.isnan(r) for r in s) for s in group])
    batch = [a for g, ok in zip(summed, applies) for a, o in zip(g, ok) if o]
    if len(batch) < 2:
        return [[0.0] * len(g) for g in summed]
    mean, std = _mean_std(batch)
    return [[(a - mean) / (std + eps) if o else 0.0 for a, o in zip(g, ok)] for g, ok in zip(summed, applies)]


NAIVE = {"grpo": grpo_naive, "grpo_no_std": grpo_no_std_naive, "gdpo": gdpo_naive}


# Conditioned rewards (Eq. 8): r_k counts only where another reward r_l passes a threshold.
# The paper uses it to make an easy reward (length) count only when a hard one (correctness)
# is met, because lowering the easy reward's weight alone does not stop it dominating.

_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq}
_CONDITION = re.compile(r"^\s*([\w.-]+)\s*:\s*([\w.-]+)\s*(>=|<=|==|>|<)\s*([-+0-9.eE]+)\s*$")


@dataclass(frozen=True)
class Condition:
    """`target:source>=threshold`: keep reward `target` only where reward `source` >= threshold, else 0."""

    target: str
    source: str
    op: str
    threshold: float

    @classmethod
    def parse(cls, spec):
        m = _CONDITION.match(spec)
        if not m:
            raise ValueError(f"bad condition {spec!r}: expected TARGET:SOURCE>=THRESHOLD, e.g. length_ok:correct>=1")
        target, source, op, threshold = m.groups()
        try:
            value = float(threshold)
        except ValueError:
            raise ValueError(f"bad condition {spec!r}: threshold {threshold!r} is not a number") from None
        if target == source:
            raise ValueError(f"bad condition {spec!r}: a reward cannot be conditioned on itself")
        return cls(target, source, op, value)

    def __str__(self):
        return f"{self.target}:{self.source}{self.op}{self.threshold:g}"


def apply_conditions(rewards, reward_names, conditions):
    """Eq. 8 on a (..., R) reward tensor: r_k <- r_k if cond(r_l) else 0.

    Every condition reads the raw, unconditioned source reward. A NaN target stays NaN
    (the reward still does not apply); a NaN source fails the condition.
    """
    out = rewards.clone()                                            # (..., R)
    for c in conditions:
        for name in (c.target, c.source):
            if name not in reward_names:
                raise ValueError(f"condition {c} names reward {name!r}, which is not among {list(reward_names)}")
        k, l = reward_names.index(c.target), reward_names.index(c.source)
        passed = _OPS[c.op](rewards[..., l], c.threshold)            # (...,) NaN compares False
        out[..., k] = torch.where(passed | torch.isnan(rewards[..., k]), rewards[..., k], 0.0)
    return out
