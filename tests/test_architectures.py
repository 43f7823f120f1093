"""Whatever model a user brings, the trainer computes that model's own log-probs: a one-step fp32 run of train.py
for each architecture, padding-free on and off.

Tiny random models of each family, windows shorter than prompt + completion: the HF sampler generates with the
model's own forward, so `sampler/logp_gap` at rounding says the trainer's log-probs are the model's own; the run's
self-check (`logprobs/fast_pass_max_diff`) compares its fast pass with the model's own forward on its first
micro-batch. Models the fast pass refuses (Gemma-2) run their own forward and say so.

Run: pytest tests/test_architectures.py   (about a minute on 2 cores)
"""

import os

import pytest
import torch

from conftest import read_jsonl
from minigdpo import logprobs, models

WINDOW = 6  # arith's prompts run to about 60 tokens here: every window binds
ARCHITECTURES = {
    "llama": {}, "qwen3": {}, "olmo2": {}, "qwen2": {},
    "mistral": dict(sliding_window=WINDOW),
    "qwen2-window": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "phi3": dict(sliding_window=WINDOW),
    "gemma2": dict(sliding_window=WINDOW, final_logit_softcapping=5.0, attn_logit_softcapping=10.0),
}


def build(path, name):
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = models.tiny_tokenizer()
    config = AutoConfig.for_model(name.split("-")[0], vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=256, pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, bos_token_id=None, **ARCHITECTURES[name])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("padding_free", ["true", "false"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_one_step_of_each_architecture_has_the_models_own_log_probs(name, padding_free, tmp_path, capsys):
    import train

    path = build(tmp_path / name, name)
    out = str(tmp_path / "run")
    train.run_training(["--preset", "smoke", "--model", path, "--max-steps", "1", "--dtype", "fp32",
                        "--padding-free", padding_free, "--output-dir", out, "--save-every", "0", "--samples-every", "0",
                        "--rewards", "tests.helpers:digit_frac,tests.helpers:vowel_frac"])
    (row,) = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert row["sampler/logp_gap"] < 1e-5, row["sampler/logp_gap"]  # mean |sampler - trainer| per token
    refusal = logprobs.fast_pass_refusal(models.load_model(path))
    if refusal:  # its own forward, said once
        assert name == "gemma2" and "logprobs/fast_pass_max_diff" not in row
        assert "the model's own forward on full sequences" in capsys.readouterr().out
    else:  # the fast pass, checked against the model's own forward on the run's first micro-batch
        assert row["logprobs/fast_pass_max_diff"] < 1e-5 and row["logprobs/fast_pass_mean_diff"] < 1e-6
