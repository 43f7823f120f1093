"""GDPO's successors: GD2PO (arXiv 2606.16771) and SAW (arXiv 2606.07705), as their official code computes them.

Called like every estimator in minigdpo/advantages.py; minigdpo/estimators.py registers them in REGISTRY:

    advantages = gd2po(rewards, weights, lengths=None, mode="snr", tau=0.8)    # (B, G, R) -> (B, G)
    advantages = saw_gdpo(rewards, weights, lengths=None, shift=None)
    advantages = saw_grpo(rewards, weights, lengths=None, shift=None)

Shape legend: B prompts, G samples per prompt, R rewards. Both papers build on verl, so their group step
is verl's GRPO z-score, (r - mean_g) / (std_g + 1e-6) with the Bessel std (VERL_STD_EPS), and their batch step is
verl's token-weighted masked_whiten (advantages.token_whiten): `lengths` gives each completion's tokens.

The NaN rule is the other estimators': a NaN reward is left out of its group's and the batch's statistics
and adds 0; a sample with no applicable reward gets 0 and no weight in the whitening. Conditions (Eq. 8)
rewrite the rewards before any estimator runs, so they apply here unchanged.
"""

import torch

from minigdpo.advantages import VERL_STD_EPS, gdpo_verl, group_zscore, grpo, token_counts, token_whiten, weights_of

SIGN_THRESHOLD = 1e-8      # GD2PO: a rollout's reward advantage counts as positive above 1e-8, negative below -1e-8
RHO_EPS = 1e-8             # GD2PO: added to rho's denominator, sum_k |L A_k| + 1e-8 (gdpo_filter_ratio_conflict_eps)
MEAN_COUNT_EPS = 1e-8      # GD2PO's verl: added to the token count masked_mean divides by (torch_functional.py)
CV_DENOMINATOR_EPS = 1e-8  # SAW: added under each CV's |mean| and under the sum of the CVs


def gd2po_group(rewards, weights=None, eps=VERL_STD_EPS, lengths=None, mode="snr", tau=0.8):
    """GD2PO before its batch step: (S, keep), both (B, G); S is 0 where a rollout is dropped.

        A_ik  = w_k (r_ik - mean_g(r_k)) / (std_g(r_k) + eps)             per reward, in its group
        u_ik  = L_i A_ik                                                  the rollout's summed token advantage
        conflict_i = some u_ik > 1e-8 and some u_ik' < -1e-8
        drop_i = conflict_i                               mode "hard"
               = conflict_i and |rho_i| < tau,            mode "snr",  rho_i = sum_k u_ik / (sum_k |u_ik| + 1e-8)
        q_b   = kept rollouts / rollouts of the group (those with a reward)
        S_i   = q_b sum_k A_ik   for a kept rollout
    """
    if mode not in ("hard", "snr"):
        raise ValueError(f"gd2po mode must be 'hard' or 'snr', got {mode!r}")
    a_k = group_zscore(rewards, eps) * weights_of(rewards, weights)    # (B, G, R)
    u = token_counts(rewards, lengths)[..., None] * a_k              # (B, G, R)
    conflict = (u > SIGN_THRESHOLD).any(-1) & (u < -SIGN_THRESHOLD).any(-1)      # (B, G)
    if mode == "hard":
        drop = conflict
    else:
        rho = u.sum(-1) / (u.abs().sum(-1) + RHO_EPS)              # (B, G)
        drop = conflict & (rho.abs() < min(max(tau, 0.0), 1.0))      # tau clamped to [0, 1], as the code does
    has_reward = ~torch.isnan(rewards).all(dim=-1)                   # (B, G)
    kept = (has_reward & ~drop).sum(1, keepdim=True).to(a_k.dtype)  # (B, 1)
    q = kept / has_reward.sum(1, keepdim=True).clamp(min=1)          # (B, 1) the group's kept share
    return torch.where(drop, 0.0, q * a_k.sum(-1)), ~drop            # (B, G), (B, G)


def gd2po(rewards, weights=None, eps=VERL_STD_EPS, lengths=None, mode="snr", tau=0.8):
    """GD2PO: GDPO's per-reward advantages, rollouts whose rewards pull against each other dropped.

        S_i, keep_i from gd2po_group (conflict filter and query reweighting q_b)
        A_i = keep_i (S_i - mu) / sqrt(var + 1e-8)      token-weighted over the kept rollouts' tokens,
              mu and var with verl's masked_mean, which divides by N + 1e-8

    mode "hard" drops every conflicting rollout; "snr" only those whose reward advantages nearly cancel,
    |rho| < tau. tau is 0.8 in the released scripts (tool-calling/scripts/*/train_gd2po_snr.sh) and 0.2 in
    the yaml default; 0.8 here. If no rollout is kept every advantage is 0, as in the code.

    The code takes a group's mean in float32: at G = 8 the mean of a reward that is the same for every member is
    one rounding step off for about 42% of values (torch 2.13, CPU), so every member gets a spurious advantage
    (up to about 0.19) and the filter sees spurious conflicts (its released scripts use G = 4, where the mean is
    exact). minigdpo computes in float64 and tests a constant group exactly: 0, which is right.

    Reproduces Qwen-Applications/GD2PO tool-calling/verl/trainer/ppo/ray_trainer.py: mode "hard" is
    adv_estimator gdpo_filter_group_ratio, "snr" is gdpo_filter_ratio_conflict_group_ratio (compute_advantage,
    _compute_gdpo_ratio_conflict_advantages, _get_mixed_sign_conflict_mask, _compute_gdpo_group_keep_ratio,
    _apply_gdpo_keep_mask). Departures: the code sums its active rewards unweighted, here with `weights`
    (default 1; a weight scales A_ik before the conflict test and rho); NaN rewards follow this module's rule
    (q_b counts the rollouts that have a reward); groups of one sample give 0 (verl scores them r / 1);
    with fewer than 2 kept tokens verl raises and this returns 0.
    """
    s, keep = gd2po_group(rewards, weights, eps, lengths, mode, tau)  # (B, G), (B, G)
    L = torch.where(keep, token_counts(rewards, lengths), 0.0)       # (B, G) the whitening sees kept tokens only
    return token_whiten(s, L, mean_eps=MEAN_COUNT_EPS)                     # (B, G)


def saw_weights(rewards, shift=None):
    """SAW's reward weights from the batch, (R,), detached:

        CV_k = std(r_k + shift_k) / (|mean(r_k + shift_k)| + 1e-8)      over every sample of the batch, Bessel
        w_k  = R CV_k / (sum_j CV_j + 1e-8)

    A reward with a larger spread for its size weighs more; the weights sum to about R. The code is written
    for two rewards (R = 2, its factor 2.0); R here is the number of rewards, so equal CVs give weight 1 each.
    `shift` (R,) moves each reward before its statistics, so that its mean is not near 0 (the code adds 3 to
    ToolRL's correctness, in [-3, 3]); it changes the mean only. A reward with fewer than two values in
    the batch gets CV 0. The code runs in float32, where the 1e-8 under a mean near 1 vanishes; minigdpo's
    rewards are float64, where it does not: two rewards of equal CV but different means get weights about
    1e-8 apart, and SAW-GRPO's z-score (std + 1e-6) can turn sums that would tie into advantages near 0.01.
    """
    R = rewards.shape[-1]
    flat = rewards.detach().reshape(-1, R)                           # (B*G, R)
    if shift is not None and len(shift):
        shift = torch.as_tensor(shift, dtype=flat.dtype, device=flat.device)  # (R,)
        if shift.shape != (R,):
            raise ValueError(f"shift has {shift.numel()} values, expected one per reward ({R})")
        flat = flat + shift
    valid = ~torch.isnan(flat)                                       # (B*G, R)
    n = valid.sum(0)                                                 # (R,)
    mean = torch.where(valid, flat, 0.0).sum(0) / n.clamp(min=1)     # (R,)
    var = torch.where(valid, flat - mean, 0.0).pow(2).sum(0) / (n - 1).clamp(min=1)  # (R,) Bessel
    cv = torch.where(n >= 2, var.sqrt() / (mean.abs() + CV_DENOMINATOR_EPS), 0.0)  # (R,)
    return R * cv / (cv.sum() + CV_DENOMINATOR_EPS)                              # (R,)


def saw_gdpo(rewards, weights=None, eps=VERL_STD_EPS, lengths=None, shift=None):
    """SAW on GDPO: GDPO with SAW's batch weights, whitened over tokens as verl-GDPO does.

        w_k = saw_weights(r, shift)_k,   A_sum,i = sum_k w_k A_k,i (group z-scores of the unshifted r_k)
        A_i = token_whiten(A_sum)_i                                    verl's masked_whiten, mean over N

    Reproduces adv_estimator gdpo-h in Zhaolutuan/SAW verl/trainer/ppo/ray_trainer.py (compute_advantage),
    which is gdpo_verl with these weights. Departures: any R (the code has correctness and format); `weights`
    multiply SAW's (default 1); the shift is an input (the code adds 3.0 to correctness, none here by
    default); NaN rewards follow this module's rule.
    """
    return gdpo_verl(rewards, saw_weights(rewards, shift) * weights_of(rewards, weights), eps, lengths)


def saw_grpo(rewards, weights=None, eps=VERL_STD_EPS, lengths=None, shift=None):
    """SAW on GRPO: GRPO's group z-score of the SAW-weighted sum, with no batch step.

        s_i = sum_k w_k r_k,i   (unshifted r, w = saw_weights(r, shift)),   A_i = (s_i - mean_g) / (std_g + 1e-6)

    Reproduces adv_estimator grpo-h in Zhaolutuan/SAW verl/trainer/ppo/ray_trainer.py, with the same
    departures as saw_gdpo.
    """
    return grpo(rewards, saw_weights(rewards, shift) * weights_of(rewards, weights), eps)
