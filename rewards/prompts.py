"""Your own prompts, in TRL's formats: any --data whose rows have a `prompt` column.

    {"prompt": "The sky is", "answer": "blue"}                                           # standard
    {"prompt": [{"role": "user", "content": "What colour is the sky?"}], "answer": "blue"}  # conversational

As TRL 1.16's GRPOTrainer treats them (trl/trainer/grpo_trainer.py:1737-1758): a standard prompt is tokenized as
it is, with the tokenizer's own special tokens and no chat template; a conversational one goes through the chat
template with a generation prompt (a last assistant message starts a new turn; it is not continued). A file holds
one format: TRL decides by the first row for a whole batch. Every other column travels with its example, and a
TRL-style reward gets each as a list, one entry per completion (rewards/__init__.py, "TRL-style rewards").

An example: the row's columns other than `prompt` under their own names, `messages` (the prompt as the row gives
it, a string or a list of messages) and `columns` (the names of the other columns of every row: a row that lacks
one gets None for it, as datasets gives TRL). A column named after an argument TRL-style rewards get from the
trainer (completions, prompts, ...) is refused: it would replace that argument. This task has no rewards of its
own: name them with --rewards.
"""

from minigdpo.data import DataError, load_rows
from rewards.trl_style import TRAINER_ARGUMENTS

REWARDS = []
RESERVED = ("messages", "columns", "completion_tokens")  # keys an example gets from minigdpo


def conversational(prompt):
    """Whether a prompt is a list of messages (TRL's is_conversational: a list of dicts with a role)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def to_example(row, settings=None):
    """One row as an example; ValueError (the row's file and line reach the message) on a row without a usable
    prompt, or with a column whose name minigdpo uses."""
    if "prompt" not in row:
        raise ValueError(f"no 'prompt' column (the row has {', '.join(map(repr, row)) or 'no columns'})")
    prompt = row["prompt"]
    if conversational(prompt):
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                   for m in prompt):
            raise ValueError("'prompt' is a list, but not of messages with a string role and content")
    elif not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"'prompt' must be a non-empty string or a list of messages, got {type(prompt).__name__}")
    clash = [c for c in RESERVED if c in row]
    if clash:
        raise ValueError(f"column {clash[0]!r} is a name minigdpo gives each example: rename it")
    shadow = [c for c in TRAINER_ARGUMENTS if c in row]  # it would replace what the reward gets from the trainer
    if shadow:
        raise ValueError(f"column {shadow[0]!r} is an argument TRL-style rewards get from the trainer: rename it")
    columns = tuple(c for c in row if c != "prompt")
    return {**{c: row[c] for c in columns}, "messages": prompt, "columns": columns}


def examples(data, split, skip_bad, settings):
    if not data:
        raise DataError("--task prompts needs --data: a .jsonl, .json or .parquet file, or a hub dataset, with a "
                        "'prompt' column")
    rows, skipped = load_rows(data, split, to_example, settings, skip_bad)
    columns = tuple(dict.fromkeys(c for ex in rows for c in ex["columns"]))  # every row's, in first-seen order
    rows = [{**dict.fromkeys(columns), **ex, "columns": columns} for ex in rows]  # None for a gap, as datasets gives
    kinds = [conversational(ex["messages"]) for ex in rows]
    if len(set(kinds)) > 1:
        at = kinds.index(not kinds[0]) + 1
        raise DataError(f"{data}: example {at} has a {'conversational' if kinds[at - 1] else 'standard'} prompt "
                        f"and example 1 a {'conversational' if kinds[0] else 'standard'} one: one format per file")
    return rows, skipped
