"""The paper's three settings as tasks: math answer checking, each task trained for 2 steps on
the tiny model, and eval.py reporting each task's metrics.

Run: pytest tests/test_tasks.py   (about a minute)
"""

import json
import os

import pytest

import eval as evaluate
from conftest import read_jsonl, run
from rewards.gsm8k import correct_reward
from rewards.math_length import final_answer, last_boxed, math_equal

TOOL_ROW = {
    "prompt": [{"role": "system", "content": "Tools: GetNews(page: int). Answer with <think> and <tool_call>."},
               {"role": "user", "content": "<user> latest news please </user>"}],
    "reward_model": {"ground_truth": '<think> use GetNews </think>\n<tool_call>\n{"name": "GetNews", "parameters": '
                                     '{"page": "1"}}\n</tool_call>'},
}


@pytest.mark.parametrize("pred,gold,equal", [
    ("72", "72", True), ("72.0", "72", True), ("1,080", "1080", True), ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac12", "1/2", True), ("-3", "-3", True), ("$5$", "5", True), ("x = 5", "5", True),
    ("5\\%", "5", True), ("90^\\circ", "90", True), ("\\text{Monday}", "Monday", True), ("0.333", "1/3", False),
    ("71", "72", False), ("", "0", False), (None, "1", False), ("\\sqrt{2}", "\\sqrt{2}", True), ("1/0", "1", False),
])
def test_math_equal(pred, gold, equal):
    assert math_equal(pred, gold) is equal


def test_boxed_extraction_and_correct_in_math_mode():
    assert last_boxed("so \\boxed{\\frac{1}{2}} and finally \\boxed{3}") == "3"
    assert last_boxed("\\boxed{a{b}c}") == "a{b}c"
    assert last_boxed("\\boxed 7.") == "7."
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("no box") is None
    assert final_answer("text <answer> 4 </answer>", "answer") == "4"
    assert final_answer("just 4", "answer") is None
    ex = {"answer": "0.5", "answer_check": "math", "answer_format": "boxed"}
    assert correct_reward("thinking... \\boxed{\\frac{1}{2}}", ex) == 1.0
    assert correct_reward("thinking... <answer>0.5</answer>", ex) == 0.0  # the configured format is boxed
    assert correct_reward("<answer>1/2</answer>", {**ex, "answer_format": "answer"}) == 1.0


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def train_two_steps(tmp_path, task, data=None, extra=()):
    out = str(tmp_path / task)
    args = ["train.py", "--preset", "smoke", "--task", task, "--output-dir", out, *extra]
    if data:
        args += ["--data", data]
    run(args)
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2]
    return rows, os.path.join(out, "checkpoints", "step_000002", "hf")


def test_toolcall_task(tmp_path):
    data = write_jsonl(tmp_path / "tool.jsonl", [TOOL_ROW] * 4)
    rows, model = train_two_steps(tmp_path, "toolcall", data)
    assert "reward/tool_format/mean" in rows[0] and "reward/tool_correct/mean" in rows[0]
    assert rows[0]["reward/tool_correct/mean"] == -3.0  # a random model makes no parseable call
    s = evaluate.main(["--model", model, "--task", "toolcall", "--data", data, "--max-new-tokens", "4",
                       "--max-prompt-len", "48", "--output", str(tmp_path / "ev")])
    assert {"format_rate", "exact_match_rate", "reward/tool_correct"} <= set(s)


def test_math_length_task_with_the_conditioned_length_reward(tmp_path):
    data = write_jsonl(tmp_path / "math.jsonl", [{"problem": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "so #### 4"}])
    rows, model = train_two_steps(tmp_path, "math_length", data,
                                  ["--condition", "length_ok:correct>=1", "--length-limit", "4", "--answer-format", "boxed"])
    assert "reward/correct/mean" in rows[0] and "reward/length_ok/mean" in rows[0]
    assert rows[0]["reward/length_ok/mean"] == 0.0  # 8 tokens > the 4-token limit
    s = evaluate.main(["--model", model, "--task", "math_length", "--data", data, "--max-new-tokens", "6",
                       "--length-limit", "4", "--output", str(tmp_path / "ev")])
    assert s["exceed_ratio"] == 1.0 and "accuracy" in s


def test_code_task_on_the_built_in_problems(tmp_path):
    rows, model = train_two_steps(tmp_path, "code", extra=["--length-limit", "100"])
    assert rows[0]["reward/pass/mean"] == 0.0 and rows[0]["reward/no_bug/mean"] == 0.0  # random bytes do not compile
    assert rows[0]["reward/pass/errors"] == 0
    s = evaluate.main(["--model", model, "--task", "code", "--limit", "3", "--max-new-tokens", "6",
                       "--length-limit", "100", "--output", str(tmp_path / "ev")])
    assert s["pass_rate"] == 0.0 and 0.0 <= s["bug_ratio"] <= 1.0 and s["exceed_ratio"] == 0.0


def test_shared_toolrl_files_train(tmp_path):
    data = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data", "toolrl",
                        "rlla_sft.json")
    if not os.path.exists(data):
        pytest.skip("shared data not present")
    train_two_steps(tmp_path, "toolcall", data)
