"""The teaching tools: the G=2 example, the collapse figure, run plots and the toy experiment.

Run: pytest tests/test_teaching.py
"""

import builtins
import json
import os
import sys

import pytest
import torch

import plot as run_plot

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import collapse  # noqa: E402
import toy_multireward  # noqa: E402


def test_two_sample_example_shows_the_collapse():
    text = collapse.two_sample_example()
    rows = {line[:26].strip(): line[26:].split() for line in text.splitlines()[1:]}
    assert len(rows) == 10
    grpo_one, gdpo_one = rows["(0,0) vs (0,1)"][:2], rows["(0,0) vs (0,1)"][2:]
    grpo_two, gdpo_two = rows["(0,0) vs (1,1)"][:2], rows["(0,0) vs (1,1)"][2:]
    assert [round(float(x), 3) for x in grpo_one] == [round(float(x), 3) for x in grpo_two]  # collapsed
    assert float(gdpo_two[1]) == pytest.approx(2 * float(gdpo_one[1]), rel=1e-3)             # separated


def test_collapse_plot(tmp_path):
    collapse.main(["--max-group", "4", "--max-rewards", "3", "--plot", str(tmp_path / "c.png")])
    assert (tmp_path / "c.png").stat().st_size > 10_000


def fake_run(path, estimator, steps=5):
    os.makedirs(path)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "reward/correct/mean": s / steps, "reward/format/mean": None if s == 2 else 0.5,
                                "kl": 0.01 * s, "completion/len_mean": 100 - s, "adv/distinct_per_group": 3}) + "\n")
    return str(path)


def test_plot_overlays_runs(tmp_path, capsys):
    a, b = fake_run(tmp_path / "grpo", "grpo"), fake_run(tmp_path / "gdpo", "gdpo")
    run_plot.main([a, b, "-o", str(tmp_path / "curves.png")])
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert run_plot.panels_for({"x": run_plot.read_run(a)})[0] == ("reward/correct/mean", "reward: correct")
    with pytest.raises(SystemExit, match="does not exist"):
        run_plot.main([str(tmp_path / "missing")])


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(SystemExit, match=r"pip install 'minigdpo\[plot\]'"):
        run_plot.plot([fake_run(tmp_path / "r", "gdpo")], str(tmp_path / "x.png"))


def test_toy_experiment_learns_with_both_estimators():
    groups, G = toy_multireward.SETTINGS["unequal, G=16"]
    for est in ("grpo", "gdpo"):
        curve, sampled = toy_multireward.run(est, groups, G, seed=0, steps=60)
        assert curve.shape == (60, 4) and ((curve >= 0) & (curve <= 1)).all() and sampled == 60 * 16 * G
        assert curve[-10:, 0].mean() > curve[:10, 0].mean() + 0.2  # the easy reward is learned
        curve, sampled = toy_multireward.run(est, groups, G, seed=0, steps=60, dynamic=True)
        assert curve[-10:, 0].mean() > curve[:10, 0].mean() + 0.2 and sampled >= 60 * 16 * G
    small, G = toy_multireward.SETTINGS["unequal, G=4"]  # groups of 4 often all fail alike: extra rounds
    assert toy_multireward.run("gdpo", small, G, seed=0, steps=30, dynamic=True)[1] > 30 * 16 * G
    mean, std = toy_multireward.summarise(torch.stack([curve, curve]), last=5)
    assert std.abs().max() == 0 and mean.shape == (4,)
