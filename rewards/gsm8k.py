"""GSM8K rewards with the semantics of the paper's released GSM8K recipe (3 rewards).

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

from minigdpo.rewards import register
from rewards.math_length import final_answer, math_equal

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


def answer_from_solution(solution):
    """GSM8K's gold answer: what follows '####' in the worked solution."""
    if "####" not in solution:
        raise ValueError("GSM8K solution has no '####' answer marker")
    return solution.split("####")[1].strip()


def _drop_separators(text):
    return text.replace(",", "") if _THOUSANDS.match(text) else text


@register("format", low=0.0, high=1.0)
def format_reward(completion, example):
    ok = _FORMAT.search(completion) and completion.count("<answer>") == 1 and completion.count("</answer>") == 1
    return 1.0 if ok else 0.0


@register("correct", low=0.0, high=1.0)
def correct_reward(completion, example):
    gold = str(example["answer"]).strip()
    if example.get("answer_check") == "math":  # the math_length task: compare by value (rewards/math_length.py)
        return 1.0 if math_equal(final_answer(completion, example.get("answer_format", "answer")), gold) else 0.0
    predicted = extract_answer(completion)
    return 1.0 if _drop_separators(predicted) == _drop_separators(gold) else 0.0


@register("integer", low=0.0, high=1.0)
def integer_reward(completion, example):
    return 1.0 if extract_answer(completion).isdigit() else 0.0
