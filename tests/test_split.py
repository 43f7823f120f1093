"""The split placement (--sampler-ranks N, minigdpo/split.py) on 3 gloo ranks, one of them sampling: its weights
come from the trainers after every update, its batches go back, and the run is the colocated one where it should be.

Run: pytest tests/test_split.py   (about 2 minutes on 2 cores)
"""

import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, free_port, read_jsonl, refusal, run
from test_async import COMMON, weights

SPLIT = ["--sampler-ranks", "1"]


def rows(out):
    return read_jsonl(os.path.join(out, "metrics.jsonl")), read_jsonl(os.path.join(out, "samples.jsonl"))


@pytest.mark.slow
def test_k0_samples_what_one_process_does_and_the_weights_land_on_the_sampling_rank(tmp_path):
    """K = 0: the sampling rank (world rank 2, the only sampler: the whole batch, with the seeds of a run of one
    process) samples step s with the weights of update s - 1, which it received from trainer 0. So it samples and
    scores what one process does, step by step, while the weights move; and the log-probs it recorded equal the
    trainers' own to fp32 rounding at every step (a sampler left with older weights is 0.04 off: K = 1 below)."""
    alone, split = str(tmp_path / "alone"), str(tmp_path / "split")
    run(["train.py", *COMMON, "--keep-checkpoints", "4", "--output-dir", alone])
    run(["train.py", *COMMON, *SPLIT, "--output-dir", split], nproc=3)
    (m1, s1), (m3, s3) = rows(alone), rows(split)
    assert [(r["completion"], r["rewards"]) for r in s1] == [(r["completion"], r["rewards"]) for r in s3]
    assert [r["reward/varied/mean"] for r in m1] == [r["reward/varied/mean"] for r in m3]
    assert all(r["sampler/logp_gap"] < 1e-5 for r in m3) and all(r["loss"] != 0 for r in m3[1:])
    a, b = weights(alone, 4), weights(split, 4)  # FSDP2 over 2 trainers: the same update, up to rounding
    assert not torch.equal(a["model.embed_tokens.weight"], weights(alone, 1)["model.embed_tokens.weight"])
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


@pytest.mark.slow
def test_two_sampling_ranks_sample_what_two_colocated_ranks_do(tmp_path):
    """4 ranks, 2 of them sampling: each takes its share of a step's prompts with the seeds of a colocated run on 2
    ranks, and each trainer gets its share of the groups from both. K = 0 samples and scores as that run does."""
    colocated, split = str(tmp_path / "colocated"), str(tmp_path / "split")
    run(["train.py", *COMMON, "--max-steps", "3", "--output-dir", colocated], nproc=2)
    run(["train.py", *COMMON, "--max-steps", "3", "--sampler-ranks", "2", "--output-dir", split], nproc=4)
    (m2, s2), (m4, s4) = rows(colocated), rows(split)
    assert [(r["completion"], r["rewards"]) for r in s2] == [(r["completion"], r["rewards"]) for r in s4]
    assert [r["reward/varied/mean"] for r in m2] == [r["reward/varied/mean"] for r in m4]
    assert all(r["sampler/logp_gap"] < 1e-5 for r in m4)


@pytest.mark.slow
def test_k1_samples_a_step_ahead_and_resumes_exactly(tmp_path):
    """K = 1: step s is sampled by the weights of update s - 2 (staleness 1 from step 2), which widens the log-prob
    gap. Killed as checkpoint 4 begins and resumed from 2, the trainers hold the batch sampled for step 3 (by the
    step-1 weights), the sampling rank starts at step 4 with the checkpoint's weights, and the run ends on the
    weights of the run that never stopped."""
    args = ["train.py", *COMMON, *SPLIT, "--async-steps", "1", "--save-every", "2"]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    run([*args, "--output-dir", straight], nproc=3)
    m, _ = rows(straight)
    assert [r["async/staleness_max"] for r in m] == [0, 1, 1, 1] and m[1]["sampler/logp_gap"] > 1e-3
    killed = run([*args, "--output-dir", resumed], nproc=3, env={"MINIGDPO_FAULT": "prepare@4"}, check=False)
    assert killed.returncode != 0 and os.path.isdir(os.path.join(resumed, "checkpoints", "step_000002", "pending"))
    run([*args, "--output-dir", resumed, "--resume"], nproc=3)
    a, b = weights(straight, 4), weights(resumed, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_an_agent_with_dynamic_sampling_runs_split_at_k1_and_its_sampling_ranks_evaluate(tmp_path):
    """The tool loop and dynamic sampling run on the sampling rank, which sends the trainers whole shares of the
    groups it kept (a multiple of both roles' ranks), and evaluates the trained weights it holds at the end."""
    import tiny_agent

    out = str(tmp_path / "agent")
    proc = run(["train.py", "--preset", "smoke", "--task", "calculator", "--tools", "rewards.calculator:calculate",
                "--model", tiny_agent.cached(), "--max-new-tokens", "40", "--max-prompt-len", "128",
                "--reward-weights", "1,1,0.5", "--max-steps", "3", "--async-steps", "1", *SPLIT, "--dynamic-sampling",
                "--max-sample-rounds", "2", "--group-size", "4", "--batch-size", "16", "--final-eval", "4",
                "--output-dir", out], nproc=3)
    m, _ = rows(out)
    assert [r["async/staleness_max"] for r in m] == [0, 1, 1]
    assert all(r["tools/call_frequency"] > 0 and r["sampling/groups_trained"] % 2 == 0 for r in m)
    assert "final evaluation" in proc.stdout and os.path.isdir(os.path.join(out, "final_eval"))


@pytest.mark.slow
def test_a_sampling_rank_that_dies_stops_the_trainers_saying_so(tmp_path):
    """World rank 2, the sampling rank, exits mid-run. The ranks run as bare processes (no torchrun, whose agent
    would stop the others itself): the trainers must find out at their next receive and stop, in one line each."""
    port, procs = free_port(), []
    for rank in range(3):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "3",
               "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "train.py", "--preset", "smoke", "--max-steps", "6", *SPLIT,
                                       "--rewards", "tests.helpers:dies_on_rank2", "--output-dir", str(tmp_path)],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        ends = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[2].returncode == 1
    for p, (_, err) in zip(procs[:2], ends[:2]):
        assert p.returncode == 2 and "Traceback" not in err, err[-3000:]
        assert err.strip().splitlines()[-1].startswith("error: a sampling rank stopped ("), err[-3000:]


@pytest.mark.parametrize("flags,says", [
    (["--sampler-ranks", "-1"], "--sampler-ranks must be >= 0"),
    (["--sampler-ranks", "1"], "--sampler-ranks 1 leaves no rank to train in a job of 1 ranks"),
    (["--sampler-ranks", "1", "--sharding", "hsdp"], "--sharding hsdp cannot run with --sampler-ranks"),
    (["--sampler-ranks", "1", "--reward-model-placement", "shard"], "cannot run with --sampler-ranks"),
])
def test_bad_split_input_is_one_line(flags, says):
    assert says in refusal(["--preset", "smoke", *flags])


def test_an_engine_process_answers_outside_the_torchrun_world_and_says_when_it_fails(monkeypatch):
    """minigdpo/engine_process.py, with a sampler that reports where it runs (the real vLLM engine runs so in
    tests/test_vllm_real.py): its calls run in a child without torchrun's world variables, a stream of weights
    arrives whole, an error comes back as itself, and a child that exits is one line."""
    from minigdpo import split
    from minigdpo.engine_process import EngineProcess
    from tests.helpers import Echo

    monkeypatch.setenv("RANK", "2")  # a sampling rank's, which the engine's world must not take
    with pytest.raises(ValueError, match="a setting this sampler refuses"):
        EngineProcess(Echo, 2, fail=True)
    engine = EngineProcess(Echo, 2)
    engine.load_weights((name, torch.full((2,), float(i))) for i, name in enumerate(["a", "b"]))
    samples, pid, rank, loaded = engine.generate([1, 5], n=2)
    assert samples == [[2, 2], [10, 10]] and pid not in (os.getpid(), None) and rank is None
    assert loaded == [("a", 0.0), ("b", 2.0)] and engine.adapters_only is False
    with pytest.raises(TypeError):
        engine.generate([1])
    with pytest.raises(split.SamplerLost, match=r"the sampler's process exited \(status 3\)"):  # one line (train.py)
        engine.exit()
    engine.close()
    assert not engine.process.is_alive()
