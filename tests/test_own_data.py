"""Your own data and TRL-style rewards: --task prompts in TRL's two prompt formats, and reward functions written
for TRL's GRPOTrainer, unchanged, through train.py (1 rank and 2 gloo ranks) and eval.py; TRL's own trainer as the
oracle of the rewards; and the bad inputs, refused in one line.

Run: pytest tests/test_own_data.py   (about a minute on 2 cores; the 2-rank run and the TRL oracle are slow)
"""

import json
import os

import pytest

from conftest import read_jsonl, refusal, run

REWARDS = "tests.trl_rewards:row_aligned,tests.trl_rewards:answer_in,tests.trl_rewards:scheduled"


def prompts_file(path, conversational, rows=8, **extra):
    """Rows whose prompt names its row_id (#3:), an answer column (empty on every third row), and `extra`."""
    with open(path, "w") as f:
        for i in range(rows):
            text = f"Item #{i}: write the word {'abc'[i % 3]}"
            prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}] \
                if conversational else text
            f.write(json.dumps({"prompt": prompt, "row_id": i, "answer": "" if i % 3 == 2 else "abc"[i % 3], **extra})
                    + "\n")
    return str(path)


def train(data, out, *extra, nproc=1, check=True):
    return run(["train.py", "--preset", "smoke", "--task", "prompts", "--data", data, "--rewards", REWARDS,
                "--output-dir", out, "--save-every", "0", *extra], nproc=nproc, check=check)


def check_rows(out, steps=2):
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["reward/row_aligned/mean"] == 1.0  # every completion got its own row's arguments
        assert r["reward/answer_in/none"] % 4 == 0  # None on every completion of a row without one
        assert r["reward/scheduled/global_step"] == r["step"] - 1  # trainer_state and log_metric
    samples = read_jsonl(os.path.join(out, "samples.jsonl"))
    assert samples and all(s["extra"]["chars"] == len(s["completion"]) for s in samples)  # log_extra's column
    return rows


@pytest.mark.parametrize("conversational", [False, True])
def test_both_formats_train_with_trl_style_rewards(tmp_path, conversational):
    out = str(tmp_path / "run")
    train(prompts_file(tmp_path / "p.jsonl", conversational), out)
    check_rows(out)


def test_log_extra_reaches_the_samples_under_dynamic_sampling(tmp_path):
    """The columns a reward logs travel with their completions, also when dynamic sampling picks and moves groups."""
    out = str(tmp_path / "run")
    train(prompts_file(tmp_path / "p.jsonl", True), out, "--dynamic-sampling", "--max-sample-rounds", "2")
    samples = read_jsonl(os.path.join(out, "samples.jsonl"))
    assert samples and all(s["extra"]["chars"] == len(s["completion"]) for s in samples)


@pytest.mark.slow
def test_two_ranks_each_score_their_own_share(tmp_path):
    out = str(tmp_path / "run")
    train(prompts_file(tmp_path / "p.jsonl", True), out, nproc=2)
    check_rows(out)


def test_a_standard_prompt_has_no_chat_template_and_a_conversational_one_has(tmp_path):
    from minigdpo import models
    from rewards import encode_prompt, load_task

    tok = models.load_tokenizer(models.resolve_model("tiny-random"))
    for conversational in (False, True):
        ex = load_task("prompts", prompts_file(tmp_path / "p.jsonl", conversational), "train").examples[0]
        text = tok.decode(encode_prompt(tok, ex["messages"], 512))
        assert ("<|im_start|>" in text) == conversational and "Item #0" in text
        assert ex["row_id"] == 0 and ex["columns"] == ("row_id", "answer")


def test_eval_takes_the_same_file_and_rewards(tmp_path):
    data, out = prompts_file(tmp_path / "p.jsonl", True), str(tmp_path / "eval")
    run(["eval.py", "--model", "tiny-random", "--task", "prompts", "--data", data, "--rewards", REWARDS,
         "--max-new-tokens", "8", "--output", out])
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["prompts"] == 8 and summary["reward/row_aligned"] == 1.0


def test_trls_own_rewards_run_unchanged(tmp_path):
    """TRL's think_format_reward (conversational completions) and its soft overlong punishment (token ids)."""
    pytest.importorskip("trl")
    out = str(tmp_path / "run")
    run(["train.py", "--preset", "smoke", "--task", "prompts", "--data", prompts_file(tmp_path / "p.jsonl", True),
         "--rewards", "trl.rewards:think_format_reward,tests.trl_rewards:overlong", "--output-dir", out,
         "--save-every", "0", "--max-steps", "1"])
    (row,) = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert row["reward/think_format_reward/mean"] == 0.0  # a random model writes no <think> block
    assert row["reward/think_format_reward/errors"] == 0
    assert -1.0 <= row["reward/overlong/mean"] < 0  # 8 tokens: past 8 - 4, punished


@pytest.mark.slow
def test_the_same_reward_functions_give_trls_rewards(tmp_path):
    """TRL's GRPOTrainer._calculate_rewards and minigdpo's scorer on the same rows and completions, both formats."""
    pytest.importorskip("trl")
    proc = run(["tests/trl_rewards_oracle.py", str(tmp_path)], timeout=600)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for fmt in ("standard", "conversational"):
        trl, mini = result[fmt]["trl"], result[fmt]["mini"]
        assert len(trl) == len(mini) == 8 and any(v is None for row in trl for v in row)
        for a, b in zip(trl, mini):
            assert [None if v is None else round(v, 5) for v in a] == [None if v is None else round(v, 5) for v in b]


# Bad input: one line each, before any step where it can be known --------------------------------

def test_a_file_without_a_prompt_column_names_the_columns_it_has(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "hi", "answer": "a"}) + "\n")
    message = refusal(["--preset", "smoke", "--task", "prompts", "--data", str(path), "--rewards", REWARDS])
    assert f"{path}:1: no 'prompt' column (the row has 'question', 'answer')" in message


def test_a_prompt_that_is_neither_text_nor_messages_names_its_row(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": {"role": "user"}}) + "\n")
    message = refusal(["--preset", "smoke", "--task", "prompts", "--data", str(path), "--rewards", REWARDS])
    assert f"{path}:2: 'prompt' must be a non-empty string or a list of messages, got dict" in message
    path.write_text(json.dumps({"prompt": "text"}) + "\n" + json.dumps({"prompt": [{"role": "user", "content": "x"}]})
                    + "\n")
    assert "one format per file" in refusal(["--preset", "smoke", "--task", "prompts", "--data", str(path),
                                             "--rewards", REWARDS])


@pytest.mark.parametrize("reward,says", [("wrong_count", "returned 7 values for 8 completions"),
                                         ("not_a_number", "returned a str for completion 0 of 8")])
def test_a_reward_that_breaks_its_contract_stops_the_run_in_one_line(tmp_path, reward, says):
    proc = train(prompts_file(tmp_path / "p.jsonl", True), str(tmp_path / "run"), "--rewards",
                 f"tests.trl_rewards:{reward}", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]  # the progress bar's lines come first: the run had started
    assert last.startswith("error: ") and f"reward '{reward}' {says}" in last  # named as TRL names it
    assert not os.path.exists(os.path.join(tmp_path, "run", "checkpoints"))  # stopped before any update


def test_no_rewards_for_your_own_prompts_is_refused(tmp_path):
    message = refusal(["--preset", "smoke", "--task", "prompts", "--data", prompts_file(tmp_path / "p.jsonl", False)])
    assert "--task prompts has no rewards of its own: name them with --rewards" in message
