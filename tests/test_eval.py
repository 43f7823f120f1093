"""eval.py on a tiny model, its metric helpers, a checkpoint's run settings, --baseline with its paired
bootstrap, and train.py's final evaluation (1 process and 2 gloo ranks).

Run: pytest tests/test_eval.py   (about a minute on 2 cores)
"""

import json
import math
import os
import random

import pytest
import torch

import eval as evaluate
from conftest import run
from minigdpo import cli, config


def test_pass_at_k():
    assert evaluate.pass_at_k(4, 0, 1) == 0.0
    assert evaluate.pass_at_k(4, 4, 1) == 1.0
    assert evaluate.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert evaluate.pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))
    assert evaluate.pass_at_k(4, 3, 2) == 1.0


def test_summary_figures():
    rewards = torch.tensor([[[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]], [[0.0, 0.0, 1.0], [float("nan"), 0.0, 0.0]]])
    s = evaluate.summarise("gsm8k", ["correct", "integer", "format"], rewards,
                           torch.tensor([[3, 5], [7, 9]]), torch.tensor([[False, True], [False, False]]), 2)
    assert s["reward/correct"] == pytest.approx(1 / 3)  # NaN left out
    assert s["accuracy"] == 0.25 and s["pass@1"] == 0.25 and s["pass@2"] == 0.5
    assert s["format_rate"] == 0.5 and s["length/mean"] == 6 and s["length/truncated_frac"] == 0.25


def test_eval_on_tiny_model(tmp_path):
    summary = evaluate.main(["--model", "tiny-random", "--task", "arith", "--limit", "5", "--n", "2", "--temperature", "1",
                             "--max-new-tokens", "6", "--max-prompt-len", "48", "--output", str(tmp_path)])
    assert summary["prompts"] == 5 and "pass@2" in summary and "format_rate" in summary
    rows = [json.loads(line) for line in open(tmp_path / "completions.jsonl")]
    assert len(rows) == 10 and set(rows[0]["rewards"]) == {"correct", "integer", "format"}
    assert json.load(open(tmp_path / "summary.json"))["prompts"] == 5


# A minigdpo checkpoint's run settings and --baseline ----------------------------------------------

RUN_FLAGS = ["--arith-difficulty", "1", "--max-new-tokens", "5", "--max-prompt-len", "40", "--length-limit", "7"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, model_cache):
    """A 2-step smoke run whose task settings all differ from eval.py's defaults, with a 3-problem final evaluation."""
    out = str(tmp_path_factory.mktemp("smoke") / "run")
    proc = run(["train.py", "--preset", "smoke", "--save-every", "0", "--final-eval", "3", "--output-dir", out] + RUN_FLAGS)
    return out, os.path.join(out, "checkpoints", "step_000002"), proc.stdout


def test_eval_takes_the_task_settings_of_a_checkpoint(smoke_run, capsys):
    _, step_dir, _ = smoke_run
    hf = os.path.join(step_dir, "hf")
    args = evaluate.parse_args(["--model", hf])
    assert (args.task, args.arith_difficulty, args.max_new_tokens, args.max_prompt_len, args.length_limit) == ("arith", 1, 5, 40, 7)
    line = capsys.readouterr().out
    assert f"settings from the run of {hf}: task=arith arith_difficulty=1 max_prompt_len=40 max_new_tokens=5" in line
    # The step directory works too, and names its hf/ directory as the model.
    assert evaluate.parse_args(["--model", step_dir]).model == hf
    # Any model that is not a checkpoint keeps eval.py's defaults (train.py's).
    plain = evaluate.parse_args(["--model", "tiny-random"])
    assert (plain.task, plain.arith_difficulty, plain.max_new_tokens) == ("gsm8k", 2, 1024)


def test_explicit_flags_override_the_checkpoint(smoke_run, capsys):
    hf = os.path.join(smoke_run[1], "hf")
    args = evaluate.parse_args(["--model", hf, "--arith-difficulty", "3", "--max-new-tokens", "4"])
    assert (args.arith_difficulty, args.max_new_tokens, args.max_prompt_len, args.task) == (3, 4, 40, "arith")
    assert "; from the command line: arith_difficulty=3 max_new_tokens=4" in capsys.readouterr().out


def test_eval_on_a_checkpoint_runs_with_its_settings(smoke_run, tmp_path):
    hf = os.path.join(smoke_run[1], "hf")
    summary = evaluate.main(["--model", hf, "--limit", "3", "--output", str(tmp_path)])  # no --task: arith from the run
    assert summary["prompts"] == 3 and summary["length/max"] <= 5  # the run's max_new_tokens
    assert set(json.loads(open(tmp_path / "completions.jsonl").readline())["rewards"]) == {"correct", "integer", "format"}


def test_baseline_on_two_tiny_models(smoke_run, tmp_path, capsys):
    hf = os.path.join(smoke_run[1], "hf")
    s = evaluate.main(["--model", hf, "--baseline", "tiny-random", "--limit", "4", "--output", str(tmp_path)])
    table = capsys.readouterr().out
    assert "95% paired bootstrap interval over prompts" in table and "tiny-random" in table
    assert s["model"]["prompts"] == s["baseline"]["prompts"] == 4
    assert s["baseline"]["length/max"] <= 5  # the baseline ran with the checkpoint's settings too
    for key, d in s["difference"].items():
        assert d["diff"] == pytest.approx(s["model"][key] - s["baseline"][key]), key
        assert d["low"] - 1e-9 <= d["diff"] <= d["high"] + 1e-9, key
    for name in ["completions.jsonl", "completions_baseline.jsonl"]:
        assert [r["prompt_index"] for r in map(json.loads, open(tmp_path / name))] == [0, 1, 2, 3]
    assert json.load(open(tmp_path / "summary.json"))["difference"].keys() == s["difference"].keys()
    # The same model as its own baseline: same prompts, settings and seed give identical figures.
    same = evaluate.main(["--model", hf, "--baseline", hf, "--limit", "4", "--output", str(tmp_path / "same")])
    assert all(d == {"diff": 0.0, "low": 0.0, "high": 0.0} for d in same["difference"].values())


def test_smoke_run_ends_with_the_final_evaluation(smoke_run):
    out, _, stdout = smoke_run
    assert stdout.index("reward            start") < stdout.index("final evaluation") < stdout.index("95% paired bootstrap")
    assert json.load(open(os.path.join(out, "final_eval", "summary.json")))["model"]["prompts"] == 3


@pytest.mark.slow
def test_final_evaluation_on_two_ranks_runs_once(tmp_path):
    proc = run(["train.py", "--preset", "smoke", "--max-steps", "1", "--final-eval", "2", "--output-dir", str(tmp_path)]
               + RUN_FLAGS, nproc=2)
    assert proc.stdout.count("final evaluation:") == 1 and proc.stdout.count("95% paired bootstrap") == 1


def test_no_final_eval_flag():
    assert cli.parse_args(["--preset", "cpu-demo"]).final_eval == 64
    assert cli.parse_args(["--preset", "cpu-demo", "--no-final-eval"]).final_eval == 0
    with pytest.raises(config.ConfigError, match="--final-eval must be >= 0"):
        config.validate(cli.parse_args(["--final-eval", "-1"]))


# The paired bootstrap -------------------------------------------------------------------------------

def naive_bootstrap(model, baseline, resamples, seed, level=0.95):
    """Reference: one resample at a time in plain Python."""
    (sm, cm), (sb, cb) = [[x.tolist() for x in pair] for pair in (model, baseline)]
    rng, P, diffs = random.Random(seed), len(sm), []
    for _ in range(resamples):
        idx = [rng.randrange(P) for _ in range(P)]
        diffs.append(sum(sm[i] for i in idx) / sum(cm[i] for i in idx) - sum(sb[i] for i in idx) / sum(cb[i] for i in idx))
    diffs.sort()
    return diffs[int((1 - level) / 2 * resamples)], diffs[int((1 + level) / 2 * resamples) - 1]


def test_paired_bootstrap_matches_the_naive_reference():
    g = torch.Generator().manual_seed(1)
    base = (torch.rand(200, generator=g) < 0.4).double()                       # (P,) solved by the baseline
    model = torch.where(torch.rand(200, generator=g) < 0.3, 1.0, base).double()  # ... and a few more by the model
    ones = torch.ones(200, dtype=torch.float64)
    d, lo, hi = evaluate.paired_bootstrap((model, ones), (base, ones))
    assert d == pytest.approx((model - base).mean().item())
    ref_lo, ref_hi = naive_bootstrap((model, ones), (base, ones), 10_000, 0)
    assert lo == pytest.approx(ref_lo, abs=0.01) and hi == pytest.approx(ref_hi, abs=0.01)
    # The normal approximation for a mean of paired differences: d +- 1.96 sd / sqrt(P).
    half = 1.96 * (model - base).std().item() / 200 ** 0.5
    assert lo == pytest.approx(d - half, abs=0.01) and hi == pytest.approx(d + half, abs=0.01)
    assert evaluate.paired_bootstrap((model, ones), (base, ones)) == (d, lo, hi)  # fixed seed: reproducible


def test_paired_bootstrap_exact_cases():
    ones = torch.ones(5, dtype=torch.float64)
    x = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    assert evaluate.paired_bootstrap((x, ones), (x, ones)) == (0.0, 0.0, 0.0)
    d, lo, hi = evaluate.paired_bootstrap((x + 0.25, ones), (x, ones))  # the same shift on every prompt
    assert (d, lo, hi) == pytest.approx((0.25, 0.25, 0.25))
    # Ratio figures: a reward with NaN samples is sum / count over prompts, as summarise prints it.
    rewards = torch.tensor([[[1.0], [float("nan")]], [[0.0], [1.0]]])                 # (P=2, n=2, R=1)
    lengths, trunc = torch.ones(2, 2, dtype=torch.long), torch.zeros(2, 2, dtype=torch.bool)
    stats = evaluate.prompt_stats("arith", ["x"], rewards, lengths, trunc, 2)
    zero = (torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
    assert evaluate.paired_bootstrap(stats["reward/x"], zero)[0] == pytest.approx(2 / 3)
    assert evaluate.summarise("arith", ["x"], rewards, lengths, trunc, 2)["reward/x"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("difficulty", [1, 2])
def test_arith_held_out_split_shares_no_problem_with_training(difficulty):
    from rewards import load_task

    question = lambda ex: ex["messages"][-1]["content"]  # noqa: E731
    train = {question(ex) for ex in load_task("arith", split="train", data_options={"arith_difficulty": difficulty}).examples}
    test = load_task("arith", split="test", data_options={"arith_difficulty": difficulty}).examples
    assert len(test) >= 1000 and not any(question(ex) in train for ex in test)


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_eval_refuses_the_tool_timeouts_train_refuses(value, capsys):
    """eval.py's --tool-timeout holds train.py's rule (config.validate): finite and > 0, else one line."""
    with pytest.raises(SystemExit):
        evaluate.parse_args(["--model", "tiny-random", "--task", "calculator", "--tools", "rewards.calculator:calculate",
                             "--tool-timeout", value])
    assert f"--tool-timeout must be > 0, got {float(value)}" in capsys.readouterr().err
    with pytest.raises(config.ConfigError, match="--tool-timeout must be > 0"):
        config.validate(cli.parse_args(["--tool-timeout", value]))
