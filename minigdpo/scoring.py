"""Scoring: a batch's rewards, under their time limits, on the one event loop that rewards and tools share.

The rewards themselves are what a user writes (rewards/: the registry, the tasks, TRL's calling convention in
rewards/trl_style.py); calling them is the trainer's machinery, and lives here.

    scorer = RewardScorer(["format", "correct"], timeout=10.0)
    rewards, stats = scorer(completions, examples, completion_tokens)
    # rewards (N, R) float64, NaN where a reward gave None or failed
    # stats[name] = {"errors", "timeouts", "invalid", "none": counts, "seconds": time spent}

A reward that raises, runs past its time limit, or returns something that is not a finite number counts as None, is
counted in the metrics, and is warned about once; a TRL-style reward that breaks its contract (the wrong number or
kind of values) is returned in the stats, and `check` raises it on every rank alike.

Shape legend: N completions, R rewards.
"""

import asyncio
import inspect
import math
import numbers
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace

import torch

from rewards import Reward, get, reward_model, trl_style
from rewards.trl_style import RewardError


class TimeUp(BaseException):
    """Raised inside a reward or a tool that runs past its limit. A BaseException, so that `except Exception` in the
    user's code cannot swallow it."""


@contextmanager
def time_limit(seconds):
    """The block runs at most `seconds` (TimeUp past it; None or 0: no limit). SIGALRM interrupts what the block waits
    on (a sleep, a lock, a socket), so it works in the main thread only, where the trainer scores and calls tools;
    in another thread the block runs unbounded."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise TimeUp

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class EventLoop:
    """One asyncio loop on a daemon thread (TRL's start_event_loop_in_daemon): every async reward and every async tool
    of a run runs on it, so what binds to a loop (a semaphore, an HTTP client) binds once, and a semaphore that a tool
    and a judge share is one semaphore. `loop()` gives the process's; `close_loop()` ends it with the run."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="minigdpo-async")
        self.thread.start()

    def run(self, coroutine, seconds=None):
        """The coroutine's result (TimeUp past `seconds`); an exception in the caller's wait cancels it on the loop."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout=seconds or None)
        except TimeoutError:
            future.cancel()
            raise TimeUp from None
        except BaseException:
            future.cancel()
            raise

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


_LOOP = None


def loop():
    """The process's event loop, made at the first async reward or tool and kept until close_loop()."""
    global _LOOP
    if _LOOP is None:
        _LOOP = EventLoop()
    return _LOOP


def close_loop():
    """End the event loop and its thread (a run's or an evaluation's end); a later loop() makes a new one."""
    global _LOOP
    if _LOOP is not None:
        _LOOP.close()
        _LOOP = None


class InvalidReward(ValueError):
    """A reward returned something that is not a finite number or None."""


def as_float(value):
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
    """Scores a batch of completions with a fixed list of rewards (the module docstring).

    `timeout` bounds each completion's call (seconds, None for no limit); a TRL-style reward, called once for the
    whole batch, gets `timeout` times the completions in the call. Once a per-completion reward has timed out
    `max_timeouts` times in one batch, its remaining samples in that batch are skipped as None, so a reward that
    always hangs costs at most timeout * max_timeouts per step.
    """

    KINDS = ("errors", "timeouts", "invalid", "none")
    ADDED = KINDS + ("truncated", "model_seconds")  # added up over batches and ranks; a reward model adds these two

    def __init__(self, specs, timeout=10.0, max_timeouts=3, own=None, names=None):
        """specs: what rewards.get loads; names: what the metrics call them (the specs by default); own: {name:
        function} for rewards the run makes itself (an environment's get_reward, TRL-style)."""
        own = own or {}
        self.names = list(names or specs)
        self.rewards = [Reward(n, own[s], batched=True) if s in own else replace(get(s), name=n)
                        for s, n in zip(specs, self.names)]
        self.timeout = timeout
        self.max_timeouts = max_timeouts
        self._warned = set()
        self.trainer_state, self.extra = None, {}  # what a TRL-style reward gets as trainer_state; its log_extra

    def models(self):
        return [reward.fn for reward in self.rewards if isinstance(reward.fn, reward_model.ModelReward)]

    def place_models(self, device, dtype, batch_size=8, placement="auto", shard_build=None):
        """Load the reward models' weights on the trainer's device, in its dtype, before any is needed (train.py;
        eval.py's scorer places them on first use). shard_build: see reward_model.ModelReward.place."""
        for model in self.models():
            model.place(device, dtype, batch_size, placement, shard_build)

    def check_conversation(self, messages, tools=False):
        """Refuse (RewardModelError) a reward model whose template cannot write a conversation of this shape (with
        tools: an assistant's tool call and the tool's message too)."""
        for model in self.models():
            model.rm.check_conversation(messages, tools)

    @classmethod
    def merge(cls, parts):
        """Stats of several batches or ranks as one: counts add up; a reward model's memory is the largest."""
        out = {}
        for part in parts:
            for name, s in part.items():
                merged = out.setdefault(name, dict.fromkeys(cls.KINDS, 0))
                for key, value in s.items():
                    if key in cls.ADDED:
                        merged[key] = merged.get(key, 0) + value
                    elif key == "model_gib":
                        merged[key] = max(merged.get(key, 0.0), value)
                    elif key == "error":  # a broken contract (trl_style.RewardError): the first rank's message
                        merged[key] = merged.get(key) or value
                    elif key.startswith("metric/"):  # a TRL-style reward's log_metric: (sum, count)
                        total, count = merged.get(key, (0.0, 0))
                        merged[key] = (total + value[0], count + value[1])
        return out

    @staticmethod
    def check(merged):
        """Raise RewardError, on every rank alike, where a reward broke its contract on any rank (merged stats)."""
        for s in merged.values():
            if s.get("error"):
                raise RewardError(s["error"])

    def _warn(self, name, kind, detail):
        if (name, kind) not in self._warned:
            self._warned.add((name, kind))
            print(f"warning: reward {name!r} {detail}; counted as None (shown once per reward)", file=sys.stderr)

    def _call(self, reward, completion, example):
        """One reward on one sample -> (kind, value), kind "ok" or one of KINDS."""
        try:
            with time_limit(self.timeout):
                value = reward.fn(completion, example)
            value = as_float(value)
        except TimeUp:
            self._warn(reward.name, "timeouts", f"ran past its {self.timeout:g} s limit")
            return "timeouts", None
        except InvalidReward as e:
            self._warn(reward.name, "invalid", str(e))
            return "invalid", None
        except Exception as e:
            self._warn(reward.name, "errors", f"raised {type(e).__name__}: {e}")
            return "errors", None
        return ("none", None) if value is None else ("ok", value)

    def _call_each(self, reward, column, s, texts, examples):
        """A per-completion reward on each sample, its values written into column (N,), its failures counted in s."""
        for i in range(len(texts)):
            if s["timeouts"] >= self.max_timeouts:
                s["timeouts"] += 1
                continue
            kind, value = self._call(reward, texts[i], examples[i])
            if kind == "ok":
                column[i] = value
            else:
                s[kind] += 1

    def _call_batched(self, reward, column, s, texts, examples, completion_ids, agent):
        """A TRL-style reward on the whole batch (rewards/trl_style.py), its values written into column (N,); agent:
        (messages, environments) of a tool loop's rollouts, or Nones. An async one runs on the shared loop."""
        N, metrics = len(texts), {}
        ids = completion_ids if completion_ids is not None else [[] for _ in texts]
        limit = self.timeout and self.timeout * N
        try:
            with time_limit(limit):
                result = reward.fn(**trl_style.arguments(texts, examples, ids, self.trainer_state, metrics, self.extra,
                                                         *agent))
                if inspect.iscoroutine(result):
                    result = loop().run(result, limit)
            got, s["invalid"] = trl_style.values(reward.name, result, N)
        except RewardError as e:
            s["error"], got = str(e), [None] * N
        except TimeUp:
            self._warn(reward.name, "timeouts", f"ran past its limit on a batch ({self.timeout:g} s x {N} completions)")
            s["timeouts"], got = N, [None] * N
        except Exception as e:
            self._warn(reward.name, "errors", f"raised {type(e).__name__}: {e}")
            s["errors"], got = N, [None] * N
        if s["invalid"]:
            self._warn(reward.name, "invalid", "returned a value that is not finite")
        s["none"] = sum(v is None for v in got) - s["invalid"] - s["errors"] - s["timeouts"]
        s.update({f"metric/{k}": v for k, v in metrics.items()})
        column.copy_(torch.tensor([math.nan if v is None else v for v in got], dtype=torch.float64))

    def score(self, completions, examples, environments=None):
        """__call__ on a sampler's Completions (minigdpo/sampler.py): their final texts, the lengths of what the model
        wrote, every token after each one's own prompt, and a tool loop's conversations and environments."""
        agent = any(c.messages is not None for c in completions)
        return self([c.text for c in completions], examples, [c.written for c in completions],
                    [c.token_ids[c.prompt_tokens:] for c in completions],
                    [c.messages for c in completions] if agent else None, environments)

    def __call__(self, completions, examples, completion_tokens=None, completion_ids=None, messages=None,
                 environments=None):
        """completion_ids (token id lists) give completion_tokens too, unless given. A tool loop's rollouts come with
        their messages (what TRL-style rewards and reward models get; minigdpo/tools.py) and environments. A broken
        contract is not raised here, where the other ranks would wait in the next collective, but returned in the
        stats (check() raises it once every rank's stats are merged)."""
        N, R = len(completions), len(self.rewards)
        if len(examples) != N:
            raise ValueError(f"{N} completions but {len(examples)} examples")
        if completion_ids is not None and completion_tokens is None:
            completion_tokens = [len(ids) for ids in completion_ids]
        if completion_tokens is not None:
            examples = [{**ex, "completion_tokens": int(n)} for ex, n in zip(examples, completion_tokens)]
        self.extra = {}  # a TRL-style reward's log_extra columns, this call's
        out = torch.full((N, R), math.nan, dtype=torch.float64)    # (N, R)
        stats = {name: dict.fromkeys(self.KINDS, 0) for name in self.names}
        reward_model.new_batch()
        for k, reward in enumerate(self.rewards):
            t0 = time.perf_counter()
            s = stats[reward.name]
            if reward.prepare is not None:
                try:
                    if isinstance(reward.fn, reward_model.ModelReward):  # it reads the whole conversation
                        reward.fn.prepare(completions, examples, messages)
                    else:
                        reward.prepare(completions, examples)
                    s.update(getattr(reward.fn, "stats", {}))  # a reward model's truncations and memory
                except reward_model.RewardModelError:  # a reward model that cannot score stops the run
                    raise
                except Exception as e:  # the per-sample calls still run without the batch cache
                    self._warn(reward.name, "prepare", f"batch hook raised {type(e).__name__}: {e}")
            if reward.batched:
                self._call_batched(reward, out[:, k], s, completions, examples, completion_ids,
                                   (messages, environments))
            else:
                self._call_each(reward, out[:, k], s, completions, examples)
            s["seconds"] = time.perf_counter() - t0
        return out, stats
