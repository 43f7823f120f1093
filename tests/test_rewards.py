"""Built-in rewards on good, bad and adversarial completions, and the safe scorer.

Run: pytest tests/test_rewards.py
"""

import json
import math
import time

import pytest

import rewards as registry
from helpers import RANGES
from minigdpo.scoring import RewardScorer
from rewards.gsm8k import answer_from_solution, correct_reward, format_reward, integer_reward
from rewards.length import length_ok
from rewards.toolcall import call_score, overlap, tool_correct, tool_format, tool_format_strict

GOOD = "<think>48/2 = 24, 48 + 24 = 72</think>\n<answer>72</answer>"
ADVERSARIAL = [
    "",
    " ",
    "\x00\x01\x02",
    "\ud800 lone surrogate",
    "😀" * 1000,
    "<think>" * 10_000 + "</think>" * 10_000,
    "<answer><answer><answer>72</answer></answer></answer>",
    "<think></think>\n<answer>" + "9" * 200_000 + "</answer>",
    "a" * 2_000_000,
    "<tool_call>\n" + "[" * 100_000 + "\n</tool_call>",
    '<tool_call>\n{"name": "x", "parameters": {"a": 1e999999}}\n</tool_call>',
    '<tool_call>\n{"name": "x", "parameters": {"a": ' + "1" * 50_000 + "}}\n</tool_call>",
]


# GSM8K ---------------------------------------------------------------------------------

def test_gsm8k_good_completion_gets_all_three():
    ex = {"answer": "72"}
    assert (format_reward(GOOD, ex), correct_reward(GOOD, ex), integer_reward(GOOD, ex)) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize(
    "completion,fmt,cor,integer",
    [
        ("<answer>72</answer>", 0.0, 1.0, 1.0),                           # no think block
        ("<think>x</think><answer>72</answer>", 0.0, 1.0, 1.0),            # newline required
        ("<think>x</think>\n<answer>72</answer>\nbye", 0.0, 1.0, 1.0),     # trailing text
        ("<think>x</think>\n<answer>72</answer>\n", 1.0, 1.0, 1.0),        # `$` matches before a final newline, as released
        ("<think>x</think>\n<answer> 72 </answer>", 1.0, 1.0, 1.0),        # stripped
        ("<think>x</think>\n<answer>72.0</answer>", 1.0, 0.0, 0.0),        # exact match, as released
        ("<think>x</think>\n<answer>-72</answer>", 1.0, 0.0, 0.0),
        ("<think>x</think>\n<answer>7</answer><answer>72</answer>", 0.0, 1.0, 1.0),  # last answer counts
        ("<think>x</think>\n<answer>71</answer>", 1.0, 0.0, 1.0),
        ("72", 0.0, 1.0, 1.0),                                            # no tag: the whole text, as released
    ],
)
def test_gsm8k_cases(completion, fmt, cor, integer):
    ex = {"answer": "72"}
    assert (format_reward(completion, ex), correct_reward(completion, ex), integer_reward(completion, ex)) == (fmt, cor, integer)


def released_format(completion):
    """The released GSM8K format rule, as NVlabs/GDPO trl-GDPO/open-r1/src/open_r1/gsm8k.py
    (format_reward_func) states it: the whole completion is one think block, a newline, one answer block,
    and it holds exactly one <answer> and one </answer>."""
    import re

    whole = re.search(r"^<think>.*?</think>\n<answer>.*?</answer>$", completion, re.DOTALL)
    return 1.0 if whole and completion.count("<answer>") == 1 and completion.count("</answer>") == 1 else 0.0


@pytest.mark.parametrize("completion", [
    "<think>5 + 3 = 8</think>\n<answer>8",                 # cut off at max_new_tokens before the closing tag
    "<think>5 + 3 = 8</think>\n<answer>8</ans",            # ... inside it
    "<think>5 + 3 = 8</think>\n<answer>",
    "<think>5 + 3 = 8</think>\n<ans",
    "<think>5 + 3 = 8",
    "<think>5 + 3 = 8</think>\n<answer>8</answer>",         # whole: the one that scores
    "<think>5 + 3 = 8</think>\n<answer>8</answer>\n",       # a trailing newline: $ allows it
    "<think>a</think>\n<answer>8</answer><answer>9</answer>",
])
def test_format_follows_the_released_rule_on_truncated_completions(completion):
    assert format_reward(completion, {"answer": "8"}) == released_format(completion)


def test_gsm8k_thousands_separators_compare_equal_on_both_sides():
    assert correct_reward("<answer>1080</answer>", {"answer": "1,080"}) == 1.0
    assert correct_reward("<answer>1,080</answer>", {"answer": "1080"}) == 1.0
    assert correct_reward("<answer>10,80</answer>", {"answer": "1080"}) == 0.0  # not a separator pattern
    assert answer_from_solution("so 2 + 2 = 4\n#### 4") == "4"
    with pytest.raises(ValueError):
        answer_from_solution("no marker")


# Length --------------------------------------------------------------------------------

def test_length_ok_tokens_and_words():
    assert length_ok("a b c", {"completion_tokens": 10, "length_limit": 10}) == 1.0
    assert length_ok("a b c", {"completion_tokens": 11, "length_limit": 10}) == 0.0
    assert length_ok("a b c", {"length_limit": 3, "length_unit": "words"}) == 1.0
    assert length_ok("a b c d", {"length_limit": 3, "length_unit": "words", "completion_tokens": 1}) == 0.0
    assert length_ok("x " * 4001, {}) == 0.0  # no token count known: words, default limit 4000


# Tool calling ----------------------------------------------------------------------------

CALL = '{"name": "GetNews", "parameters": {"page": "1"}}'
GT_CALL = f"<think> use the tool </think>\n<tool_call>\n{CALL}\n</tool_call>"
GT_RESP = "<think> no tool needed </think>\n<response> Hello! </response>"
GT_BOTH = f"<think> t </think>\n<tool_call>\n{CALL}\n</tool_call>\n<response> r </response>"


# Expected values read off ToolRL's released format check (qiancheng0/ToolRL and NVlabs/GDPO
# verl-GDPO, verl/utils/reward_score/rlla.py): its compute_score strips the decoded answer, then
# the format function matches the block regex and counts only the <tool_call>/<response> tags
# the ground truth has. It never counts <think>, and `$` also matches before one final newline.
TWO_THINKS = f"<think>a</think>\n<think>b</think>\n<tool_call>\n{CALL}\n</tool_call>"
NESTED_THINK = f"<think>a <think>b</think>\n<tool_call>\n{CALL}\n</tool_call>"
TOOL_FORMAT_CASES = [  # (truth, completion, released value, strict value)
    (GT_CALL, GT_CALL, 1.0, 1.0),
    (GT_CALL, GT_RESP, 0.0, 0.0),
    (GT_CALL, f"<think>a</think>\n<tool_call>{CALL}</tool_call>", 0.0, 0.0),  # newlines inside the block required
    (GT_CALL, TWO_THINKS, 1.0, 0.0),        # the lazy .*? runs over the first </think>
    (GT_CALL, NESTED_THINK, 1.0, 0.0),
    (GT_CALL, f"<think>a</think>\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>", 0.0, 0.0),
    (GT_CALL, GT_CALL + " done", 0.0, 0.0),  # text after the last block
    (GT_CALL, " " + GT_CALL, 1.0, 0.0),      # stripped first
    (GT_CALL, "\n" + GT_CALL, 1.0, 0.0),
    (GT_CALL, GT_CALL + "\n\n", 1.0, 0.0),
    (GT_CALL, "\t" + GT_CALL + " \n", 1.0, 0.0),
    (GT_CALL, GT_CALL + "\n", 1.0, 1.0),     # `$` matches before one final newline, in both modes
    (GT_RESP, GT_RESP, 1.0, 1.0),
    (GT_RESP, GT_CALL, 0.0, 0.0),
    (GT_RESP, "<think>maybe <tool_call> later</think>\n<response>hi</response>", 1.0, 1.0),  # tool_call not counted
    (GT_RESP, "<think>t</think>\n<response>a</response>\n<response>b</response>", 0.0, 0.0),
    (GT_RESP, "<think>t</think>\n<think>u</think>\n<response>a</response>", 1.0, 0.0),
    (GT_BOTH, GT_BOTH, 1.0, 1.0),
    (GT_BOTH, GT_CALL, 0.0, 0.0),
    (GT_BOTH, "\n" + GT_BOTH.replace("<think> t </think>", "<think>a</think>\n<think>b</think>") + " ", 1.0, 0.0),
    ("<think> only </think>", "<think> x </think>", 1.0, 1.0),
    ("<think> only </think>", "<think> x </think>\n<response>y</response>", 0.0, 0.0),
    ("<think> only </think>", "<think>a</think><think>b</think>", 1.0, 0.0),
    ("<think> only </think>", "  <think> x </think>\n\n", 1.0, 0.0),
]


@pytest.mark.parametrize("truth,completion,released,strict", TOOL_FORMAT_CASES, ids=range(len(TOOL_FORMAT_CASES)))
def test_tool_format_matches_the_released_checker(truth, completion, released, strict):
    assert tool_format(completion, {"ground_truth": truth}) == released
    assert tool_format_strict(completion, {"ground_truth": truth}) == strict


def call(name, **params):
    return {"name": name, "parameters": params}


def test_tool_correct_hand_computed_scores():
    gold = [call("GetNews", page="1")]
    assert call_score(gold, gold) == 3.0
    # names 1 + param names 1 + values 0 = 2 of S_max = 1 + (1 + 1) = 3
    assert call_score(gold, [call("GetNews", page="2")]) == pytest.approx(6 * 2 / 3 - 3)
    # wrong name: names overlap 0, no same-name call: score 0 -> -3
    assert call_score(gold, [call("Other", page="1")]) == -3.0
    # two gold calls, one predicted exactly: names 1/2; first call 1 + 1; S_max = 1 + 2 + 3 = 6
    gold2 = [call("A", x=1), call("B", y=2, z=3)]
    assert call_score(gold2, [call("A", x=1)]) == pytest.approx(6 * (0.5 + 2) / 6 - 3)
    # repeated names count as multisets: gold [A, A] vs [A] -> 1 / (2 + 1 - 1)
    assert overlap(["A", "A"], ["A"]) == 0.5
    # matching is greedy in gold order and uses each predicted call once: the first gold A takes
    # the only predicted A (names 1 + values 0) and the second gold A, its exact twin, finds none
    gold3 = [call("A", x=1), call("A", x=2)]
    assert call_score(gold3, [call("A", x=2)]) == pytest.approx(6 * (0.5 + 1) / 5 - 3)


def test_tool_correct_from_text():
    ex = {"ground_truth": GT_CALL}
    assert tool_correct(GT_CALL, ex) == 3.0
    assert tool_correct("<think>x</think>", ex) == -3.0                                  # no call at all
    assert tool_correct("<tool_call>\n{not json}\n</tool_call>", ex) == -3.0
    assert tool_correct('<tool_call>\n["GetNews"]\n</tool_call>', ex) == -3.0           # not an object
    assert tool_correct('<tool_call>\n{"name": "GetNews", "parameters": 3}\n</tool_call>', ex) == -3.0
    assert tool_correct('<tool_call>\n{"name": ["x"], "parameters": {}}\n</tool_call>', ex) == -3.0  # unhashable name
    assert tool_correct(GT_CALL, {"ground_truth": GT_RESP}) == 0.0                       # nothing to call


def test_tool_correct_accepts_multiple_calls_and_order_free_names():
    gold = "<tool_call>\n" + json.dumps(call("A", x=1)) + "\n" + json.dumps(call("B", y=2)) + "\n</tool_call>"
    swapped = "<tool_call>\n" + json.dumps(call("B", y=2)) + "\n" + json.dumps(call("A", x=1)) + "\n</tool_call>"
    assert tool_correct(swapped, {"ground_truth": gold}) == 3.0  # full score, though not an exact list match


# Every reward on adversarial text ------------------------------------------------------------

EXAMPLES = {"answer": "72", "ground_truth": GT_BOTH, "completion_tokens": 5}


@pytest.mark.parametrize("name", ["format", "correct", "integer", "length_ok", "tool_format", "tool_format_strict",
                                  "tool_correct"])
@pytest.mark.parametrize("i", range(len(ADVERSARIAL)))
def test_adversarial_completions_stay_in_range_and_fast(name, i):
    reward = registry.get(name)
    t = time.perf_counter()
    value = reward.fn(ADVERSARIAL[i], EXAMPLES)
    assert time.perf_counter() - t < 2.0
    assert RANGES[name][0] <= value <= RANGES[name][1]


# Registry and scorer -----------------------------------------------------------------------

def test_registry_names_and_errors():
    assert {"format", "correct", "integer", "length_ok", "tool_format", "tool_format_strict",
            "tool_correct"} <= set(registry.names())
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        registry.get("nope")
    assert registry.get("rewards.gsm8k:format_reward").fn is format_reward
    with pytest.raises(ValueError, match="cannot load reward"):
        registry.get("rewards.gsm8k:missing")


def raises(c, e):
    raise KeyError("boom")


def hangs(c, e):
    while True:
        try:
            time.sleep(10)
        except Exception:  # even code that swallows exceptions is stopped
            pass


def t_nan(c, e):
    return math.nan


def t_inf(c, e):
    return math.inf


def t_text(c, e):
    return "1.0"


def t_none(c, e):
    return None


def t_ok(c, e):
    return len(c)


t_raises, t_hangs = raises, hangs


def test_scorer_turns_every_failure_into_nan_and_counts_it(capsys):
    bad = ["raises", "nan", "inf", "text", "none", "ok", "hangs"]
    names = [f"tests.test_rewards:t_{n}" for n in bad]
    scorer = RewardScorer(names, timeout=0.05, max_timeouts=2)
    t = time.perf_counter()
    out, stats = scorer(["a", "bb", "ccc", "dddd"], [{}] * 4)
    assert time.perf_counter() - t < 2.0
    assert out.shape == (4, 7)
    assert out[:, names.index("tests.test_rewards:t_ok")].tolist() == [1.0, 2.0, 3.0, 4.0]
    others = [k for k, n in enumerate(names) if not n.endswith("t_ok")]
    assert out[:, others].isnan().all()
    assert stats["tests.test_rewards:t_raises"]["errors"] == 4
    assert stats["tests.test_rewards:t_nan"]["invalid"] == 4 and stats["tests.test_rewards:t_inf"]["invalid"] == 4 and stats["tests.test_rewards:t_text"]["invalid"] == 4
    assert stats["tests.test_rewards:t_none"]["none"] == 4
    assert stats["tests.test_rewards:t_hangs"]["timeouts"] == 4  # 2 timed out, then 2 skipped
    err = capsys.readouterr().err
    assert err.count("'tests.test_rewards:t_raises' raised KeyError") == 1  # warned once, not per sample
    assert "ran past its 0.05 s limit" in err
    # the scorer is reusable and warns only once per reward across batches
    scorer(["a"], [{}])
    assert "t_raises" not in capsys.readouterr().err


def test_scorer_passes_completion_tokens_and_checks_lengths():
    scorer = RewardScorer(["length_ok"])
    out, _ = scorer(["x", "y"], [{"length_limit": 3}] * 2, completion_tokens=[3, 4])
    assert out[:, 0].tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="2 completions but 1 examples"):
        scorer(["x", "y"], [{}])
