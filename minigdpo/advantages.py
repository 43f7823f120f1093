"""Advantage estimators: GRPO, GRPO without std, GDPO (arXiv 2601.05242), and the GDPO variants of verl and NeMo-RL.
GDPO's successors, GD2PO and SAW, are in minigdpo/successors.py; minigdpo/estimators.py names them all (REGISTRY)
for the command line.

Every estimator is a pure function with one signature:

    advantages = estimator(rewards, weights, lengths=None)   # rewards (B, G, R), weights (R,) -> (B, G)

Shape legend: B prompts, G samples per prompt (the group), R reward functions. `lengths` (B, G) gives each
completion's length in tokens; `gdpo_verl`, `gd2po` and `saw_gdpo` read it (their batch step whitens over tokens, so
each sample weighs its length), the others ignore it.

Rules shared by grpo, grpo_no_std and gdpo (they match the paper's released TRL code,
NVlabs/GDPO trl-0.18.0-gdpo/trl/trainer/grpo_trainer.py, on NaN-free input):
- every std is the unbiased (Bessel) one, as `torch.std` computes it;
- every normalisation divides by (std + 1e-4);
- `weights` multiply the rewards (GRPO) or the per-reward advantages (GDPO, Eq. 7);
- the batch step of GDPO runs over the whole global batch, so multi-rank callers all-gather the rewards first.
gdpo_verl and gdpo_nemo reproduce the other released GDPOs; their docstrings say where they depart from these rules.
Each estimator has a loop-over-groups twin in tests/advantages_naive.py, the tests' oracle.

NaN marks a reward that does not apply to a sample. The estimators that normalise each reward (gdpo and its peers)
leave it out of its group's statistics, and it contributes 0 to that sample's advantage. Those that sum the rewards
first (grpo, grpo_no_std, saw_grpo) add a NaN reward as 0, as TRL's nansum does: in the group (NaN, 1), (0, 1),
(1, 1) the first sample gets exactly the advantage of (0, 1). Under every estimator a sample whose rewards are all
NaN gets 0 and stays out of the statistics. A group in which a reward is constant (or has fewer than two values)
carries no signal for it and gives exactly 0.

Conditioned rewards (Eq. 8) rewrite the reward tensor before any estimator runs: see `Condition` and
`apply_conditions` at the end of the file.
"""

import math
import operator
import re
from dataclasses import dataclass

import torch

STD_EPS = 1e-4         # added to every std, as in the released TRL code
VERL_STD_EPS = 1e-6    # added to verl's group std: std + 1e-6 (verl/trainer/ppo/core_algos.py)
WHITEN_VAR_EPS = 1e-8  # added to the variance in verl's masked_whiten: rsqrt(var + 1e-8) (torch_functional.py)
NEMO_STD_EPS = 1e-6    # added to NeMo-RL's per-reward std (nemo_rl/algorithms/advantage_estimator.py)


def weights_of(rewards, weights):
    """Default weights are 1 per reward; check the shape once."""
    R = rewards.shape[-1]
    if weights is None:
        return torch.ones(R, dtype=rewards.dtype, device=rewards.device)  # (R,)
    weights = torch.as_tensor(weights, dtype=rewards.dtype, device=rewards.device)  # (R,)
    if weights.shape != (R,):
        raise ValueError(f"weights has shape {tuple(weights.shape)}, expected ({R},) for {R} rewards")
    return weights


def group_zscore(x, eps=STD_EPS, scale=True):
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


def grpo(rewards, weights=None, eps=STD_EPS, lengths=None):
    """GRPO on the summed reward (the paper's baseline, Sec. 2).

        s_i = sum_k w_k r_k,i
        A_i = (s_i - mean_g(s)) / (std_g(s) + eps)

    Different reward combinations with the same sum s get the same advantage: this is
    the "reward collapse" that GDPO removes.
    """
    s = _weighted_sum(rewards, weights_of(rewards, weights))          # (B, G)
    return group_zscore(s, eps)                                      # (B, G)


def grpo_no_std(rewards, weights=None, eps=STD_EPS, lengths=None):
    """GRPO without the std division: the paper's "GRPO w/o std" ablation.

        A_i = s_i - mean_g(s),   s_i = sum_k w_k r_k,i
    """
    s = _weighted_sum(rewards, weights_of(rewards, weights))          # (B, G)
    return group_zscore(s, eps, scale=False)                         # (B, G)


def gdpo(rewards, weights=None, eps=STD_EPS, lengths=None, single_reward_grpo=True):
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
    a_sum = gdpo_group(rewards, weights, eps)                        # (B, G)     Eq. 4, 5, 7
    has_reward = ~torch.isnan(rewards).all(dim=-1)                   # (B, G)
    flat = a_sum[has_reward]                                         # (M,)
    if flat.numel() < 2:
        return torch.zeros_like(a_sum)
    a = (a_sum - flat.mean()) / (flat.std() + eps)                   # (B, G)     Eq. 6, Bessel std
    return torch.where(has_reward, a, 0.0)


def gdpo_group(rewards, weights=None, eps=STD_EPS):
    """GDPO's group step, Eq. 4-5 (weighted as in Eq. 7): each reward z-scored in its group, then summed."""
    a_k = group_zscore(rewards, eps)                                 # (B, G, R)  Eq. 4
    return (a_k * weights_of(rewards, weights)).sum(dim=-1)            # (B, G)     Eq. 5, 7


def gdpo_verl(rewards, weights=None, eps=VERL_STD_EPS, lengths=None):
    """GDPO as verl-GDPO computes it: eps 1e-6, then a token-weighted whitening of the batch.

        A_k,i   = (r_k,i - mean_g(r_k)) / (std_g(r_k) + eps)     group step, eps = 1e-6
        A_sum,i = sum_k w_k A_k,i
        N       = sum_i L_i                                       response tokens in the batch
        mu      = sum_i L_i A_sum,i / N                           token-weighted mean
        var     = sum_i L_i (A_sum,i - mu)^2 / (N - 1)            token-weighted, Bessel over N tokens
        A_i     = (A_sum,i - mu) / sqrt(var + 1e-8)

    L_i is completion i's length in tokens (`lengths`, (B, G); without it every sample counts as one token). verl
    copies each sample's advantage onto its response tokens and whitens that (B*G, T) grid under the response mask,
    so a long completion weighs L_i times.

    Reproduces `adv_estimator=gdpo` of NVlabs/GDPO verl-GDPO: compute_advantage in verl/trainer/ppo/ray_trainer.py,
    which runs core_algos.compute_grpo_outcome_advantage on each reward and verl.utils.torch_functional.masked_whiten
    on their sum. (Upstream volcengine/verl has no gdpo estimator as of January 2026.) Departures, none of which
    changes a trained run: verl-GDPO sums exactly two rewards unweighted, here any R with weights (default 1); NaN
    rewards follow this module's rules (a sample with no reward gets L_i = 0); a completion of 0 tokens gets 0, as
    verl's mask gives it; with fewer than 2 tokens in the batch verl raises and this returns 0.
    """
    return token_whiten(gdpo_group(rewards, weights, eps), token_counts(rewards, lengths))  # (B, G)


def token_counts(rewards, lengths=None):
    """Tokens per sample, (B, G): `lengths`, or 1 each without it, and 0 for a sample with no applicable reward."""
    L = torch.ones(rewards.shape[:2]) if lengths is None else torch.as_tensor(lengths)  # (B, G)
    L = L.to(device=rewards.device, dtype=rewards.dtype)
    if L.shape != rewards.shape[:2]:
        raise ValueError(f"lengths has shape {tuple(L.shape)}, expected {tuple(rewards.shape[:2])}")
    return torch.where(torch.isnan(rewards).all(dim=-1), 0.0, L)


def token_whiten(a, L, mean_eps=0.0):
    """verl's masked_whiten of (B, G) per-sample values copied onto L_i tokens each (B, G).

        mu = sum_i L_i a_i / (N + mean_eps),   N = sum_i L_i
        var = sum_i L_i (a_i - mu)^2 / (N + mean_eps) * N / (N - 1)       Bessel over the N tokens
        out_i = (a_i - mu) / sqrt(var + 1e-8)                             0 where L_i = 0

    verl's masked_mean divides by N in verl-GDPO and SAW, by N + 1e-8 in GD2PO: mean_eps picks one.
    With fewer than 2 tokens verl raises; this returns 0.
    """
    n = L.sum()                                                      # ()
    if n < 2:
        return torch.zeros_like(a)
    mu = (L * a).sum() / (n + mean_eps)                              # ()
    var = (L * (a - mu).pow(2)).sum() / (n + mean_eps) * (n / (n - 1))  # ()
    return torch.where(L > 0, (a - mu) * torch.rsqrt(var + WHITEN_VAR_EPS), 0.0)  # (B, G)


def leave_one_out_zscore(x, eps=NEMO_STD_EPS):
    """Each sample against the other samples of its group, as NeMo-RL scores them.

        b_i = mean_{j != i} x_j,   s_i = std_{j != i} x_j  (Bessel over the G-1 others)
        z_i = (x_i - b_i) / (s_i + eps)   if s_i > 0,   else  x_i - b_i  (kept unscaled)

    x: (B, G) or (B, G, R); the others are the non-NaN samples of the group. NaN entries, and groups with fewer than
    two values, give 0. s_i = 0 means the others are all equal (always so when there is only one); that is tested
    exactly, so rounding cannot turn a zero spread into a tiny divisor.
    """
    valid = ~torch.isnan(x)                                          # (B, G, ...)
    n = valid.sum(dim=1, keepdim=True).to(x.dtype)                   # (B, 1, ...) counts as floats: no int promotion
    m = (n - 1).clamp(min=1)                                         # (B, 1, ...) others per sample
    x0 = torch.where(valid, x, 0.0)                                  # (B, G, ...)
    total = x0.sum(dim=1, keepdim=True)                              # (B, 1, ...)
    base = (total - x0) / m                                          # (B, G, ...) leave-one-out mean
    dev = torch.where(valid, x - total / n.clamp(min=1), 0.0)        # (B, G, ...) about the full mean
    # Sum of squares of the others about their own mean: Q - d_i^2 n / (n - 1).
    q_others = (dev.pow(2).sum(dim=1, keepdim=True) - dev.pow(2) * n / m).clamp(min=0)  # (B, G, ...)
    std = (q_others / (m - 1).clamp(min=1)).sqrt()                   # (B, G, ...)
    # The others are all equal exactly when all of them sit at the group's max, or all at its min.
    hi = torch.where(valid, x, -math.inf).amax(dim=1, keepdim=True)  # (B, 1, ...)
    lo = torch.where(valid, x, math.inf).amin(dim=1, keepdim=True)   # (B, 1, ...)
    at_hi, at_lo = (valid & (x == hi)).to(x.dtype), (valid & (x == lo)).to(x.dtype)  # (B, G, ...)
    spread = (at_hi.sum(1, keepdim=True) - at_hi < m) & (at_lo.sum(1, keepdim=True) - at_lo < m)  # (B, G, ...)
    z = torch.where(spread, (x - base) / (std + eps), x - base)      # (B, G, ...)
    return torch.where(valid & (n >= 2), z, 0.0)


def gdpo_nemo(rewards, weights=None, eps=NEMO_STD_EPS, lengths=None, leave_one_out=True):
    """GDPO as NeMo-RL computes it: leave-one-out baselines, then a plain batch z-score.

        A_k,i   = (r_k,i - b_k,i) / (s_k,i + eps)   if s_k,i > 0, else r_k,i - b_k,i
                  b, s: mean and Bessel std of the *other* samples of i's group, eps = 1e-6
        A_sum,i = sum_k w_k A_k,i
        A_i     = (A_sum,i - mean_batch) / std_batch    if std_batch > 0 (Bessel, no eps)
                = A_sum,i - mean_batch                  otherwise

    Reproduces GDPOAdvantageEstimator in NVIDIA-NeMo/RL nemo_rl/algorithms/advantage_estimator.py, with its default
    use_leave_one_out_baseline=True and normalize_rewards=True; the per-prompt statistics are
    calculate_baseline_and_std_per_prompt in nemo_rl/algorithms/utils.py. leave_one_out=False uses the whole group
    for b and s (then a constant reward gives 0). Unlike GDPO's other normalisations, a sample whose others all agree
    keeps its raw difference r - b: with G = 2 nothing is ever scaled. Like NeMo-RL it refuses a single reward.
    Departures: NeMo-RL orders `weights` by reward name, here they follow the rewards' order; it computes the spread
    as E[x^2] - E[x]^2, which can round a zero to a tiny positive number, here a zero spread is detected exactly; NaN
    rewards follow this module's rules (a sample with no reward gets 0 and stays out of the batch statistics).

    The exact test is the fixed side of NVIDIA-NeMo/RL #4158: a group that splits 7 against 1 on a reward that
    float32 cannot hold (0.35, 0.4) gives the singleton others with a spread of 0, which sqrt(E[x^2] - E[x]^2)
    in float32 rounds to about 1.6e-4, and before that fix the singleton's advantage was divided by it (a run
    saw advantages of 7,428). Here it keeps its raw difference r - b, in float32 and float64 alike.
    """
    a_sum = gdpo_nemo_group(rewards, weights, eps, leave_one_out)    # (B, G)
    has_reward = ~torch.isnan(rewards).all(dim=-1)                   # (B, G)
    flat = a_sum[has_reward]                                         # (M,)
    if flat.numel() < 2:
        return torch.zeros_like(a_sum)
    std = flat.std()                                                 # () Bessel
    a = (a_sum - flat.mean()) / std if std > 0 else a_sum - flat.mean()  # (B, G)
    return torch.where(has_reward, a, 0.0)


def gdpo_nemo_group(rewards, weights=None, eps=NEMO_STD_EPS, leave_one_out=True):
    """NeMo-RL's group step: each reward against its leave-one-out baseline, then the weighted sum."""
    if rewards.shape[-1] < 2:
        raise ValueError("gdpo_nemo needs two or more rewards, as NeMo-RL's GDPO estimator does; use grpo for one")
    per_reward = leave_one_out_zscore(rewards, eps) if leave_one_out else group_zscore(rewards, eps)  # (B, G, R)
    return (per_reward * weights_of(rewards, weights)).sum(dim=-1)     # (B, G)


def advantage_stats(advantages, rewards, names):
    """The step's advantages (B, G): mean, std, distinct values per group (the collapse signal) and the share of
    groups with none; and each reward's own group advantage (Eq. 4, whatever the estimator) over the batch: its std
    and the share of rollouts where it is 0, the signal that reward gives. rewards: (B, G, R) after conditions."""
    a_k = group_zscore(rewards)                                      # (B, G, R)
    flat = a_k.reshape(-1, a_k.shape[-1])                            # (B*G, R)
    out = {"adv/mean": advantages.mean().item(), "adv/std": advantages.std().item(),
           "adv/distinct_per_group": distinct_per_group(advantages).float().mean().item(),
           "adv/zero_groups": (advantages.abs().amax(dim=1) < 1e-6).float().mean().item()}
    for k, name in enumerate(names):
        out[f"adv/{name}/std"] = flat[:, k].std().item() if flat.shape[0] > 1 else 0.0
        out[f"adv/{name}/zero_frac"] = (flat[:, k].abs() < 1e-6).double().mean().item()
    return out


def distinct_per_group(advantages, decimals=4):
    """Distinct advantage values inside each group of (B, G): the training-time collapse signal."""
    keys = torch.round(advantages.float() * 10**decimals).sort(dim=1).values  # (B, G)
    return 1 + (keys[:, 1:] != keys[:, :-1]).sum(dim=1)                       # (B,)


# Conditioned rewards (Eq. 8): r_k counts only where another reward r_l passes a threshold, so that an easy reward
# (length) counts only when a hard one (correctness) is met: its weight alone does not stop it dominating.

_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq}
_CONDITION = re.compile(r"^\s*([^<>=]+?)\s*(>=|<=|==|>|<)\s*([-+0-9.eE]+)\s*$")


@dataclass(frozen=True)
class Condition:
    """`target:source>=threshold`: keep reward `target` only where reward `source` >= threshold, else 0."""

    target: str
    source: str
    op: str
    threshold: float

    @classmethod
    def parse(cls, spec, names=()):
        """`names`, the run's rewards, tell TARGET from SOURCE where a name holds a colon (model:PATH)."""
        m = _CONDITION.match(spec)
        pairs = [(m[1][:i].strip(), m[1][i + 1:].strip()) for i, ch in enumerate(m[1]) if ch == ":"] if m else []
        known = [p for p in pairs if set(p) <= set(names)]
        if not pairs or (len(pairs) > 1 and len(known) != 1) or not all(known[0] if known else pairs[0]):
            raise ValueError(f"bad condition {spec!r}: expected TARGET:SOURCE>=THRESHOLD, e.g. length_ok:correct>=1"
                             + (", with TARGET and SOURCE among the rewards" if len(pairs) > 1 else ""))
        (target, source), op, threshold = known[0] if known else pairs[0], m[2], m[3]
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
