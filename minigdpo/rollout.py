"""Steps 1-3 of a training step: prompts, G completions each, their rewards.

`rollout` is one round: this rank's prompts, sampled and scored, with every rank's rewards gathered (GDPO's
batch step needs them all). Most runs take exactly one round per step; --dynamic-sampling runs rounds of fresh
prompts until the step holds enough groups to learn from (minigdpo/dynamic_sampling.py, a loop around this).

Shape legend: B prompts per step (all ranks), G samples per prompt, R rewards.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from minigdpo import dist
from minigdpo.sampler import SamplingParams
from minigdpo.scoring import RewardScorer
from rewards import encode_prompt


@contextmanager
def timed(seconds, name):
    """Add the seconds the block takes to seconds[name]."""
    t0 = time.perf_counter()
    yield
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0


def add_counts(parts):
    """Count dicts added key by key, zeros kept, keys in their first order (the tool loop's: over rollouts, rounds,
    batches and ranks)."""
    parts = list(parts)
    return {k: sum(part.get(k, 0) for part in parts) for k in dict.fromkeys(k for part in parts for k in part)}


@dataclass
class Rollout:
    """A step's groups: this rank's prompts and completions, every rank's rewards (what the step trains on), and
    what it logs: every group sampled, which dynamic sampling's extra rounds make more than those it trains on."""
    prompts: list              # this rank's prompts, token ids, one per group
    completions: list          # this rank's completions: G per prompt, one list per group
    rewards: torch.Tensor      # (B, G, R) every rank's groups, float64, NaN where a reward does not apply or failed
    lengths: torch.Tensor      # (B, G) every rank's completion lengths
    sampled_rewards: torch.Tensor  # (groups sampled, G, R) every group of every round, for the metrics
    sampled_lengths: torch.Tensor  # (groups sampled, G)
    truncated: torch.Tensor    # (groups sampled * G,) 1 where a completion ran to max_new_tokens
    failures: list             # every rank's scorer failures, {reward: {kind: n}}
    stats: dict = field(default_factory=dict)  # sampling/... (dynamic sampling's rounds)
    tools: dict = field(default_factory=dict)  # the tool loop's counts, every rank's summed (tools.metrics)
    seconds: dict = field(default_factory=dict)  # what its phases took on this rank (time/generate, ...)


def trainer_state(step, cursor, cfg, sizes, num_prompts):
    """What a TRL-style reward gets as trainer_state (rewards/trl_style.py): a transformers TrainerState with the
    optimizer steps done before this step's sampling, their total, and the epochs of prompts taken and to take."""
    from transformers import TrainerState

    return TrainerState(global_step=(step - 1) * cfg.num_iterations, max_steps=sizes.total_steps * cfg.num_iterations,
                        epoch=cursor / num_prompts,
                        num_train_epochs=sizes.total_steps * sizes.prompts_per_step / num_prompts)


def step_prompts(step, cursor, order, task, cfg, sizes, round_=0):
    """This rank's examples for a round of a step (B prompts from `cursor` in `order`, each rank a contiguous
    slice, so groups never straddle ranks) and the round's sampling seed, fixed by the step and the round: a
    resumed run samples the same."""
    per_rank, rank = sizes.prompts_per_rank, dist.rank()
    mine = order.take(cursor, sizes.prompts_per_step)[rank * per_rank:(rank + 1) * per_rank]
    examples = [task.examples[i] for i in mine]
    return examples, cfg.seed * 1_000_003 + step * 1_009 + rank + round_ * 1_000_000_007


def rollout(examples, seed, tokenizer, sampler, scorer, cfg, seconds, sleep=False, agent=None, state=None):
    """Steps 1-3 once: this rank's `examples` as prompts, G completions each drawn from `seed`; with an agent
    (minigdpo/tools.py), G rollouts of its tool loop each. Returns score(): step 3, their rewards in a Rollout
    (`state`: their trainer_state). sleep=True puts the sampler to sleep before scoring, so that a reward model's
    memory does not come on top of vLLM's: only when an update (and so a weight sync) is sure to follow."""
    G = cfg.group_size
    params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, seed=seed, ignore_eos=cfg.ignore_eos)
    counts = {}
    if agent is None:
        prompts = [encode_prompt(tokenizer, ex["messages"], cfg.max_prompt_len) for ex in examples]
        with timed(seconds, "generate"):
            groups = sampler.generate(prompts, G, params)                  # len(prompts) lists of G completions
    else:
        prompts, groups, counts = agent.rollouts(examples, G, params, sampler, cfg.max_prompt_len, seconds)
    if sleep:
        sampler.sleep()
    flat = [c for group in groups for c in group]
    rows = [ex for ex in examples for _ in range(G)]
    if agent is not None:  # the prompt as the model saw it: what an environment's reset appended included (TRL)
        rows = [{**ex, "messages": messages} for ex, messages in zip(rows, agent.prompts)]

    def score():
        """Step 3: the completions' rewards, every rank's gathered."""
        scorer.trainer_state = state
        with timed(seconds, "reward"):
            scores, failures = scorer.score(flat, rows, agent and agent.environments)
        for i, c in enumerate(flat):  # log_extra's values travel with their completion (dynamic sampling moves groups)
            c.extra = {column: values[i] for column, values in scorer.extra.items() if i < len(values)}
        rewards = dist.all_gather(scores).view(-1, G, scores.shape[1]).double()          # (B, G, R)
        lengths = dist.all_gather(torch.tensor([float(c.written) for c in flat])).view(-1, G)  # (B, G) model tokens
        truncated = dist.all_gather(torch.tensor([float(c.finish_reason == "length") for c in flat]))  # (B * G,)
        gathered = dist.all_gather_object((failures, counts))  # with the tool loop's counts (Agent.rollouts)
        failures = [RewardScorer.merge([f]) for f, _ in gathered]
        RewardScorer.check(RewardScorer.merge(failures))  # a reward that broke its contract on a rank: every rank stops
        return Rollout(prompts, groups, rewards, lengths, rewards.cpu(), lengths, truncated, failures,
                       tools=add_counts(c for _, c in gathered), seconds=seconds)
    return score
