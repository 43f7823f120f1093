"""Prompt datasets (tasks), robust row reading, and the resumable prompt order.

A task turns raw rows into examples: a dict with `messages` (the chat prompt) and the
ground truth under the keys its rewards read (`answer`, `ground_truth`, `tests`).

| task        | source                                                              | default rewards          |
|-------------|---------------------------------------------------------------------|--------------------------|
| gsm8k       | question/answer rows (GSM8K's jsonl), or openai/gsm8k               | correct, integer, format |
| arith       | generated here: integer word problems with one worked example       | correct, integer, format |
| toolcall    | ToolRL rows (prompt + reward_model.ground_truth) or its SFT file (instruction/input/output) | tool_format, tool_correct |
| math_length | problem (or question) / answer rows; GSM8K's "####" and MATH's \\boxed solutions work too | correct, length_ok |
| code        | question / tests rows (or APPS-style input_output); built-in: 24 problems | pass, length_ok, no_bug |

Bad rows stop loading with `FILE:LINE: what is wrong`, or with skip_bad=True are skipped and
counted.
"""

import json
import os
import random
from dataclasses import dataclass, field

from minigdpo.code_problems import PROBLEMS
from rewards.code import SYSTEM_PROMPT as CODE_SYSTEM_PROMPT
from rewards.gsm8k import SYSTEM_PROMPT as MATH_SYSTEM_PROMPT
from rewards.gsm8k import answer_from_solution
from rewards.math_length import SYSTEM_PROMPTS as MATH_LENGTH_PROMPTS
from rewards.math_length import last_boxed


class DataError(ValueError):
    """A data problem, reported as one line naming the file and row."""


@dataclass
class Task:
    name: str
    examples: list
    rewards: list
    skipped: int = 0            # malformed rows skipped with skip_bad
    extra: dict = field(default_factory=dict)  # keys added to every example (length limits, answer format)


# Reading rows --------------------------------------------------------------------------------

def read_rows(path, skip_bad=False):
    """Numbered rows of a .jsonl, .json (a list) or .parquet file: ([(line, row)], [(line, problem)] skipped)."""
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading parquet needs pyarrow: pip install 'minigdpo[parquet]'") from None
        return list(enumerate(pq.read_table(path).to_pylist(), start=1)), []
    if path.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                rows = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{path}: not a valid JSON file ({e})") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a JSON list of rows")
        return list(enumerate(rows, start=1)), []
    rows, bad = [], []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            problem = None
            try:
                line = raw.decode("utf-8").strip()
                if not line:
                    continue
                row = json.loads(line)
                if not isinstance(row, dict):
                    problem = f"expected a JSON object, got {type(row).__name__}"
            except UnicodeDecodeError:
                problem = "not valid UTF-8"
            except json.JSONDecodeError as e:
                problem = f"invalid JSON ({e.msg} at column {e.colno})"
            if problem is None:
                rows.append((number, row))
            elif skip_bad:
                bad.append((number, problem))
            else:
                raise DataError(f"{path}:{number}: {problem} (pass --skip-bad-rows to skip such rows)")
    return rows, bad


def _hub_rows(name, split):
    try:
        from datasets import load_dataset
    except ImportError:
        raise DataError(f"{name!r} is not a local file; loading hub datasets needs: pip install datasets") from None
    repo, _, config = name.partition(":")
    return list(load_dataset(repo, config or None, split=split))


def _convert(source, numbered_rows, convert, extra, skip_bad, skipped):
    """Apply a row converter; a missing field or bad value names the file and line."""
    examples = []
    for number, row in numbered_rows:
        try:
            examples.append(convert(row, extra))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            problem = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            if not skip_bad:
                raise DataError(f"{source}:{number}: {problem} (pass --skip-bad-rows to skip such rows)") from None
            skipped.append((number, problem))
    return examples


def load_rows(data, split, convert, extra, skip_bad):
    """Examples from a local file or a hub dataset; returns (examples, skipped count)."""
    if os.path.exists(data) or data.endswith((".jsonl", ".json", ".parquet")):
        numbered, skipped = read_rows(data, skip_bad)
    else:
        numbered, skipped = list(enumerate(_hub_rows(data, split), start=1)), []
    examples = _convert(data, numbered, convert, extra, skip_bad, skipped)
    if not examples:
        raise DataError(f"{data}: no usable rows" + (f" ({len(skipped)} malformed)" if skipped else ""))
    return examples, len(skipped)


# Tasks ----------------------------------------------------------------------------------------

def _text(value, what):
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"field {what!r} must be a non-empty string")
    return value


def gsm8k_example(row, extra):
    return {"messages": [{"role": "system", "content": MATH_SYSTEM_PROMPT},
                         {"role": "user", "content": _text(row["question"], "question")}],
            "answer": answer_from_solution(_text(row["answer"], "answer"))}


def toolcall_example(row, extra):
    if "prompt" in row:  # ToolRL's RL format
        messages = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
        truth = row["reward_model"]["ground_truth"]
    else:  # ToolRL's SFT format: instruction (system, with the tools) / input (dialogue) / output (target)
        messages = [{"role": "system", "content": _text(row["instruction"], "instruction")},
                    {"role": "user", "content": _text(row["input"], "input")}]
        truth = row["output"]
    if not messages:
        raise ValueError("empty prompt")
    return {"messages": messages, "ground_truth": _text(truth, "ground_truth")}


def _field(row, *names):
    for name in names:
        if row.get(name) not in (None, ""):
            return row[name]
    raise KeyError(names[-1] if len(names) == 1 else " or ".join(repr(n) for n in names))


def math_length_example(row, extra):
    question = _text(_field(row, "problem", "question"), "problem")
    answer = row.get("answer")
    if answer in (None, ""):
        solution = _text(_field(row, "solution"), "solution")
        answer = answer_from_solution(solution) if "####" in solution else last_boxed(solution)
    elif "####" in str(answer):
        answer = answer_from_solution(str(answer))
    if answer in (None, ""):
        raise ValueError("no final answer in the row")
    fmt = extra.get("answer_format", "answer")
    return {"messages": [{"role": "system", "content": MATH_LENGTH_PROMPTS[fmt]}, {"role": "user", "content": question}],
            "answer": str(answer).strip(), "answer_check": "math"}


def code_example(row, extra):
    question = _text(_field(row, "question", "problem", "prompt"), "question")
    tests = row.get("tests")
    if tests is None and "input_output" in row:  # APPS / TACO style
        io = json.loads(row["input_output"]) if isinstance(row["input_output"], str) else row["input_output"]
        tests = [{"input": i, "output": o} for i, o in zip(io["inputs"], io["outputs"])]
    if isinstance(tests, str):
        tests = json.loads(tests)
    if not isinstance(tests, list) or not tests:
        raise ValueError("field 'tests' must be a non-empty list")
    for t in tests:
        if not isinstance(t, dict) or not (isinstance(t.get("assert"), str) or
                                           (isinstance(t.get("input", ""), str) and isinstance(t.get("output"), str))):
            raise ValueError('each test must be {"input": str, "output": str} or {"assert": str}')
    return {"messages": [{"role": "system", "content": CODE_SYSTEM_PROMPT}, {"role": "user", "content": question}],
            "tests": tests}


_NAMES = ["Ava", "Ben", "Cleo", "Dev", "Emma", "Finn", "Gita", "Hugo", "Iris", "Jon"]
_ITEMS = ["apples", "marbles", "stickers", "books", "coins", "shells", "cards", "pencils"]


def arith_problem(rng, difficulty):
    """A word problem with `difficulty` operations on small integers; the answer stays >= 0."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    total = rng.randint(2, 9 + 3 * difficulty)
    sentences = [f"{name} has {total} {item}."]
    for _ in range(difficulty):
        op = rng.choice(["gain", "lose", "double"] if total <= 30 else ["gain", "lose"])
        if op == "gain":
            k = rng.randint(1, 5 + 3 * difficulty)
            total += k
            sentences.append(rng.choice([f"Then {name} finds {k} more.", f"A friend gives {name} {k} more."]))
        elif op == "lose" and total > 1:
            k = rng.randint(1, total - 1)
            total -= k
            sentences.append(rng.choice([f"Then {name} gives away {k}.", f"{name} loses {k} of them."]))
        else:
            total *= 2
            sentences.append(f"Then the number of {item} doubles.")
    sentences.append(f"How many {item} does {name} have now?")
    return " ".join(sentences), str(total)


# One worked example in the answer format: small models follow a shown format far more often
# than a described one, which gives RL a non-zero reward to start from.
ARITH_SHOT = [{"role": "user", "content": "Mia has 4 shells. Then Mia finds 3 more. How many shells does Mia have now?"},
              {"role": "assistant", "content": "<think>4 + 3 = 7</think>\n<answer>7</answer>"}]


def arith_examples(difficulty, count=5000, seed=1234):
    rng = random.Random(seed * 100 + difficulty)
    out = []
    for _ in range(count):
        question, answer = arith_problem(rng, difficulty)
        messages = [{"role": "system", "content": MATH_SYSTEM_PROMPT}, *ARITH_SHOT, {"role": "user", "content": question}]
        out.append({"messages": messages, "answer": answer})
    return out


DEFAULT_REWARDS = {
    "gsm8k": ["correct", "integer", "format"],
    "arith": ["correct", "integer", "format"],
    "toolcall": ["tool_format", "tool_correct"],
    "math_length": ["correct", "length_ok"],
    "code": ["pass", "length_ok", "no_bug"],
}
DEFAULT_DATA = {"gsm8k": "openai/gsm8k:main", "math_length": "agentica-org/DeepScaleR-Preview-Dataset"}
CONVERTERS = {"gsm8k": gsm8k_example, "toolcall": toolcall_example, "math_length": math_length_example,
              "code": code_example}


def load_task(name, data="", split="train", skip_bad=False, arith_difficulty=2, extra=None):
    """The examples of a task, with the task's default rewards and `extra` keys on every example."""
    if name not in DEFAULT_REWARDS:
        raise DataError(f"unknown task {name!r}; choose from {', '.join(DEFAULT_REWARDS)}")
    skipped, extra = 0, dict(extra or {})
    if name == "arith" and not data:
        examples = arith_examples(arith_difficulty, seed=1234 if split == "train" else 4321)
        if split != "train":  # easy levels have few distinct problems: keep the held-out ones truly unseen
            seen = {ex["messages"][-1]["content"] for ex in arith_examples(arith_difficulty, seed=1234)}
            examples = [ex for ex in examples if ex["messages"][-1]["content"] not in seen]
    elif name == "code" and not data:  # the built-in set serves both training and evaluation offline
        examples = [code_example(p, extra) for p in PROBLEMS]
    else:
        source = data or DEFAULT_DATA.get(name)
        if not source:
            raise DataError(f"task {name!r} needs --data (a local .jsonl/.json/.parquet file or a hub dataset name)")
        examples, skipped = load_rows(source, split, CONVERTERS[name], extra, skip_bad)
    examples = [{**ex, **extra} for ex in examples] if extra else examples
    return Task(name, examples, DEFAULT_REWARDS[name], skipped, extra)


def encode_prompt(tokenizer, messages, max_len):
    """Chat template with the generation prompt, cut from the left to max_len tokens."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return ids[-max_len:]


# Order -------------------------------------------------------------------------------------------

class PromptOrder:
    """A seeded, endless order over prompt indices: one shuffle per epoch.

    take(cursor, count) gives the indices at positions [cursor, cursor + count). The order is
    a pure function of (seed, number of prompts), so resuming only needs the cursor, and a
    run resumed with another world size continues the same sequence.
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
