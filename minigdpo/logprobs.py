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

The fast pass runs only where `fast_pass_refusal` says it reproduces the model's forward; every other model runs its
own forward, head included, and each run checks itself once (`check_fast_pass`), a difference beyond rounding sending
it to its own forward for good: a model nobody tested is safe by construction (docs/performance.md, "Which models").

`LogProbModel` wraps the Hugging Face model and is the FSDP2 root (fsdp.shard), so the embedding
and the head are gathered by the root's own hooks; `whole_weights` streams its weights out, whole, under
their Hugging Face names (for the sampler and the exports).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface

from minigdpo import dist, fsdp, microbatch
from minigdpo.models import layer_windows
from minigdpo.sampler import Completion, tied_names


def naive_logprobs(lm, prompt_ids, prompt_mask, repeats, completion_ids, completion_mask, temperature=1.0,
                   entropy=False):
    """The textbook formula on full sequences: log_softmax(logits / temperature).gather(next token), (n, T); with
    entropy=True also each token's entropy (n, T), without gradient. The model's own forward, head included."""
    index = torch.repeat_interleave(torch.arange(len(repeats), device=prompt_ids.device), repeats)  # (n,)
    T = completion_ids.shape[1]
    ids = torch.cat([prompt_ids[index], completion_ids], 1)                # (n, P+T)
    attn = torch.cat([prompt_mask[index], torch.ones_like(completion_ids)], 1)  # (n, P+T)
    logits = lm(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0), use_cache=False,
                logits_to_keep=T + 1).logits[:, -(T + 1):-1].float()  # (n, T, V): a model may keep every position
    logp_all = torch.log_softmax(logits / temperature, dim=-1)              # (n, T, V)
    logp = logp_all.gather(-1, completion_ids[..., None]).squeeze(-1) * completion_mask  # (n, T)
    if not entropy:
        return logp
    with torch.no_grad():
        return logp, -(logp_all.exp() * logp_all).sum(-1) * completion_mask  # (n, T)


def own_logprobs(lm, prompt_ids, prompt_mask, repeats, completion_ids, completion_mask, temperature=1.0,
                 entropy=False, chunk=1024):
    """naive_logprobs, rows of about `chunk` completion tokens at a time (one row at least), each row block recomputed
    in the backward (checkpointed): the model's own forward, head included, without (n, T, V) logits for a whole
    micro-batch, in the forward or kept for the backward. The fallback of LogProbModel (fallback_line: its memory)."""
    index = torch.repeat_interleave(torch.arange(len(repeats), device=prompt_ids.device), repeats)  # (n,)
    rows = max(1, chunk // completion_ids.shape[1])
    def block(*args):
        out = naive_logprobs(lm, *args, entropy=entropy)
        return out if entropy else (out,)

    parts = []
    for s in range(0, len(index), rows):
        own = index[s:s + rows]                                               # (r,)
        args = (prompt_ids[own], prompt_mask[own], torch.ones_like(own), completion_ids[s:s + rows],
                completion_mask[s:s + rows], temperature)
        parts.append(checkpoint(block, *args, use_reentrant=False) if torch.is_grad_enabled() else block(*args))
    out = [torch.cat(column) for column in zip(*parts)]                       # (n, T) each
    return tuple(out) if entropy else out[0]


# The head, chunk by chunk ----------------------------------------------------------------------

class ChunkedLogProbs(torch.autograd.Function):
    """log softmax(hidden @ weight.T / temperature)[targets], `chunk` tokens at a time.

    Forward keeps only the (K,) log-sum-exp per token, never the (K, V) logits; backward recomputes each chunk's
    logits and forms the gradient d logp / d logits = onehot - softmax in place. So at most two (chunk, V) float32
    blocks are alive, forward or backward, and the entropy comes from the same logits at no extra matmul. Every matmul
    runs in the compute dtype, with fp32 output (_mm_fp32_out); a frozen head (LoRA) gets no weight gradient.
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
            top = logits.amax(-1, keepdim=True)                            # (k, 1)
            exps = (logits - top).exp_()                                   # (k, V) softmax, not yet normalised
            total = exps.sum(-1)                                           # (k,)
            lse[s:e] = total.log() + top.squeeze(-1)                       # torch.logsumexp, with one temporary
            logp[s:e] = logits.gather(-1, targets[s:e, None]).squeeze(-1) - lse[s:e]
            if entropy:  # lse - E[logit], >= 0 but for rounding
                ent[s:e] = (lse[s:e] - exps.mul_(logits).sum(-1) / total).clamp_(min=0)
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


# What the fast pass accepts -------------------------------------------------------------------------

# Forward: embed, rotary embeddings, decoder layers, norm and a plain head (tests/test_architectures.py)
FAST_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2")
FAST_ATTENTION = ("sdpa", "eager")  # the model's own kernel: one SDPA reproduces it
# Beyond rounding, by the largest and the mean |fast - own| per token (benchmarks/fast_pass_check.py)
FAST_PASS_BOUND = {torch.float32: {"max": 1e-4, "mean": 1e-5}, torch.bfloat16: {"max": 2.0, "mean": 0.1}}


def fast_pass_refusal(lm, context=None):
    """Why the fast pass (shared prefix, packed row, chunked head) would not reproduce lm's own forward, or "" where
    it does: the one rule. It accepts the model types of FAST_MODEL_TYPES, with a kernel of FAST_ATTENTION, and
    layers that attend fully or through a sliding window of any of the forms models.layer_windows reads (a banded
    mask here). A rotary scaling that picks its factor by the longest sequence of a pass (Phi-3's longrope, dynamic
    NTK) is refused where a sequence of `context` tokens (None: any) can pass its original length: packed, a short
    sequence would get the factor of its long mates. Every other model runs its own forward, head included."""
    config = lm.config
    if config.model_type not in FAST_MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {', '.join(FAST_MODEL_TYPES)}"
    if getattr(config, "_attn_implementation", None) not in FAST_ATTENTION:
        return f"attention kernel {config._attn_implementation!r} is not one of {', '.join(FAST_ATTENTION)}"
    rope = getattr(config, "rope_parameters", None) or {}
    for r in [rope] if "rope_type" in rope else [v for v in rope.values() if isinstance(v, dict)]:
        original = r.get("original_max_position_embeddings", config.max_position_embeddings)
        if r.get("rope_type") in ("longrope", "dynamic") and (context is None or context > original):
            return f"rope type {r['rope_type']!r} scales by the longest sequence of a pass, past {original} tokens"
    try:
        layer_windows(config)
    except ValueError as e:
        return str(e)
    return ""


# The packed pass -------------------------------------------------------------------------------

PACKED = "minigdpo_packed"  # the attention implementation the packed pass swaps in, layer by layer


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                     **kwargs):
    """Attention over a packed row, as transformers calls an attention function: query (1, h, L, d), key and
    value (1, kv, L, d), attention_mask a Packed layout with its biases. The projections, norms and MLP ran on the
    L packed tokens; here q, k and v are copied, in one index_copy, into padded rows (prompts (b, P); completions
    (N, T), their prompt's keys in front), the key-value heads repeated for their query heads, SDPA runs
    on those rows with the layer's bias (its sliding window, if any), and one index_select reads the outputs back
    into the packed row. Their backwards are a gather and an index_add over distinct rows, and splits, not slices,
    part the rows: no whole-row buffer of zeros in the backward. Few ops per layer: a host that issues kernels one
    at a time keeps up with the GPU (benchmarks/update_ops.py)."""
    pk, h, kv, d = attention_mask, query.shape[1], key.shape[1], query.shape[-1]
    prompt_bias, tail_bias = pk.bias[sliding_window]
    (b, _, P, _), (N, _, T, _) = prompt_bias.shape, tail_bias.shape
    qkv = torch.cat([query, key, value], dim=1).squeeze(0).transpose(0, 1)  # (L, h + 2kv, d)
    rows = qkv.new_zeros(b * P + N * T, h + 2 * kv, d).index_copy(0, pk.dest, qkv)  # (b*P + N*T, h + 2kv, d)
    q, kv_rows = rows.split([h, 2 * kv], dim=1)
    (q_p, q_t), (kv_p, kv_t) = q.split([b * P, N * T]), kv_rows.split([b * P, N * T])
    kv_p, kv_t = kv_p.view(b, P, 2 * kv, d), kv_t.view(N, T, 2 * kv, d)
    out_p = attend(q_p.view(b, P, h, d), kv_p, prompt_bias, dropout, scaling)                        # (b * P, h, d)
    out_t = attend(q_t.view(N, T, h, d), torch.cat([kv_p.index_select(0, pk.owner), kv_t], dim=1), tail_bias,
                   dropout, scaling)                                                                 # (N * T, h, d)
    return torch.cat([out_p, out_t]).index_select(0, pk.dest)[None], None  # (1, L, h, d)


def attend(q, kv, bias, dropout, scaling):
    """SDPA of q (r, s, h, d) over keys and values kv (r, u, 2 kv heads, d), with an additive bias (r, 1, s, u): the
    key-value heads repeated for their query heads, one copy each of k and v, of these rows only (contiguous: a
    compiled layer's backward met strided views of one joint copy with the wrong strides)."""
    (r, s, h, d), u = q.shape, kv.shape[1]
    k, v = (t.transpose(1, 2)[:, :, None].expand(-1, -1, h * 2 // kv.shape[2], -1, -1).reshape(r, h, u, d)
            for t in kv.chunk(2, dim=2))                                   # (r, h, u, d) each, contiguous
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=bias, dropout_p=dropout,
                                         scale=scaling)                                              # (r, h, s, d)
    return out.transpose(1, 2).reshape(r * s, h, d)                        # (r * s, h, d)


AttentionInterface.register(PACKED, packed_attention)


def layer_packed(layer, hidden, packed, position_embeddings):
    """One decoder layer over a packed row (1, L, H), its attention through packed_attention. A forward method
    of its own (fsdp.shard registers it): FSDP2 gathers the layer once per call, and checkpointing can run it
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
    (embed, rotary embeddings at each token's own position, decoder layers, final norm) on L tokens. The attention
    biases are made here, once per pass and window, and live as long as the pass needs them (its backward)."""
    base = lm.base_model
    hidden = base.embed_tokens(packed.ids)                                 # (1, L, H)
    position_embeddings = base.rotary_emb(hidden, packed.positions)
    packed = packed.attending(hidden.dtype, set(layer_windows(lm.config)))
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
    """forward(micro-batch) -> per-token log-probs (N, T) of its completion tokens. With the fast pass (`fast`):
    exactly naive_logprobs, and its gradients, at 1/G of the prompt's cost and without (N, T, V) logits; with a
    packed layout, without padding. Otherwise (fast_pass_refusal, or check_fast_pass) naive_logprobs itself."""

    def __init__(self, lm, context=None):
        super().__init__()
        self.lm = lm
        self.refusal = fast_pass_refusal(lm, context)  # "" where the fast pass reproduces lm's own forward
        self.fast = not self.refusal
        self.has_adapters = False  # policy.build sets it where peft's adapters are in lm (whole_weights reads it)
        if self.fast:
            for layer in decoder_layers(lm):
                layer.layer_packed = layer_packed.__get__(layer)

    def compile_layers(self):
        """torch.compile each decoder layer's own forward, with dynamic shapes: the layer's math alone. FSDP2's
        collectives run in the hooks around it (layer_packed, which fsdp.shard registers, calls layer.forward),
        checkpointing wraps it, the attention kernel is chosen outside it, the head and the loss stay eager. A layer
        compiles once per kind of call (packed or its own forward; with or without gradient; its window)."""
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # the kinds above
        for layer in decoder_layers(self.lm):
            layer.forward = torch.compile(layer.forward, dynamic=True)

    def forward(self, mb, temperature=1.0, chunk=1024, entropy=False):
        """mb: a MicroBatch (minigdpo/microbatch.py). Returns (N, T) log-probs, and entropies with entropy=True."""
        T = mb.completion_ids.shape[1]
        if not self.fast or mb.packed is None:  # the model's own forward, head included, on full sequences
            valid = torch.zeros(mb.completion_ids.numel(), device=mb.out_index.device).index_fill_(
                0, mb.out_index, 1.0).view(-1, T)                                # (N, T) the completion tokens
            return own_logprobs(self.lm, mb.prompt_ids, mb.prompt_mask, mb.repeats, mb.completion_ids, valid,
                                temperature, entropy, chunk)
        hidden = packed_hidden_states(self.lm, mb.packed)                       # (K, H)
        weight = self.lm.get_output_embeddings().weight                         # (V, H)
        lp, ent = chunked_logprobs(hidden, weight, mb.targets, temperature, chunk, entropy)  # (K,)
        where = (mb.out_index // T, mb.out_index % T)                          # (K,), (K,)
        out = lp.new_zeros(mb.completion_ids.shape).index_put(where, lp)       # (N, T)
        return (out, ent.new_zeros(mb.completion_ids.shape).index_put(where, ent)) if entropy else out

    def whole_weights(self, dtype=None, main_only=False, adapters_only=False):
        """Yield (Hugging Face name, whole tensor) one parameter at a time, in `dtype` when given.

        Memory stays bounded by one full tensor. Tied weights appear once, under the first name (the
        input embedding), as in Hugging Face checkpoints. Every rank must iterate to the end, in the same
        order: each step is a collective. main_only=True gathers each tensor on rank 0 alone (the other
        ranks get None), for a writer that only rank 0 runs. A LoRA model yields its merged weights
        under the base model's names (lora.merged_state), or with adapters_only=True its adapters alone.
        """
        tied = self.tied_names()
        if self.has_adapters:
            from minigdpo import lora  # minigdpo/lora.py imports only dist: no circle

            yield from (lora.adapter_weights(self.lm, dtype) if adapters_only
                        else lora.merged_state(self.lm, dtype, tied, main_only))
            return
        for name, t in self.lm.state_dict(keep_vars=True).items():
            if name not in tied:  # cast first: fewer bytes to gather
                yield name, dist.full_tensor(t.detach().to(dtype) if dtype is not None else t.detach(), main_only)

    def tied_names(self):
        """Names that share storage with an earlier name, e.g. lm_head.weight -> model.embed_tokens.weight."""
        return tied_names(self.lm)

    def fallback_line(self, chunk, max_new_tokens):
        """The line a run prints when the model runs its own forward, with the logits that costs at most per pass."""
        rows = max(1, chunk // max_new_tokens)
        mib = rows * (max_new_tokens + 1) * self.lm.config.get_text_config().vocab_size * 4 * 3 / 2**20
        return (f"log-probs: the model's own forward on full sequences ({self.refusal}: the fast pass does not "
                f"reproduce it), {rows} row(s) at a time: up to {mib:,.0f} MiB of fp32 logits per pass "
                "(--logprob-chunk); --padding-free does nothing; --micro-batch-tokens counts prompts per completion")


def check_batch(model, groups, pad_id, device, layout, max_len=None):
    """The micro-batch a run checks its fast pass on: the 4 longest completions of its first group (where a window
    binds first), and, where every one of them ends within the model's smallest sliding window, one more whose tokens
    repeat the group's until it passes that window by a quarter (within max_len positions, default the model's)."""
    prompt, comps, adv = groups[0]
    rows = sorted(range(len(comps)), key=lambda j: -len(comps[j].token_ids))[:4]
    picked, adv = [comps[j] for j in rows], adv[rows]
    windows = [w for w in layer_windows(model.lm.config) if w]
    max_len = max_len or model.lm.config.max_position_embeddings
    if windows and len(prompt) + len(picked[0].token_ids) <= min(windows):
        tokens = [t for c in picked for t in c.token_ids] or [pad_id]
        n = min(min(windows) + max(16, min(windows) // 4), max_len) - len(prompt)
        picked, adv = picked + [Completion((tokens * n)[:n], [0.0] * n)], torch.cat([adv, adv[:1]])
    return microbatch.build([(prompt, picked, adv)], pad_id, device, layout)


@torch.no_grad()
def check_fast_pass(model, mb, temperature, bound):
    """The run checks itself once: |fast pass - the model's own forward| over a micro-batch's counted tokens, its
    largest and its mean, of every rank's, both in eval mode (no dropout: LoRA's would differ between the passes);
    beyond either `bound` (FAST_PASS_BOUND) the model runs its own forward for good. Every rank calls it."""
    training = model.training
    model.eval()
    try:
        fast = model(mb, temperature)                                       # (N, T)
        model.fast = False
        own = model(mb, temperature)                                        # (N, T)
    finally:
        model.train(training)
    fsdp.reshard(model)  # no backward follows: free what the root keeps gathered for one
    diff = (fast - own).abs() * mb.mask                                     # (N, T)
    sums = dist.all_reduce(torch.stack([diff.sum(), mb.mask.sum()]).double())
    found = {"max": dist.all_reduce(diff.max().double(), op="max").item(), "mean": (sums[0] / sums[1]).item()}
    model.fast = all(found[k] <= bound[k] for k in bound)
    return found
