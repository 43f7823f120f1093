"""train.py end to end on a tiny random model: 1 process and 2 gloo ranks (FSDP2), exact
resume, the 1-rank/2-rank equivalence of an update, and one-line config errors.

Run: pytest tests/test_train.py   (about a minute on 2 cores)
"""

import os
import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import read_jsonl, refusal, refused, run

SMOKE = ["train.py", "--preset", "smoke", "--rewards", "tests.helpers:digit_frac,tests.helpers:vowel_frac,format"]


def final_weights(out, step):
    return load_file(os.path.join(out, "checkpoints", f"step_{step:06d}", "hf", "model.safetensors"))


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_smoke_run(tmp_path, nproc):
    out = str(tmp_path / "run")
    proc = run(SMOKE + ["--output-dir", out, "--temperature", "0.7"], nproc=nproc)  # as the cpu-demo samples
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2]
    for key in ["reward/digit_frac/mean", "reward/format/std", "adv/distinct_per_group", "loss", "kl",
                "loss/clip_low_frac", "entropy", "grad_norm", "lr", "completion/len_mean", "completion/truncated_frac",
                "time/generate", "time/reward", "time/logprob", "time/update", "throughput/gen_tokens_per_s",
                "throughput/update_tokens_per_s", "throughput/update_tflops_per_device",
                "sampler/logp_gap", "reward/format/errors", "adv/format/std", "adv/format/zero_frac",
                "adv/digit_frac/std"]:
        assert key in rows[0], key
    assert rows[0]["grad_norm"] > 0 and rows[0]["adv/distinct_per_group"] > 1  # there was a signal to learn from
    assert 0 <= rows[0]["adv/format/zero_frac"] <= 1 and rows[0]["adv/digit_frac/std"] > 0
    assert rows[0]["sampler/logp_gap"] < 1e-3       # the sampler and the trainer agree on log-probs, temperature too
    assert rows[1]["sampler/logp_gap"] < 1e-3       # ... also after the first weight sync
    assert rows[1]["kl"] > 0                        # the policy moved away from the reference
    assert len(read_jsonl(os.path.join(out, "samples.jsonl"))) > 0
    assert os.path.exists(os.path.join(out, "checkpoints", "step_000002", "COMPLETE"))
    assert "start" in proc.stdout and "end" in proc.stdout  # the reward table


def test_resume_reaches_the_same_parameters(tmp_path):
    common = SMOKE + ["--lr-schedule", "constant", "--save-every", "1", "--keep-checkpoints", "5"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run(common + ["--max-steps", "4", "--output-dir", a])
    run(common + ["--max-steps", "2", "--output-dir", b])
    proc = run(common + ["--max-steps", "4", "--output-dir", b, "--resume"])
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout
    wa, wb = final_weights(a, 4), final_weights(b, 4)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert [r["step"] for r in read_jsonl(os.path.join(b, "metrics.jsonl"))] == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_update_on_two_ranks_equals_one_rank(tmp_path, agg):
    one, two = str(tmp_path / "one.pt"), str(tmp_path / "two.pt")
    run(["tests/dist_update.py", one, agg], nproc=1)
    run(["tests/dist_update.py", two, agg], nproc=2)
    a, b = torch.load(one), torch.load(two)
    for key in ["loss", "kl", "loss/pg", "entropy", "grad_norm", "loss/ratio_mean"]:
        assert a["stats"][key] == pytest.approx(b["stats"][key], rel=1e-4, abs=1e-6), key
    # grad_norm (before clipping) above checks the gradient's scale, which AdamW's update hides.
    # Two AdamW steps at lr 1e-3 move a weight by up to 2e-3; only float summation order differs.
    for name, t in a["params"].items():
        torch.testing.assert_close(t, b["params"][name], rtol=0, atol=1e-5, msg=name)


def test_a_bad_flag_stops_train_py_with_one_line_and_status_2(tmp_path):
    proc = run(["train.py", "--preset", "smoke", "--output-dir", str(tmp_path), "--group-size", "1"], check=False)
    assert "--group-size must be at least 2" in refused(proc)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--batch-size", "10", "--group-size", "4"], "must be a multiple of --group-size"),
        (["--estimator", "ppo"], "--estimator 'ppo' is not one of"),
        (["--lr", "-1"], "--lr must be in (0, 1)"),
        (["--rewards", "nope"], "unknown reward 'nope'"),
        (["--condition", "length_ok:correct"], "bad condition"),
        (["--condition", "length_ok:correct>=1"], "names reward 'length_ok'"),
        (["--reward-weights", "1,2"], "--reward-weights has 2 values for 3 rewards"),
        (["--max-steps", "x"], "invalid int value"),
        (["--task", "toolcall"], "needs --data"),
        (["--data", "/nonexistent.jsonl", "--task", "gsm8k"], "/nonexistent.jsonl: no such file"),
    ],
)
def test_bad_config_is_one_line_before_any_model_loads(tmp_path, capsys, flags, message):
    assert message in refusal(["--preset", "smoke", "--output-dir", str(tmp_path)] + flags)
    assert "parameters:" not in capsys.readouterr().out  # stopped before the model was built


@pytest.mark.slow
def test_two_ranks_need_whole_groups_per_rank(tmp_path):
    proc = run(["train.py", "--preset", "smoke", "--batch-size", "4", "--output-dir", str(tmp_path)], nproc=2, check=False)
    assert proc.returncode != 0
    assert "must divide by world size x group size = 2 x 4" in proc.stderr


def test_update_throughput_counts_every_pass_and_only_trainable_weight_gradients(tmp_path):
    """throughput/update_tflops_per_device: tokens of all num_iterations passes over the update's time, at
    4 x parameters + 2 x trainable parameters FLOPs per token (LoRA's frozen weights get no gradient), plus
    attention's share (throughput/attention_flops_frac)."""
    rows = {}
    for name, extra in (("one", []), ("two", ["--num-iterations", "2"]), ("lora", ["--lora-rank", "4"])):
        proc = run(SMOKE + ["--output-dir", str(tmp_path / name), "--max-steps", "1", "--save-every", "0"] + extra)
        n_params, n_trainable = (int(x.replace(",", "")) for x in
                                 re.search(r"parameters: ([\d,]+), trainable: ([\d,]+)", proc.stdout).groups())
        row = read_jsonl(os.path.join(tmp_path / name, "metrics.jsonl"))[0]
        tokens = row["throughput/update_tokens_per_s"] * row["time/update"]
        flops_per_token = row["throughput/update_tflops_per_device"] * 1e12 / row["throughput/update_tokens_per_s"] \
            * (1 - row["throughput/attention_flops_frac"])
        assert 0 < row["throughput/attention_flops_frac"] < 0.5 and 0 <= row["throughput/padding_frac"] < 1
        rows[name] = tokens, flops_per_token, n_params, n_trainable
    assert rows["two"][0] == pytest.approx(2 * rows["one"][0], rel=1e-6)  # the same sampled batch, two passes
    tokens, flops, n_params, n_trainable = rows["lora"]
    assert n_trainable < n_params and flops == pytest.approx(4 * n_params + 2 * n_trainable, rel=1e-6)
    assert rows["one"][1] == pytest.approx(6 * rows["one"][2], rel=1e-6)


def test_padding_free_true_and_false_train_the_same(tmp_path):
    """The packed row and the padded one: the same loss, KL and updated parameters (fp32), under dapo."""
    rows, weights = {}, {}
    for flag in ("true", "false"):
        out = str(tmp_path / flag)
        run(SMOKE + ["--max-steps", "1", "--save-every", "1", "--loss-agg", "dapo", "--padding-free", flag,
                     "--max-prompt-len", "1000", "--micro-batch-size", "8", "--output-dir", out])  # 2 prompts of 2 lengths
        rows[flag] = read_jsonl(os.path.join(out, "metrics.jsonl"))[0]
        weights[flag] = final_weights(out, 1)
    assert rows["true"]["throughput/padding_frac"] == 0 < rows["false"]["throughput/padding_frac"]
    for key in ("loss", "kl", "loss/pg", "entropy", "grad_norm"):
        assert rows["true"][key] == pytest.approx(rows["false"][key], abs=1e-5), key
    for name, w in weights["true"].items():
        torch.testing.assert_close(w, weights["false"][name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
def test_a_token_budget_moves_groups_between_ranks_and_counts_globally(tmp_path):
    """Rank 0's two long groups go to micro-batches of their own, rank 1's two short ones join one of them: one
    rank trains on a long group and both short ones, the other on the second long group; each runs one
    micro-batch, and the update's normaliser is the global token count over the world size on both."""
    import json

    out = str(tmp_path / "deal.json")
    run(["tests/deal_main.py", out], nproc=2)
    got = [json.load(open(f"{out}.{r}")) for r in (0, 1)]
    assert sorted(tuple(g["groups"]) for g in got) == [(10, 20, 21), (11,)]
    assert [g["micro_batches"] for g in got] == [1, 1] and sum(g["empty"] for g in got) == 0
    total = sum(g["tokens"] for g in got)
    assert total == 2 * 2 * 30 + 2 * 2 * 5 and all(g["normaliser"] == total / 2 for g in got)


@pytest.mark.slow
def test_two_ranks_with_a_token_budget_resume_exactly(tmp_path):
    common = SMOKE + ["--batch-size", "16", "--micro-batch-tokens", "300", "--max-steps", "3", "--save-every", "1",
                      "--keep-checkpoints", "5", "--lr-schedule", "constant"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run(common + ["--output-dir", a], nproc=2)
    run(common + ["--output-dir", b, "--max-steps", "2"], nproc=2)  # stopped after step 2's checkpoint
    run(common + ["--output-dir", b, "--resume"], nproc=2)
    wa, wb = final_weights(a, 3), final_weights(b, 3)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    ra, rb = read_jsonl(os.path.join(a, "metrics.jsonl")), read_jsonl(os.path.join(b, "metrics.jsonl"))
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]

