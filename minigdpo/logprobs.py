"""Per-token log-probs of completions under the policy: the textbook version, and the fast one.

Shape legend: b prompts, n completions (sequences), P prompt columns, T completion columns,
K valid completion tokens, H hidden size, V vocabulary.

The textbook version (`naive_logprobs`) runs each full sequence (prompt + completion) through the
model and takes log_softmax(logits / temperature).gather(target). The fast one (`LogProbModel`)
computes exactly the same numbers, and is the test oracle's subject, with three savings:

- the head runs on chunks of valid tokens (`ChunkedLogProbs`): a (n, T, V) float32 logits tensor
  never exists, which matters with a 150k vocabulary;
- the shared prefix: a group's G completions share their prompt, and a prompt token never attends to a
  completion, so each distinct prompt runs through each decoder layer once and its keys and values serve
  all G completions. The prompt costs 1/G;
- no padding (`packed_hidden_states`): a micro-batch's prompts and completions are one row of tokens for
  the projections, norms and MLP, and only attention sees them in padded rows (--padding-free false keeps
  the padding in the row, which computes the same numbers at its cost).

`LogProbModel` wraps the Hugging Face model and is the FSDP2 root (dist.shard), so the embedding
and the head are gathered by the root's own hooks; `whole_weights` streams its weights out, whole, under
their Hugging Face names (for the sampler and the exports).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface

from minigdpo import dist
from minigdpo.sampler import tied_names

PREFIX_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # whose forward the shared-prefix pass reproduces
PREFIX_ATTENTION = ("sdpa", "eager")


def naive_logprobs(lm, prompt_ids, prompt_mask, repeats, completion_ids, completion_mask, temperature=1.0):
    """The textbook formula on full sequences: log_softmax(logits / temperature).gather(next token), (n, T)."""
    index = torch.repeat_interleave(torch.arange(len(repeats), device=prompt_ids.device), repeats)  # (n,)
    ids = torch.cat([prompt_ids[index], completion_ids], 1)                # (n, P+T)
    attn = torch.cat([prompt_mask[index], torch.ones_like(completion_ids)], 1)  # (n, P+T)
    logits = lm(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                use_cache=False).logits[:, -completion_ids.shape[1] - 1:-1].float()  # (n, T, V)
    logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, completion_ids[..., None]).squeeze(-1)  # (n, T)
    return logp * completion_mask


# The head, chunk by chunk ----------------------------------------------------------------------

class ChunkedLogProbs(torch.autograd.Function):
    """log softmax(hidden @ weight.T / temperature)[targets], `chunk` tokens at a time.

    Forward keeps only the (K,) log-sum-exp per token, never the (K, V) logits; backward recomputes
    each chunk's logits and forms the gradient d logp / d logits = onehot - softmax in place. So at
    most one (chunk, V) float32 block is alive, forward or backward, and the entropy comes from the
    same logits at no extra matmul. Every matmul runs in the compute dtype, with fp32 output
    (_mm_fp32_out); a frozen head (LoRA) gets no weight gradient.
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


# The shared-prefix pass ------------------------------------------------------------------------

def shares_prefix(lm):
    """Whether the shared-prefix pass reproduces lm's own forward: a known model type, no sliding-window
    layers, and an attention kernel that takes a 4-D mask (sdpa, eager). Other models run full sequences."""
    config = lm.config
    return (config.model_type in PREFIX_MODEL_TYPES
            and all(t == "full_attention" for t in getattr(config, "layer_types", None) or ["full_attention"])
            and getattr(config, "_attn_implementation", None) in PREFIX_ATTENTION)


# The packed pass -------------------------------------------------------------------------------

PACKED = "minigdpo_packed"  # the attention implementation the packed pass swaps in, layer by layer


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention over a packed row, as transformers calls an attention function: query (1, h, L, d), key and
    value (1, kv, L, d), attention_mask a Packed layout. The projections, norms and MLP ran on the L packed tokens;
    here they are copied into padded rows (prompts (b, P); completions (N, T), their prompt's keys in front), SDPA
    runs on those with the shared-prefix pass's masks, and the outputs are read back into the packed row.
    Copies in and reads out are index_copy and index_select, whose backwards are a gather and an index_add over
    distinct rows: an indexing that sent every padding slot to one row would accumulate their gradients into it
    one atomic add at a time on a GPU."""
    pk, h, d, kv = attention_mask, query.shape[1], query.shape[-1], key.shape[1]
    (b, _, P, _), (N, _, T, _) = pk.prompt_attn.shape, pk.tail_attn.shape
    Lp = pk.prompt_tokens

    def rows(x, part, dest, n, width):  # (1, heads, L, d) -> (n, width, heads, d): part's tokens at dest, else 0
        flat = x[0, :, part].transpose(0, 1)                               # (tokens, heads, d)
        return flat.new_zeros(n * width, x.shape[1], d).index_copy(0, dest, flat).view(n, width, x.shape[1], d)

    def attend(q, k, v, mask):  # q (r, s, h, d); k, v (r, u, kv, d) -> (r * s, h, d)
        k, v = (t.transpose(1, 2).repeat_interleave(h // kv, dim=1) for t in (k, v))  # (r, h, u, d)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
        return out.transpose(1, 2).reshape(-1, h, d)                       # (r * s, h, d)

    prompts, tails = slice(0, Lp), slice(Lp, None)
    k_p, v_p = (rows(t, prompts, pk.prompt_dest, b, P) for t in (key, value))               # (b, P, kv, d)
    out_p = attend(rows(query, prompts, pk.prompt_dest, b, P), k_p, v_p, pk.prompt_attn)    # (b * P, h, d)
    k_t, v_t = (torch.cat([mine.index_select(0, pk.owner), rows(t, tails, pk.tail_dest, N, T)], dim=1)
                for mine, t in ((k_p, key), (v_p, value)))                                 # (N, P + T, kv, d)
    out_t = attend(rows(query, tails, pk.tail_dest, N, T), k_t, v_t, pk.tail_attn)          # (N * T, h, d)
    out = torch.cat([out_p.index_select(0, pk.prompt_dest), out_t.index_select(0, pk.tail_dest)])  # (L, h, d)
    return out[None], None


AttentionInterface.register(PACKED, packed_attention)


def layer_packed(layer, hidden, packed, position_embeddings):
    """One decoder layer over a packed row (1, L, H), its attention through packed_attention. A forward method
    of its own (dist.shard registers it): FSDP2 gathers the layer once per call, and checkpointing can run it
    again. layer.forward, not layer(): the module call would run FSDP2's hooks (and transformers' checkpointing)
    again inside this one."""
    config = layer.self_attn.config
    kept, config._attn_implementation = config._attn_implementation, PACKED
    try:
        return layer.forward(hidden, attention_mask=packed, position_ids=packed.positions,
                             position_embeddings=position_embeddings)
    finally:
        config._attn_implementation = kept


def packed_hidden_states(lm, packed):
    """Final hidden states before each completion token, (K, H), from the packed row: the model's own layers
    (embed, rotary embeddings at each token's own position, decoder layers, final norm) on L tokens."""
    base = lm.base_model
    hidden = base.embed_tokens(packed.ids)                                 # (1, L, H)
    position_embeddings = base.rotary_emb(hidden, packed.positions)
    recompute = lm.is_gradient_checkpointing and lm.training and torch.is_grad_enabled()
    for layer in base.layers:
        if recompute:
            hidden = checkpoint(layer.layer_packed, hidden, packed, position_embeddings, use_reentrant=False)
        else:
            hidden = layer.layer_packed(hidden, packed, position_embeddings)
    return base.norm(hidden)[0, packed.before]                             # (K, H)


# The model ----------------------------------------------------------------------------------------

def decoder_layers(lm):
    """The repeated blocks FSDP2 shards one by one (model.layers for Llama/Qwen/Mistral, h for GPT-2)."""
    base = lm.base_model
    for attr in ("layers", "h", "blocks"):
        if isinstance(getattr(base, attr, None), nn.ModuleList):
            return list(getattr(base, attr))
    raise ValueError(f"cannot find the decoder layers of {type(lm).__name__}")


class LogProbModel(nn.Module):
    """forward(micro-batch) -> per-token log-probs (N, T) of its completion tokens: exactly naive_logprobs, and its
    gradients, at 1/G of the prompt's cost and without (N, T, V) logits; with a packed layout, without padding."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.shares_prefix = shares_prefix(lm)  # also: it can pack (the same forward, laid out otherwise)
        self.lora = False  # policy.build sets it when peft's adapters are in lm: whole_weights then merges them
        if self.shares_prefix:
            for layer in decoder_layers(lm):
                layer.layer_packed = layer_packed.__get__(layer)

    def forward(self, mb, temperature=1.0, chunk=1024, entropy=False):
        """mb: a MicroBatch (minigdpo/microbatch.py). Returns (N, T) log-probs, and entropies with entropy=True."""
        if self.shares_prefix and mb.packed is not None:
            hidden = packed_hidden_states(self.lm, mb.packed)                   # (K, H)
        else:  # one full sequence per completion
            hidden = self.full_sequences(mb)                                    # (N, T, H)
            hidden = hidden.reshape(-1, hidden.shape[-1])[mb.out_index]         # (K, H)
        weight = self.lm.get_output_embeddings().weight                         # (V, H)
        lp, ent = chunked_logprobs(hidden, weight, mb.targets, temperature, chunk, entropy)  # (K,)
        T = mb.completion_ids.shape[1]
        where = (mb.out_index // T, mb.out_index % T)                          # (K,), (K,)
        out = lp.new_zeros(mb.completion_ids.shape).index_put(where, lp)       # (N, T)
        if not entropy:
            return out
        return out, ent.new_zeros(mb.completion_ids.shape).index_put(where, ent)

    def full_sequences(self, mb):
        index = torch.repeat_interleave(torch.arange(len(mb.repeats), device=mb.repeats.device), mb.repeats)  # (N,)
        T = mb.completion_ids.shape[1]
        ids = torch.cat([mb.prompt_ids[index], mb.completion_ids], 1)                           # (N, P+T)
        attn = torch.cat([mb.prompt_mask[index], torch.ones_like(mb.completion_ids)], 1)        # (N, P+T)
        return self.lm.base_model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                                  use_cache=False).last_hidden_state[:, -T - 1:-1]              # (N, T, H)

    def whole_weights(self, dtype=None, main_only=False):
        """Yield (Hugging Face name, whole tensor) one parameter at a time, in `dtype` when given.

        Memory stays bounded by one full tensor. Tied weights appear once, under the first name (the
        input embedding), as in Hugging Face checkpoints. Every rank must iterate to the end, in the same
        order: each step is a collective. main_only=True gathers each tensor on rank 0 alone (the other
        ranks get None), for a writer that only rank 0 runs. A LoRA model yields its merged weights
        under the base model's names (lora.merged_state).
        """
        tied = self.tied_names()
        if self.lora:
            from minigdpo import lora  # minigdpo/lora.py imports only dist: no circle

            yield from lora.merged_state(self.lm, dtype, tied, main_only)
            return
        for name, t in self.lm.state_dict(keep_vars=True).items():
            if name not in tied:  # cast first: fewer bytes to gather
                yield name, dist.full_tensor(t.detach().to(dtype) if dtype is not None else t.detach(), main_only)

    def tied_names(self):
        """Names that share storage with an earlier name, e.g. lm_head.weight -> model.embed_tokens.weight."""
        return tied_names(self.lm)
