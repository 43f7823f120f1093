"""Aten ops per decoder layer per micro-batch of the update pass, eager, on the CPU: a proxy for the kernel
launches that leave a GPU idle when the host cannot issue them fast enough (docs/performance.md).

    python benchmarks/update_ops.py                                  # this checkout
    MINIGDPO_ROOT=/path/to/other/checkout python benchmarks/update_ops.py   # another one, to compare

A Qwen2-shaped model (GQA, q/k/v biases) of 1 and of 3 layers runs one micro-batch (4 prompts x 4 completions of
spread lengths) forward and backward, packed and padded, with and without activation checkpointing; each op is
counted once as it is dispatched (TorchDispatchMode), views left out. Per layer = (ops at 3 layers - ops at 1) / 2,
so the embedding, the head and the loss drop out; the attention function's own forward ops are counted apart.
"""

import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.environ.get("MINIGDPO_ROOT", os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minigdpo import logprobs  # noqa: E402
try:
    from tests.microbatches import micro_batches  # noqa: E402
except ImportError:  # a checkout from before micro_batches moved from minigdpo/microbatch.py to tests/
    from minigdpo.microbatch import micro_batches  # noqa: E402
from minigdpo.sampler import Completion  # noqa: E402


class Count(TorchDispatchMode):
    """Non-view aten ops dispatched, in all and inside the attention function's forward."""

    def __init__(self):
        super().__init__()
        self.ops, self.in_attention, self.attending = 0, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops += 1
            self.in_attention += self.attending
        return func(*args, **(kwargs or {}))


def model(layers, checkpointing):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(config)
    if checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.train()
    return logprobs.LogProbModel(lm)


def batch(layout):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (int(n),), generator=g).tolist() for n in (20, 35, 50, 65)]
    lengths = torch.randint(5, 60, (16,), generator=g).tolist()
    comps = [Completion(torch.randint(0, 500, (n,), generator=g).tolist(), [0.0] * n) for n in lengths]
    (mb,) = micro_batches([p for p in prompts for _ in range(4)], comps, torch.zeros(16), 16, 0, torch.device("cpu"),
                          4, layout)
    return mb


def count(layers, layout, checkpointing):
    m, mb = model(layers, checkpointing), batch(layout)
    attention = logprobs.packed_attention
    counter = Count()

    def watched(*args, **kwargs):
        counter.attending = True
        try:
            return attention(*args, **kwargs)
        finally:
            counter.attending = False

    from transformers import AttentionInterface

    AttentionInterface.register(logprobs.PACKED, watched)
    try:
        with counter:
            logp = m(mb)
        forward, in_attention = counter.ops, counter.in_attention
        with counter:
            (logp * mb.mask).sum().backward()
    finally:
        AttentionInterface.register(logprobs.PACKED, attention)
    return forward, in_attention, counter.ops - forward


def main():
    print(f"checkout: {sys.path[0]}")
    print(f"{'layout':<8} {'checkpointing':<14} {'forward':>8} {'in attention':>13} {'backward':>9}   per layer")
    for layout in ("packed", "padded"):
        for ckpt in (False, True):
            one, three = count(1, layout, ckpt), count(3, layout, ckpt)
            per = [(b - a) / 2 for a, b in zip(one, three)]
            print(f"{layout:<8} {str(ckpt):<14} {per[0]:>8.0f} {per[1]:>13.0f} {per[2]:>9.0f}")


if __name__ == "__main__":
    main()
