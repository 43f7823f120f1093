"""TRL's own GRPOTrainer as the oracle for minigdpo's advantages, loss and gradients (tests/trl_oracle.py).

One optimizer step of each on the same fixed completions, for every loss aggregation (TRL's loss_type
names), with one micro-batch and with several. Skipped only when TRL is not installed (it is in the
`test` extra, which CI installs).

Run: pytest tests/test_trl_oracle.py   (about 2 minutes on 2 cores)
"""

import pytest
import torch

from conftest import run
from trl_oracle import CASES

pytest.importorskip("trl")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("trl_oracle"))
    for part in ("fixtures", "trl", "mini"):
        run(["tests/trl_oracle.py", part, work], timeout=900)
    return work


def relative(a, b):
    return abs(a - b) / max(abs(a), 1e-12)


@pytest.mark.parametrize("loss_type,ga", CASES)
def test_one_step_matches_trl(work, loss_type, ga):
    trl = torch.load(f"{work}/trl_{loss_type}_{ga}.pt")
    mini = torch.load(f"{work}/mini_{loss_type}_{ga}.pt")
    assert len(trl["micro"]) == ga
    torch.testing.assert_close(mini["adv"], trl["adv"], rtol=0, atol=1e-6)
    assert relative(trl["loss"], mini["loss"]) < 1e-5, (trl["loss"], mini["loss"])
    assert trl["grads"].keys() == mini["grads"].keys()
    scale = max(g.abs().max().item() for g in trl["grads"].values())
    for name, g in trl["grads"].items():
        assert (g - mini["grads"][name]).abs().max().item() <= 1e-5 * scale, name
