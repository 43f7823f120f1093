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
It returns one number or None ("does not apply": NaN in the rewards, which each estimator treats by its own rule,
minigdpo/estimators.py) per completion, as a list, a tuple, a numpy array or a tensor, numpy scalars and booleans
included, as TRL takes them. An `async def` reward runs on the run's one event loop (TRL's daemon loop;
minigdpo/scoring.py), the one async tools run on too, so an asyncio.Semaphore or client made at import keeps working
from step to step, and one that a tool and a judge share is one. A non-finite number
counts as None, as any reward's does. A result of the wrong length, or a value that is neither a number nor None,
stops the run in one line on every rank (TRL raises on both); a reward that raises, or runs past its batch's limit
(--reward-timeout per completion, times the completions in the call), counts every completion of the call as None.
A row that lacks a column other rows have gives None there, as datasets gives TRL (rewards/prompts.py).
"""

import inspect
import math
import numbers

import numpy as np
import torch


class RewardError(ValueError):
    """A reward broke its contract (the count or the kind of its values): one line, and the run stops."""


TRL_NAMES = ("prompts", "completions", "completion_ids")
# What the trainer passes by these names; a data column named so would shadow it (rewards/prompts.py refuses one)
TRAINER_ARGUMENTS = TRL_NAMES + ("trainer_state", "log_metric", "log_extra", "environments")


def is_batched(fn):
    """Whether fn is TRL-style, by its named parameters: it names one of TRL's arguments, or takes **kwargs without
    the two positional parameters (completion, example) of a per-completion reward (rewards/__init__.py)."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.name in TRL_NAMES for p in parameters):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) < 2 and any(p.kind is p.VAR_KEYWORD for p in parameters)


def columns(example):
    """An example's columns, as TRL passes a row's: a row's own (rewards/prompts.py), or a built-in task's fields."""
    return example.get("columns") or [k for k in example if k not in ("messages", "completion_tokens", "columns")]


def arguments(texts, examples, completion_ids, state, metrics, extra, messages=None, environments=None):
    """The keyword arguments of one TRL-style call. messages: each completion as TRL's list of messages (a tool
    loop's conversation, minigdpo/tools.py); environments: each completion's environment."""
    chat = [isinstance(ex["messages"], list) for ex in examples]
    names = columns(examples[0]) if examples else ()

    def log_metric(name, value):
        total, count = metrics.get(name, (0.0, 0))
        metrics[name] = (total + float(value), count + 1)

    def log_extra(column, values):
        extra[column] = list(values)

    return {"prompts": [ex["messages"] for ex in examples],
            "completions": messages or [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)],
            "completion_ids": [list(ids) for ids in completion_ids], **{c: [ex[c] for ex in examples] for c in names},
            "trainer_state": state, "log_metric": log_metric, "log_extra": log_extra,
            **({"environments": environments} if environments is not None else {})}


def values(name, result, n):
    """One float or None per completion from what reward `name` returned (awaited first where it is a coroutine's, on
    the scorer's loop), and how many were not finite; RewardError on the wrong count or on a value that is neither a
    number nor None."""
    if isinstance(result, (np.ndarray, torch.Tensor)) and result.ndim == 1:
        result = result.tolist()
    if not isinstance(result, (list, tuple)) or len(result) != n:
        got = f"{len(result)} values" if isinstance(result, (list, tuple)) else f"a {type(result).__name__}"
        raise RewardError(f"reward {name!r} returned {got} for {n} completions: it must return one number or None "
                          "per completion")
    out, invalid = [], 0
    for i, v in enumerate(result):
        if isinstance(v, (torch.Tensor, np.ndarray, np.generic)) and np.size(v) == 1:
            v = v.item()  # numpy's scalars and booleans, as TRL's torch.tensor(values) takes them
        if v is not None and not isinstance(v, numbers.Real):  # True and False count as 1 and 0, as in TRL
            raise RewardError(f"reward {name!r} returned a {type(v).__name__} for completion {i} of {n}: it must "
                              "return one number or None per completion")
        finite = v is not None and math.isfinite(float(v))
        invalid += v is not None and not finite
        out.append(float(v) if finite else None)
    return out, invalid
