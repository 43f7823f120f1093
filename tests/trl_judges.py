"""TRL-style rewards as real judges write them, for tests/test_trl_style.py: a judge that takes real time per
completion, an async judge rate-limited by a module-level semaphore, numpy results, a schedule on trainer_state, and
a reward of the project's own kind that takes **kwargs."""

import asyncio
import time

import numpy as np

LIMIT = asyncio.Semaphore(2)  # created at import, outside any event loop: the usual rate limit of an API judge


def slow_judge(completions, **kwargs):
    """20 ms per completion, as an LLM judge or a code-running reward takes."""
    time.sleep(0.02 * len(completions))
    return [1.0] * len(completions)


async def rate_limited_judge(completions, **kwargs):
    async def one(c):
        async with LIMIT:
            await asyncio.sleep(0)
            return float(len(c) if isinstance(c, str) else len(c[0]["content"]))

    return await asyncio.gather(*(one(c) for c in completions))


def numpy_scores(completions, **kwargs):
    return np.arange(len(completions), dtype=np.float32)


def numpy_bools(completions, **kwargs):
    return [np.bool_(i % 2) for i in range(len(completions))]


def by_step(completions, trainer_state, **kwargs):
    return [float(trainer_state.global_step)] * len(completions)


def own_kind(completion, example, **kwargs):
    """The project's own per-completion kind, with a **kwargs for what it ignores."""
    return float(len(completion))
