"""Every advantage estimator, registered once, and the question dynamic sampling asks each of them.

    REGISTRY[name].advantages(rewards, weights, lengths=None, **options)  # rewards (B, G, R), weights (R,) -> (B, G)

GRPO, GDPO and the peers' GDPOs are in minigdpo/advantages.py, GDPO's successors in minigdpo/successors.py, and
the loop-over-groups twin of each in tests/advantages_naive.py (TWINS). REGISTRY holds, for each name, the
estimator, its group step (its advantages before any batch step) and its own flags; the command line, dynamic
sampling, examples/collapse.py and the tests all read their lists from it. A new estimator is one function, one
entry here, its naive twin in TWINS, its row in docs/estimators.md, and `python examples/collapse.py --write-docs`
(the count tables README.md and docs/ show gain its column; tests/test_docs_tables.py compares them with the
script); tests/test_estimator_contract.py then checks it, as every entry, against the contract:

- advantages(rewards (B, G, R), weights (R,) or None, eps=..., lengths=None, **options) -> (B, G), in the rewards'
  dtype; a batch step sees every group of the global batch;
- its naive twin, and its group step's, compute the same on nested lists (1e-9 in float64), NaN rewards, weights
  and lengths included: the twin is the oracle;
- NaN is "does not apply" and each estimator's docstring states what it does with one; advantages stay finite;
- lengths (B, G) matter only where `reads_lengths` says so (a batch step weighted by tokens); elsewhere they are
  ignored;
- a batch where nothing differs (all rewards equal, or all NaN) gets advantages of 0 (below 1e-6), and a group whose
  samples' rewards are all equal gets 0 from the group step (below 1e-12: NeMo-RL's leave-one-out mean rounds), so
  dynamic sampling (informative_groups, tol 1e-6) finds no signal in it;
- options(cfg) gives its keywords from the run's config (its own flags); the defaults of every keyword are the
  command line's.
"""

from dataclasses import dataclass
from typing import Callable

from minigdpo import successors
from minigdpo.advantages import VERL_STD_EPS, gdpo, gdpo_group, gdpo_nemo, gdpo_nemo_group, \
    gdpo_verl, grpo, grpo_no_std, weights_of


@dataclass(frozen=True)
class Estimator:
    advantages: Callable          # (rewards, weights, lengths=None, **options) -> (B, G)
    group_step: Callable          # (rewards, weights, **options) -> (B, G), before any batch step
    options: Callable = lambda cfg: {}  # its keywords, from the run's config (its own flags)
    reads_lengths: bool = False   # its batch step weighs completions by their tokens (verl's whitening)


def _gdpo_group(r, w):
    return grpo(r, w) if r.shape[-1] == 1 else gdpo_group(r, w)


def _saw_gdpo_group(r, w, shift=None):
    return gdpo_group(r, successors.saw_weights(r, shift) * weights_of(r, w), VERL_STD_EPS)


def _saw_options(cfg):
    return {"shift": cfg.saw_shift or None}


REGISTRY = {
    "grpo": Estimator(grpo, grpo),
    "grpo_no_std": Estimator(grpo_no_std, grpo_no_std),
    "gdpo": Estimator(gdpo, _gdpo_group),
    "gdpo_verl": Estimator(gdpo_verl, lambda r, w: gdpo_group(r, w, VERL_STD_EPS), reads_lengths=True),
    "gdpo_nemo": Estimator(gdpo_nemo, gdpo_nemo_group),
    "gd2po": Estimator(successors.gd2po,
                       lambda r, w, mode="snr", tau=0.8: successors.gd2po_group(r, w, mode=mode, tau=tau)[0],
                       lambda cfg: {"mode": cfg.gd2po_mode, "tau": cfg.gd2po_tau}, reads_lengths=True),
    "saw_gdpo": Estimator(successors.saw_gdpo, _saw_gdpo_group, _saw_options, reads_lengths=True),
    "saw_grpo": Estimator(successors.saw_grpo, successors.saw_grpo, _saw_options),
}


def informative_groups(rewards, weights, estimator, tol=1e-6, **options):
    """Which groups of (B, G, R) rewards carry a signal for `estimator`: bool (B,).

    A group is informative when the estimator's own group-level advantages (before any batch step) are not all zero:
    some |A_i| > tol. Where they are all zero the group's completions cannot be told apart, and a batch step only
    shifts them all alike. Conditions (Eq. 8) are applied first by the caller; NaN rewards follow the estimators'
    rules. This is not the variance of the summed reward, which DAPO-style filters test: under GDPO, rewards (2,0,0)
    against (0,1,1) sum to 2 and 2, yet each reward varies and the group step gives +-0.71; under every estimator
    here (1,0) against (0,1) gives 0 (the two rewards' z-scores cancel), and so does a constant sum under GRPO.
    """
    return REGISTRY[estimator].group_step(rewards, weights, **options).abs().amax(dim=1) > tol  # (B,)
