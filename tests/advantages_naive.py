"""The advantage estimators again, one group at a time in plain Python floats: slow and obvious on
purpose. The tests use them as the oracle of the vectorised ones in minigdpo/advantages.py and
minigdpo/successors.py, which state each equation. rewards is a nested list (B, G, R) of floats, NaN where a
reward does not apply. TWINS, at the end, pairs every registered estimator (minigdpo/estimators.py) with its twin
and its group step's twin; tests/test_estimator_contract.py fails for an estimator that has none.
"""

import math

from minigdpo.advantages import NEMO_STD_EPS, STD_EPS, VERL_STD_EPS, WHITEN_VAR_EPS


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


def grpo_naive(rewards, weights=None, eps=STD_EPS, lengths=None):
    """Loop-over-groups GRPO; rewards is a nested list (B, G, R) of floats."""
    return [_zscore_list(sums, eps) for sums in _naive_sums(rewards, weights)]


def grpo_no_std_naive(rewards, weights=None, eps=STD_EPS, lengths=None):
    """Loop-over-groups GRPO w/o std."""
    return [_zscore_list(sums, eps, scale=False) for sums in _naive_sums(rewards, weights)]


def gdpo_sums(rewards, weights, eps):
    """GDPO's group step, one group at a time: each reward's z-scores, weighted and summed."""
    R = len(rewards[0][0])
    weights = [1.0] * R if weights is None else list(weights)
    summed = []
    for group in rewards:
        per_reward = [_zscore_list([_nan_to_none(s[k]) for s in group], eps) for k in range(R)]
        summed.append([sum(weights[k] * per_reward[k][i] for k in range(R)) for i in range(len(group))])
    return summed


def nemo_sums(rewards, weights, eps, leave_one_out=True):
    """NeMo-RL's group step, one sample at a time: the baseline and std of the others of its group."""
    R = len(rewards[0][0])
    weights = [1.0] * R if weights is None else list(weights)
    summed = []
    for group in rewards:
        adv = [0.0] * len(group)
        for k in range(R):
            values = [_nan_to_none(s[k]) for s in group]
            present = [v for v in values if v is not None]
            for i, v in enumerate(values):
                if v is None or len(present) < 2:
                    continue
                others = [u for j, u in enumerate(values) if u is not None and (j != i or not leave_one_out)]
                b, s = _mean_std(others)
                adv[i] += weights[k] * ((v - b) / (s + eps) if max(others) > min(others) else v - b)
        summed.append(adv)
    return summed


def _applies(rewards):
    return [[not all(math.isnan(r) for r in s) for s in group] for group in rewards]


def gdpo_naive(rewards, weights=None, eps=STD_EPS, lengths=None):
    """Loop-over-groups GDPO: Eq. 4 per reward, Eq. 5/7 sum, Eq. 6 over the batch (GRPO for one reward)."""
    if len(rewards[0][0]) == 1:
        return grpo_naive(rewards, weights, eps)
    summed, applies = gdpo_sums(rewards, weights, eps), _applies(rewards)
    batch = [a for g, ok in zip(summed, applies) for a, o in zip(g, ok) if o]
    if len(batch) < 2:
        return [[0.0] * len(g) for g in summed]
    mean, std = _mean_std(batch)
    return [[(a - mean) / (std + eps) if o else 0.0 for a, o in zip(g, ok)] for g, ok in zip(summed, applies)]


def gdpo_verl_naive(rewards, weights=None, eps=VERL_STD_EPS, lengths=None):
    """Loop-over-groups verl GDPO: group z-scores, then whiten a flat list of every response token."""
    lengths = [[1] * len(g) for g in rewards] if lengths is None else lengths
    summed = gdpo_sums(rewards, weights, eps)
    counts = [[int(n) if o else 0 for n, o in zip(ls, ok)] for ls, ok in zip(lengths, _applies(rewards))]
    return _whiten_tokens(summed, counts)


def _whiten_tokens(values, counts, mean_eps=0.0):
    """verl's masked_whiten on a flat list holding each sample's value once per token (counts[b][i] times);
    masked_mean divides by N + mean_eps (0 in verl-GDPO and SAW, 1e-8 in GD2PO)."""
    tokens = [a for g, ns in zip(values, counts) for a, n in zip(g, ns) for _ in range(n)]
    if len(tokens) < 2:
        return [[0.0] * len(g) for g in values]
    n = len(tokens)
    mean = sum(tokens) / (n + mean_eps)
    var = sum((t - mean) ** 2 for t in tokens) / (n + mean_eps) * n / (n - 1)
    return [[(a - mean) / math.sqrt(var + WHITEN_VAR_EPS) if c else 0.0 for a, c in zip(g, ns)]
            for g, ns in zip(values, counts)]


def gdpo_nemo_naive(rewards, weights=None, eps=NEMO_STD_EPS, lengths=None, leave_one_out=True):
    """Loop-over-samples NeMo-RL GDPO: each sample's baseline and std from the others of its group."""
    summed, applies = nemo_sums(rewards, weights, eps, leave_one_out), _applies(rewards)
    batch = [a for g, ok in zip(summed, applies) for a, o in zip(g, ok) if o]
    if len(batch) < 2:
        return [[0.0] * len(g) for g in summed]
    mean, std = _mean_std(batch)
    return [[((a - mean) / std if std > 0 else a - mean) if o else 0.0 for a, o in zip(g, ok)]
            for g, ok in zip(summed, applies)]


def gd2po_sums(rewards, weights, eps, lengths, mode, tau):
    """GD2PO before whitening, one rollout at a time: (S, kept) per group; S is 0 for a dropped rollout."""
    R = len(rewards[0][0])
    weights = [1.0] * R if weights is None else list(weights)
    lengths = [[1] * len(g) for g in rewards] if lengths is None else lengths
    sums, kept = [], []
    for group, ls, ok in zip(rewards, lengths, _applies(rewards)):
        per_reward = [_zscore_list([_nan_to_none(s[k]) for s in group], eps) for k in range(R)]
        keep = []
        for i in range(len(group)):
            u = [(ls[i] if ok[i] else 0) * weights[k] * per_reward[k][i] for k in range(R)]
            conflict = any(x > 1e-8 for x in u) and any(x < -1e-8 for x in u)
            rho = sum(u) / (sum(abs(x) for x in u) + 1e-8)
            keep.append(not conflict if mode == "hard" else not (conflict and abs(rho) < min(max(tau, 0.0), 1.0)))
        q = sum(k and o for k, o in zip(keep, ok)) / max(sum(ok), 1)
        sums.append([q * sum(weights[k] * per_reward[k][i] for k in range(R)) if keep[i] else 0.0
                     for i in range(len(group))])
        kept.append(keep)
    return sums, kept


def gd2po_naive(rewards, weights=None, eps=VERL_STD_EPS, lengths=None, mode="snr", tau=0.8):
    """Loop-over-rollouts GD2PO: conflict filter, query reweighting, then whiten the kept rollouts' tokens."""
    sums, kept = gd2po_sums(rewards, weights, eps, lengths, mode, tau)
    lengths = [[1] * len(g) for g in rewards] if lengths is None else lengths
    counts = [[int(n) if o and k else 0 for n, o, k in zip(ls, ok, kp)]
              for ls, ok, kp in zip(lengths, _applies(rewards), kept)]
    return _whiten_tokens(sums, counts, mean_eps=1e-8)


def saw_weights_naive(rewards, shift=None):
    """SAW's weights from every sample of the batch: R CV_k / (sum_j CV_j + 1e-8)."""
    R = len(rewards[0][0])
    shift = [0.0] * R if not shift else list(shift)
    cvs = []
    for k in range(R):
        values = [s[k] + shift[k] for group in rewards for s in group if not math.isnan(s[k])]
        if len(values) < 2:
            cvs.append(0.0)
            continue
        mean, std = _mean_std(values)
        cvs.append(std / (abs(mean) + 1e-8))
    return [R * cv / (sum(cvs) + 1e-8) for cv in cvs]


def saw_times(rewards, weights, shift):
    R = len(rewards[0][0])
    weights = [1.0] * R if weights is None else list(weights)
    return [w * u for w, u in zip(saw_weights_naive(rewards, shift), weights)]


def saw_gdpo_naive(rewards, weights=None, eps=VERL_STD_EPS, lengths=None, shift=None):
    """Loop-over-groups SAW-GDPO: verl GDPO with SAW's weights."""
    return gdpo_verl_naive(rewards, saw_times(rewards, weights, shift), eps, lengths)


def saw_grpo_naive(rewards, weights=None, eps=VERL_STD_EPS, lengths=None, shift=None):
    """Loop-over-groups SAW-GRPO: GRPO's group z-score of the SAW-weighted sum."""
    return grpo_naive(rewards, saw_times(rewards, weights, shift), eps)


TWINS = {  # name -> (the twin of REGISTRY[name].advantages, the twin of its group step)
    "grpo": (grpo_naive, grpo_naive),
    "grpo_no_std": (grpo_no_std_naive, grpo_no_std_naive),
    "gdpo": (gdpo_naive, lambda r, w: grpo_naive(r, w) if len(r[0][0]) == 1 else gdpo_sums(r, w, STD_EPS)),
    "gdpo_verl": (gdpo_verl_naive, lambda r, w: gdpo_sums(r, w, VERL_STD_EPS)),
    "gdpo_nemo": (gdpo_nemo_naive, lambda r, w: nemo_sums(r, w, NEMO_STD_EPS)),
    "gd2po": (gd2po_naive, lambda r, w, mode="snr", tau=0.8: gd2po_sums(r, w, VERL_STD_EPS, None, mode, tau)[0]),
    "saw_gdpo": (saw_gdpo_naive, lambda r, w, shift=None: gdpo_sums(r, saw_times(r, w, shift), VERL_STD_EPS)),
    "saw_grpo": (saw_grpo_naive, saw_grpo_naive),
}
