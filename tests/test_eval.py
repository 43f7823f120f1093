"""eval.py on a tiny model, and its metric helpers.

Run: pytest tests/test_eval.py
"""

import json
import math

import pytest
import torch

import eval as evaluate


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
