"""Property tests: random and adversarial text through every registered reward. None may raise
or hang, and every value must lie in the reward's declared range.

Run: pytest tests/test_fuzz.py
"""

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import rewards as registry
from helpers import RANGES

GT = ('<think> t </think>\n<tool_call>\n{"name": "GetNews", "parameters": {"page": "1", "q": [1, 2]}}\n</tool_call>\n'
      "<response> r </response>")
EXAMPLE = {"answer": "72", "ground_truth": GT, "tests": [{"input": "1\n", "output": "1\n"}], "length_limit": 50,
           "completion_tokens": 10}

any_char = st.characters(codec=None, categories=None)  # includes lone surrogates: invalid unicode
tags = st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "<tool_call>", "</tool_call>", "<response>",
                        "</response>", "\n", "```python\n", "```", "\\boxed{", "}", "{", "####"])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(10**400), max_value=10**400) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=25)


@st.composite
def tool_calls(draw):
    calls = draw(st.lists(st.fixed_dictionaries({"name": st.sampled_from(["GetNews", "x", ""]), "parameters": json_values}),
                          max_size=3))
    lines = [json.dumps(c) for c in calls] + draw(st.lists(st.text(max_size=30), max_size=2))
    return "<think>a</think>\n<tool_call>\n" + "\n".join(lines) + "\n</tool_call>"


def nested(depth):
    return "<think>" * depth + "<answer>" + "[" * depth + "1" + "]" * depth + "</answer>" * depth + "</think>" * depth


completions = st.one_of(
    st.text(any_char, max_size=300),
    st.lists(st.one_of(tags, st.text(any_char, max_size=10)), max_size=60).map("".join),
    tool_calls(),
    json_values.map(lambda v: "<tool_call>\n" + json.dumps(v) + "\n</tool_call>"),
    st.integers(min_value=1, max_value=3000).map(nested),
)

ADVERSARIAL = ["x" * 1_000_000, nested(5000), "<tool_call>\n" + "[" * 200_000 + "\n</tool_call>",
               '<tool_call>\n{"name": "GetNews", "parameters": {"page": ' + "9" * 100_000 + "}}\n</tool_call>",
               "\ud800\udfff\ud800", "\\boxed{" * 10_000, "<answer>" + "1," * 100_000 + "</answer>"]

FAST = [n for n in registry.names() if registry.get(n).prepare is None]
SANDBOXED = [n for n in registry.names() if registry.get(n).prepare is not None]


def check(name, completion):
    """One completion through the reward as the scorer calls it: per completion, or TRL-style (batched, by keyword,
    the completion as the last message of a tool loop's conversation, minigdpo/tools.py)."""
    reward = registry.get(name)
    if reward.batched:
        from rewards import trl_style

        example = dict(EXAMPLE, messages=[{"role": "user", "content": "q"}], kind="hard")
        messages = [[{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]},
                     {"role": "tool", "content": "r"}, {"role": "assistant", "content": completion}]]
        (value,), _ = trl_style.values(name, reward.fn(**trl_style.arguments([completion], [example], [[]], None, {},
                                                                              {}, messages)), 1)
    else:
        value = reward.fn(completion, dict(EXAMPLE))
    low, high = RANGES[name]
    assert value is None or low <= value <= high, (name, value)


@pytest.mark.parametrize("name", FAST)
@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(completion=completions)
def test_fast_rewards_never_raise_and_stay_in_range(name, completion):
    check(name, completion)


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("i", range(len(ADVERSARIAL)))
def test_fast_rewards_on_huge_inputs(name, i):
    check(name, ADVERSARIAL[i])


@pytest.mark.parametrize("name", SANDBOXED)
@settings(max_examples=12, deadline=30_000, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(completion=completions)
@example(completion="```python\nimport os\nos.fork()\nprint(1)\n```")
@example(completion="\ud800 print(1)")
def test_sandboxed_rewards_never_raise_and_stay_in_range(name, completion):
    check(name, completion)


def test_every_reward_has_a_finite_range_to_check():
    assert set(RANGES) == set(registry.names())
    for low, high in RANGES.values():
        assert -float("inf") < low < high < float("inf")
