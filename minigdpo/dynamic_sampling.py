"""--dynamic-sampling: rounds of fresh prompts until a step holds B groups its estimator can learn from.

A loop around rollout.rollout. Each round samples B fresh prompts (each rank its slice); a group counts when the
estimator's own group-level advantages, on the conditioned rewards, are not all zero
(estimators.informative_groups). The step trains on the first B such groups, or at --max-sample-rounds on
what it found, rounded down to a multiple of the world size (none: it skips its update). The groups are then
dealt out to the ranks in equal shares, in the order they were sampled, each moving to the rank that trains it.

Shape legend: B prompts per step, G samples per prompt, R rewards, S groups the step trains on.
"""

import torch

from minigdpo import dist
from minigdpo.advantages import apply_conditions
from minigdpo.estimators import REGISTRY, informative_groups
from minigdpo.rollout import Rollout, add_counts, rollout, step_prompts
from minigdpo.scoring import RewardScorer


def informative(rewards, names, conditions, weights, cfg):
    """(B,) the groups of (B, G, R) rewards the run's estimator can learn from, its conditions applied."""
    return informative_groups(apply_conditions(rewards, names, conditions), weights.to(rewards.device), cfg.estimator,
                              **REGISTRY[cfg.estimator].options(cfg))


def sample(step, cursor, order, task, tokenizer, sampler, scorer, cfg, sizes, names, conditions, weights, seconds,
           agent=None, state=None):
    """Steps 1-3 in rounds of fresh prompts (`state`: the rewards' trainer_state); (Rollout, cursor), sampling/..."""
    B, world, rank, per_rank = sizes.prompts_per_step, dist.world_size(), dist.rank(), sizes.prompts_per_rank
    rounds, found = [], []                                            # found: (round, group) pairs, in order
    for n in range(cfg.max_sample_rounds):
        examples, seed = step_prompts(step, cursor, order, task, cfg, sizes, n)
        cursor += B
        rounds.append(rollout(examples, seed, tokenizer, sampler, scorer, cfg, seconds, agent=agent, state=state)())
        keep = informative(rounds[-1].rewards, names, conditions, weights, cfg)      # (B,)
        found += [(n, g) for g in range(B) if keep[g]]
        if len(found) >= B:
            break
    chosen = found[:B] if len(found) >= B else found[:len(found) // sizes.groups_unit * sizes.groups_unit]
    S = len(chosen)
    # Each rank's share of the chosen groups, sent by the ranks that sampled them.
    local = {(n, rank * per_rank + i): (r.prompts[i], r.completions[i]) for n, r in enumerate(rounds)
             for i in range(per_rank)}
    share = [{g: local[g] for g in chosen[r * S // world:(r + 1) * S // world] if g in local} for r in range(world)]
    received = {g: group for part in dist.exchange_objects(share) for g, group in part.items()}
    mine = [received[g] for g in chosen[rank * S // world:(rank + 1) * S // world]]
    sampled, kept = len(rounds) * B, len(found)
    stats = {"sampling/rounds": len(rounds), "sampling/groups_sampled": sampled, "sampling/groups_informative": kept,
             "sampling/groups_trained": S, "sampling/uninformative_frac": 1 - kept / sampled,
             "sampling/samples_per_trained": sampled / max(S, 1), "sampling/skipped_update": int(S == 0)}

    def pick(key):
        return torch.stack([getattr(rounds[n], key)[g] for n, g in chosen]) if S else getattr(rounds[0], key)[:0]

    failures = [RewardScorer.merge(part) for part in zip(*[r.failures for r in rounds])]  # per rank
    return Rollout([p for p, _ in mine], [c for _, c in mine], pick("rewards"), pick("lengths"),
                   torch.cat([r.rewards for r in rounds]).cpu(), torch.cat([r.lengths for r in rounds]),
                   torch.cat([r.truncated for r in rounds]), failures, stats,
                   add_counts(r.tools for r in rounds), seconds), cursor
