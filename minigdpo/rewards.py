"""The reward registry, and the scorer that turns completions into a (N, R) reward tensor.

A reward is a plain function `fn(completion: str, example: dict) -> float | None`, where
`example` is the dataset row with its ground truth under fixed keys (`answer` for math,
`ground_truth` for tool calls, `tests` for code) plus `completion_tokens`, the length of
this completion in tokens. `None` means the reward does not apply to this sample.

Rewards live in the top-level `rewards/` package, one file per task, and register by name:

    from minigdpo.rewards import register

    @register("format", low=0.0, high=1.0)
    def format_reward(completion, example): ...

`get("module.path:function")` also loads a user's function without registering it first.

The scorer never lets a reward crash training. A reward that raises, runs past its time
limit, or returns something that is not a finite number counts as None (NaN in the tensor,
so the estimators leave it out), is counted in the metrics, and is warned about once.
"""

import importlib
import math
import numbers
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class Reward:
    name: str
    fn: Callable
    low: float = -math.inf   # the declared range: every value the reward returns lies in [low, high]
    high: float = math.inf
    prepare: Optional[Callable] = None  # optional batch hook, prepare(completions, examples), run before fn


_REGISTRY = {}


def register(name, low=-math.inf, high=math.inf, prepare=None):
    """Decorator: register `fn(completion, example)` under `name`."""

    def wrap(fn):
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise ValueError(f"reward {name!r} is already registered by {_REGISTRY[name].fn.__module__}")
        _REGISTRY[name] = Reward(name, fn, low, high, prepare)
        return fn

    return wrap


def _load_builtin():
    importlib.import_module("rewards")  # its modules register the built-in rewards


def get(name):
    """The Reward registered as `name`, or a user's function given as `module.path:function`."""
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load reward {name!r}: {e}") from None
        return Reward(name, fn)
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; registered: {', '.join(names())}")
    return _REGISTRY[name]


def names():
    _load_builtin()
    return sorted(_REGISTRY)


class RewardTimeout(BaseException):
    """Raised inside a reward that runs too long. A BaseException, so `except Exception` in
    reward code cannot swallow it."""


@contextmanager
def _alarm_handler():
    """Install a SIGALRM handler for the duration of a batch (main thread on POSIX only)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield False
        return

    def on_alarm(signum, frame):
        raise RewardTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        yield True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class InvalidReward(ValueError):
    """A reward returned something that is not a finite number or None."""


def _as_float(value):
    """A finite float, or None for "does not apply"; raises InvalidReward otherwise."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise InvalidReward(f"returned {type(value).__name__}, not a number")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidReward(f"returned {value}")
    return value


class RewardScorer:
    """Scores a batch of completions with a fixed list of rewards.

    scorer = RewardScorer(["format", "correct"], timeout=10.0)
    rewards, stats = scorer(completions, examples, completion_tokens)
    # rewards (N, R) float64, NaN where a reward gave None or failed
    # stats[name] = {"errors", "timeouts", "invalid", "none": counts, "seconds": time spent}

    `timeout` bounds each call (seconds, None for no limit). Once a reward has timed out
    `max_timeouts` times in one batch, its remaining samples in that batch are skipped as
    None, so a reward that always hangs costs at most timeout * max_timeouts per step.
    """

    KINDS = ("errors", "timeouts", "invalid", "none")

    def __init__(self, reward_names, timeout=10.0, max_timeouts=3):
        self.rewards = [get(n) for n in reward_names]
        self.names = list(reward_names)
        self.timeout = timeout
        self.max_timeouts = max_timeouts
        self._warned = set()

    def _warn(self, name, kind, detail):
        if (name, kind) not in self._warned:
            self._warned.add((name, kind))
            print(f"warning: reward {name!r} {detail}; counted as None (shown once per reward)", file=sys.stderr)

    def _call(self, reward, completion, example, can_time_out):
        """One reward on one sample -> (kind, value), kind "ok" or one of KINDS."""
        arm = can_time_out and bool(self.timeout)
        try:
            if arm:
                signal.setitimer(signal.ITIMER_REAL, self.timeout)
            try:
                value = reward.fn(completion, example)
            finally:
                if arm:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            value = _as_float(value)
        except RewardTimeout:
            self._warn(reward.name, "timeouts", f"ran past its {self.timeout:g} s limit")
            return "timeouts", None
        except InvalidReward as e:
            self._warn(reward.name, "invalid", str(e))
            return "invalid", None
        except Exception as e:
            self._warn(reward.name, "errors", f"raised {type(e).__name__}: {e}")
            return "errors", None
        return ("none", None) if value is None else ("ok", value)

    def __call__(self, completions, examples, completion_tokens=None):
        N, R = len(completions), len(self.rewards)
        if len(examples) != N:
            raise ValueError(f"{N} completions but {len(examples)} examples")
        if completion_tokens is not None:
            examples = [{**ex, "completion_tokens": int(n)} for ex, n in zip(examples, completion_tokens)]
        out = torch.full((N, R), math.nan, dtype=torch.float64)    # (N, R)
        stats = {name: dict.fromkeys(self.KINDS, 0) for name in self.names}
        with _alarm_handler() as can_time_out:
            for k, reward in enumerate(self.rewards):
                t0 = time.perf_counter()
                s = stats[reward.name]
                if reward.prepare is not None:
                    try:
                        reward.prepare(completions, examples)
                    except Exception as e:  # the per-sample calls still run without the batch cache
                        self._warn(reward.name, "prepare", f"batch hook raised {type(e).__name__}: {e}")
                for i in range(N):
                    if s["timeouts"] >= self.max_timeouts:
                        s["timeouts"] += 1
                        continue
                    kind, value = self._call(reward, completions[i], examples[i], can_time_out)
                    if kind == "ok":
                        out[i, k] = value
                    else:
                        s[kind] += 1
                s["seconds"] = time.perf_counter() - t0
        return out, stats
