"""The calculator task: an agent's rewards that pull against each other. The model may call a calculator tool
(`--tools rewards.calculator:calculate`, minigdpo/tools.py) before it answers.

    What is 7+2? Answer as <answer>N</answer>; a calculate tool is there if you need it.          easy -> 9
    What is 4837*29? Answer as <answer>N</answer>; a calculate tool is there if you need it.      hard -> 140273

Half the problems are easy (two single digits added), half hard (two numbers of --arith-difficulty digits, 1 to 6,
multiplied). A model adds single digits on its own, but multiplies large numbers right only with the tool; and
every call costs: the right answer and tool economy conflict on hard problems and agree on easy ones, so the policy
should learn to call the tool where it pays, and there only.

| reward        | value                                                                               |
|---------------|-------------------------------------------------------------------------------------|
| solved        | 1 if the final message's last <answer>...</answer> holds the right integer, else 0    |
| answer_tag    | 1 if the final message is exactly one <answer>integer</answer>, else 0              |
| tool_economy  | 1 / (1 + the calls the rollout made): 1 without a call, 0.5 with one                |

They are TRL-style rewards (rewards/trl_style.py): they read the whole conversation and the `kind` column, and log
each kind's share of right answers (reward/solved/easy, .../hard) and of rollouts that call (reward/tool_economy/
calls_easy, .../calls_hard). With equal weights a hard group whose
callers are all right and whose others are all wrong gives GDPO two z-scores that cancel (README, the collapse
example): weigh the economy lower (`--reward-weights 1,1,0.5`, the presets' choice).
"""

import ast
import operator
import random
import re

REWARDS = ["solved", "answer_tag", "tool_economy"]
INSTRUCTION = "Answer as <answer>N</answer>; a calculate tool is there if you need it."
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / // % and parentheses.

    Args:
        expression: The expression, for example "23*45".
    """
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            out = _OPS[type(node.op)](value(node.left), value(node.right))
            if abs(out) > 10**30:
                raise ValueError("a number past 10**30")
            return out
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    if len(expression) > 200:
        raise ValueError("an expression of more than 200 characters")
    out = value(ast.parse(expression, mode="eval").body)
    return str(int(out)) if float(out).is_integer() else f"{out:.6g}"


def question(rng, hard, digits):
    """(the user's message, the expression, its value)."""
    if hard:
        a, b = (rng.randint(10 ** (digits - 1), 10**digits - 1) for _ in range(2))
        expression = f"{a}*{b}"
    else:
        expression = f"{rng.randint(0, 9)}+{rng.randint(0, 9)}"
    return f"What is {expression}? {INSTRUCTION}", expression, calculate(expression)


def generate(digits, count=5000, seed=1234):
    rng = random.Random(seed * 100 + digits)
    out = []
    for i in range(count):
        hard = i % 2 == 1
        text, expression, answer = question(rng, hard, digits)
        out.append({"messages": [{"role": "user", "content": text}], "answer": answer,
                    "kind": "hard" if hard else "easy"})
    return out


def examples(data, split, skip_bad, settings):
    digits = settings.get("arith_difficulty", 2)
    found = generate(digits, seed=1234 if split == "train" else 4321)
    if split != "train":  # held-out: no problem of the training split (easy ones are few: 100)
        seen = {ex["messages"][-1]["content"] for ex in generate(digits, seed=1234)}
        found = [ex for ex in found if ex["messages"][-1]["content"] not in seen]
    return found, 0


def final(completion):
    """The final message's text: the last message of a conversation (TRL's format), or the text itself."""
    return completion if isinstance(completion, str) else (completion[-1].get("content") or "")


def calls(completion):
    """Tool calls a rollout made (its assistant messages' tool_calls)."""
    return 0 if isinstance(completion, str) else sum(len(m.get("tool_calls") or []) for m in completion
                                                     if m.get("role") == "assistant")


def _by_kind(log_metric, values, kind, prefix=""):
    for k in ("easy", "hard"):
        picked = [v for v, this in zip(values, kind) if this == k]
        if picked:
            log_metric(prefix + k, sum(picked) / len(picked))


def solved(completions, answer, kind, log_metric, **kwargs):
    found = [_ANSWER.findall(final(c)) for c in completions]
    values = [1.0 if f and f[-1] == str(a) else 0.0 for f, a in zip(found, answer)]
    _by_kind(log_metric, values, kind)
    return values


def answer_tag(completions, **kwargs):
    return [1.0 if re.fullmatch(r"\s*<answer>-?\d+</answer>\s*", final(c)) else 0.0 for c in completions]


def tool_economy(completions, kind, log_metric, **kwargs):
    _by_kind(log_metric, [float(calls(c) > 0) for c in completions], kind, "calls_")  # each kind's share that calls
    return [1.0 / (1 + calls(c)) for c in completions]
