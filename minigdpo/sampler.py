"""Rollout samplers behind one small interface, and the Hugging Face backend.

    sampler.generate(prompt_token_ids, n, params) -> [[Completion] * n for each prompt]
    sampler.load_weights(named_tensors)           # the trainer's new weights, by HF name (with LoRA and
                                                  # sampler.adapters_only: the adapters alone, by peft's names)
    sampler.sleep(); sampler.wake()               # free and restore accelerator memory

A Completion holds the sampled token ids (ending with the stop token when one was drawn),
the log-prob of each under the sampling distribution at the given temperature (before
top-p truncation, the same quantity the trainer recomputes), and why it ended. vLLM reports
its log-probs after top-p truncation instead, which is why vllm_sampler.check_sampler refuses
--top-p below 1 with vLLM.

The vLLM backend lives in minigdpo/vllm_sampler.py, with `make_sampler`, which picks one of the two.

Shape legend: B prompts, n samples per prompt, N = B * n rows, P prompt columns, V vocab.
"""

from dataclasses import dataclass, field
from functools import partial

import torch
from transformers import AttentionInterface, Cache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from minigdpo.lora import is_adapter
from minigdpo.models import layer_windows


@dataclass
class SamplingParams:
    temperature: float = 1.0   # 0 means greedy
    top_p: float = 1.0
    max_new_tokens: int = 256  # or one limit per prompt (a list: the tool loop's remaining budgets)
    seed: int = 0              # the same seed and weights give the same completions
    ignore_eos: bool = False   # keep going past stop tokens (benchmarks use fixed lengths)


@dataclass
class Completion:
    token_ids: list
    logprobs: list
    finish_reason: str = "length"  # "stop" when a stop token ended it
    text: str = field(default="", repr=False)
    extra: dict = field(default_factory=dict, repr=False)  # a TRL-style reward's log_extra values (samples.jsonl)
    # A tool loop's rollout (minigdpo/tools.py): 1 where the model wrote the token, 0 on tools' and the template's;
    # the conversation after the prompt; the tokens of its own prompt that lead token_ids (0 but with environments)
    tool_mask: list = field(default=None, repr=False)
    messages: list = field(default=None, repr=False)
    prompt_tokens: int = 0
    tool_counts: tuple = (0, 0)  # a tool loop's rollout: its (calls, failed calls)

    @property
    def written(self):
        """The tokens the model wrote: what the loss, the KL and the lengths count."""
        return len(self.token_ids) if self.tool_mask is None else sum(self.tool_mask)


class WeightSyncError(RuntimeError):
    """A weight sync that would leave some of the sampler's weights stale; the message names them."""


def tied_names(lm):
    """Names in `lm`'s state dict that share storage with an earlier name, e.g. lm_head.weight ->
    model.embed_tokens.weight."""
    first, tied = {}, {}
    for name, t in lm.state_dict(keep_vars=True).items():
        if id(t) in first:
            tied[name] = first[id(t)]
        else:
            first[id(t)] = name
    return tied


def check_sync(expected, sent):
    """WeightSyncError naming every expected weight the trainer did not send (it would stay stale)."""
    missing = [n for n in expected if n not in set(sent)]
    if missing:
        raise WeightSyncError(f"weight sync sent no tensor for {', '.join(missing[:5])}"
                              f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}: "
                              "the sampler would keep stale weights there")


def left_pad(prompts, pad_id, device):
    """(B, P) token ids and attention mask for prompts of different lengths."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)      # (B, P)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)            # (B, P)
    for i, p in enumerate(prompts):
        if p:
            ids[i, P - len(p):] = torch.tensor(p)
            mask[i, P - len(p):] = 1
    return ids.to(device), mask.to(device)


def common_prefix(prompts):
    """Length of the longest token prefix all prompts share."""
    first, n = prompts[0], min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != first[i] for p in prompts):
            return i
    return n


def sample_next(logits, params, generator):
    """Draw one token per row from (N, V) logits; returns tokens and their log-probs (N,).

    The log-prob is under softmax(logits / temperature), before top-p truncation. Sampling
    inverts the CDF with one cumsum and a binary search: exact, and a few full-vocabulary
    passes cheaper than torch.multinomial, which matters with a 150k vocabulary.
    """
    logits = logits.float()                                            # (N, V), ours to modify
    if params.temperature == 0:
        tokens = logits.argmax(-1)                                     # (N,)
    elif params.temperature != 1.0:
        logits = logits / params.temperature
    lse = torch.logsumexp(logits, -1, keepdim=True)                    # (N, 1)
    if params.temperature != 0:
        probs = (logits - lse).exp_()                                  # (N, V)
        if params.top_p < 1.0:
            sorted_p, order = probs.sort(-1, descending=True)          # (N, V)
            sorted_p.masked_fill_(sorted_p.cumsum(-1) - sorted_p > params.top_p, 0.0)  # beyond the nucleus
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        cdf = probs.cumsum_(-1)                                        # (N, V)
        u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, u).squeeze(-1).clamp_(max=cdf.shape[1] - 1)  # (N,)
    return tokens, (logits.gather(-1, tokens[:, None]) - lse).squeeze(-1)


def sync_every(device):
    """Decode steps between the HF sampler's checks for "every row stopped". On an accelerator each
    check waits for the device, so it asks every 16 steps and finished rows run up to 15 steps more.
    On the CPU the check costs nothing (every step has already run), and the extra steps would not:
    it asks at every step."""
    return 1 if device.type == "cpu" else 16


def decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """A decode step's attention: one new token a row (N, H, 1, D) against its cache (N, K, L, D) under the sampler's
    (N, 1, 1, L) padding mask, each key head with its H / K query heads in one matmul, no repeated copy of the cache,
    a softmax in fp32 (SDPA's CPU kernels took 4-20x as long: docs/performance.md). Any other call is SDPA's."""
    (N, H, T, D), K = query.shape, key.shape[1]
    if T > 1 or attention_mask is None or attention_mask.dtype != torch.bool or dropout or kwargs.get("softcap") \
            or kwargs.get("s_aux") is not None:  # a prefill, softcapping, attention sinks
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if key.device.type == "cpu" and key.dtype != torch.float32:  # bf16 matmuls there: 1.7x as long on strided keys
        key, value = key.contiguous(), value.contiguous()  # (RoomyLayer's) as on a copy: benchmarks/decode_attention.py
    scores = (query.view(N, K, H // K, D) @ key.transpose(2, 3)).float() * (scaling or D**-0.5)  # (N, K, H / K, L)
    probs = scores.masked_fill(~attention_mask, float("-inf")).softmax(-1).to(value.dtype)    # mask: (N, 1, 1, L)
    return (probs @ value).view(N, 1, H, D), None                                           # SDPA's: (N, 1, H, D)


class RoomyLayer(DynamicLayer):
    """A full-attention layer's KV cache with room for `room` more tokens: each token's keys and values are written in
    place, where DynamicLayer copies the whole cache to append them, at every token of every layer. The room is the
    longest completion's, set aside when the decode starts (docs/performance.md, "the generation, op by op")."""

    def __init__(self, room):
        super().__init__()
        self.room, self.held, self.buffers = room, None, ()

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if self.keys is not self.held or end > self.buffers[0].shape[-2]:  # new, batch_repeat_interleave'd or full
            old = (self.keys, self.values) if start else ()
            self.buffers = [s.new_empty((*s.shape[:-2], end + self.room, s.shape[-1]))
                            for s in (key_states, value_states)]
            for buffer, s in zip(self.buffers, old):
                buffer[..., :start, :] = s
        for buffer, s in zip(self.buffers, (key_states, value_states)):
            buffer[..., start:end, :] = s
        self.keys, self.values = (buffer[..., :end, :] for buffer in self.buffers)
        self.held = self.keys
        return self.keys, self.values


DECODE = "minigdpo_decode"  # the HF sampler's attention kernel where SDPA's mask applies (HFSampler.__init__)
AttentionInterface.register(DECODE, decode_attention)
AttentionMaskInterface.register(DECODE, sdpa_mask)  # a prefill's mask, made for SDPA


class HFSampler:
    """Batched sampling with a plain (unsharded) Hugging Face model and its KV cache.

    The prompts' common prefix is prefilled once, each prompt's own tokens once, and each
    prompt's cache is copied to its n samples. Every sequence stops at its own stop token;
    the batch ends when all have stopped or at max_new_tokens.
    The model is a separate inference copy: `load_weights` refreshes it after each update.
    """

    def __init__(self, model, stop_ids, pad_id, device, tokenizer=None):
        self.model = model.to(device).eval()
        self.model.config.use_cache = True
        # A sliding window counts cache slots, padding included, and transformers keeps only the window's slots of
        # such a layer: those models get no padding between the prompts' shared prefix and their own tokens, and
        # the 2-D mask, which transformers fits to each layer's cache.
        try:
            self.full_attention = not any(layer_windows(model.config))
        except ValueError:  # a kind of layer layer_windows does not know: no sharing
            self.full_attention = False
        if self.full_attention and getattr(model.config, "_attn_implementation", None) == "sdpa":
            model.config._attn_implementation = DECODE  # this copy's own config: the trainer's stays as it was
        # With peft's LoRA layers in the model (make_sampler), a sync sends the adapters alone: the base weights
        # stay those of the checkpoint, as the trainer's frozen base does.
        self.adapters_only = hasattr(model, "peft_config")
        tied = tied_names(model)  # a sync sends each tied weight once, under its first name (the input embedding)
        self.expected = [n for n in model.state_dict(keep_vars=True)
                         if n not in tied and (not self.adapters_only or is_adapter(n))]
        self.stop_ids = torch.tensor(sorted(stop_ids), device=device)
        self.pad_id, self.device, self.tokenizer = pad_id, device, tokenizer
        self.offloaded, self.discarded, self.shapes = False, False, {}  # sleep(): moved off the accelerator, or dropped
        self.sync_every = sync_every(device)  # decode steps between host checks for "every row stopped"

    @torch.no_grad()
    def generate(self, prompts, n, params):
        if self.discarded:  # it would sample from empty weights
            raise WeightSyncError("generate() after sleep() dropped the weights, with no load_weights() since")
        self.wake()  # back on the accelerator if sleep() moved it off and no weight sync brought it back
        B, T = len(prompts), params.max_new_tokens
        limits = torch.tensor(T if isinstance(T, list) else [T] * B, device=self.device).repeat_interleave(n)  # (N,)
        cache, logits, mask = self._prefill(prompts, int(limits.max()))     # (B, V), (B, P)
        if n > 1:  # share the prefill: copy each prompt's cache to its n samples
            cache.batch_repeat_interleave(n)
            logits, mask = logits.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)  # (N, V), (N, P)
        N = B * n
        next_pos = mask.sum(-1)                                             # (N,)
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        tokens = torch.full((N, int(limits.max())), self.pad_id, dtype=torch.long, device=self.device)  # (N, T)
        logps = torch.zeros(tokens.shape, device=self.device)
        done = torch.zeros(N, dtype=torch.bool, device=self.device)        # (N,)
        lengths = limits.clone()                                           # (N,) each row's own limit
        for t in range(tokens.shape[1]):
            tok, lp = sample_next(logits, params, generator)                # (N,), (N,)
            tok = torch.where(done, self.pad_id, tok)
            tokens[:, t], logps[:, t] = tok, torch.where(done, 0.0, lp)
            if not params.ignore_eos:
                stopped = ~done & torch.isin(tok, self.stop_ids)
                lengths = torch.where(stopped, t + 1, lengths)
                done |= stopped
            done |= t + 1 >= limits  # a row at its own limit is done
            # bool() waits for an accelerator: there, ask every sync_every steps. The extra steps of
            # finished rows write padding beyond their lengths, so the completions are the same.
            if (t + 1) % self.sync_every == 0 and bool(done.all()):
                break
            # Rows that are done feed padding; their outputs are never read, so the new column can be all ones.
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (N, P + t + 1)
            # decode_attention's mask, (N, 1, 1, L): a 4-D mask is used as it is, where transformers reads a 2-D one
            # on the host (masking_utils.fast_all) to see whether it may drop it, a sync per token. Others: 2-D.
            kernel_mask = mask[:, None, None, :].bool() if self.model.config._attn_implementation == DECODE else mask
            out = self.model(input_ids=tok[:, None], attention_mask=kernel_mask,
                             position_ids=next_pos[:, None],
                             past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
            next_pos = next_pos + 1
        return self._completions(tokens.cpu(), logps.cpu(), lengths.cpu(), B, n)

    def _prefill(self, prompts, room):
        """Run the prompts through the model: the KV cache, the logits of each prompt's last token
        (B, V), and the (B, P) mask of the positions the cache holds (0 = padding).

        The prompts' longest common prefix (a task's system prompt and examples, often most of a
        prompt) runs once, and its cache is copied to every row; then each prompt's own tokens run
        after it, left-padded, so the padding sits between the two. Positions count real tokens
        only, so each row gets the keys, values and logits it gets alone.
        """
        B = len(prompts)
        # every row keeps a token of its own
        shared = min(common_prefix(prompts), min(len(p) for p in prompts) - 1) if B > 1 and self.full_attention else 0
        # Where the attention applies no window, full layers with room for the decode: given none, transformers (5.20)
        # builds its cache from the config, with sliding layers for a stray `sliding_window` that Llama's or OLMo-2's
        # attention never applies, whose cache keeps only the window's keys ("The size of tensor a (4) must match the
        # size of tensor b (43)"). Elsewhere None: transformers builds it from the config, as the attention reads it.
        cache = Cache(layer_class_to_replicate=partial(RoomyLayer, room)) if self.full_attention else None
        if shared > 0:
            out = self.model(input_ids=torch.tensor([prompts[0][:shared]], device=self.device), past_key_values=cache,
                             use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            cache.batch_repeat_interleave(B)                                # (1, ...) -> (B, ...)
        ids, own = left_pad([p[shared:] for p in prompts], self.pad_id, self.device)  # (B, S)
        pos = shared + (own.cumsum(-1) - 1).clamp(min=0)                    # (B, S)
        mask = torch.cat([own.new_ones((B, shared)), own], dim=1)          # (B, shared + S)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        return out.past_key_values, out.logits[:, -1], mask

    def _completions(self, tokens, logps, lengths, B, n):
        stop = set(self.stop_ids.tolist())
        rows = []
        for i in range(B * n):
            L = int(lengths[i])
            ids = tokens[i, :L].tolist()
            finish = "stop" if ids and ids[-1] in stop else "length"
            text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
            rows.append(Completion(ids, logps[i, :L].tolist(), finish, text))
        return [rows[b * n:(b + 1) * n] for b in range(B)]

    @torch.no_grad()
    def load_weights(self, named_tensors):
        params, sent = self.model.state_dict(keep_vars=True), []
        for name, tensor in named_tensors:
            if name not in params:
                raise WeightSyncError(f"weight sync sent {name!r}, which the sampler's model does not have")
            sent.append(name)
            p = params[name]
            if self.offloaded or self.discarded:  # asleep: the new weights go straight to the device
                p.data = torch.empty(self.shapes.get(name, p.shape), dtype=p.dtype, device=self.device)
            p.data.copy_(tensor.to(p.device, p.dtype))
        self.discarded = False
        self.wake()  # offloaded: the rest (buffers) follows, and generate()'s wake() has no whole-model copy to make
        check_sync(self.expected, sent)

    def adapters_off(self):
        """Sample from the base model the sampler holds under its LoRA adapters (eval.py's baseline of a LoRA run)."""
        for m in self.model.modules():
            if hasattr(m, "lora_A"):  # peft's LoRA layers
                m.enable_adapters(False)

    def sleep(self):
        """Free the inference copy's memory while the trainer needs it: sleep() comes only where a weight sync follows,
        which rewrites every weight, so they go (as vLLM's level-2 sleep: on the CPU too, where the update's peak
        counts them). Under LoRA a sync sends the adapters alone: the copy moves off the accelerator instead."""
        if not self.adapters_only and not self.discarded:
            self.shapes = {n: p.shape for n, p in self.model.named_parameters()}
            for p in self.model.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.discarded = True
        elif self.adapters_only and self.device.type == "cuda" and not self.offloaded:
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self.offloaded = True

    def wake(self):
        if self.offloaded:
            self.model.to(self.device)
            self.offloaded = False

    def close(self):
        """Nothing to shut down (the vLLM engine has something)."""
