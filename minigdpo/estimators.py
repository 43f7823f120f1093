"""Every advantage estimator by name, and the question dynamic sampling asks each of them.

    ESTIMATORS[name](rewards, weights, lengths=None, **options)   # rewards (B, G, R), weights (R,) -> (B, G)

GRPO, GDPO and the peers' GDPOs are in minigdpo/advantages.py, GDPO's successors in minigdpo/successors.py.
`options` are an estimator's own keywords: gd2po's mode and tau, SAW's shift (train.py's estimator_options).
"""

from minigdpo import successors
from minigdpo.advantages import VERL_EPS, gdpo, gdpo_group, gdpo_nemo, gdpo_nemo_group, gdpo_verl, grpo, grpo_no_std

ESTIMATORS = {"grpo": grpo, "grpo_no_std": grpo_no_std, "gdpo": gdpo, "gdpo_verl": gdpo_verl, "gdpo_nemo": gdpo_nemo,
              "gd2po": successors.gd2po, "saw_gdpo": successors.saw_gdpo, "saw_grpo": successors.saw_grpo}

# Each estimator's advantages before its batch step: the within-group comparison, the only part that
# can tell one completion of a prompt from another.
GROUP_STEPS = {"grpo": grpo, "grpo_no_std": grpo_no_std,
               "gdpo": lambda r, w: grpo(r, w) if r.shape[-1] == 1 else gdpo_group(r, w),
               "gdpo_verl": lambda r, w: gdpo_group(r, w, VERL_EPS), "gdpo_nemo": gdpo_nemo_group,
               **successors.GROUP_STEPS}


def informative_groups(rewards, weights, estimator, tol=1e-6, **options):
    """Which groups of (B, G, R) rewards carry a signal for `estimator`: bool (B,).

    A group is informative when the estimator's own group-level advantages (before any batch step)
    are not all zero: some |A_i| > tol. Where they are all zero the group's completions cannot be
    told apart, and a batch step only shifts them all alike. Conditions (Eq. 8) are applied first by
    the caller; NaN rewards follow the estimators' rules. This is not the variance of the summed
    reward, which DAPO-style filters test: under GDPO, rewards (2,0,0) against (0,1,1) sum to 2 and 2,
    yet each reward varies and the group step gives +-0.71; under every estimator here (1,0) against
    (0,1) gives 0 (the two rewards' z-scores cancel), and so does a constant sum under GRPO.
    """
    return GROUP_STEPS[estimator](rewards, weights, **options).abs().amax(dim=1) > tol  # (B,)
