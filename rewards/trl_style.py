"""TRL-style reward functions, unchanged: called as TRL 1.16's GRPOTrainer calls them.

    def my_reward(completions, answer, **kwargs):          # --rewards mypkg.rewards:my_reward
        return [1.0 if answer_of(c) == a else 0.0 for c, a in zip(completions, answer)]

A reward is TRL-style when it takes one of TRL's argument names or **kwargs. Each rank calls it once on its own share,
by keyword (TRL's _calculate_rewards, trl/trainer/grpo_trainer.py:1579-1636), every argument a list with one entry
per completion, in the order of the completions:
- prompts: each completion's prompt as its row gives it (a string, or a list of messages);
- completions: the text, or [{"role": "assistant", "content": text}] for a conversational prompt;
- completion_ids: the sampled token ids, the stop token included when one ended it;
- every other column of the row (rewards/prompts.py; a built-in task's examples give their own fields);
- trainer_state: a transformers TrainerState with global_step (optimizer steps done before this step's sampling),
  max_steps, epoch and num_train_epochs, what a reward schedule reads; log_metric(name, value): logged as
  reward/<reward>/<name>, the mean over calls and ranks; log_extra(column, values): one value per completion,
  written beside the completions in samples.jsonl.
It returns one number or None ("does not apply", left out by the estimators as a None always is) per completion;
an `async def` reward is run to completion. A non-finite number counts as None, as any reward's does. A result of
the wrong length, or a value that is neither a number nor None, stops the run in one line on every rank (TRL
raises on both); a reward that raises or runs past --reward-timeout counts every completion of the call as None.
"""

import asyncio
import inspect
import math
import numbers

import torch


class RewardError(ValueError):
    """A reward broke its contract (the count or the kind of its values): one line, and the run stops."""


TRL_NAMES = ("prompts", "completions", "completion_ids")


def is_batched(fn):
    """Whether fn is TRL-style: it takes one of TRL's argument names, or **kwargs (TRL's rewards all do), where a
    per-completion reward takes (completion, example)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name in TRL_NAMES or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def arguments(texts, examples, completion_ids, state, metrics, extra):
    """The keyword arguments of one TRL-style call."""
    chat = [isinstance(ex["messages"], list) for ex in examples]
    columns = examples[0].get("columns") if examples else ()
    if columns is None:  # a built-in task's example: its own fields
        columns = [k for k in examples[0] if k not in ("messages", "completion_tokens")]

    def log_metric(name, value):
        total, count = metrics.get(name, (0.0, 0))
        metrics[name] = (total + float(value), count + 1)

    def log_extra(column, values):
        extra[column] = list(values)

    return {"prompts": [ex["messages"] for ex in examples],
            "completions": [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)],
            "completion_ids": [list(ids) for ids in completion_ids], **{c: [ex[c] for ex in examples] for c in columns},
            "trainer_state": state, "log_metric": log_metric, "log_extra": log_extra}


def values(name, result, n):
    """One float or None per completion from what reward `name` returned, and how many were not finite;
    RewardError on the wrong count or on a value that is neither a number nor None."""
    if inspect.iscoroutine(result):
        result = asyncio.run(_awaited(result))
    if not isinstance(result, (list, tuple)) or len(result) != n:
        got = f"{len(result)} values" if isinstance(result, (list, tuple)) else f"a {type(result).__name__}"
        raise RewardError(f"reward {name!r} returned {got} for {n} completions: it must return one number or None "
                          "per completion")
    out, invalid = [], 0
    for i, v in enumerate(result):
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if v is not None and not isinstance(v, numbers.Real):  # True and False count as 1 and 0, as in TRL
            raise RewardError(f"reward {name!r} returned a {type(v).__name__} for completion {i} of {n}: it must "
                              "return one number or None per completion")
        finite = v is not None and math.isfinite(float(v))
        invalid += v is not None and not finite
        out.append(float(v) if finite else None)
    return out, invalid


async def _awaited(coroutine):
    return await coroutine
