"""The GSM8K task: prompts from question/answer rows, and the paper's released GSM8K rewards (3 of them).

Rows: GSM8K's jsonl (`question`, and `answer` ending in "#### 72"), or the hub's openai/gsm8k.

The completion is asked to look like

    <think>step by step reasoning</think>
    <answer>72</answer>

| reward  | value                                                                          |
|---------|--------------------------------------------------------------------------------|
| format  | 1 if the whole completion is one think block then one answer block, else 0     |
| correct | 1 if the text in the last <answer>...</answer>, stripped, equals the answer    |
|         | (math_length examples compare by value instead: rewards/math_length.py)        |
| integer | 1 if that extracted answer is all digits, else 0                               |

One normalisation beyond the released code: GSM8K writes 93 of its 8,792 answers with thousands
separators ("1,080"). The released `correct` then demands the comma while `integer` forbids
it, so no completion can earn both. Here a number written with separators compares equal to
the same digits without them, on both sides; every other input scores as released.
"""

import re

from minigdpo.data import load_rows, nonempty
from rewards.math_length import answer_from_solution, final_answer, math_equal

REWARDS = ["correct", "integer", "format"]
DATA = "openai/gsm8k:main"

SYSTEM_PROMPT = """You are a careful math assistant.
Work through the problem step by step, then give the final answer as a plain integer.
Reply in exactly this format and nothing else:
<think>your step by step reasoning</think>
<answer>the final integer answer</answer>"""

_FORMAT = re.compile(r"^<think>.*?</think>\n<answer>.*?</answer>$", re.DOTALL)
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+$")


def extract_answer(completion):
    """Text between the last <answer> and the next </answer>, stripped (the whole text if no tag)."""
    return completion.split("<answer>")[-1].split("</answer>")[0].strip()


def to_example(row, settings=None):
    """One GSM8K row as an example: the system prompt, the question, and the gold answer."""
    return {"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                         {"role": "user", "content": nonempty(row["question"], "question")}],
            "answer": answer_from_solution(nonempty(row["answer"], "answer"))}


def examples(data, split, skip_bad, settings):
    return load_rows(data or DATA, split, to_example, settings, skip_bad)


def _drop_separators(answer):
    return answer.replace(",", "") if _THOUSANDS.match(answer) else answer


def format_reward(completion, example):
    ok = _FORMAT.search(completion) and completion.count("<answer>") == 1 and completion.count("</answer>") == 1
    return 1.0 if ok else 0.0


def correct_reward(completion, example):
    gold = str(example["answer"]).strip()
    if example.get("answer_check") == "math":  # the math_length task: compare by value (rewards/math_length.py)
        return 1.0 if math_equal(final_answer(completion, example.get("answer_format", "answer")), gold) else 0.0
    predicted = extract_answer(completion)
    return 1.0 if _drop_separators(predicted) == _drop_separators(gold) else 0.0


def integer_reward(completion, example):
    return 1.0 if extract_answer(completion).isdigit() else 0.0
