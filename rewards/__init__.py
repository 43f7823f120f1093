"""Tasks and their rewards: what the trainer asks, and how each answer is scored.

A task (one file here) turns data rows into examples: a dict with `messages` (the chat prompt) and
the ground truth under the keys its rewards read. A reward is a plain function
`fn(completion: str, example: dict) -> float | None`; None means it does not apply to that sample.
`example` also carries `completion_tokens`, the completion's length in tokens.

| task        | file           | default rewards          | data                                                  |
|-------------|----------------|--------------------------|-------------------------------------------------------|
| gsm8k       | gsm8k.py       | correct, integer, format | question/answer rows (GSM8K's jsonl) or openai/gsm8k  |
| arith       | arith.py       | correct, integer, format | built in: integer word problems (or gsm8k-style rows) |
| toolcall    | toolcall.py    | tool_format, tool_correct| ToolRL's rows or its SFT file (--data)                |
| math_length | math_length.py | correct, length_ok       | problem/answer rows; DeepScaleR on the hub            |
| code        | code.py        | pass, length_ok, no_bug  | built in: code_problems.jsonl (24 problems), or rows  |
| calculator  | calculator.py  | solved, answer_tag,      | built in: sums and products, for an agent with tools  |
|             |                | tool_economy             |                                                       |

Built-in rewards and tasks are registered here, in one place, by name; `get("module:function")`
also loads a user's own reward (`--rewards correct,mypkg.rewards:polite`: docs/tasks.md, "Your own reward").

A reward that raises, runs past its time limit, or returns something that is not a finite number counts as None
(NaN in the tensor, which each estimator treats by its own rule: the per-reward ones leave it out of its group,
grpo, grpo_no_std and saw_grpo add it as 0; minigdpo/advantages.py), is counted in the metrics, and is warned
about once; training goes on. What stops a run is a TRL-style reward that breaks its contract (the wrong number or
kind of values, rewards/trl_style.py): every rank stops with one line and exit status 2, before any update.
"""

import importlib
import inspect
import math
import numbers
import random
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from minigdpo.data import DataError
from rewards import reward_model, trl_style
from rewards.trl_style import RewardError  # noqa: F401 (train.py and eval.py catch it from here)

TASKS = {"gsm8k": "rewards.gsm8k", "arith": "rewards.arith", "toolcall": "rewards.toolcall",
         "math_length": "rewards.math_length", "code": "rewards.code", "prompts": "rewards.prompts",
         "calculator": "rewards.calculator"}
BUILTIN = {"format": "rewards.gsm8k:format_reward", "correct": "rewards.gsm8k:correct_reward",
           "integer": "rewards.gsm8k:integer_reward", "length_ok": "rewards.length:length_ok",
           "tool_format": "rewards.toolcall:tool_format", "tool_format_strict": "rewards.toolcall:tool_format_strict",
           "tool_correct": "rewards.toolcall:tool_correct", "pass": "rewards.code:pass_reward",
           "no_bug": "rewards.code:no_bug_reward", "solved": "rewards.calculator:solved",
           "answer_tag": "rewards.calculator:answer_tag", "tool_economy": "rewards.calculator:tool_economy"}


# Tasks -----------------------------------------------------------------------------------------

@dataclass
class Task:
    name: str
    examples: list
    rewards: list               # the task's default rewards
    skipped: int = 0            # malformed rows skipped with skip_bad
    reward_options: dict = field(default_factory=dict)  # keys added to every example (length limits, answer format)


def load_task(name, data="", split="train", skip_bad=False, data_options=None, reward_options=None):
    """The examples of task `name`, with its default rewards and `reward_options` on every example.

    data: a local .jsonl/.json/.parquet file or a hub dataset ("" for the task's own); data_options: what a
    task's own data depends on (arith_difficulty); reward_options: what its rewards read from each example
    (length_limit, length_unit, answer_format), which the data may depend on too."""
    if name not in TASKS:
        raise DataError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    task = importlib.import_module(TASKS[name])
    reward_options = dict(reward_options or {})
    examples, skipped = task.examples(data, split, skip_bad, {**reward_options, **(data_options or {})})
    return Task(name, [{**ex, **reward_options} for ex in examples], list(task.REWARDS), skipped, reward_options)


TOOL_CUT_SAID = False  # a prompt whose tools' schemas the cut can reach is said once per process


def encode_prompt(tokenizer, messages, max_len, tools=None):
    """Chat template with the generation prompt (and the tools' schemas, an agent's), cut from the left to max_len
    tokens; a string (TRL's standard prompt, rewards/prompts.py) is tokenized as it is, with the tokenizer's own
    special tokens, as TRL does. Templates put the schemas early (Qwen's in the system message), where the cut
    starts: an agent's prompt that is cut says so, once."""
    global TOOL_CUT_SAID
    if isinstance(messages, str):
        return tokenizer(messages).input_ids[-max_len:]
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if tools and len(ids) > max_len and not TOOL_CUT_SAID:
        TOOL_CUT_SAID = True
        print(f"warning: a prompt with the tools' schemas takes {len(ids)} tokens and --max-prompt-len {max_len} cuts "
              "it from the left, where the schemas may be: raise --max-prompt-len (shown once)", file=sys.stderr)
    return ids[-max_len:]


class PromptOrder:
    """A seeded, endless order over prompt indices: one shuffle per epoch.

    take(cursor, count) gives the indices at positions [cursor, cursor + count). The order is a pure
    function of (seed, number of prompts), so resuming only needs the cursor, and a run resumed with
    another world size continues the same sequence.
    """

    def __init__(self, num_prompts, seed):
        self.n, self.seed = num_prompts, seed
        self._epoch, self._perm = None, None

    def _permutation(self, epoch):
        if epoch != self._epoch:
            self._perm = list(range(self.n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._perm)
            self._epoch = epoch
        return self._perm

    def take(self, cursor, count):
        return [self._permutation(p // self.n)[p % self.n] for p in range(cursor, cursor + count)]


# The registry ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reward:
    name: str
    fn: Callable
    prepare: Optional[Callable] = None  # a batch hook, prepare(completions, examples), run before fn
    batched: bool = False  # TRL-style: fn(prompts=, completions=, completion_ids=, columns..., **kwargs), per batch


def get(name):
    """The built-in reward `name`, a user's function given as `module.path:function`, or a reward model
    given as `model:PATH[@LABEL]` (rewards/reward_model.py)."""
    if name.startswith("model:"):
        scorer = reward_model.get(name)
        return Reward(name, scorer, scorer.prepare)
    if ":" not in name and name not in BUILTIN:
        raise ValueError(f"unknown reward {name!r}; registered: {', '.join(names())}")
    module, _, attr = BUILTIN.get(name, name).partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load reward {name!r}: {e}") from None
    return Reward(name, fn, getattr(fn, "prepare", None), trl_style.is_batched(fn))


def names():
    return sorted(BUILTIN)


# The scorer ------------------------------------------------------------------------------------

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

    `timeout` bounds each completion's call (seconds, None for no limit); a TRL-style reward, called once for the
    whole batch, gets `timeout` times the completions in the call. Once a per-completion reward has timed out
    `max_timeouts` times in one batch, its remaining samples in that batch are skipped as None, so a reward that
    always hangs costs at most timeout * max_timeouts per step.
    """

    KINDS = ("errors", "timeouts", "invalid", "none")
    ADDED = KINDS + ("truncated", "model_seconds")  # added up over batches and ranks; a reward model adds these two

    def __init__(self, reward_names, timeout=10.0, max_timeouts=3, own=None):
        """own: {name: function} for rewards the run makes itself (an environment's get_reward, TRL-style)."""
        own = own or {}
        self.rewards = [Reward(n, own[n], batched=True) if n in own else get(n) for n in reward_names]
        self.names = list(reward_names)
        self.timeout = timeout
        self.max_timeouts = max_timeouts
        self._warned = set()
        self.trainer_state, self.extra = None, {}  # what a TRL-style reward gets as trainer_state; its log_extra
        self._loop = None  # the async rewards' event loop, made at the first one and kept (trl_style.EventLoop)

    def place_models(self, device, dtype, batch_size=8, placement="auto", shard_build=None):
        """Load the reward models' weights on the trainer's device, in its dtype, before any is needed (train.py;
        eval.py's scorer places them on first use). shard_build: see reward_model.ModelReward.place."""
        for reward in self.rewards:
            if isinstance(reward.fn, reward_model.ModelReward):
                reward.fn.place(device, dtype, batch_size, placement, shard_build)

    def check_conversation(self, messages):
        """Refuse (RewardModelError) a reward model whose template cannot write a conversation of this shape."""
        for reward in self.rewards:
            if isinstance(reward.fn, reward_model.ModelReward):
                reward.fn.rm.check_conversation(messages)

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

    @contextmanager
    def _time_limit(self, can_time_out, calls=1):
        """The block runs under --reward-timeout times `calls` completions (RewardTimeout past it), where the alarm
        handler is installed."""
        arm = can_time_out and bool(self.timeout)
        if arm:
            signal.setitimer(signal.ITIMER_REAL, self.timeout * calls)
        try:
            yield
        finally:
            if arm:
                signal.setitimer(signal.ITIMER_REAL, 0)

    def _call(self, reward, completion, example, can_time_out):
        """One reward on one sample -> (kind, value), kind "ok" or one of KINDS."""
        try:
            with self._time_limit(can_time_out):
                value = reward.fn(completion, example)
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

    def _call_each(self, reward, column, s, texts, examples, can_time_out):
        """A per-completion reward on each sample, its values written into column (N,), its failures counted in s."""
        for i in range(len(texts)):
            if s["timeouts"] >= self.max_timeouts:
                s["timeouts"] += 1
                continue
            kind, value = self._call(reward, texts[i], examples[i], can_time_out)
            if kind == "ok":
                column[i] = value
            else:
                s[kind] += 1

    def _call_batched(self, reward, column, s, texts, examples, completion_ids, can_time_out, agent):
        """A TRL-style reward on the whole batch (rewards/trl_style.py), its values written into column (N,); agent:
        (messages, environments) of a tool loop's rollouts, or Nones."""
        N, metrics = len(texts), {}
        ids = completion_ids if completion_ids is not None else [[] for _ in texts]
        try:
            with self._time_limit(can_time_out, N):
                result = reward.fn(**trl_style.arguments(texts, examples, ids, self.trainer_state, metrics, self.extra,
                                                         *agent))
                if inspect.iscoroutine(result):
                    self._loop = self._loop or trl_style.EventLoop()
                    result = self._loop.run(result)
                got, s["invalid"] = trl_style.values(reward.name, result, N)
        except RewardError as e:
            s["error"], got = str(e), [None] * N
        except RewardTimeout:
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
        their messages and environments (what TRL-style rewards get; minigdpo/tools.py). A broken contract is not
        raised here, where the other ranks would wait in the next collective, but returned in the stats (check()
        raises it once every rank's stats are merged)."""
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
        with _alarm_handler() as can_time_out:
            for k, reward in enumerate(self.rewards):
                t0 = time.perf_counter()
                s = stats[reward.name]
                if reward.prepare is not None:
                    try:
                        reward.prepare(completions, examples)
                        s.update(getattr(reward.fn, "stats", {}))  # a reward model's truncations and memory
                    except reward_model.RewardModelError:  # a reward model that cannot score stops the run
                        raise
                    except Exception as e:  # the per-sample calls still run without the batch cache
                        self._warn(reward.name, "prepare", f"batch hook raised {type(e).__name__}: {e}")
                if reward.batched:
                    self._call_batched(reward, out[:, k], s, completions, examples, completion_ids, can_time_out,
                                       (messages, environments))
                else:
                    self._call_each(reward, out[:, k], s, completions, examples, can_time_out)
                s["seconds"] = time.perf_counter() - t0
        return out, stats
