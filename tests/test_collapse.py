"""Reward-collapse counts (the paper's Figure 3) on small cases.

Run: pytest tests/test_collapse.py
"""

import itertools
import math
import os
import sys

import pytest
import torch

from minigdpo.advantages import distinct_per_group
from advantages_naive import TWINS
from minigdpo.estimators import REGISTRY

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from collapse import COUNTED, count_distinct, distinct_rows, enumerate_groups, main  # noqa: E402


@pytest.mark.parametrize("G", range(2, 9))
def test_grpo_with_two_rewards_gives_one_plus_g_choose_two(G):
    assert count_distinct("grpo", G, 2) == 1 + G * (G - 1) // 2


def test_paper_smallest_example():
    assert count_distinct("grpo", 2, 2) == 2
    assert count_distinct("gdpo", 2, 2) == 3


@pytest.mark.parametrize("G,R", [(2, 2), (3, 2), (4, 2), (2, 3), (3, 3), (4, 3)])
def test_multiset_enumeration_equals_brute_force_over_ordered_groups(G, R):
    outcomes = list(itertools.product([0.0, 1.0], repeat=R))
    ordered = torch.tensor(list(itertools.product(outcomes, repeat=G)), dtype=torch.float64)  # (2^(RG), G, R)
    groups = enumerate_groups(G, R)
    assert groups.shape[0] == min(math.comb(2**R + G - 1, G), math.comb(2**G + R - 1, R))
    for name in COUNTED:
        assert count_distinct(name, G, R) == distinct_rows(REGISTRY[name].advantages(ordered, None, eps=0.0)), name


@pytest.mark.parametrize("G,R", [(4, 2), (4, 3), (6, 2)])
def test_gdpo_keeps_more_groups_than_grpo(G, R):
    grpo, no_std, gdpo = (count_distinct(n, G, R) for n in ("grpo", "grpo_no_std", "gdpo"))
    assert grpo < no_std < gdpo


def test_distinct_per_group():
    adv = torch.tensor([[0.5, 0.5, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    assert distinct_per_group(adv).tolist() == [3, 1, 4]


def test_cli_prints_table(capsys):
    main(["--max-group", "4", "--max-rewards", "3"])
    out = capsys.readouterr().out
    assert all(name in out for name in COUNTED)
    lines = out.splitlines()
    header = next(line.split() for line in lines if line.split()[:1] == ["G"])  # the first table: R = 2, G varies
    row = next(line.split() for line in lines if line.split()[:1] == ["2"])     # its row at G = 2
    want = {"grpo": "2", "grpo_no_std": "3", "gdpo": "3", "gdpo_verl": "3", "gdpo_nemo": "3", "gd2po": "3"}
    assert header[1:] == list(COUNTED) and {k: v for k, v in zip(header[1:], row[1:]) if k in want} == want


@pytest.mark.parametrize("G,R", [(3, 2), (4, 2), (4, 3)])
def test_gdpo_nemo_leave_one_out_scales_split_more_groups(G, R):
    # Counted by the naive oracle over every ordered group: leave-one-out gives each sample
    # its own std, so gdpo_nemo separates groups that GDPO's shared group std maps alike.
    outcomes = list(itertools.product([0.0, 1.0], repeat=R))
    ordered = [list(g) for g in itertools.product(outcomes, repeat=G)]
    naive = {tuple(sorted(round(a, 6) for a in row)) for row in TWINS["gdpo_nemo"][0](ordered, None, eps=0.0)}
    assert count_distinct("gdpo_nemo", G, R) == len(naive)
    assert count_distinct("gdpo_verl", G, R) == count_distinct("gdpo", G, R) < len(naive)
