"""A stand-in for the slice of vLLM 0.10.2 that minigdpo/vllm_sampler.py calls.

It mimics the signatures (unknown keyword arguments raise, as they would), the output objects,
the sleep/wake semantics (level 1 backs weights up to CPU and restores that backup on wake; a
write into sleeping weights is lost) and a Llama/Qwen2 model's `load_weights`, which maps
Hugging Face names onto vLLM's stacked qkv_proj / gate_up_proj layout and skips a tied lm_head.
`install(monkeypatch)` puts it in sys.modules as `vllm` and `vllm.inputs`.
"""

import sys
import types
from dataclasses import dataclass

import torch


@dataclass
class Logprob:
    logprob: float
    rank: int = 1
    decoded_token: str = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float
    logprobs: list
    finish_reason: str = None
    stop_reason: object = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str
    prompt_token_ids: list
    prompt_logprobs: object
    outputs: list
    finished: bool = True


class SamplingParams:
    def __init__(self, n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=16, logprobs=None, seed=None,
                 stop_token_ids=None, ignore_eos=False, skip_special_tokens=True):
        self.__dict__.update(locals())
        del self.__dict__["self"]


def TokensPrompt(prompt_token_ids):  # a TypedDict in vLLM
    return {"prompt_token_ids": prompt_token_ids}


STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]


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

    def _rows(self, shard):
        return {"q": (0, self.q), "k": (self.q, self.q + self.kv), "v": (self.q + self.kv, self.q + 2 * self.kv)}[shard]

    def load_weights(self, weights):
        loaded = set()
        for name, tensor in weights:
            self.received.append((name, tuple(tensor.shape)))
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            for packed, part, shard in STACKED:
                if part in name:
                    target = name.replace(part, packed)
                    param = self.params[target]  # KeyError for a name vLLM does not know
                    if isinstance(shard, str):
                        lo, hi = self._rows(shard)
                    else:
                        half = param.shape[0] // 2
                        lo, hi = shard * half, (shard + 1) * half
                    self.engine.write(target, param, slice(lo, hi), tensor)
                    loaded.add(target)
                    break
            else:
                param = self.params[name]
                self.engine.write(name, param, slice(None), tensor)
                loaded.add(name)
        return loaded


class LLM:
    instances = []

    def __init__(self, model, *, tokenizer=None, dtype="auto", seed=0, gpu_memory_utilization=0.9, max_model_len=None,
                 max_num_seqs=None, enable_sleep_mode=False, enable_prefix_caching=None, tensor_parallel_size=1,
                 distributed_executor_backend=None, logprobs_mode="raw_logprobs"):
        from transformers import AutoConfig

        self.kwargs = {k: v for k, v in locals().items() if k not in ("self", "AutoConfig")}
        self.calls = []
        self.weights_asleep = self.kv_asleep = False
        self.backup = None
        self.script = None  # list of (token_ids, logprobs, finish_reason) handed out by generate
        model_obj = FakeModel(AutoConfig.from_pretrained(model), self)
        executor = types.SimpleNamespace(driver_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model_obj)))
        self.llm_engine = types.SimpleNamespace(model_executor=executor)
        self.model = model_obj
        LLM.instances.append(self)

    def write(self, name, param, rows, tensor):
        self.calls.append(("load", name))
        if self.weights_asleep:  # the GPU pages are gone: the write lands nowhere
            return
        assert param[rows].shape == tensor.shape, (name, param[rows].shape, tensor.shape)
        param[rows] = tensor.detach().float().cpu()

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        assert not (self.weights_asleep or self.kv_asleep), "generate on a sleeping engine"
        self.calls.append(("generate", len(prompts), sampling_params.n))
        self.last_params = sampling_params
        outs = []
        for i, prompt in enumerate(prompts):
            completions = []
            for j in range(sampling_params.n):
                ids, lps, finish = self.script[(i * sampling_params.n + j) % len(self.script)]
                steps = [{t: Logprob(lp), t + 1: Logprob(-9.0, rank=2)} for t, lp in zip(ids, lps)]  # sampled + one other
                completions.append(CompletionOutput(j, "", list(ids), sum(lps), steps, finish))
            outs.append(RequestOutput(str(i), None, prompt["prompt_token_ids"], None, completions))
        return outs

    def sleep(self, level=1):
        self.calls.append(("sleep", level))
        self.backup = {k: v.clone() for k, v in self.model.params.items()} if level == 1 else None
        self.weights_asleep = self.kv_asleep = True

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags or ("weights", "kv_cache"))))
        if tags is None or "weights" in tags:
            if self.weights_asleep and self.backup is not None:
                for k, v in self.backup.items():  # level 1 restores the CPU copy taken at sleep time
                    self.model.params[k].copy_(v)
            self.weights_asleep = False
        if tags is None or "kv_cache" in tags:
            self.kv_asleep = False

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def collective_rpc(self, method, *args, **kwargs):
        self.calls.append(("collective_rpc", method))


def install(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = LLM, SamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = TokensPrompt
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    LLM.instances.clear()
    return vllm
