"""Tasks, row reading with clear errors, and the resumable prompt order.

Run: pytest tests/test_data.py
"""

import json
import os

import pytest

from minigdpo.data import DataError, read_rows
from minigdpo import models
from rewards import PromptOrder, encode_prompt, load_task
from rewards.arith import generate as arith_examples
from rewards.gsm8k import correct_reward

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data")


def write(tmp_path, name, content):
    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(p)


GOOD = json.dumps({"question": "1+1?", "answer": "so\n#### 2"})


@pytest.mark.parametrize(
    "content,problem",
    [
        (GOOD + "\n{not json\n", ":2: invalid JSON"),
        (GOOD + "\n" + json.dumps({"question": "x"}) + "\n", ":2: missing field 'answer'"),
        (GOOD + "\n" + json.dumps({"question": "x", "answer": "no marker"}) + "\n", ":2: GSM8K solution has no '####'"),
        (b'{"question": "\xff\xfe", "answer": "#### 1"}\n', ":1: not valid UTF-8"),
        ("[1, 2]\n", ":1: expected a JSON object"),
        ("", "no usable rows"),
        ("\n\n", "no usable rows"),
    ],
)
def test_bad_rows_name_the_file_and_line(tmp_path, content, problem):
    path = write(tmp_path, "d.jsonl", content)
    with pytest.raises(DataError) as e:
        load_task("gsm8k", path)
    assert str(e.value).startswith(path) and problem in str(e.value)
    assert "\n" not in str(e.value)


def test_skip_bad_rows_counts_them(tmp_path):
    content = "\n".join([GOOD, "{oops", json.dumps({"question": "q"}), GOOD]).encode() + b"\n\xff\n"
    task = load_task("gsm8k", write(tmp_path, "d.jsonl", content), skip_bad=True)
    assert len(task.examples) == 2 and task.skipped == 3


def test_gsm8k_from_the_shared_file():
    path = os.path.join(SHARED, "gsm8k", "test.jsonl")
    if not os.path.exists(path):
        pytest.skip("shared data not present")
    task = load_task("gsm8k", path)
    assert len(task.examples) == 1319 and task.rewards == ["correct", "integer", "format"]
    ex = task.examples[0]
    assert ex["messages"][0]["role"] == "system" and ex["answer"].isdigit()


def test_toolcall_from_both_shared_formats():
    for name, count in [("test.jsonl", 80), ("rlla_sft.json", 400)]:
        path = os.path.join(SHARED, "toolrl", name)
        if not os.path.exists(path):
            pytest.skip("shared data not present")
        task = load_task("toolcall", path)
        assert len(task.examples) == count and task.rewards == ["tool_format", "tool_correct"]
        assert "Available Tools" in task.examples[0]["messages"][0]["content"]
        assert task.examples[0]["ground_truth"].startswith("<think>")


def test_arith_is_deterministic_and_its_answers_are_right():
    a, b = arith_examples(3, count=50), arith_examples(3, count=50)
    assert a == b
    for ex in a:
        assert int(ex["answer"]) >= 0
        assert correct_reward(f"<think>x</think>\n<answer>{ex['answer']}</answer>", ex) == 1.0
    assert load_task("arith", split="test").examples[0] != load_task("arith").examples[0]  # a held-out split


def test_extra_keys_reach_every_example():
    task = load_task("arith", reward_options={"length_limit": 7})
    assert all(ex["length_limit"] == 7 for ex in task.examples)


def test_prompt_order_is_seeded_resumable_and_covers_each_epoch():
    order = PromptOrder(10, seed=3)
    first = order.take(0, 10)
    assert sorted(first) == list(range(10))
    assert order.take(0, 25) == first + order.take(10, 15)
    assert PromptOrder(10, seed=3).take(7, 9) == order.take(0, 16)[7:]  # a fresh object resumes from a cursor
    assert PromptOrder(10, seed=4).take(0, 10) != first


def test_encode_prompt_cuts_from_the_left():

    tok = models.tiny_tokenizer()
    ids = encode_prompt(tok, [{"role": "user", "content": "x" * 100}], 20)
    assert len(ids) == 20 and tok.decode(ids).endswith("<|im_start|>assistant\n")


def test_read_rows_json_list(tmp_path):
    rows, bad = read_rows(write(tmp_path, "d.json", json.dumps([{"a": 1}, {"a": 2}])))
    assert rows == [(1, {"a": 1}), (2, {"a": 2})] and bad == []
