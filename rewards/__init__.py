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

The trainer calls them through its scorer (minigdpo/scoring.py): a reward that raises, runs past its time limit, or
returns something that is not a finite number counts as None (NaN in the tensor, which each estimator treats by its
own rule: the per-reward ones leave it out of its group, grpo, grpo_no_std and saw_grpo add it as 0;
minigdpo/advantages.py), is counted in the metrics, and is warned about once; training goes on. What stops a run:
a TRL-style reward that breaks its contract (the wrong number or kind of values, rewards/trl_style.py), and a reward
model that cannot score (rewards/reward_model.py): every rank stops with one line and exit status 2.
"""

import importlib
import os
import random
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

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
    try:
        fn = load_object(BUILTIN.get(name, name))
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load reward {name!r}: {e}") from None
    return Reward(name, fn, getattr(fn, "prepare", None), trl_style.is_batched(fn))


def load_object(spec):
    """What `module.path:name` names (a reward, a tool, an environment), the module found in the working folder too,
    as `python -c` finds one: `--tools mytools:add` run beside mytools.py. The folder comes last, after the installed
    packages, so a file there never shadows one."""
    module, _, name = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    return getattr(importlib.import_module(module), name)


def metric_names(specs):
    """What the metrics call each reward: a `module:function` by its function, as TRL names a reward
    (reward/<function>/mean), and by its whole spec where two functions share a name; the others as given."""
    short = [s.rpartition(":")[2] if ":" in s and not s.startswith("model:") else s for s in specs]
    return [n if short.count(n) == 1 else s for n, s in zip(short, specs)]


def names():
    return sorted(BUILTIN)
