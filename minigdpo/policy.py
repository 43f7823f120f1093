"""The trained policy and its frozen reference, built sharded.

`build` builds the model on the meta device, wraps it for log-probs (minigdpo/logprobs.py), shards it
with FSDP2 over all ranks (fsdp.shard), then has each rank read only its own shards from the
checkpoint's safetensors files, so the trainer's copy is never whole on a rank. Two exceptions: a checkpoint whose
tensors do not match the model by name and shape is loaded whole first (transformers converts it), and every rank's
sampler holds a whole copy of its own (minigdpo/sampler.py, minigdpo/vllm_sampler.py).
"""

import torch

from minigdpo import fsdp, lora
from minigdpo.logprobs import LogProbModel, decoder_layers
from minigdpo.models import empty_model, load_model, safetensors_files


def check_lora_targets(path, targets):
    """ConfigError unless every --lora-targets name matches a linear layer in the decoder layers of
    the model at `path`, checked on the meta device, before any weights load."""
    lm = empty_model(path, torch.float32)
    lora.check_targets(lm, decoder_layers(lm), targets)


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


def build(path, device, compute_dtype, grad_checkpointing=False, frozen=False, offload=False, lora_settings=None,
          compile=False, context=None):
    """Build as the module docstring says: on the meta device, wrapped, sharded, each rank reading its own shards
    (start-up host memory: this rank's shards plus the read rows, about 1.5 x fp32 model / world for a bf16 checkpoint).

    The trained model keeps fp32 master weights and computes in compute_dtype; the frozen reference needs no master
    copy and is loaded in compute_dtype directly (half the memory in bf16). With `lora_settings` (lora.Settings)
    peft's adapters are injected before sharding: the frozen base is loaded in compute_dtype like the reference, and
    only the adapters keep fp32 master weights. compile=True compiles each decoder layer's forward
    (LogProbModel.compile_layers); context: the longest sequence a pass meets (logprobs.fast_pass_refusal).
    """
    dtype = compute_dtype if frozen or lora_settings else torch.float32
    lm = empty_model(path, dtype)
    read = shard_reader(path, lm)
    if read is None:  # names or shapes that differ from the checkpoint's: transformers converts them
        lm = load_model(path, dtype)
    if lora_settings:
        read = lora.attach(lm, lora_settings, read)
    lm.config.use_cache = False
    if grad_checkpointing and not frozen:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = LogProbModel(lm, context)
    if compile:  # each layer's own forward, inside FSDP2's hooks and checkpointing (LogProbModel.compile_layers)
        model.compile_layers()
    model.has_adapters = bool(lora_settings)
    if frozen:
        model.requires_grad_(False)
    model.train(not frozen)  # the reference in eval mode
    param_dtype = compute_dtype if compute_dtype != torch.float32 and not frozen else None
    model = fsdp.shard(model, decoder_layers(lm), param_dtype=param_dtype, offload=offload,
                       forward_methods=("layer_packed",))
    if read is not None:
        fill(lm, torch.device("cpu") if offload else device, read)
    return model


def fill(lm, device, read):
    """Allocate a sharded meta-device model and read this rank's shards into it (fsdp.materialize)."""
    fsdp.materialize(lm, device, read)
    with torch.no_grad():  # buffers that no checkpoint stores (rotary tables, Gemma's embedding scale): transformers
        for m in lm.modules():  # computes them, and may draw the module's weights anew on the way: they are put back
            if m._non_persistent_buffers_set:
                kept = [(p, p.detach().clone()) for p in m.parameters(recurse=False)]
                lm._init_weights(m)
                for p, value in kept:
                    p.copy_(value)


def build_classifier(path, config, device, dtype):
    """A frozen sequence classifier (a reward model, rewards/reward_model.py) sharded with FSDP2 as the reference
    is: built on the meta device, each rank reading only its own shards."""
    from transformers import AutoModelForSequenceClassification

    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    read = shard_reader(path, model)
    if read is None:
        raise ValueError(f"reward model {path}: its tensors do not match its config by name and shape, so it "
                         "cannot be sharded; use --reward-model-placement resident or offload")
    model.requires_grad_(False).eval()
    fill(fsdp.shard(model, decoder_layers(model)), device, read)
    return model
