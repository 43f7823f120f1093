"""Reading data rows robustly: a local .jsonl, .json or .parquet file, or a hub dataset.

The tasks (rewards/) convert rows into examples with these functions. A bad row stops loading
with `FILE:LINE: what is wrong`, or with skip_bad=True is skipped and counted.
"""

import json
import os


class DataError(ValueError):
    """A data problem, reported as one line naming the file and row."""


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


def _convert(source, numbered_rows, convert, settings, skip_bad, skipped):
    """Apply a row converter; a missing field or bad value names the file and line."""
    examples = []
    for number, row in numbered_rows:
        try:
            examples.append(convert(row, settings))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            problem = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            if isinstance(e, KeyError) and isinstance(row, dict) and "prompt" in row:  # TRL's format, another task
                raise DataError(f"{source}:{number}: {problem}; rows with a 'prompt' column are TRL's format: "
                                "pass --task prompts") from None
            if not skip_bad:
                raise DataError(f"{source}:{number}: {problem} (pass --skip-bad-rows to skip such rows)") from None
            skipped.append((number, problem))
    return examples


def load_rows(data, split, convert, settings, skip_bad):
    """convert(row, settings) applied to every row of a local file or a hub dataset; returns (examples,
    the count of skipped rows)."""
    if os.path.exists(data) or data.endswith((".jsonl", ".json", ".parquet")):
        numbered, skipped = read_rows(data, skip_bad)
    else:  # a hub dataset, "repo" or "repo:config"
        try:
            from datasets import load_dataset
        except ImportError:
            raise DataError(f"{data!r} is not a local file; loading hub datasets needs: pip install datasets") from None
        repo, _, config = data.partition(":")
        numbered, skipped = list(enumerate(load_dataset(repo, config or None, split=split), start=1)), []
    examples = _convert(data, numbered, convert, settings, skip_bad, skipped)
    if not examples:
        raise DataError(f"{data}: no usable rows" + (f" ({len(skipped)} malformed)" if skipped else ""))
    return examples, len(skipped)


def nonempty(value, what):
    """A non-empty string, or ValueError naming the field."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"field {what!r} must be a non-empty string")
    return value


def first_field(row, *names):
    """The first of `names` the row has (not empty), or KeyError."""
    for name in names:
        if row.get(name) not in (None, ""):
            return row[name]
    raise KeyError(names[-1] if len(names) == 1 else " or ".join(repr(n) for n in names))
