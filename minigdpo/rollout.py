"""Steps 1-3 of a training step: prompts, G completions each, their rewards.

`rollout` is one round, what most runs take: this rank's prompts, sampled and scored, with every rank's
rewards gathered (GDPO's batch step needs them all). `sample_groups` is the step's sampling: one round,
or with --dynamic-sampling rounds of fresh prompts until the step holds B groups the estimator can learn
from, which it then deals out to the ranks.

Shape legend: B prompts per step (all ranks), G samples per prompt, R rewards, S = this rank's completions,
K groups trained on.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from minigdpo import dist
from minigdpo.sampler import SamplingParams
from rewards import RewardScorer, encode_prompt


@contextmanager
def timed(seconds, name):
    """Add the seconds the block takes to seconds[name]."""
    t0 = time.perf_counter()
    yield
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0


@dataclass
class Round:
    """One round of sampling: this rank's prompts and completions, and every rank's rewards by group."""
    prompts: list              # this rank's prompts, token ids
    completions: list          # this rank's S completions, G per prompt, in prompt order
    scores: torch.Tensor       # (S, R) this rank's rewards, NaN where a reward does not apply or failed
    counts: dict               # this rank's scorer failures, {reward: {kind: n}}
    rewards: torch.Tensor      # (B, G, R) every rank's, float64
    lengths: torch.Tensor      # (B, G) every rank's completion lengths
    truncated: torch.Tensor    # (B * G,) 1 where a completion ran to max_new_tokens


def rollout(examples, seed, tokenizer, sampler, scorer, cfg, seconds, sleep=False):
    """Steps 1-3 once: this rank's `examples` as prompts, G completions each drawn from `seed`, their rewards.
    sleep=True puts the sampler to sleep before scoring, so that a reward model's memory does not come on top of
    vLLM's: only when an update (and so a weight sync) is sure to follow."""
    G = cfg.group_size
    prompts = [encode_prompt(tokenizer, ex["messages"], cfg.max_prompt_len) for ex in examples]
    params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, seed=seed, ignore_eos=cfg.ignore_eos)
    with timed(seconds, "generate"):
        completions = [c for group in sampler.generate(prompts, G, params) for c in group]   # S = prompts * G
    if sleep:
        sampler.sleep()
    with timed(seconds, "reward"):
        scores, counts = scorer([c.text for c in completions], [ex for ex in examples for _ in range(G)],
                                [len(c.token_ids) for c in completions])                   # (S, R)
    lengths = torch.tensor([float(len(c.token_ids)) for c in completions])                 # (S,)
    truncated = torch.tensor([float(c.finish_reason == "length") for c in completions])    # (S,)
    return Round(prompts, completions, scores, counts, dist.all_gather(scores).view(-1, G, scores.shape[1]).double(),
                 dist.all_gather(lengths).view(-1, G), dist.all_gather(truncated))


@dataclass
class Sampled:
    """What a step trains on (this rank's groups, every rank's chosen rewards) and what it logs (all sampled)."""
    groups: list               # this rank's share: {"prompt", "completions", "rewards"} per group
    rewards: torch.Tensor      # (K, G, R) the chosen groups', every rank's
    lengths: torch.Tensor      # (K, G)
    all_rewards: torch.Tensor  # (rounds * B, G, R) every group sampled this step
    all_lengths: torch.Tensor  # (rounds * B, G)
    truncated: torch.Tensor    # (rounds * B * G,)
    counts: list               # every rank's scorer failures, summed over rounds
    stats: dict                # sampling/... metrics


def sample_groups(step, cursor, order, task, tokenizer, sampler, scorer, cfg, derived, informative, seconds):
    """Steps 1-3 for a step: B prompts (each rank its contiguous slice, so groups never straddle ranks) from
    `cursor` in `order`, sampled with a seed fixed by the step and the round (a resumed run samples the same).

    `informative(rewards)` says which of B groups the estimator can learn from (train.py asks the estimator's
    own question, on the conditioned rewards). Without --dynamic-sampling one round is the step. With it,
    rounds of B fresh prompts follow until B such groups are found or --max-sample-rounds; the step trains on
    what it found, rounded down to a multiple of the world size (none: no update), dealt out to the ranks in
    equal shares, in the order sampled. `seconds` gathers the time/... of each phase. Returns (Sampled, cursor).
    """
    B, G, rank, world, mine = derived.prompts_per_step, cfg.group_size, dist.rank(), dist.world_size(), derived.prompts_per_rank
    rounds, found, kept = [], [], 0
    for n in range(cfg.max_sample_rounds if cfg.dynamic_sampling else 1):
        examples = [task.examples[i] for i in order.take(cursor, B)[rank * mine:(rank + 1) * mine]]
        cursor += B
        seed = cfg.seed * 1_000_003 + step * 1_009 + rank + n * 1_000_000_007
        rounds.append(rollout(examples, seed, tokenizer, sampler, scorer, cfg, seconds, sleep=not cfg.dynamic_sampling))
        keep = informative(rounds[-1].rewards)                                  # (B,) logged with or without the flag
        kept += int(keep.sum())
        found += [(n, g) for g in range(B) if keep[g] or not cfg.dynamic_sampling]
        if len(found) >= B:
            break
    chosen = found[:B] if len(found) >= B else found[:len(found) // world * world]
    K = len(chosen)
    local = {(n, rank * mine + i): {"prompt": r.prompts[i], "completions": r.completions[i * G:(i + 1) * G],
                                    "rewards": r.scores[i * G:(i + 1) * G]} for n, r in enumerate(rounds) for i in range(mine)}
    if cfg.dynamic_sampling:  # each rank's share of the chosen groups, from the ranks that sampled them
        share = [{k: local[k] for k in chosen[r * K // world:(r + 1) * K // world] if k in local} for r in range(world)]
        local = {k: v for part in dist.exchange_objects(share) for k, v in part.items()}
    sampled = len(rounds) * B
    stats = {"sampling/rounds": len(rounds), "sampling/groups_sampled": sampled, "sampling/groups_informative": kept,
             "sampling/groups_trained": K, "sampling/uninformative_frac": 1 - kept / sampled,
             "sampling/samples_per_trained": sampled / max(K, 1), "sampling/skipped_update": int(K == 0)}
    pick = lambda key: torch.stack([getattr(rounds[n], key)[g] for n, g in chosen]) if K else getattr(rounds[0], key)[:0]
    per_rank = dist.all_gather_object([r.counts for r in rounds])
    counts = [RewardScorer.merge(rank_rounds) for rank_rounds in per_rank]
    return Sampled([local[k] for k in chosen[rank * K // world:(rank + 1) * K // world]], pick("rewards"), pick("lengths"),
                   torch.cat([r.rewards for r in rounds]).cpu(), torch.cat([r.lengths for r in rounds]),
                   torch.cat([r.truncated for r in rounds]), counts, stats), cursor
