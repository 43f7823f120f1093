"""The code task: Python problems with stdin/stdout tests, scored in the sandbox (rewards/sandbox.py).
The paper's code setting has 3 rewards.

Rows: `question` (or `problem`, `prompt`) with `tests`, or APPS-style `input_output`. Without --data
the task uses the 24 built-in problems of code_problems.jsonl (each with a reference solution that the
tests check scores 1 in the sandbox, and three tests whose outputs that solution produced).

The example's `tests` is a list of {"input": stdin, "output": expected stdout} pairs (or
{"assert": "assert f(2) == 4"}). The program is the last fenced ```python block of the
completion, or the whole completion when it has none.

| reward    | range  | value                                                                        |
|-----------|--------|------------------------------------------------------------------------------|
| pass      | [0, 1] | fraction of tests passed                                                     |
| no_bug    | {0, 1} | 1 when every run exited cleanly: no compile or runtime error, no kill, no timeout |
| length_ok | {0, 1} | rewards/length.py; the paper conditions it: --condition length_ok:pass>=1    |

Scoring a batch runs all its programs at once on a bounded pool (the `prepare` hook) and
caches the reports, so `pass` and `no_bug` share one run per program.
"""

import json
import os
import re
from collections import OrderedDict

from minigdpo.data import first_field, load_rows, nonempty, read_rows
from rewards.sandbox import Limits, SandboxPool, job_key, run_tests

REWARDS = ["pass", "length_ok", "no_bug"]
PROBLEMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_problems.jsonl")

SYSTEM_PROMPT = ("You are a careful Python programmer. Write a complete Python 3 program that reads the input from "
                 "standard input and prints the answer to standard output. Reply with the program in one ```python "
                 "code block.")

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
LIMITS = Limits(timeout=10.0, cpu_seconds=5, memory_mb=1024)
_CACHE = OrderedDict()
_CACHE_SIZE = 4096
_POOL = None


def to_example(row, settings=None):
    question = nonempty(first_field(row, "question", "problem", "prompt"), "question")
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
    return {"messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
            "tests": tests}


def problems():
    """The built-in problems as rows: name, question, a reference solution, tests."""
    return [row for _, row in read_rows(PROBLEMS)[0]]


def examples(data, split, skip_bad, settings):
    """The rows of --data, or the built-in problems (both training and evaluation, offline)."""
    return load_rows(data or PROBLEMS, split, to_example, settings, skip_bad)


def extract_program(completion):
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def _remember(key, report):
    _CACHE[key] = report
    _CACHE.move_to_end(key)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)


def prepare(completions, examples):
    """Run every not-yet-seen (program, tests) of the batch in parallel and cache the reports."""
    global _POOL
    jobs = {}
    for completion, example in zip(completions, examples):
        program, tests = extract_program(completion), example.get("tests") or []
        key = job_key(program, tests)
        if tests and key not in _CACHE:
            jobs[key] = (program, tests)
    if jobs:
        _POOL = _POOL or SandboxPool(limits=LIMITS)
        for key, report in zip(jobs, _POOL.map_tests(list(jobs.values()))):
            _remember(key, report)


def report_for(completion, example):
    tests = example.get("tests")
    if not tests:
        return None
    program = extract_program(completion)
    key = job_key(program, tests)
    if key not in _CACHE:  # scored on its own, outside a batch
        _remember(key, run_tests(program, tests, LIMITS))
    return _CACHE[key]


def pass_reward(completion, example):
    report = report_for(completion, example)
    return None if report is None else report.pass_fraction


def no_bug_reward(completion, example):
    report = report_for(completion, example)
    return None if report is None else float(not report.error)


pass_reward.prepare = no_bug_reward.prepare = prepare  # the scorer runs it once per batch, before the calls
