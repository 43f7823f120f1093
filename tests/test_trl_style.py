"""TRL-style rewards under real judges: a judge that takes time, an async judge with a rate limit, numpy results,
rows with gaps, columns that would shadow TRL's arguments, trainer_state in eval.py, and which functions count as
TRL-style. Each case failed on the scorer of commit fcf090c.

Run: pytest tests/test_trl_style.py   (seconds)
"""

import json
import os

import pytest

import rewards as registry
from conftest import refusal
from minigdpo.scoring import RewardScorer
from rewards import load_task

J = "tests.trl_judges:"


def conversational_file(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def test_a_judge_that_takes_time_per_completion_keeps_its_values():
    """20 ms per completion, 64 completions (1.3 s) under a 0.1 s per-completion limit: the batch's limit scales
    with it (--reward-timeout per completion), so no value is lost."""
    scorer = RewardScorer([J + "slow_judge"], timeout=0.1)
    out, stats = scorer(["x"] * 64, [{"messages": "p"}] * 64)
    assert stats[J + "slow_judge"]["timeouts"] == 0 and out[:, 0].tolist() == [1.0] * 64


def test_a_batch_past_its_scaled_limit_still_times_out():
    scorer = RewardScorer([J + "slow_judge"], timeout=0.005)  # 20 ms per completion against 5 ms each
    out, stats = scorer(["x"] * 8, [{"messages": "p"}] * 8)
    assert stats[J + "slow_judge"]["timeouts"] == 8 and out.isnan().all()


def test_an_async_judge_with_a_module_level_semaphore_works_from_its_second_step():
    scorer = RewardScorer([J + "rate_limited_judge"])
    for _ in range(3):  # a loop per call broke this from the second call: "bound to a different event loop"
        out, stats = scorer(["ab", "abc", "a"], [{"messages": "p"}] * 3)
        assert stats[J + "rate_limited_judge"]["errors"] == 0
        assert out[:, 0].tolist() == [2.0, 3.0, 1.0]


@pytest.mark.parametrize("name,expected", [("numpy_scores", [0.0, 1.0, 2.0, 3.0]),
                                           ("numpy_bools", [0.0, 1.0, 0.0, 1.0])])
def test_numpy_results_are_taken_as_trl_takes_them(name, expected):
    scorer = RewardScorer([J + name])
    out, stats = scorer(["a"] * 4, [{"messages": "p"}] * 4)
    RewardScorer.check(RewardScorer.merge([stats]))
    assert out[:, 0].tolist() == expected


def test_a_row_without_a_column_other_rows_have_gets_none_for_it(tmp_path):
    """As datasets gives TRL: None where a row lacks a column; the reward sees every row, no error."""
    data = conversational_file(tmp_path / "p.jsonl", [{"prompt": "a", "answer": "a"}, {"prompt": "b"},
                                                      {"prompt": "c", "hint": "h"}])
    examples = load_task("prompts", data, "train").examples
    assert [(ex["answer"], ex["hint"]) for ex in examples] == [("a", None), (None, None), (None, "h")]
    scorer = RewardScorer(["tests.trl_rewards:answer_in"])
    out, stats = scorer(["a", "b", "c"], examples)
    assert stats["tests.trl_rewards:answer_in"]["errors"] == 0
    assert out[0, 0].item() == 1.0 and out[1:, 0].isnan().all()  # None: the reward's own "does not apply"


@pytest.mark.parametrize("column", ["completions", "prompts", "completion_ids", "trainer_state"])
def test_a_column_named_after_a_trl_argument_is_refused_at_start(tmp_path, column):
    data = conversational_file(tmp_path / "p.jsonl", [{"prompt": "a", column: "GOLD"}])
    message = refusal(["--preset", "smoke", "--task", "prompts", "--data", data, "--rewards",
                       "tests.trl_rewards:answer_in"])
    assert f"column {column!r}" in message and "rename it" in message


def test_eval_gives_trl_style_rewards_a_trainer_state(tmp_path):
    import eval as evaluation

    data = conversational_file(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    summary = evaluation.main(["--model", "tiny-random", "--task", "prompts", "--data", data, "--rewards",
                               J + "by_step", "--max-new-tokens", "2", "--output", str(tmp_path / "eval")])
    assert summary["reward/by_step"] == 0.0  # a model that is not a checkpoint: step 0, not NaN


def test_eval_of_a_checkpoint_gives_the_checkpoints_step(tmp_path):
    import eval as evaluation
    from conftest import run

    out = str(tmp_path / "run")
    run(["train.py", "--preset", "smoke", "--output-dir", out, "--max-steps", "2", "--save-every", "0"])
    data = conversational_file(tmp_path / "p.jsonl", [{"prompt": "a"}])
    summary = evaluation.main(["--model", os.path.join(out, "checkpoints", "step_000002"), "--task", "prompts",
                               "--data", data, "--rewards", J + "by_step", "--output", str(tmp_path / "eval")])
    assert summary["reward/by_step"] == 2.0


def test_a_reward_of_the_projects_own_kind_with_kwargs_is_called_per_completion():
    reward = registry.get(J + "own_kind")
    assert not reward.batched
    out, stats = RewardScorer([J + "own_kind"])(["a", "bcd"], [{"messages": "p"}] * 2)
    assert out[:, 0].tolist() == [1.0, 3.0] and stats[J + "own_kind"]["errors"] == 0
    assert registry.get("tests.trl_rewards:answer_in").batched  # completions, answer, **kwargs: TRL's kind
