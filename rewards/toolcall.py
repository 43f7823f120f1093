"""The toolcall task: ToolRL's prompts and its reward, as used in the paper's tool-calling runs.

Rows (--data): ToolRL's RL format (`prompt` messages, `reward_model.ground_truth`) or its SFT file
(`instruction` holding the tools, `input` the dialogue, `output` the target).

The example's `ground_truth` is the target text: a think block, then a tool_call block
(one JSON object per line, each {"name": ..., "parameters": {...}}), a response block, or both:

    <think> ... </think>
    <tool_call>
    {"name": "GetNews", "parameters": {"page": "1"}}
    </tool_call>

| reward             | range   | value                                                               |
|--------------------|---------|---------------------------------------------------------------------|
| tool_format        | {0, 1}  | 1 if the stripped completion has the ground truth's blocks, in order |
| tool_format_strict | {0, 1}  | the same blocks, each exactly once (think too), unstripped          |
| tool_correct       | [-3, 3] | how well the predicted tool calls match the ground truth's           |

tool_format reproduces the format reward of ToolRL's released code, which the paper's
tool-calling runs use unchanged (qiancheng0/ToolRL and NVlabs/GDPO verl-GDPO, both in
verl/utils/reward_score/rlla.py). Their compute_score strips surrounding whitespace first;
the check then matches the block pattern and counts only the <tool_call> and <response> tags
the ground truth has. It never counts <think>, so two think blocks, or a <think> inside the
think text, still pass: the pattern's lazy `.*?` runs over the first `</think>`. As with any
Python `$`, one final newline after the last block is allowed. (Their compute_score also cuts
the decoded prompt+answer at the chat template's assistant marker; minigdpo scores the
completion text alone, so there is nothing to cut.) tool_format_strict is minigdpo's older,
stricter check: every block exactly once, <think> included, and no stripping.

tool_correct is 0.0 when the ground truth makes no tool call, -3 when the completion's
calls cannot be parsed, 3 for an exact match of the whole call list, and otherwise
6 * score / S_max - 3 with

    S_max = 1 + sum over gold calls of (1 + number of its parameters)
    score = overlap(gold names, predicted names)
            + for each gold call, its best unused predicted call of the same name:
              overlap(parameter names) + number of parameter values equal exactly

where overlap(a, b) = |a & b| / (|a| + |b| - |a & b|) counts repeated names (multisets).
"""

import json
import re
from collections import Counter

from minigdpo.data import DataError, load_rows, nonempty

REWARDS = ["tool_format", "tool_correct"]
MAX_SCORE, MIN_SCORE = 3.0, -3.0

_PATTERNS = {  # (has tool_call, has response) -> the shape the completion must have
    (False, True): r"^<think>.*?</think>\n<response>.*?</response>$",
    (True, False): r"^<think>.*?</think>\n<tool_call>\n.*?\n</tool_call>$",
    (True, True): r"^<think>.*?</think>\n<tool_call>\n.*?\n</tool_call>\n<response>.*?</response>$",
    (False, False): r"^<think>.*?</think>$",
}
_PATTERNS = {k: re.compile(v, re.DOTALL) for k, v in _PATTERNS.items()}


def to_example(row, settings=None):
    if "prompt" in row:  # ToolRL's RL format
        messages = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
        truth = row["reward_model"]["ground_truth"]
    else:  # ToolRL's SFT format: instruction (system, with the tools) / input (dialogue) / output (target)
        messages = [{"role": "system", "content": nonempty(row["instruction"], "instruction")},
                    {"role": "user", "content": nonempty(row["input"], "input")}]
        truth = row["output"]
    if not messages:
        raise ValueError("empty prompt")
    return {"messages": messages, "ground_truth": nonempty(truth, "ground_truth")}


def examples(data, split, skip_bad, settings):
    if not data:
        raise DataError("task 'toolcall' needs --data (a local .jsonl/.json/.parquet file or a hub dataset name)")
    return load_rows(data, split, to_example, settings, skip_bad)


def _blocks(ground_truth):
    return "<tool_call>" in ground_truth, "<response>" in ground_truth


def _format_ok(text, ground_truth, count_think):
    """1.0 if `text` has the ground truth's block layout and each counted tag once, else 0.0."""
    has_call, has_response = _blocks(ground_truth)
    tags = ["think"] * count_think + ["tool_call"] * has_call + ["response"] * has_response
    # Count first: with each counted tag present once the lazy pattern runs in linear time,
    # and the result is the same as matching first (both conditions must hold).
    if any(text.count(f"<{t}>") != 1 or text.count(f"</{t}>") != 1 for t in tags):
        return 0.0
    return 1.0 if _PATTERNS[has_call, has_response].search(text) else 0.0


def tool_format(completion, example):
    """ToolRL's released format reward: strip, then check the blocks (see the module docstring)."""
    return _format_ok(completion.strip(), example["ground_truth"], count_think=False)


def tool_format_strict(completion, example):
    """Stricter than ToolRL: exactly one block of each kind, <think> included, on the raw text."""
    return _format_ok(completion, example["ground_truth"], count_think=True)


def parse_calls(text):
    """The calls in the first <tool_call> block of `text`: one JSON object per line."""
    if "<tool_call>" not in text or "</tool_call>" not in text:
        raise ValueError("no <tool_call> block")
    block = text.split("<tool_call>")[1].split("</tool_call>")[0].strip()
    calls = [json.loads(line) for line in block.split("\n")]
    if not all(isinstance(c, dict) and "name" in c for c in calls):
        raise ValueError("every tool call must be a JSON object with a name")
    return calls


def overlap(a, b):
    """Frequency-aware overlap of two lists: |a & b| / (|a| + |b| - |a & b|)."""
    if a == b:
        return 1.0
    if not a or not b:
        return 0.0
    common = sum((Counter(a) & Counter(b)).values())
    return common / (len(a) + len(b) - common)


def _params(call):
    params = call["parameters"]
    if not isinstance(params, dict):
        raise ValueError("tool call parameters must be a JSON object")
    return params


def call_score(gold, predicted):
    """Map two call lists to [-3, 3] as described in the module docstring."""
    if gold == predicted:
        return MAX_SCORE
    score = overlap([c["name"] for c in gold], [c["name"] for c in predicted])
    s_max = 1.0
    used = set()
    for g in gold:
        g_params = _params(g)
        s_max += 1 + len(g_params)
        best, best_i = 0.0, None
        for i, p in enumerate(predicted):
            if i in used or p["name"] != g["name"]:
                continue
            p_params = _params(p)
            s = overlap(list(g_params), list(p_params))
            s += sum(1.0 for k, v in g_params.items() if k in p_params and p_params[k] == v)
            if s > best:
                best, best_i = s, i
        if best_i is not None:
            used.add(best_i)
            score += best
    return (MAX_SCORE - MIN_SCORE) * score / s_max + MIN_SCORE


def tool_correct(completion, example):
    truth = example["ground_truth"]
    if "<tool_call>" not in truth:
        return 0.0
    gold = parse_calls(truth)  # a malformed ground truth is a data error, reported by the scorer
    try:
        return call_score(gold, parse_calls(completion))
    except Exception:  # unparseable or ill-typed calls (including absurdly deep JSON) get the minimum
        return MIN_SCORE
