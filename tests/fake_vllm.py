"""A stand-in for the slice of vLLM 0.33.0 that minigdpo/vllm_sampler.py calls, written from its source.

Every behaviour cites the file and line of the vLLM 0.33.0 wheel it mimics (paths under `vllm/`).
tests/check_vllm_contract.py checks the names used here against that wheel; the behaviours are
tested one by one in tests/test_vllm_sampler.py.

Behaviours:
- sample j of a request draws from stream seed + j (v1/engine/parallel_sampling.py:81), one stream per
  seed (v1/worker/gpu_model_runner.py:1265-1266; the V2 runner, the default on CUDA, keeps the seed
  per request, v1/worker/gpu/sample/states.py:54-58, and hashes it with the position,
  v1/worker/gpu/sample/gumbel.py:264-272); two requests with the same seed draw the same noise;
- stop ids stop generation even with ignore_eos; EOS stops only without it (v1/core/sched/utils.py:105-112,
  sampling_params.py:781-782);
- logprobs=0 gives exactly one {token: Logprob} dict per generated token, holding the sampled token
  (v1/sample/sampler.py:398-416, v1/worker/gpu/sample/logprob.py:126-133, logprobs.py:198-208);
- processed log-probs are taken after temperature and top-p, so they are renormalised over the nucleus
  (v1/sample/ops/topk_topp_sampler.py:303-308 and 555-562; v1/worker/gpu/sample/sampler.py:346-359, 171-173);
- sleep(level>=1) also resets the prefix cache (v1/engine/core.py:1007-1008 -> 932-945); sleeping
  again is a no-op for the weights (v1/executor/abstract.py:400-403);
- wake_up on a tag that is not asleep does nothing (v1/executor/abstract.py:412-422); generation resumes only
  once every tag is awake (v1/engine/core.py:1053-1055);
- external_launcher reads RANK and LOCAL_RANK (v1/executor/uniproc_executor.py:195-196) and, with more than
  one rank, joins the existing default process group; without one a rank would wait forever in
  init_process_group (distributed/parallel_state.py:1928-1983);
- building the engine reseeds python, numpy, torch and CUDA RNGs (v1/worker/gpu_worker.py:517 and 1094,
  utils/torch_utils.py:528-539);
- level-1 sleep backs the weights up to CPU, then unmaps their GPU memory; wake_up maps it again at the
  same address and restores the copy (device_allocator/cumem.py:265-280, 345-360;
  device_allocator/sleep_mode_backend.py:134-137). A write into sleeping weights touches unmapped memory:
  a CUDA error (illegal address), raised here. Level 2 keeps no copy: after wake_up the weights are
  uninitialised memory (cumem.py:361-364 zeroes it on ROCm only), NaN here, until reloaded. The real engine
  generates from such weights without a word; this one refuses to, so that every test driving it checks that
  no path generates between a level-2 sleep and the next reload;
- a Llama/Qwen2 `load_weights` maps Hugging Face names onto the stacked qkv_proj / gate_up_proj layout
  (model_executor/models/llama.py:348-357, model_executor/models/qwen2.py:325), skips rotary buffers
  (model_executor/models/utils.py:236) and a tied lm_head (model_executor/models/utils.py:255-259), raises
  ValueError on a name it does not know (model_executor/models/utils.py:441-448) except an unexpected
  ".bias", which it ignores (model_executor/models/utils.py:457-458), raises ValueError when a tied lm_head
  came without its embedding (model_executor/models/utils.py:491-502), and returns the set of its own
  parameter names that received a tensor (model_executor/models/utils.py:476-478);
- the in-place reload (collective_rpc("reload_weights", kwargs={"weights_iterator": ...}), reaching
  Worker.reload_weights, v1/worker/gpu_worker.py:636-638 -> model_loader/reload/inplace.py:32-96) runs the same
  load_weights, but does not see the tie of a tied lm_head (model_loader/reload/__init__.py:8-11): a tensor sent
  under lm_head.weight is written into the shared storage; it returns None (inplace.py:32-38), and a module
  sent nothing keeps its old weights (model_loader/reload/layerwise.py:255-267);
- sleep mode is a CUDA platform's (platforms/interface.py:231-236): current_platform says it is available;
- the engine core's shutdown (v1/engine/core.py:834-850) ends in cleanup_dist_env_and_memory, which destroys
  the default process group if one is initialised (distributed/parallel_state.py:2539-2546);
- the model attribute chain llm_engine.model_executor exists only in-process, which external_launcher
  forces (config/parallel.py:1050-1052, v1/engine/llm_engine.py:136-138); by default the engine core runs in
  another process and llm_engine has no model_executor;
- sleep mode turns on the CuMem allocator (config/model.py:666-673), of which one instance serves a process:
  a second engine built while the first's memory is alive fails an assertion (v1/worker/gpu_worker.py:413-416);
- 0 < temperature < 0.01 is raised to 0.01 (sampling_params.py:560-568); below 0 or above 2 is refused
  (sampling_params.py:662-673) with VLLMValidationError, which is not a ValueError (exceptions.py:10-28);
- the EOS ids of the model's generation_config.json, other than the tokenizer's, join each request's stop
  ids unless ignore_eos (v1/engine/input_processor.py:489-492, sampling_params.py:775-803);
- LoRA: an adapter is loaded from its folder (adapter_config.json with r, lora_alpha and target_modules, and
  adapter_model.safetensors; lora/peft_helper.py:156-198, lora/lora_model.py:239-241) when its id is not in the
  worker's LRU cache of max_loras adapters, and a cached id is served from the cache whatever its path holds now
  (lora/worker_manager.py:296-297): this one refuses an id reused with a new path, which would serve stale adapters;
- a prompt of max_model_len tokens or more is refused (v1/engine/input_processor.py:574-602), and a completion
  ends with finish_reason "length" once prompt + completion reach max_model_len (v1/core/sched/utils.py:114-118).
`install(monkeypatch)` puts it in sys.modules as `vllm` and `vllm.inputs`.
"""

import os
import random
import sys
import types
from dataclasses import dataclass

import numpy as np
import torch

VERSION = "0.33.0"


class VLLMValidationError(Exception):  # exceptions.py:10-28: VLLMError(Exception), not a ValueError
    pass


@dataclass
class Logprob:  # logprobs.py:13
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:  # outputs.py:59-98
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float | None
    logprobs: list | None
    finish_reason: str | None = None
    stop_reason: object = None


@dataclass
class RequestOutput:  # outputs.py:169-176
    request_id: str
    prompt: str | None
    prompt_token_ids: list | None
    prompt_logprobs: object
    outputs: list
    finished: bool


class SamplingParams:
    """The fields minigdpo sets (sampling_params.py:285-342); any other keyword raises, as the msgspec Struct does."""

    def __init__(self, *, n=1, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop_token_ids=None,
                 ignore_eos=False, max_tokens=16, logprobs=None):
        self.__dict__.update({k: v for k, v in locals().items() if k != "self"})
        if self.seed == -1:  # sampling_params.py:570-571
            self.seed = None
        self.stop_token_ids = list(dict.fromkeys(stop_token_ids or []))  # sampling_params.py:582-585
        if 0 < temperature < 0.01:  # sampling_params.py:560-568: "We have maxed it out to 0.01"
            self.temperature = 0.01
        if not 0 <= self.temperature <= 2:  # sampling_params.py:662-673
            raise VLLMValidationError(f"temperature must be in [0, 2], got {temperature}.")
        if self.temperature < 1e-5:  # sampling_params.py:615-620, 769-773: greedy
            self.top_p, self.top_k = 1.0, 0
            if n > 1:
                raise VLLMValidationError(f"n must be 1 when using greedy sampling, got {n}.")


def TokensPrompt(prompt_token_ids):  # a TypedDict in vLLM (inputs/__init__.py:33)
    return {"prompt_token_ids": prompt_token_ids}


def set_random_seed(seed):
    """utils/torch_utils.py:528-539, called from the worker while the engine is built."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def top_p_mask(logits, p):
    """topk_topp_sampler.py:555-562: drop the tokens whose ascending cumulative probability is <= 1 - p."""
    order = logits.argsort()                                           # ascending
    cum = logits[order].softmax(-1).cumsum(-1)
    drop = cum <= 1 - p
    drop[-1] = False                                                   # at least one token
    return logits.clone().index_fill_(0, order[drop], float("-inf"))


STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]  # llama.py:348-357


class FakeModel:
    """vLLM's parameter layout for a Llama/Qwen2 config, with its load_weights name mapping."""

    def __init__(self, config, engine):
        self.engine, self.config = engine, config
        H, hd = config.hidden_size, config.hidden_size // config.num_attention_heads
        self.q, self.kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
        I, V = config.intermediate_size, config.vocab_size
        p = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
        for i in range(config.num_hidden_layers):
            pre = f"model.layers.{i}."
            p[pre + "self_attn.qkv_proj.weight"] = (self.q + 2 * self.kv, H)
            if getattr(config, "attention_bias", False) or config.model_type == "qwen2":
                p[pre + "self_attn.qkv_proj.bias"] = (self.q + 2 * self.kv,)
            p[pre + "self_attn.o_proj.weight"] = (H, self.q)
            p[pre + "mlp.gate_up_proj.weight"] = (2 * I, H)
            p[pre + "mlp.down_proj.weight"] = (H, I)
            p[pre + "input_layernorm.weight"] = (H,)
            p[pre + "post_attention_layernorm.weight"] = (H,)
        if not config.tie_word_embeddings:
            p["lm_head.weight"] = (V, H)
        self.params = {k: torch.zeros(v) for k, v in p.items()}
        self.received = []  # (hf name, shape) in arrival order

    def named_parameters(self):
        return iter(self.params.items())

    def _rows(self, shard):
        return {"q": (0, self.q), "k": (self.q, self.q + self.kv), "v": (self.q + self.kv, self.q + 2 * self.kv)}[shard]

    def load_weights(self, weights, reload=False):
        loaded, tied_alone = set(), False
        for name, tensor in weights:
            self.received.append((name, tuple(tensor.shape)))
            if "rotary_emb.inv_freq" in name:                                             # utils.py:236
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                if reload:  # reload/__init__.py:8-11: the tie is not seen; the shared storage gets the tensor
                    self.engine.write("model.embed_tokens.weight", self.params["model.embed_tokens.weight"],
                                      slice(None), tensor)
                    continue
                tied_alone = True                                                          # utils.py:255-259, 480-489
                continue
            for packed, part, shard in STACKED:
                if part in name:
                    target = name.replace(part, packed)
                    if target not in self.params:
                        if name.endswith(".bias"):                                         # utils.py:457-458
                            break
                        self._unknown(name)
                    param = self.params[target]
                    if isinstance(shard, str):
                        lo, hi = self._rows(shard)
                    else:
                        half = param.shape[0] // 2
                        lo, hi = shard * half, (shard + 1) * half
                    self.engine.write(target, param, slice(lo, hi), tensor)
                    loaded.add(target)
                    break
            else:
                if name not in self.params:
                    if name.endswith(".bias"):                                             # utils.py:457-458
                        continue
                    self._unknown(name)
                self.engine.write(name, self.params[name], slice(None), tensor)
                loaded.add(name)
        if tied_alone and "model.embed_tokens.weight" not in loaded:                       # utils.py:491-502
            raise ValueError("'lm_head.weight' was skipped because it is tied to 'model.embed_tokens.weight', but "
                             "'model.embed_tokens.weight' was not found in the checkpoint")
        return loaded                                                                       # utils.py:476-478

    def _unknown(self, name):                                                               # utils.py:441-448
        raise ValueError(f"There is no module or parameter named {name!r} in {self.config.model_type}")


ENGINE_ARGS = ("max_model_len", "max_num_seqs", "enable_sleep_mode", "enable_prefix_caching",
               "distributed_executor_backend", "logprobs_mode", "enforce_eager", "kv_cache_memory_bytes",
               "enable_lora", "max_loras", "max_lora_rank")  # EngineArgs fields passed through **kwargs


@dataclass
class LoRARequest:  # lora/request.py:24-42
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        assert self.lora_int_id >= 1, "id must be > 0"                                          # request.py:38-39
        assert self.lora_path, "lora_path cannot be empty"                                        # request.py:42


class LLM:
    instances = []

    def __init__(self, model, *, tokenizer=None, dtype="auto", seed=0, gpu_memory_utilization=0.92,
                 tensor_parallel_size=1, **kwargs):
        from transformers import AutoConfig, AutoTokenizer

        unknown = set(kwargs) - set(ENGINE_ARGS)
        if unknown:  # EngineArgs(**kwargs) rejects them (entrypoints/llm.py:295-343)
            raise TypeError(f"EngineArgs got unexpected keyword arguments {sorted(unknown)}")
        self.kwargs = dict(model=model, tokenizer=tokenizer, dtype=dtype, seed=seed, tensor_parallel_size=tensor_parallel_size,
                           gpu_memory_utilization=gpu_memory_utilization, **kwargs)
        external = kwargs.get("distributed_executor_backend") == "external_launcher"
        if external:
            rank, _ = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])  # KeyError without them
            if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
                raise RuntimeError(f"rank {rank} would wait forever in init_process_group: no default process group")
        if kwargs.get("enable_sleep_mode") and any(i.kwargs.get("enable_sleep_mode") for i in LLM.instances):
            raise AssertionError("CuMem allocator can only be used for one instance per process.")  # gpu_worker.py:413-416
        set_random_seed(seed)
        self.logprobs_mode = kwargs.get("logprobs_mode", "raw_logprobs")
        self.calls = []
        self.sleeping_tags = set()
        self.backup = None
        from transformers import GenerationConfig

        config = AutoConfig.from_pretrained(model)
        self.eos_token_id = AutoTokenizer.from_pretrained(tokenizer or model).eos_token_id  # input_processor.py:489-492
        try:  # config/model.py:1837-1858 (the config's own EOS when the model has no generation_config.json)
            eos = GenerationConfig.from_pretrained(model).eos_token_id
        except OSError:
            eos = config.eos_token_id
        eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        self.generation_eos = sorted(eos - {self.eos_token_id})  # sampling_params.py:790-797
        self.max_model_len = kwargs.get("max_model_len") or config.max_position_embeddings
        table = torch.randn(config.vocab_size, config.vocab_size, generator=torch.Generator().manual_seed(0))
        self.logits = lambda prompt, output: table[(output or prompt)[-1]]  # a toy LM: (V,) next-token logits
        self.streams = []  # (request index, sample index, seed its noise was drawn from)
        model_obj = FakeModel(config, self)
        executor = types.SimpleNamespace(driver_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model_obj)))
        # In-process (model_executor reachable) only under external_launcher (config/parallel.py:1050-1052).
        core = types.SimpleNamespace(shutdown=self._shutdown)
        self.llm_engine = types.SimpleNamespace(model_executor=executor, engine_core=core) if external else \
            types.SimpleNamespace(engine_core=core)
        self.model = model_obj
        LLM.instances.append(self)

    def write(self, name, param, rows, tensor):
        self.calls.append(("load", name))
        if "weights" in self.sleeping_tags:  # cumem.py:278: the weights' GPU pages are unmapped
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        assert param[rows].shape == tensor.shape, (name, param[rows].shape, tensor.shape)
        param[rows] = tensor.detach().float().cpu()

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None):
        assert not self.sleeping_tags, "the scheduler stays paused until every tag is awake: generate would hang"
        if lora_request is not None:
            self._load_adapter(lora_request)
        stale = [k for k, v in self.model.params.items() if torch.isnan(v).any()]
        if stale:  # cumem.py:361-364: after sleep(level=2) the weights are uninitialised memory until reloaded
            raise AssertionError(f"generate from weights discarded by sleep(level=2) and never reloaded ({stale[0]}, "
                                 f"{len(stale)} in all): the real engine samples noise from them without a word")
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):  # entrypoints/common/offline.py:258-262
            raise ValueError(f"The lengths of prompts ({len(prompts)}) and params ({len(params)}) must be the same.")
        self.calls.append(("generate", len(prompts), params[0].n))
        self.last_params = params
        for prompt in prompts:
            if len(prompt["prompt_token_ids"]) >= self.max_model_len:  # input_processor.py:574-602
                raise VLLMValidationError(f"The decoder prompt (length {len(prompt['prompt_token_ids'])}) plus the "
                                          f"number of requested output tokens (at least 1) is longer than the "
                                          f"maximum model length of {self.max_model_len}.")
        outs = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            completions = []
            for j in range(sp.n):
                seed = None if sp.seed is None else sp.seed + j  # parallel_sampling.py:81
                self.streams.append((i, j, seed))
                completions.append(self._sample(list(prompt["prompt_token_ids"]), sp, j, seed))
            outs.append(RequestOutput(str(i), None, prompt["prompt_token_ids"], None, completions, True))
        self.last_outputs = outs
        return outs

    def _sample(self, prompt, sp, index, seed):
        generator = torch.Generator().manual_seed(seed) if seed is not None else None  # gpu_model_runner.py:1265
        stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.generation_eos))  # sampling_params.py:798-803
        ids, steps, finish, stop_reason = [], [], "length", None
        while len(ids) < sp.max_tokens and len(prompt) + len(ids) < self.max_model_len:  # core/sched/utils.py:114-118
            raw = self.logits(prompt, ids).float()                                        # (V,)
            logits = raw / sp.temperature                                                 # sampler.py:340
            if sp.top_p < 1.0:
                logits = top_p_mask(logits, sp.top_p)
            q = torch.empty_like(logits).exponential_(generator=generator)              # topk_topp_sampler.py:616-627
            token = int((logits.softmax(-1) / q).argmax())
            lp = (logits if self.logprobs_mode == "processed_logprobs" else raw).log_softmax(-1)  # sampler.py:149-150
            ids.append(token)
            if sp.logprobs is not None:  # the sampled token, then the top `logprobs` (0 here)
                top = lp.topk(sp.logprobs).indices.tolist()
                steps.append({t: Logprob(float(lp[t]), int((lp > lp[t]).sum()) + 1) for t in [token] + top})
            if token == self.eos_token_id and not sp.ignore_eos:                          # core/sched/utils.py:105
                finish = "stop"
                break
            if token in stop_ids:                                                         # core/sched/utils.py:109-112
                finish, stop_reason = "stop", token
                break
        cum = sum(next(iter(s.values())).logprob for s in steps) if sp.logprobs is not None else None
        return CompletionOutput(index, "", ids, cum, steps if sp.logprobs is not None else None, finish, stop_reason)

    def _load_adapter(self, request):
        """The worker loads an adapter from its folder when its id is not cached (lora/worker_manager.py:296-297, the
        LRU cache of max_loras entries); a cached id is served from the cache, whatever its path now holds. The
        fake refuses what would then serve stale adapters: an id reused with another path."""
        import json

        assert self.kwargs.get("enable_lora"), "LoRA is not enabled"                    # lora_model_runner_mixin.py
        for name in ("adapter_config.json", "adapter_model.safetensors"):              # peft_helper.py:181, lora_model.py:239
            assert os.path.isfile(os.path.join(request.lora_path, name)), f"{request.lora_path} has no {name}"
        with open(os.path.join(request.lora_path, "adapter_config.json")) as f:
            config = json.load(f)
        assert {"r", "lora_alpha", "target_modules"} <= set(config)                      # peft_helper.py:160-169
        assert config["r"] <= self.kwargs.get("max_lora_rank", 16)                       # peft_helper.py:193-198
        seen = getattr(self, "adapters", {})
        if seen.get(request.lora_int_id, request.lora_path) != request.lora_path:
            raise AssertionError(f"adapter id {request.lora_int_id} reused with a new path: the worker serves the "
                                 "cached adapter (worker_manager.py:296-297), stale")
        self.adapters = {request.lora_int_id: request.lora_path}                         # max_loras=1: LRU of one
        self.calls.append(("lora", request.lora_int_id))

    def sleep(self, level=1, mode="abort"):
        self.calls.append(("sleep", level))
        if level >= 1:
            self.reset_prefix_cache(reset_running_requests=True, reset_connector=True)  # core.py:1007-1008, 940
        if "weights" in self.sleeping_tags:  # abstract.py:401-403: already asleep
            return
        # sleep_mode_backend.py:134-136: level 1 offloads the weights, level 2 drops them
        self.backup = {k: v.clone() for k, v in self.model.params.items()} if level == 1 else None
        self.sleeping_tags |= {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))
        if not self.sleeping_tags or any(t not in self.sleeping_tags for t in tags or ()):  # abstract.py:413-422
            return not self.sleeping_tags
        woken = set(tags) if tags else set(self.sleeping_tags)
        if "weights" in woken:
            for k, v in self.model.params.items():  # cumem.py:350-364: the CPU copy comes back, or (level 2) nothing
                v.copy_(self.backup[k]) if self.backup is not None else v.fill_(float("nan"))
            self.backup = None
        self.sleeping_tags -= woken
        return not self.sleeping_tags

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset_prefix_cache",))
        return True

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("collective_rpc", method))
        if method == "reload_weights" and (kwargs or {}).get("weights_iterator") is not None:
            self.model.load_weights(kwargs["weights_iterator"], reload=True)               # reload/inplace.py:92-96
        return [None]

    def _shutdown(self):
        self.calls.append(("shutdown",))
        if torch.distributed.is_initialized():                                             # parallel_state.py:2545-2546
            torch.distributed.destroy_process_group()


def install(monkeypatch):
    import importlib.machinery

    vllm = types.ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)  # importlib.util.find_spec("vllm") finds it
    vllm.LLM, vllm.SamplingParams, vllm.__version__ = LLM, SamplingParams, VERSION
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = TokensPrompt
    vllm.inputs = inputs
    exceptions = types.ModuleType("vllm.exceptions")
    exceptions.VLLMValidationError = VLLMValidationError
    vllm.exceptions = exceptions
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setitem(sys.modules, "vllm.exceptions", exceptions)
    lora, request = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request.LoRARequest, lora.request, vllm.lora = LoRARequest, request, lora
    monkeypatch.setitem(sys.modules, "vllm.lora", lora)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_sleep_mode_available=lambda: True, is_cpu=lambda: False)
    vllm.platforms = platforms
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    LLM.instances.clear()
    return vllm
