"""The vLLM rollout backend, colocated with the FSDP2 trainer: one engine per rank; and `make_sampler`,
which picks it or the built-in Hugging Face sampler (minigdpo/sampler.py).

Written against vLLM 0.33.0 (pinned in setup.py's `vllm` and `gpu` extras). Every vLLM call the
project makes is in this file; tests/check_vllm_contract.py checks each name against the wheel:

    vllm.LLM(model, tokenizer, dtype, seed, gpu_memory_utilization, tensor_parallel_size=1,
             **EngineArgs: max_model_len, max_num_seqs, enable_sleep_mode=True, enable_prefix_caching=True,
             distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs")
    vllm.SamplingParams(n, temperature, top_p, max_tokens, logprobs=0, seed, stop_token_ids, ignore_eos)
    vllm.inputs.TokensPrompt(prompt_token_ids=...)
    LLM.generate(prompts, [SamplingParams per prompt], use_tqdm=False) -> [RequestOutput]
        RequestOutput.outputs -> [CompletionOutput(token_ids, logprobs, finish_reason)]
        CompletionOutput.logprobs -> one {token_id: Logprob(logprob, ...)} per generated token
    LLM.sleep(level=1), LLM.wake_up(tags=["weights"] or ["kv_cache"]), LLM.reset_prefix_cache()
    LLM.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(iterable of (name, tensor))
        (the in-process model, reachable because external_launcher keeps the engine in this process)

`load_weights` takes Hugging Face checkpoint names; the vLLM model maps them to its own layout
(q/k/v into qkv_proj, gate/up into gate_up_proj), skips lm_head when embeddings are tied, raises
ValueError on a name it does not know, and returns the names of its own parameters that received a
tensor (vllm/model_executor/models/utils.py:476-478). Nothing in vLLM checks that set on this path
(only its disk loader does, vllm/model_executor/model_loader/default_loader.py:567-572), so the sync
checks it: every vLLM parameter must have received a tensor, and every Hugging Face weight must have
been sent (a stacked qkv_proj shows as received when only q arrived).
vLLM's own RL weight-update API (vllm/entrypoints/rl: init_weight_transfer_engine, update_weights)
connects a trainer in another process through a transfer backend (vllm/distributed/weight_transfer);
colocated in one process, the direct call streams each full tensor with no transport in between.

The weight life cycle, one step:

    generate()      engine awake, weights current
    sleep()         level 1: weights copied to CPU, KV cache freed, prefix cache reset; the trainer gets the memory
    load_weights()  wake the weights only, stream the new ones in one tensor at a time, reset
                    the prefix cache (its entries were computed with the old weights)
    wake()          allocate the KV cache; generate again

Weights only ever come from the trainer. Nothing reloads them from disk after a sync: that
pattern silently serves stale weights (huggingface/trl#5312). `sampler/logp_gap` in the
metrics would show it at once.

Sampling streams. vLLM draws sample j of a request from the stream `seed + j`
(vllm/v1/engine/parallel_sampling.py:81), so one seed shared by every prompt would give sample j
of every prompt the same noise. Each prompt i of a call gets its own seed, `(seed * B + i) * n`:
its n samples then use the streams `seed * B * n + i * n + j`, one per (prompt, sample), and calls
with different seeds (train.py adds the rank and the step) use disjoint blocks of B * n streams.
"""

import os
import random
import socket

import numpy as np
import torch

from minigdpo import dist, models
from minigdpo.sampler import Completion, HFSampler, WeightSyncError, check_sync, weight_names

VLLM_VERSION = "0.33.0"
# What the vLLM 0.33.0 wheel declares (its METADATA); setup.py's own ranges must lie inside these.
# tests/check_vllm_contract.py compares this record with the wheel.
VLLM_REQUIRES = {"torch": "==2.14.0", "transformers": ">=5.16.1,<5.21.0"}


def request_seeds(seed, num_prompts, n):
    """One seed per prompt, n apart, so that (prompt i, sample j) draws from stream seed*B*n + i*n + j.

    Kept below 2**62, so that seed + j stays an int64 too: the V2 model runner stores seeds as int64
    (vllm/v1/worker/gpu/sample/states.py:58).
    """
    return [((seed * num_prompts + i) * n) % 2**62 for i in range(num_prompts)]


def _ensure_launcher_env():
    """external_launcher reads torchrun's variables; a plain `python train.py` has none."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        # vLLM would open its own one-rank group with this RANK and wait forever (parallel_state.py:1928).
        raise RuntimeError("the vLLM sampler joins the trainer's process group: call dist.init() before building it")


class _KeepRNG:
    """Restore python, numpy, torch and CUDA RNG states on exit: building an engine reseeds them all
    (vllm/v1/worker/gpu_worker.py:517 and 1094 -> vllm/utils/torch_utils.py:528)."""

    def __enter__(self):
        self.states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                       torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)

    def __exit__(self, *exc):
        py, npy, cpu, cuda = self.states
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class VLLMSampler:
    """Sampler interface over a colocated vLLM engine (see the module docstring for the order of calls)."""

    def __init__(self, model_path, tokenizer, stop_ids, seed=0, dtype=None, gpu_memory_utilization=0.3,
                 max_model_len=2048, max_num_seqs=256):
        import vllm

        _ensure_launcher_env()
        self.tokenizer = tokenizer
        self.stop_ids = sorted(stop_ids)
        with _KeepRNG():
            self.llm = vllm.LLM(model=model_path, tokenizer=model_path,
                                dtype="bfloat16" if dtype is None else str(dtype).split(".")[-1],
                                seed=seed, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                                max_num_seqs=max_num_seqs, enable_sleep_mode=True, enable_prefix_caching=True,
                                tensor_parallel_size=1, distributed_executor_backend="external_launcher",
                                logprobs_mode="processed_logprobs")  # log-probs after temperature, as the trainer computes them
        self.weights_awake, self.kv_awake = True, True
        self.expected = weight_names(models.empty_model(model_path, torch.float32))  # what every sync must send

    def _model(self):
        return self.llm.llm_engine.model_executor.driver_worker.model_runner.model

    def generate(self, prompts, n, params):
        import vllm
        from vllm.inputs import TokensPrompt

        self.wake()
        stop = [] if params.ignore_eos else self.stop_ids  # vLLM stops on stop_token_ids even with ignore_eos
        sampling = [vllm.SamplingParams(n=n, temperature=params.temperature, top_p=params.top_p,
                                        max_tokens=params.max_new_tokens, logprobs=0, seed=s,
                                        stop_token_ids=stop, ignore_eos=params.ignore_eos)
                    for s in request_seeds(params.seed, len(prompts), n)]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling, use_tqdm=False)
        return [[self._completion(c) for c in out.outputs] for out in outputs]

    def _completion(self, out):
        ids = list(out.token_ids)
        logprobs = [step[token].logprob for token, step in zip(ids, out.logprobs)]
        finish = "stop" if out.finish_reason == "stop" else "length"
        return Completion(ids, logprobs, finish, self.tokenizer.decode(ids, skip_special_tokens=True))

    def _wake_up(self, tag):
        # vLLM maps its memory straight from the driver: blocks the trainer's caching allocator still
        # holds after the update would be out of its reach.
        torch.cuda.empty_cache()
        self.llm.wake_up(tags=[tag])

    def load_weights(self, named_tensors):
        """Stream (HF name, full tensor) pairs into the engine, check that none of its weights stayed stale,
        then drop prefix-cache entries."""
        if not self.weights_awake:  # writing into sleeping weights would write into unmapped memory
            self._wake_up("weights")
            self.weights_awake = True
        sent = []

        def stream():
            for name, tensor in named_tensors:
                sent.append(name)
                yield name, tensor

        model = self._model()
        loaded = model.load_weights(stream())
        stale = [name for name, _ in model.named_parameters() if name not in loaded]
        if stale:
            raise WeightSyncError(f"vLLM's {', '.join(stale[:5])} received no tensor in the weight sync")
        check_sync(self.expected, sent)
        self.llm.reset_prefix_cache()

    def sleep(self):
        if self.weights_awake or self.kv_awake:
            self.llm.sleep(level=1)
            self.weights_awake = self.kv_awake = False

    def wake(self):
        if not self.weights_awake:
            self._wake_up("weights")
            self.weights_awake = True
        if not self.kv_awake:
            self._wake_up("kv_cache")
            self.kv_awake = True


# Picking a backend -----------------------------------------------------------------------------

class SamplerUnavailable(RuntimeError):
    """The requested backend cannot run here; the message says why in one line."""


def resolve_kind(kind):
    """"hf" or "vllm" for a --sampler value; raises SamplerUnavailable before any model loads."""
    import importlib.util

    if kind == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available() else "hf"
    if kind == "vllm":
        if not torch.cuda.is_available():
            raise SamplerUnavailable("--sampler vllm needs a CUDA GPU; use --sampler hf on this machine")
        if importlib.util.find_spec("vllm") is None:
            raise SamplerUnavailable("--sampler vllm needs vLLM: pip install 'minigdpo[vllm]'")
    return kind


def make_sampler(kind, model_path, device, tokenizer, stop_ids, dtype, seed=0, **vllm_options):
    """The rollout backend: "hf", "vllm", or "auto" (vLLM when importable with CUDA, else HF)."""
    if resolve_kind(kind) == "vllm":
        return VLLMSampler(model_path, tokenizer, stop_ids, seed=seed, dtype=dtype, **vllm_options)
    return HFSampler(models.load_model(model_path, dtype), stop_ids, tokenizer.pad_token_id, device, tokenizer)
