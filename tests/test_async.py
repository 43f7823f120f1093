"""Asynchronous rollouts (--async-steps K, minigdpo/pipeline.py): the pipeline's rules as a property test, then
train.py itself: weights that never change sample and score alike at K = 1 and K = 0, the step-2 gradient is the
decoupled objective computed by hand from the recorded sampler log-probs, a killed run resumes to the weights of an
uninterrupted one, agents and dynamic sampling run at K = 1, and bad input is one line.

K = 0 is the synchronous loop: tests/test_one_file.py binds its update to the one-file trainer's, and every other
test of train.py runs it.

Run: pytest tests/test_async.py   (about three minutes on 2 cores)
"""

import json
import os
import random
import sys
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT, read_jsonl, refusal, run
from minigdpo import models
from minigdpo.pipeline import Pipeline

sys.path.insert(0, os.path.join(ROOT, "examples"))


# The pipeline's rules -------------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(K=st.integers(0, 3), first=st.integers(0, 3), steps=st.integers(1, 7), seed=st.integers(0, 10**6),
       pending=st.integers(0, 3), skipped=st.sets(st.integers(1, 10), max_size=3), overlap=st.booleans())
def test_every_step_is_trained_once_in_order_by_weights_at_most_k_updates_old(K, first, steps, seed, pending,
                                                                               skipped, overlap):
    """A sampler and a trainer that take random times, the sampler once very slow (a slow group still trains),
    updates that skip themselves, a resumed start with batches already sampled, and generation overlapping the
    scoring or not: every step is trained once, in order, by the batch sampled for it, sampled by exactly the weights
    its step names (never newer, at most K updates old), scored on the main thread after its generation, and the
    sampler ends holding the last weights."""
    rng, last, lock = random.Random(seed), first + steps, threading.Lock()
    pending = min(pending, K, steps)
    held, trained, sampled, scored = [first], [], {}, []  # held: the version of the weights the sampler holds

    def sample(step, version):
        weights_of = max([first] + [v for v in range(first + 1, version + 1) if v not in skipped])  # a skip keeps them
        with lock:
            assert held[-1] == weights_of, (step, held[-1], version)  # loaded before the step, and not newer
        time.sleep(rng.random() * (0.01 if step != first + 2 else 0.1))
        sampled[step] = version

        def score():
            assert threading.current_thread() is threading.main_thread() and step in sampled
            time.sleep(rng.random() * 0.01)
            scored.append(step)
            return f"batch {step}"
        return score, step * 10

    def load(weights):
        with lock:
            held.append(int(weights[0][1]))

    pipe = Pipeline(K, first, last, sample, load, [(f"batch {first + 1 + i}", (first + 1 + i) * 10,
                                                    max(first, first - K + i)) for i in range(pending)], overlap)

    def train():
        for step in range(first + 1, last + 1):
            batch, cursor, staleness, _, _ = pipe.batch(step)
            assert batch == f"batch {step}" and cursor == step * 10 and 0 <= staleness <= K
            trained.append(step)
            time.sleep(rng.random() * 0.01)
            pipe.publish(step, None if step in skipped else (lambda step=step: [("version", torch.tensor(step))]))
            if step % 3 == 0:
                assert [b for b, _, _ in pipe.pending(step)] == [f"batch {s}" for s in range(step + 1,
                                                                                             min(step + K, last) + 1)]
            pipe.step_done(step)

    pipe.run(train)
    assert trained == list(range(first + 1, last + 1))
    assert sampled == {s: max(first, s - 1 - K) for s in range(first + 1 + pending, last + 1)}
    assert scored == list(range(first + 1 + pending, last + 1))
    published = [s for s in range(first + 1, last + 1) if s not in skipped]
    assert held[-1] == (published[-1] if published else first)  # the last weights, for the final evaluation


def test_an_error_on_either_side_stops_both():
    def failing_sample(step, version):
        raise ValueError("a reward broke")

    pipe = Pipeline(1, 0, 5, failing_sample, lambda w: None)
    with pytest.raises(ValueError, match="a reward broke"):
        pipe.run(lambda: [pipe.batch(s) for s in range(1, 6)])  # the sampler fails first

    def failing_train():
        pipe.batch(1)
        raise RuntimeError("out of memory")

    pipe = Pipeline(2, 0, 50, lambda step, version: (lambda: step, step), lambda w: None, overlap=True)
    with pytest.raises(RuntimeError, match="out of memory"):
        pipe.run(failing_train)


def test_with_overlap_the_next_step_generates_while_this_one_is_scored():
    """Each step's scoring waits until the next step's generation has begun: it can end only where the two overlap
    (without overlap it would wait out its timeout); a reward that fails while the next step generates stops both."""
    generating = {s: threading.Event() for s in range(1, 6)}

    def sample(step, version):
        generating[step].set()

        def score():
            assert step == 5 or generating[step + 1].wait(timeout=30), f"step {step + 1} did not generate meanwhile"
            return step
        return score, step

    pipe = Pipeline(2, 0, 5, sample, lambda w: None, overlap=True)
    pipe.run(lambda: [pipe.step_done(s) for s in range(1, 6) if pipe.batch(s)[0] == s])
    assert all(e.is_set() for e in generating.values())

    def failing(step, version):
        return (lambda: 1 / 0) if step == 2 else (lambda: step), step

    pipe = Pipeline(1, 0, 5, failing, lambda w: None, overlap=True)
    with pytest.raises(ZeroDivisionError):
        pipe.run(lambda: [pipe.step_done(s) for s in range(1, 6) if pipe.batch(s)])


# train.py ---------------------------------------------------------------------------------------------------------

ROOT_REWARD = "tests.trl_rewards:varied"
COMMON = ["--preset", "smoke", "--max-steps", "4", "--rewards", f"{ROOT_REWARD},format", "--beta", "0.04",
          "--lr-schedule", "constant", "--samples-every", "1"]


def weights(out, step):
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "checkpoints", f"step_{step:06d}", "hf", "model.safetensors"))


def test_weights_that_never_change_sample_and_score_alike_at_k1_and_k0(tmp_path):
    """--lr 1e-12 moves no fp32 weight: K = 1 must then sample and score exactly what K = 0 does, step by step."""
    runs = {}
    for k in (0, 1):
        out = str(tmp_path / f"k{k}")
        run(["train.py", *COMMON, "--lr", "1e-12", "--async-steps", str(k), "--output-dir", out])
        runs[k] = (read_jsonl(os.path.join(out, "metrics.jsonl")), read_jsonl(os.path.join(out, "samples.jsonl")))
    (m0, s0), (m1, s1) = runs[0], runs[1]
    assert [r["reward/varied/mean"] for r in m0] == [r["reward/varied/mean"] for r in m1]
    assert [(r["completion"], r["rewards"]) for r in s0] == [(r["completion"], r["rewards"]) for r in s1]
    assert [r["async/staleness_max"] for r in m1] == [0, 1, 1, 1] and all(r["async/staleness_max"] == 0 for r in m0)
    assert all(r["async/is_weight_mean"] == pytest.approx(1.0, abs=1e-4) for r in m1)  # pi_old = mu to rounding
    assert all({"time/wait_sampler", "time/wait_trainer", "time/step"} <= set(r) for r in m1)


def test_with_generation_overlapping_the_scoring_rewards_keep_their_limits_and_their_steps_state(tmp_path):
    """K = 1 with no tools: each step after the first generates while the one before is scored. The rewards still run
    on the main thread, so a hanging one is cut at its limit (SIGALRM), and a TRL-style reward gets the trainer_state
    of the step it scores (the optimizer steps before that step's sampling: max(0, s - 2) at K = 1), not the state of
    the step generating beside it."""
    out = str(tmp_path / "run")
    proc = run(["train.py", *COMMON, "--async-steps", "1", "--rewards", "tests.helpers:hangs,tests.trl_rewards:scheduled",
                "--reward-timeout", "0.2", "--save-every", "0", "--output-dir", out])
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["reward/scheduled/global_step"] for r in rows] == [0, 0, 1, 2]
    assert rows[0]["reward/hangs/timeouts"] == 8 and proc.stderr.count("ran past its 0.2 s limit") == 1


def test_the_step2_gradient_is_the_decoupled_objective_by_hand(tmp_path):
    """At K = 1 step 2 trains on a batch that the step-0 weights sampled: the loss is the clipped surrogate taken to
    the proximal policy (the weights before the update), times min(pi_prox / mu, C), mu the sampler's recorded
    log-probs. Recomputed here from the recorded sequences, mu and the proximal weights, token_mean, beta 0."""
    out = str(tmp_path / "step")
    run(["tests/agent_step.py", out, *COMMON, "--max-steps", "2", "--async-steps", "1", "--beta", "0", "--loss-agg",
         "token_mean", "--max-grad-norm", "0", "--lr", "1e-2", "--importance-sampling-cap", "1.02", "--record-step",
         "2", "--output-dir", str(tmp_path / "run")])
    seen = torch.load(os.path.join(out, "rank0.pt"))
    lm = models.load_model(models.resolve_model("tiny-random"))
    assert not lm.load_state_dict(seen["before"], strict=False).unexpected_keys  # the proximal policy (a tied head)
    lm.zero_grad(set_to_none=True)
    tokens = sum(sum(m) for _, _, m, _, _ in seen["sequences"])
    clipped = 0
    for prompt, completion, mask, adv, mu in seen["sequences"]:
        ids = torch.tensor([prompt + completion])
        logp = torch.log_softmax(lm(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), -1)
        picked = logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]                     # (T,)
        w = torch.exp(picked.detach() - torch.tensor(mu)).clamp(max=1.02)                     # min(pi_prox / mu, C)
        clipped += int((torch.exp(picked.detach() - torch.tensor(mu)) > 1.02).sum())
        ratio = torch.exp(picked - picked.detach())                                           # 1, with its gradient
        (-(adv * ratio * w * torch.tensor(mask, dtype=torch.float)).sum() / tokens).backward()
    assert clipped > 0  # the cap binds on some tokens: the weights moved between sampling and training
    for name, p in lm.named_parameters():
        torch.testing.assert_close(seen["grads"][name], p.grad, atol=1e-6, rtol=1e-4)


def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(tmp_path):
    """K = 1, a checkpoint every 2 steps: the checkpoint at step 2 holds the batch already sampled for step 3 (by
    the step-1 weights). Killed as checkpoint 4 begins, resumed from 2: step 3 trains on the saved batch, step 4 is
    sampled by the checkpoint's weights, as in the run that never stopped."""
    args = [*COMMON, "--async-steps", "1", "--save-every", "2"]
    run(["train.py", *args, "--output-dir", str(tmp_path / "straight")])
    killed = run(["train.py", *args, "--output-dir", str(tmp_path / "resumed")], env={"MINIGDPO_FAULT": "prepare@4"},
                 check=False)
    assert killed.returncode != 0 and os.path.isdir(tmp_path / "resumed" / "checkpoints" / "step_000002" / "pending")
    run(["train.py", *args, "--output-dir", str(tmp_path / "resumed"), "--resume"])
    a, b = weights(tmp_path / "straight", 4), weights(tmp_path / "resumed", 4)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_agent_and_dynamic_sampling_run_at_k1(tmp_path):
    import tiny_agent

    agent = ["--task", "calculator", "--tools", "rewards.calculator:calculate", "--model", tiny_agent.cached(),
             "--max-new-tokens", "40", "--max-prompt-len", "128", "--reward-weights", "1,1,0.5"]
    out = str(tmp_path / "agent")
    run(["train.py", "--preset", "smoke", *agent, "--max-steps", "3", "--async-steps", "1", "--output-dir", out,
         "--dynamic-sampling", "--max-sample-rounds", "2", "--group-size", "4", "--batch-size", "16"])
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1]
    assert all(r["tools/call_frequency"] > 0 and r["sampling/rounds"] >= 1 for r in rows)


@pytest.mark.parametrize("flags,says", [
    (["--async-steps", "-1"], "--async-steps must be >= 0"),
    (["--async-steps", "1", "--reward-model-placement", "shard"], "cannot run with --async-steps"),
    (["--importance-sampling-cap", "0.5"], "--importance-sampling-cap must be -1 (auto), 0 (off) or >= 1"),
])
def test_bad_async_input_is_one_line(flags, says):
    assert says in refusal(["--preset", "smoke", *flags])


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 1])
def test_two_ranks_sample_and_train_side_by_side(tmp_path, k):
    """2 gloo ranks: at K = 0 the two threads take turns on the world group, and the sampler starts step s + 1 only
    once the trainer's step s, its metrics' collectives included, is over on every rank; at K = 1 the sampling
    thread's collectives go to a group of their own. Either would hang or cross its collectives otherwise."""
    out = str(tmp_path / "run")
    run(["train.py", *COMMON, "--async-steps", str(k), "--save-every", "2", "--output-dir", out], nproc=2)
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["async/staleness_max"] for r in rows] == (
        [0, 0, 0, 0] if k == 0 else [0, 1, 1, 1])

