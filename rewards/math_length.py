"""The math_length task: math problems whose answers are checked by value, for the paper's
length-constrained math setting.

Rows: `problem` (or `question`) with an `answer`, or a `solution` whose final answer is GSM8K's
"#### 72" or MATH's \\boxed{72}; GSM8K's jsonl works offline, and the hub default is
agentica-org/DeepScaleR-Preview-Dataset. The task's examples carry `answer_check: "math"` and `answer_format` ("answer" for
<answer> tags, "boxed" for \\boxed{}); the shared `correct` reward (rewards/gsm8k.py) then
extracts the final answer in that format and compares it with `math_equal` instead of by
exact string. Its length reward is `length_ok` (rewards/length.py), which the paper
conditions on correctness: `--condition length_ok:correct>=1`.

math_equal handles integers, decimals, fractions (a/b, \\frac{a}{b}, \\dfrac, \\frac12),
signs, thousands separators, $...$, \\text{...}, degrees, percent and "x = 5"; two
answers are equal when their normalised strings match or both parse to the same exact
rational number. It is small and dependency-free on purpose; symbolic equivalence
(e.g. \\sqrt{8} vs 2\\sqrt{2}) is out of scope.
"""

import re
from fractions import Fraction

from minigdpo.data import first_field, load_rows, nonempty

REWARDS = ["correct", "length_ok"]
DATA = "agentica-org/DeepScaleR-Preview-Dataset"
SYSTEM_PROMPTS = {
    "answer": "Solve the problem. Think step by step, then give only the final answer inside <answer></answer> tags.",
    "boxed": "Solve the problem. Think step by step, then give the final answer in \\boxed{}.",
}

_MAX_CHARS = 1000  # answers longer than this are not math answers; keeps every check linear and fast


def answer_from_solution(solution):
    """GSM8K's gold answer: what follows '####' in the worked solution."""
    if "####" not in solution:
        raise ValueError("GSM8K solution has no '####' answer marker")
    return solution.split("####")[1].strip()


def to_example(row, settings):
    question = nonempty(first_field(row, "problem", "question"), "problem")
    answer = row.get("answer")
    if answer in (None, ""):
        solution = nonempty(first_field(row, "solution"), "solution")
        answer = answer_from_solution(solution) if "####" in solution else last_boxed(solution)
    elif "####" in str(answer):
        answer = answer_from_solution(str(answer))
    if answer in (None, ""):
        raise ValueError("no final answer in the row")
    prompt = SYSTEM_PROMPTS[settings.get("answer_format", "answer")]
    return {"messages": [{"role": "system", "content": prompt}, {"role": "user", "content": question}],
            "answer": str(answer).strip(), "answer_check": "math"}


def examples(data, split, skip_bad, settings):
    return load_rows(data or DATA, split, to_example, settings, skip_bad)


def last_boxed(text):
    """Content of the last \\boxed{...} (balanced braces) or \\boxed x; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:].split("{", 1) if "{" in text[start:start + 8] else None
    if rest is None:
        m = re.match(r"\\(?:boxed|fbox)\s+([^\s$]+)", text[start:])
        return m.group(1) if m else None
    depth, out = 1, []
    for ch in rest[1]:
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return "".join(out)
        out.append(ch)
    return None


def final_answer(completion, answer_format):
    """The final answer in the configured format, or None when the completion gives none."""
    if answer_format == "boxed":
        return last_boxed(completion)
    if "<answer>" not in completion:
        return None
    return completion.split("<answer>")[-1].split("</answer>")[0].strip()


_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC = re.compile(r"\\frac\{([^{}]+)\}\{([^{}]+)\}")
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")


def normalize(s):
    s = s.strip()
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for junk in ("$", "\\(", "\\)", "\\[", "\\]", "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "^\\circ", "^{\\circ}",
                 "\\%", "%", "\\$"):
        s = s.replace(junk, "")
    s = _TEXT.sub(r"\1", s)
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5"
    s = s.replace(" ", "").rstrip(".")
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    return s


def to_number(s):
    """An exact Fraction for an integer, decimal or simple fraction, else None."""
    m = _FRAC.fullmatch(s.lstrip("+-"))
    sign = -1 if s.startswith("-") else 1
    try:
        if m:
            return sign * Fraction(m.group(1)) / Fraction(m.group(2))
        if re.fullmatch(r"[+-]?(\d+(\.\d*)?|\.\d+)(/[+-]?\d+(\.\d*)?)?", s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def math_equal(predicted, gold):
    if predicted is None or len(predicted) > _MAX_CHARS:
        return False
    p, g = normalize(predicted), normalize(str(gold))
    if p == g and p != "":
        return True
    a, b = to_number(p), to_number(g)
    return a is not None and a == b
