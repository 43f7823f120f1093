"""Code rewards, run in the sandbox (minigdpo/sandbox.py). The paper's code setting has 3 rewards.

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

import re
from collections import OrderedDict

from minigdpo.rewards import register
from minigdpo.sandbox import Limits, SandboxPool, job_key, run_tests

SYSTEM_PROMPT = ("You are a careful Python programmer. Write a complete Python 3 program that reads the input from "
                 "standard input and prints the answer to standard output. Reply with the program in one ```python "
                 "code block.")

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
LIMITS = Limits(timeout=10.0, cpu_seconds=5, memory_mb=1024)
_CACHE = OrderedDict()
_CACHE_SIZE = 4096
_POOL = None


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


@register("pass", low=0.0, high=1.0, prepare=prepare)
def pass_reward(completion, example):
    report = report_for(completion, example)
    return None if report is None else report.pass_fraction


@register("no_bug", low=0.0, high=1.0, prepare=prepare)
def no_bug_reward(completion, example):
    report = report_for(completion, example)
    return None if report is None else float(not report.error)
