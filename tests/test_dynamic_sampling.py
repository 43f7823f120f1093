"""Dynamic sampling that understands several rewards: informative_groups against its naive loop for every
estimator, the two examples of docs/conditions-and-dynamic-sampling.md, and --dynamic-sampling in train.py (the cap, 2 ranks that find
different numbers of informative groups, and an exact resume across a step that needed extra rounds).

Run: pytest tests/test_dynamic_sampling.py   (about 3 minutes on 2 cores)
"""

import itertools
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import read_jsonl, run
from minigdpo.advantages import Condition, apply_conditions
from minigdpo.estimators import REGISTRY, informative_groups
from conftest import informative_groups_naive


def groups(t):
    return torch.tensor(t, dtype=torch.float64)


def test_a_constant_sum_with_varying_rewards_is_informative_for_gdpo_only():
    """(2,0,0) against (0,1,1): both sum to 2. GRPO's group step gives 0; GDPO's gives +-0.71 (each reward
    varies). NeMo-RL's leave-one-out keeps raw differences when the others agree (always, at G = 2), and
    those sum to 0 as GRPO's do. GD2PO drops both samples: each reward's advantage pulls against another's
    and they nearly cancel (|rho| = 1/3 < tau). SAW's rewards have equal CVs here, sqrt(2) / 1 and
    sqrt(1/2) / (1/2), but the 1e-8 under each CV leaves the weights 1e-8 apart, so SAW-GRPO's sums differ
    by about 2e-8 and its z-score (std + 1e-6) makes that +-0.0099 (minigdpo/successors.py, saw_weights)."""
    r = groups([[[2, 0, 0], [0, 1, 1]]])
    want = {"grpo": False, "grpo_no_std": False, "gdpo": True, "gdpo_verl": True, "gdpo_nemo": False,
            "gd2po": False, "saw_gdpo": True, "saw_grpo": True}
    assert {e: bool(informative_groups(r, None, e)) for e in want} == want  # the estimators worked out by hand


def test_rewards_that_cancel_are_uninformative_for_every_estimator():
    """(1,0) against (0,1): every reward varies, yet no estimator tells the two samples apart."""
    r = groups([[[1, 0], [0, 1]]])
    assert not any(bool(informative_groups(r, None, e)) for e in REGISTRY)
    weighted = informative_groups(r, torch.tensor([1.0, 2.0], dtype=torch.float64), "gdpo")
    assert bool(weighted)  # unequal weights (Eq. 7) break the tie


@pytest.mark.parametrize("estimator", sorted(REGISTRY))
@pytest.mark.parametrize("G,R", [(2, 2), (3, 2), (4, 3), (5, 1)])
def test_informative_groups_equals_the_naive_loop(estimator, G, R):
    if estimator == "gdpo_nemo" and R == 1:  # NeMo-RL's GDPO refuses a single reward, and so does its twin here
        with pytest.raises(ValueError, match="two or more rewards"):
            informative_groups(torch.zeros(4, G, R, dtype=torch.float64), None, estimator)
        return
    g = torch.Generator().manual_seed(G * 10 + R)
    binary = torch.randint(0, 2, (64, G, R), generator=g).double()                 # many ties and constants
    scales = torch.randn(64, G, R, generator=g).double() * torch.tensor([1.0, 10.0, 0.01][:R], dtype=torch.float64)
    nans = torch.where(torch.rand(64, G, R, generator=g) < 0.2, math.nan, binary)  # rewards that do not apply
    weights = torch.tensor([1.0, 0.5, 2.0][:R], dtype=torch.float64)
    for rewards in (binary, scales, nans):
        for w in (None, weights):
            got = informative_groups(rewards, w, estimator).tolist()
            assert got == informative_groups_naive(rewards.tolist(), None if w is None else w.tolist(), estimator)


def test_conditions_apply_before_the_test():
    """length_ok:correct>=1 (Eq. 8) zeroes length_ok where correct fails, which can take a group's signal."""
    r = groups([[[0, 1], [0, 0]]])                         # correct fails for both; only length_ok varies
    names, cond = ["correct", "length_ok"], [Condition.parse("length_ok:correct>=1")]
    assert bool(informative_groups(r, None, "gdpo"))
    assert not bool(informative_groups(apply_conditions(r, names, cond), None, "gdpo"))


def test_summed_reward_filters_drop_groups_gdpo_can_use():
    """Over every binary reward table of a few (G, R): where the summed reward varies GDPO has a signal too,
    and from G = 4, R = 3 on some tables with a constant sum carry one for GDPO: rewards whose spreads
    differ, e.g. (1,0,0) (1,0,0) (0,1,0) (0,0,1), whose z-scores no longer cancel. A filter on the summed
    reward's variance drops those (examples/collapse.py --informative counts them for docs/conditions-and-dynamic-sampling.md)."""
    for G, R, extra in [(2, 2, False), (2, 3, False), (3, 3, False), (4, 2, False), (4, 3, True), (5, 3, True)]:
        rows = list(itertools.product([0.0, 1.0], repeat=R))
        tables = groups([list(t) for t in itertools.product(rows, repeat=G)])   # (2^(G R), G, R)
        summed_varies = tables.sum(-1).std(dim=1) > 0
        gdpo_keeps = informative_groups(tables, None, "gdpo")
        assert not (summed_varies & ~gdpo_keeps).any(), (G, R)
        assert bool((gdpo_keeps & ~summed_varies).any()) is extra, (G, R)
    assert bool(informative_groups(groups([[[1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]]]), None, "gdpo"))


# --dynamic-sampling in train.py ---------------------------------------------------------------------

DS = ["train.py", "--preset", "smoke", "--dynamic-sampling", "--rewards", "tests.helpers:odd_answers_only"]


def test_the_cap_trains_on_what_it_found_or_skips_the_update(tmp_path):
    out = str(tmp_path / "none")
    run(["train.py", "--preset", "smoke", "--dynamic-sampling", "--max-sample-rounds", "2", "--max-steps", "2",
         "--rewards", "tests.helpers:constant", "--output-dir", out, "--save-every", "0"])
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["sampling/rounds"] for r in rows] == [2, 2] and [r["sampling/skipped_update"] for r in rows] == [1, 1]
    assert all(r["sampling/groups_trained"] == 0 and "grad_norm" not in r for r in rows)
    first = load_file(os.path.join(out, "checkpoints", "step_000002", "hf", "model.safetensors"))
    from minigdpo import models

    base = models.load_model(models.resolve_model("tiny-random")).state_dict()
    assert all(torch.equal(first[k], base[k]) for k in first)  # no update ever ran
    out = str(tmp_path / "some")
    run(DS + ["--max-sample-rounds", "1", "--max-steps", "4", "--output-dir", out, "--save-every", "0"])
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    for r in rows:
        assert r["sampling/rounds"] == 1 and r["sampling/groups_sampled"] == 2
        assert r["sampling/groups_trained"] == r["sampling/groups_informative"]  # at the cap: what it found
        assert r["sampling/skipped_update"] == (r["sampling/groups_trained"] == 0)
    assert any(r["sampling/groups_trained"] > 0 for r in rows) and any(r["sampling/groups_trained"] < 2 for r in rows)


@pytest.mark.slow
def test_two_ranks_that_find_different_numbers_of_groups_train_the_same_number(tmp_path):
    out = str(tmp_path / "run")
    run(DS + ["--max-steps", "4", "--max-sample-rounds", "6", "--output-dir", out, "--save-every", "0"], nproc=2)
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert any(r["sampling/rounds"] > 1 for r in rows)  # a rank had no signal in some round
    for r in rows:
        assert r["sampling/groups_trained"] in (0, 2) and r["sampling/groups_informative"] >= r["sampling/groups_trained"]
        assert r["sampling/samples_per_trained"] == r["sampling/groups_sampled"] / max(r["sampling/groups_trained"], 1)


@pytest.mark.slow
def test_resume_is_exact_across_a_step_that_needed_extra_rounds(tmp_path):
    common = DS + ["--max-steps", "4", "--max-sample-rounds", "6", "--save-every", "1", "--keep-checkpoints", "5",
                   "--lr-schedule", "constant"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run(common + ["--output-dir", a])
    killed = run(common + ["--output-dir", b], env={"MINIGDPO_FAULT": "prepare@3"}, check=False)
    assert killed.returncode != 0
    rows = read_jsonl(os.path.join(a, "metrics.jsonl"))
    assert any(r["sampling/rounds"] > 1 for r in rows[:2])  # the resumed-from checkpoint follows extra rounds
    run(common + ["--output-dir", b, "--resume"])
    wa = load_file(os.path.join(a, "checkpoints", "step_000004", "hf", "model.safetensors"))
    wb = load_file(os.path.join(b, "checkpoints", "step_000004", "hf", "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r["sampling/rounds"] for r in read_jsonl(os.path.join(b, "metrics.jsonl"))] == [r["sampling/rounds"] for r in rows]


def test_the_readme_count_of_groups_a_summed_filter_drops():
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from collapse import informative_table

    from minigdpo.estimators import REGISTRY

    header, row = informative_table(((4, 3),)).splitlines()
    columns = dict(zip(["G", "R", "groups", "sum varies", *REGISTRY, "gdpo only"], map(int, row.split())))
    assert header.split()[-1] == "only" and len(row.split()) == len(columns)  # every estimator has its column
    assert {k: columns[k] for k in ("groups", "sum varies", "grpo", "gdpo", "gdpo only")} == \
        {"groups": 330, "sum varies": 298, "grpo": 298, "gdpo": 304, "gdpo only": 6}  # the counts the docs cite


@pytest.mark.parametrize("backend", ["vllm", "lora"])
def test_dynamic_sampling_with_the_vllm_sampler_and_with_lora(tmp_path, backend):
    """The fake vLLM engine (tests/vllm_train.py), and LoRA adapters on the HF sampler."""
    out = str(tmp_path / "run")
    args = DS[1:] + ["--max-steps", "3", "--max-sample-rounds", "3", "--save-every", "0", "--output-dir", out]
    run(["tests/vllm_train.py"] + args if backend == "vllm" else ["train.py"] + args + ["--lora-rank", "4"])
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["sampling/groups_trained"] <= r["sampling/groups_informative"] for r in rows)
    assert any(r["sampling/groups_trained"] > 0 for r in rows)


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_a_step_with_nothing_to_learn_leaves_the_sampler_on_the_trainers_weights(tmp_path, backend):
    """Step 1 finds no group to learn from and skips its update; step 2 must still sample from the trainer's
    weights. The fake engine refuses to generate from weights a level-2 sleep discarded (tests/fake_vllm.py),
    as the sampler's wrapper does; the sampler sleeps only when a weight sync follows."""
    out = str(tmp_path / "run")
    args = ["--preset", "smoke", "--dynamic-sampling", "--max-sample-rounds", "1", "--max-steps", "3", "--rewards",
            "tests.helpers:constant_first_step", "--save-every", "0", "--output-dir", out, "--final-eval", "4"]
    run(["tests/vllm_train.py" if backend == "vllm" else "train.py"] + args)
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["sampling/skipped_update"] for r in rows] == [1, 0, 0]
    assert all(r["sampler/logp_gap"] < 1e-3 for r in rows[1:]) or backend == "vllm"  # the fake's log-probs are a toy's
