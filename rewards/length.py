"""A length reward: `length_ok` is 1 when the completion stays within a limit, else 0.

The limit and its unit come from the example, so one registered function serves every task:
- `example["length_limit"]`: the limit (default 4000, the paper's math setting);
- `example["length_unit"]`: "tokens" (default; uses `example["completion_tokens"]`, which the
  trainer fills in) or "words" (whitespace-separated words of the completion).

On its own this reward is easy to satisfy and can dominate a hard one. The paper conditions
it on correctness (Eq. 8): `--condition length_ok:correct>=1`.
"""

DEFAULT_LIMIT = 4000


def completion_length(completion, example):
    """Length in the example's unit; falls back to words when no token count is known."""
    if example.get("length_unit", "tokens") == "tokens" and "completion_tokens" in example:
        return int(example["completion_tokens"])
    return len(completion.split())


def length_ok(completion, example):
    limit = example.get("length_limit", DEFAULT_LIMIT)
    return 1.0 if completion_length(completion, example) <= limit else 0.0
