"""The statistics of the study over seeds (examples/gdpo_vs_grpo.py): intervals over seeds, paired tests, Holm.

Written from the formulas they cite, with numpy alone (scipy is not a dependency); tests/test_study.py checks each
against hand-computed values and, where scipy is installed, against it.
"""

import math

import numpy as np

# Two-sided 95% quantiles of Student's t by degrees of freedom (t_0.975), for intervals over a few seeds.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093}


def interval(values):
    """Mean and 95% Student-t interval over seeds."""
    x = np.asarray(values, dtype=float)
    mean = float(x.mean())
    if len(x) < 2:
        return {"mean": mean, "low": None, "high": None, "n": len(x)}
    half = T975.get(len(x) - 1, 1.96) * float(x.std(ddof=1)) / np.sqrt(len(x))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(x)}


def betainc(a, b, x):
    """The regularised incomplete beta function I_x(a, b), by its continued fraction (A&S 26.5.8) evaluated with
    Lentz's method; past x = (a+1)/(a+b+2) as 1 - I_(1-x)(b, a), where it converges fast."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    f, c, d = 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > 1e-30 else 1e-30)  # Lentz's guard against a vanishing denominator
        c = 1.0 + num / c
        c = c if abs(c) > 1e-30 else 1e-30
        f *= c * d
        if abs(1.0 - c * d) < 1e-15:
            return front * (f - 1.0)
    raise ArithmeticError(f"betainc({a}, {b}, {x}) did not converge")


def t_test_p(t, df):
    """Two-sided p-value of Student's t with df degrees of freedom: P(|T| >= |t|) = I_(df/(df+t^2))(df/2, 1/2)
    (A&S 26.7.1)."""
    x, y = df / (df + t * t), t * t / (df + t * t)  # y: 1 - x without the cancellation near t = 0
    return 1.0 - betainc(0.5, df / 2, y) if x > (df / 2 + 1) / (df / 2 + 2.5) else betainc(df / 2, 0.5, x)


def sign_flip_p(d, draws=65_536):
    """Two-sided paired permutation test: under "a and b are exchangeable within a seed" each difference's sign is
    a fair coin, so p = the fraction of sign assignments whose |mean| reaches the observed one. Every one of the 2^n
    assignments for n <= 16; above, `draws` random ones (seed 0), p = (1 + hits) / (1 + draws)."""
    d = np.asarray(d, dtype=float)  # [n]
    n = len(d)
    if n <= 16:
        signs = 1 - 2 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)  # [2^n, n], each assignment once
    else:
        signs = np.random.default_rng(0).choice([-1, 1], size=(draws, n))  # [draws, n]
    hits = int((np.abs(signs @ d) / n >= abs(d.mean()) - 1e-12).sum())  # the tolerance counts exact ties as ties
    return hits / len(signs) if n <= 16 else (1 + hits) / (1 + draws)


def paired(a, b, resamples=10_000):
    """a - b over paired seeds: mean, 95% percentile-bootstrap interval (low, high), paired Student-t 95% interval
    (t_low, t_high) with its two-sided p-value (p_t), the exact sign-flip test's p-value (p_signflip), and wins /
    ties / losses of a."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)  # [n]
    rng = np.random.default_rng(0)
    boot = d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(1)  # [resamples]
    t = interval(d)
    sd = float(d.std(ddof=1)) if len(d) > 1 else None
    if sd is None:
        p_t = None
    elif sd == 0:  # every seed the same difference: certain if it is not 0, and no evidence if it is
        p_t = 1.0 if t["mean"] == 0 else 0.0
    else:
        p_t = t_test_p(float(t["mean"] / (sd / np.sqrt(len(d)))), len(d) - 1)
    return {"mean": float(d.mean()), "low": float(np.percentile(boot, 2.5)), "high": float(np.percentile(boot, 97.5)),
            "t_low": t["low"], "t_high": t["high"], "p_t": p_t, "p_signflip": sign_flip_p(d),
            "wins": int((d > 1e-9).sum()), "ties": int((abs(d) <= 1e-9).sum()), "losses": int((d < -1e-9).sum()),
            "n": len(d)}


def holm(ps):
    """Holm's step-down adjusted p-values, in the order given: the i-th smallest p times (m - i + 1), made
    non-decreasing along that order and capped at 1. Rejecting where the adjusted p < alpha holds the family-wise
    error rate at alpha."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    adjusted, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted
