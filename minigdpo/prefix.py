"""The shared-prefix pass: hidden states of G completions per prompt, running each prompt once.

A group's G completions share their prompt, and a prompt token never attends to a completion. So the
prompt rows (b, P) run through each decoder layer once, their keys and values are copied to the
group's n completion rows, and the completion rows (n, T) attend to them. The hidden states, and
their gradients, are exactly those of n full sequences (P + T), for 1/G of the prompt's compute.

Both run in ONE call per decoder layer (`layer_pair`): the prompt rows, then the completion rows.
Under FSDP2 each call of a layer gathers its parameters once in the forward and once in the backward.
Two passes over the model, prompts then completions, would call every layer twice, gathering each
layer twice each way; the backward of the completions would also run through all the layers before
that of the prompts starts. policy.build registers layer_pair with FSDP2 as a forward method.

The layer loop is written here rather than left to the model's forward, so it covers the model
types whose forward is exactly: embed, rotary position embeddings, decoder layers with a causal
mask, final norm (MODEL_TYPES, full attention only). Other models run full sequences.
"""

import torch

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ATTENTION = ("sdpa", "eager")


def supported(lm):
    """Whether the shared-prefix pass reproduces lm's own forward: a known model type, no sliding-window
    layers, and an attention kernel that takes a 4-D mask (sdpa, eager)."""
    config = lm.config
    return (config.model_type in MODEL_TYPES
            and all(t == "full_attention" for t in getattr(config, "layer_types", None) or ["full_attention"])
            and getattr(config, "_attn_implementation", None) in ATTENTION)


def attach(layers):
    """Give each decoder layer its layer_pair method (FSDP2 then wraps it with its gather and free)."""
    for layer in layers:
        layer.layer_pair = layer_pair.__get__(layer)


def layer_pair(layer, prompt, tail, cache, index, prompt_kwargs, tail_kwargs):
    """One decoder layer over the prompt rows (b, P, H), then over the completion rows (n, T, H).

    The prompt's keys and values land in the layer's cache entry (b rows), are copied to the n
    completion rows (index (n,): each row's prompt), and the completions attend to them.
    layer.forward, not layer(): the module call would run FSDP2's hooks again inside this call.
    """
    prompt = layer.forward(prompt, past_key_values=cache, use_cache=True, **prompt_kwargs)   # (b, P, H)
    cache.layers[layer.self_attn.layer_idx].batch_select_indices(index)  # (b, ...) -> (n, ...), differentiably
    tail = layer.forward(tail, past_key_values=cache, use_cache=True, **tail_kwargs)         # (n, T, H)
    return prompt, tail


def masks(prompt_mask, index, T, dtype, eager):
    """The attention masks of the two halves: prompts (b, 1, P, P) and completions (n, 1, T, P + T).

    Prompts are left-padded: a real token attends to the real tokens up to itself. A padding query
    attends to itself alone, so that no row is fully masked (a NaN under softmax); its output is never
    read. Completions attend to their prompt's real tokens and causally to themselves. sdpa takes
    True = attend; eager adds 0 or the dtype's minimum to the scores.
    """
    P, device = prompt_mask.shape[1], prompt_mask.device
    keep = prompt_mask.bool()                                              # (b, P)
    causal_p = torch.ones(P, P, dtype=torch.bool, device=device).tril()   # (P, P)
    eye = torch.eye(P, dtype=torch.bool, device=device)                    # (P, P)
    prompt = (causal_p & keep[:, None, :]) | eye                           # (b, P, P)
    causal_t = torch.ones(T, T, dtype=torch.bool, device=device).tril()   # (T, T)
    tail = torch.cat([keep[index, None, :].expand(-1, T, -1),              # (n, T, P)
                      causal_t.expand(len(index), -1, -1)], dim=2)         # (n, T, P + T)
    out = prompt[:, None], tail[:, None]                                   # (., 1, q, kv)
    if eager:
        low = torch.finfo(dtype).min
        out = tuple(torch.zeros(m.shape, dtype=dtype, device=device).masked_fill_(~m, low) for m in out)
    return out


def hidden_states(lm, prompt_ids, prompt_mask, index, completion_ids):
    """Final hidden states before each completion token, (n, T, H): the last prompt position's for the
    first token, then the completion's own. prompt_ids, prompt_mask: (b, P) left-padded;
    index: (n,) each completion's prompt; completion_ids: (n, T)."""
    from transformers import DynamicCache

    base = lm.base_model
    T = completion_ids.shape[1]
    prompt = base.embed_tokens(prompt_ids)                                 # (b, P, H)
    tail = base.embed_tokens(completion_ids)                               # (n, T, H)
    prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)                 # (b, P)
    tail_pos = prompt_mask.sum(-1)[index, None] + torch.arange(T, device=prompt_ids.device)  # (n, T)
    prompt_attn, tail_attn = masks(prompt_mask, index, T, prompt.dtype, lm.config._attn_implementation == "eager")
    prompt_kwargs = dict(attention_mask=prompt_attn, position_ids=prompt_pos,
                         position_embeddings=base.rotary_emb(prompt, prompt_pos))
    tail_kwargs = dict(attention_mask=tail_attn, position_ids=tail_pos,
                       position_embeddings=base.rotary_emb(tail, tail_pos))
    cache = DynamicCache(config=lm.config)
    for layer in base.layers:
        prompt, tail = layer.layer_pair(prompt, tail, cache, index, prompt_kwargs, tail_kwargs)
    prompt, tail = base.norm(prompt), base.norm(tail)
    return torch.cat([prompt[index, -1:], tail[:, :-1]], dim=1)          # (n, T, H)
