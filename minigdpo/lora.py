"""LoRA through peft: the adapters, the reference without them, merged weights for the sampler,
and adapter checkpoints in peft's format.

With --lora-rank R > 0 every targeted linear layer of the policy computes

    y = W x + (alpha / R) * B (A dropout(x))        W (out, in) frozen;  A (R, in), B (out, R) trained

(Hu et al., 2021, Eq. 3). peft (pip install 'minigdpo[lora]') builds and runs these layers; this file
only places them. `peft.inject_adapter_in_model` swaps each targeted layer for peft's LoRA layer in
place, so the Hugging Face model keeps its own module tree, and LogProbModel, decoder_layers and FSDP2
see the model they see without LoRA. Only the names of the targeted layers gain a level:

    model.layers.0.self_attn.q_proj.weight  ->  model.layers.0.self_attn.q_proj.base_layer.weight
                                                model.layers.0.self_attn.q_proj.lora_A.default.weight  (R, in)
                                                model.layers.0.self_attn.q_proj.lora_B.default.weight  (out, R)

What changes against full fine-tuning (docs/gpus.md, "LoRA on one GPU", tells the whole of it): the base weights
are frozen in the compute dtype, the adapters keep fp32 master weights; the reference is the policy with its adapters
off (`adapters_off`); a sync sends the adapters alone (`adapter_weights`), and merged weights (`merged_state`) go to
exports; checkpoints hold the adapters in peft's format (`adapter/`). Initialisation is peft's, drawn on the host
from a fixed seed, one whole tensor at a time: every rank and every world size gets the same adapters.
"""

import contextlib
import json
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from minigdpo import dist

ADAPTER = "default"  # peft's name for a model's only adapter


@dataclass
class Settings:
    """What train.py's LoRA flags ask for; None in its place means full fine-tuning."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple
    seed: int = 0


def settings(cfg):
    """Settings from a config, or None when --lora-rank is 0."""
    if not cfg.lora_rank:
        return None
    return Settings(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, tuple(cfg.lora_targets), cfg.seed)


def check_targets(lm, layers, targets):
    """Raise ConfigError unless each target names a linear layer inside the decoder layers.

    peft matches a target by the last parts of a module's name ("q_proj" matches "model.layers.0.self_attn.q_proj").
    Outside the decoder layers an adapter would be wrong here: the head's weight is read directly by the chunked
    log-softmax, and the embedding is tied to it. Runs on a meta-device model, before any weights load.
    """
    from minigdpo.config import ConfigError

    inside = {id(m) for layer in layers for m in layer.modules()}
    linear = [(name, m) for name, m in lm.named_modules() if isinstance(m, nn.Linear)]
    for target in targets:
        hits = [(name, m) for name, m in linear if name == target or name.endswith("." + target)]
        outside = [name for name, m in hits if id(m) not in inside]
        if outside:
            raise ConfigError(f"--lora-targets {target!r} matches {outside[0]}, outside the decoder layers: "
                              "only the linear layers inside them can take adapters")
        if not hits:
            names = sorted({name.rsplit(".", 1)[-1] for name, m in linear if id(m) in inside})
            raise ConfigError(f"--lora-targets {target!r} matches no linear layer of {type(lm).__name__}; "
                              f"its decoder layers have {', '.join(names)}")


def attach(lm, lora, read):
    """Inject peft's LoRA layers into lm in place, before FSDP2 shards it; returns the reader that
    policy.build materialises the sharded model with.

    lm may be on the meta device (then read(name, start, stop) reads the checkpoint's rows) or
    loaded (read is None). The adapters are created fp32 (master weights), whatever the base's dtype.
    The returned reader maps base-layer names back to the checkpoint's and serves the adapters' initial
    values, so each rank reads the rows of its own adapter shards as it reads its base weights.
    """
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.targets), bias="none", task_type="CAUSAL_LM",
                        base_model_name_or_path=lm.config.name_or_path)
    inject_adapter_in_model(config, lm, adapter_name=ADAPTER, low_cpu_mem_usage=read is not None)  # freezes the rest
    initial = initial_adapters(lm, lora.seed)  # in place, on the host
    if read is None:  # a loaded model: its adapters are ready
        return None
    for _, layer in lora_layers(lm):  # back to the meta device: fsdp.materialize allocates them with the rest
        layer.lora_A.to_empty(device="meta")
        layer.lora_B.to_empty(device="meta")
    return lambda name, start, stop: (initial[name][start:stop] if name in initial
                                      else read(name.replace(".base_layer.", "."), start, stop))


def initial_adapters(lm, seed):
    """{parameter name: fp32 tensor}: peft's own initialisation (reset_lora_parameters) of every adapter,
    on the host, layer after layer from one seeded stream, so it is the same on every rank."""
    values = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for prefix, layer in lora_layers(lm):
            for part in (layer.lora_A, layer.lora_B):
                part[ADAPTER].to_empty(device="cpu")
                part[ADAPTER].float()
            layer.reset_lora_parameters(ADAPTER, init_lora_weights=True)
            for part in ("lora_A", "lora_B"):
                values[f"{prefix}.{part}.{ADAPTER}.weight"] = getattr(layer, part)[ADAPTER].weight.detach().clone()
    return values


def lora_layers(lm):
    """[(module name, peft LoRA layer)] in module order."""
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in lm.named_modules() if isinstance(m, LoraLayer)]


def has_adapters(lm):
    return hasattr(lm, "peft_config")  # set by inject_adapter_in_model


@contextlib.contextmanager
def adapters_off(model):
    """Run `model` as its base model: every LoRA layer skips its adapter (peft's enable_adapters(False)).

    peft also clears the adapters' requires_grad when it switches them off. This is restored at once:
    FSDP2 decides which of a layer's parameters are trainable, and how their gradients are reduced, at
    the model's first forward, and on step 1 the first forward is this reference pass.
    """
    layers = [m for _, m in lora_layers(model)]
    trainable = [(p, p.requires_grad) for m in layers for p in m.parameters()]
    for m in layers:
        m.enable_adapters(False)
    for p, flag in trainable:
        p.requires_grad_(flag)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)
        for p, flag in trainable:
            p.requires_grad_(flag)


def merged_state(lm, dtype, skip, main_only=False):
    """Yield (base model's Hugging Face name, whole tensor): each adapted weight merged,
    W + (alpha / R) B A, computed in fp32; every other tensor as it is; the adapters themselves not.

    Names in `skip` (tied weights) are left out. Every rank must iterate to the end, in the same order:
    each gather is a collective. main_only=True gathers on rank 0 alone, and merges there; the other
    ranks get None (dist.full_tensor).
    """
    layers = dict(lora_layers(lm))
    state = lm.state_dict(keep_vars=True)
    for name, t in state.items():
        if name in skip or is_adapter(name):
            continue
        prefix, _, leaf = name.rpartition(".base_layer.")
        if prefix in layers and leaf == "weight":
            A = dist.full_tensor(state[f"{prefix}.lora_A.{ADAPTER}.weight"].detach(), main_only)   # (R, in)
            B = dist.full_tensor(state[f"{prefix}.lora_B.{ADAPTER}.weight"].detach(), main_only)   # (out, R)
            W = dist.full_tensor(t.detach(), main_only)                                           # (out, in)
            if W is None:  # main_only, on another rank
                yield f"{prefix}.weight", None
                continue
            merged = W.float() + layers[prefix].scaling[ADAPTER] * (B.float() @ A.float())  # (out, in)
            yield f"{prefix}.weight", merged.to(dtype or W.dtype)
        else:  # a bias of an adapted layer, or any other tensor: its name without the ".base_layer"
            t = t.detach().to(dtype or t.dtype)  # as the merged weights above: no copy where the dtype stays
            yield name.replace(".base_layer.", "."), dist.full_tensor(t, main_only)


def adapter_weights(lm, dtype=None):
    """Yield (name, whole tensor) of every adapter, A and B, under lm's own names, in `dtype` when given: what a
    sampler that applies the adapters itself receives at each sync (a few hundred MB at 7B, not the merged 15 GB).
    Every rank must iterate to the end: each gather is a collective."""
    for name, t in lm.state_dict(keep_vars=True).items():
        if is_adapter(name):
            yield name, dist.full_tensor(t.detach().to(dtype) if dtype is not None else t.detach())


def is_adapter(name):
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def adapter_state(lm):
    """{key: whole fp32 tensor} of the adapters, keyed as PeftModel.save_pretrained keys them.
    Every rank must call it: each gather is a collective."""
    from peft import get_peft_model_state_dict

    state = {name: dist.full_tensor(t.detach()) for name, t in lm.state_dict(keep_vars=True).items()
             if is_adapter(name)}
    # PeftModel's own keys start with its wrappers' names (PeftModel.base_model -> LoraModel.model).
    return {"base_model.model." + k: v for k, v in get_peft_model_state_dict(lm, state, ADAPTER).items()}


def save_adapter(path, state, lm, tokenizer=None):
    """Write adapter_config.json and adapter_model.safetensors (peft's format), and the tokenizer when given."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: v.to("cpu").contiguous() for k, v in state.items()}, os.path.join(path, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config = lm.peft_config[ADAPTER]
    inference_mode, config.inference_mode = config.inference_mode, True  # as PeftModel.save_pretrained writes it
    try:
        config.save_pretrained(path)
    finally:
        config.inference_mode = inference_mode
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def is_adapter_dir(path):
    return os.path.isfile(os.path.join(path, "adapter_config.json"))


def merge_adapter_dir(adapter_dir, out):
    """Merge a saved adapter into its base model (peft's merge_and_unload) and save the result to `out`,
    a directory transformers and vLLM load as is; returns `out`. For evaluating a LoRA checkpoint
    written without --merge-on-save."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        base_path = json.load(f)["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype="auto")
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(out)
    return out


def trainable_count(model):
    """(trainable parameters, all parameters): global counts, also under FSDP2."""
    return (sum(p.numel() for p in model.parameters() if p.requires_grad), sum(p.numel() for p in model.parameters()))
