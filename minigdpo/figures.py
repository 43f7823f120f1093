"""eval.py's figures: each task's metrics from (P, n, R) rewards, and model - baseline with a paired bootstrap
interval over prompts.

| task        | extra figures                                               |
|-------------|-------------------------------------------------------------|
| toolcall    | exact-match rate of the tool calls                          |
| math_length | exceed ratio: completions over the length limit             |
| code        | pass rate, bug ratio, exceed ratio (the paper's Table 5)    |

Shape legend: P prompts, n samples per prompt, R rewards, K bootstrap resamples.
"""

import math

import torch

# task -> (reward that means "solved", its threshold, reward that means "well formatted"); 3: an exact match
TASK_METRICS = {"gsm8k": ("correct", 1.0, "format"), "arith": ("correct", 1.0, "format"),
                "toolcall": ("tool_correct", 3.0, "tool_format"), "math_length": ("correct", 1.0, None),
                "code": ("pass", 1.0, None), "prompts": (None, 0.0, None),  # prompts: your rewards, each's mean
                "calculator": ("solved", 1.0, "answer_tag")}
RESAMPLES = 10_000  # bootstrap resamples behind each --baseline interval


def pass_at_k(n, c, k):
    """Unbiased pass@k for c correct among n samples: 1 - C(n-c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def prompt_stats(task, names, rewards, lengths, truncated, n, tool_counts=None):
    """Each mean-type figure as per-prompt (sums (P,), counts (P,)) from (P, n, R) rewards and (P, n) lengths (and an
    agent's (P, n, 2) calls and failed calls per rollout).

    A figure is sum(sums) / sum(counts): a mean over samples, NaN rewards left out. Keeping the
    two apart lets the bootstrap resample prompts and recompute exactly the figure printed.
    """
    P = rewards.shape[0]
    ones = torch.full((P,), float(n), dtype=torch.float64)             # (P,) samples per prompt

    def per(x):                                                         # (P, n) -> (P,)
        return x.double().sum(1)

    out = {}
    for k, name in enumerate(names):
        col = rewards[..., k]                                           # (P, n)
        out[f"reward/{name}"] = (per(col.nan_to_num(0)), per(~col.isnan()))
    solved_name, threshold, format_name = TASK_METRICS[task]
    if solved_name in names:
        solved = rewards[..., names.index(solved_name)] >= threshold      # (P, n), NaN counts as unsolved
        out["accuracy"] = (per(solved), ones)
        counts = solved.sum(1).tolist()
        k = 1
        while k <= n:
            out[f"pass@{k}"] = (torch.tensor([pass_at_k(n, c, k) for c in counts], dtype=torch.float64),
                                torch.ones(P, dtype=torch.float64))
            k *= 2
    if format_name in names:
        out["format_rate"] = (per(rewards[..., names.index(format_name)] >= 1), ones)
    if task == "toolcall" and "accuracy" in out:
        out["exact_match_rate"] = out["accuracy"]
    if "length_ok" in names:
        out["exceed_ratio"] = (per(rewards[..., names.index("length_ok")] < 1), ones)
    if task == "code":
        if "pass" in names:
            out["pass_rate"] = (per(rewards[..., names.index("pass")].nan_to_num(0)), ones)
        if "no_bug" in names:
            out["bug_ratio"] = (per(rewards[..., names.index("no_bug")] < 1), ones)
    if tool_counts is not None:  # TRL's tool figures, and how many rollouts call a tool at all
        calls, failed = tool_counts[..., 0], tool_counts[..., 1]      # (P, n) each
        out["tools/call_rate"] = (per(calls > 0), ones)
        out["tools/call_frequency"] = (per(calls), ones)
        out["tools/failure_frequency"] = (per(failed), per(calls))
    out["length/mean"] = (per(lengths), ones)
    out["length/truncated_frac"] = (per(truncated), ones)
    return out


def summarise(task, names, rewards, lengths, truncated, n, tool_counts=None):
    """Figures from (P, n, R) rewards and (P, n) lengths / truncation flags (and an agent's tool counts)."""
    out = {"prompts": rewards.shape[0], "samples_per_prompt": n}
    for key, (sums, counts) in prompt_stats(task, names, rewards, lengths, truncated, n, tool_counts).items():
        out[key] = (sums.sum() / counts.sum()).item()  # 0/0 = NaN: a reward that never applied
    out["length/median"] = lengths.float().median().item()
    out["length/max"] = lengths.max().item()
    return out


def paired_bootstrap(model, baseline, resamples=RESAMPLES, seed=0, level=0.95):
    """model - baseline for one figure, with a percentile bootstrap interval over paired prompts.

    model, baseline: per-prompt (sums (P,), counts (P,)) on the same P prompts (prompt_stats).
    The estimate is d = sum(s_m) / sum(c_m) - sum(s_b) / sum(c_b), the difference of the two printed figures.
    Each of K resamples draws P prompt indices with replacement, the same indices for both models (paired: how
    hard a prompt is cancels out of d), and recomputes d. The interval is the (1 - level)/2 and (1 + level)/2
    quantiles of the K values; a fixed seed makes it reproducible. Returns (d, low, high)."""
    (sm, cm), (sb, cb) = model, baseline
    P = sm.numel()
    generator = torch.Generator().manual_seed(seed)
    diffs = []
    for start in range(0, resamples, 1000):  # chunks keep the (K, P) index matrix small for large P
        idx = torch.randint(P, (min(1000, resamples - start), P), generator=generator)   # (k, P)
        diffs.append(sm[idx].sum(1) / cm[idx].sum(1) - sb[idx].sum(1) / cb[idx].sum(1))  # (k,)
    diffs = torch.cat(diffs)                                                              # (K,)
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=diffs.dtype)
    low, high = torch.nanquantile(diffs, q).tolist()  # a resample whose figure is 0/0 is left out
    return (sm.sum() / cm.sum() - sb.sum() / cb.sum()).item(), low, high


def compare(model, baseline, resamples=RESAMPLES, seed=0):
    """{figure: (baseline, model, diff, low, high)} from two (summary, prompt_stats) results on the same prompts."""
    (sm, stats_m), (sb, stats_b) = model, baseline
    return {k: (sb[k], sm[k], *paired_bootstrap(stats_m[k], stats_b[k], resamples, seed)) for k in stats_m}


def comparison_table(rows, model, baseline, prompts, n, temperature):
    """The side-by-side table printed by --baseline (and at the end of the CPU demo)."""
    sampling = "greedy" if temperature == 0 else f"temperature {temperature}"
    w = max([22] + [len(k) for k in rows])  # as wide as the longest name (tools/failure_frequency)
    lines = [f"model     {model}", f"baseline  {baseline}",
             f"{prompts} prompts x {n} sample{'s' if n > 1 else ''}, {sampling}; diff = model - baseline, "
             f"95% paired bootstrap interval over prompts ({RESAMPLES} resamples, seed 0)",
             f"{'metric':<{w}} {'baseline':>9} {'model':>9} {'diff':>9}   95% interval"]
    for k, (b, m, d, lo, hi) in rows.items():
        lines.append(f"{k:<{w}} {b:>9.3f} {m:>9.3f} {d:>+9.3f}   [{lo:+.3f}, {hi:+.3f}]")
    return "\n".join(lines)
