"""Micro-batches: how a step's sequences are cut, and laid out for the model.

Shape legend: b distinct prompts in a micro-batch, N its sequences, P prompt columns, T completion columns,
K completion tokens, L packed tokens (each prompt once and every completion token, no padding).

A micro-batch holds its distinct prompts once each, left-padded (b, P), and its completions right-padded (N, T),
and for the models whose forward the pass reproduces (minigdpo/logprobs.py) a `Packed` layout: each prompt once
and every completion in one row of tokens, with the indices that take them to and from the padded rows attention
reads; packed, the row holds no padding (--padding-free false keeps it in). Every index is built here, on the
host, so that no pass over the model waits for the device to learn a shape.

Two ways to cut a step's groups (`cut`):
- by count (--micro-batch-size S): each rank cuts its own groups, prompts in order of length, S sequences each;
- by tokens (--micro-batch-tokens N): whole groups (prompt once + its completions) fill micro-batches of at most
  N tokens, longest first (first fit); a group longer than N runs alone. The micro-batches are dealt out so that
  ranks hold about the same number of tokens, each group moving to the rank that trains it, and a rank with
  fewer micro-batches than the others runs empty ones: FSDP2's collectives are matched call by call.
"""

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from minigdpo import dist
from minigdpo.sampler import Completion, left_pad


@dataclass
class Packed:
    """A micro-batch as one row of L tokens, prompts first, and where attention finds them: padded rows, as the
    shared-prefix pass computes attention (a packed row would make it quadratic in L, docs/performance.md). Only
    vectors: the attention biases are made when a pass runs (`attending`), so a step's masks never all exist."""
    ids: torch.Tensor          # (1, L) the prompts' tokens, then the completions'
    positions: torch.Tensor    # (1, L) each token's position in its own sequence
    dest: torch.Tensor         # (L,) each token's place among attention's rows, flat: b * P prompt rows, then N * T
    owner: torch.Tensor        # (N,) each completion's prompt
    prompt_pos: torch.Tensor   # (b, P) the position of each prompt column, -1 on padding
    tail_pos: torch.Tensor     # (N, T) the position of each completion column
    before: torch.Tensor       # (K,) packed index of the hidden state that predicts each completion token
    bias: dict = field(default_factory=dict)  # {window: (prompts (b, 1, P, P), completions (N, 1, T, P + T))}

    def attending(self, dtype, windows):
        """This layout with the additive attention biases for each sliding window in `windows` (None: full
        attention), in `dtype`: 0 where a query attends to a key, the dtype's lowest value elsewhere. A window keeps
        the keys less than `window` positions back, as transformers' sliding_window_overlay does."""
        pp, tp = self.prompt_pos, self.tail_pos                            # (b, P), (N, T)
        own = pp[self.owner]                                               # (N, P)
        bias = {}
        for w in windows:
            near = lambda q, k: q - k < (w or math.inf)  # noqa: E731
            prompt = (pp[:, None, :] >= 0) & (pp[:, None, :] <= pp[:, :, None]) & near(pp[:, :, None], pp[:, None, :])
            prompt |= torch.eye(pp.shape[1], dtype=torch.bool, device=pp.device)  # a padding query sees itself
            tail = torch.cat([(own[:, None, :] >= 0) & near(tp[:, :, None], own[:, None, :]),          # (N, T, P)
                              (tp[:, None, :] <= tp[:, :, None]) & near(tp[:, :, None], tp[:, None, :])], 2)
            bias[w] = tuple(torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)
                            [:, None] for m in (prompt, tail))             # (b, 1, P, P), (N, 1, T, P + T)
        return replace(self, bias=bias)


@dataclass
class MicroBatch:
    prompt_ids: torch.Tensor      # (b, P) left-padded
    prompt_mask: torch.Tensor     # (b, P)
    repeats: torch.Tensor         # (b,) completions per prompt, summing to N
    completion_ids: torch.Tensor  # (N, T) right-padded
    mask: torch.Tensor            # (N, T) 1 on the tokens the loss counts: those the model wrote
    adv: torch.Tensor             # (N,)
    sampler_logp: torch.Tensor    # (N, T) the sampler's log-probs
    out_index: torch.Tensor       # (K,) flat (N*T) place of each completion token
    targets: torch.Tensor         # (K,) the completion tokens
    tokens: int = 0                          # the tokens the loss counts
    seqs: int = 0                            # the sequences the loss counts (0: an empty micro-batch)
    pairs: int = 0                           # causal (query, key) pairs of the real tokens: attention's work
    packed: Optional[Packed] = None
    ref_logp: Optional[torch.Tensor] = None  # (N, T) step 5
    old_logp: Optional[torch.Tensor] = None  # (N, T) step 5, with num_iterations > 1

    def model_tokens(self):
        """Tokens a pass over this micro-batch computes, padding included: its row's length, or without one (a model
        that runs full sequences) each completion's row with its prompt."""
        if self.packed is not None:
            return self.packed.ids.shape[1]
        return self.prompt_mask.shape[1] * int(self.repeats.sum()) + self.completion_ids.numel()

    def real_tokens(self, shared=True):
        """The tokens a pass needs: each prompt's own (once, or once per completion) and every completion's."""
        prompt = self.prompt_mask.sum(-1)                                  # (b,)
        return int((prompt.sum() if shared else (prompt * self.repeats).sum()).item()) + self.targets.numel()


def build(groups, pad_id, device, layout=None):
    """One micro-batch from [(prompt ids, [Completion], adv (n,))]: each entry a prompt and some of its group.
    No entries: an empty micro-batch, one padding token through the model that the loss never counts."""
    counted = bool(groups)
    groups = groups or [([pad_id], [Completion([pad_id], [0.0])], torch.zeros(1))]
    prompts = [p for p, _, _ in groups]
    comps = [c for _, cs, _ in groups for c in cs]
    repeats = torch.tensor([len(cs) for _, cs, _ in groups])              # (b,)
    prompt_ids, prompt_mask = left_pad(prompts, pad_id, device)            # (b, P)
    lengths = [len(c.token_ids) for c in comps]
    N, T = len(comps), max(1, max(lengths))
    completion_ids = torch.full((N, T), pad_id, dtype=torch.long)          # (N, T)
    mask, sampler_logp = torch.zeros((N, T)), torch.zeros((N, T))          # (N, T)
    for row, c in enumerate(comps):
        if lengths[row]:
            completion_ids[row, :lengths[row]] = torch.tensor(c.token_ids)
            sampler_logp[row, :lengths[row]] = torch.tensor(c.logprobs)
            # the tokens the model wrote; a tool loop's tool results and template glue are context (tool_mask 0)
            mask[row, :lengths[row]] = float(counted) * (torch.tensor(c.tool_mask, dtype=torch.float)
                                                         if c.tool_mask is not None else 1.0)
    out_index = [row * T + t for row, n in enumerate(lengths) for t in range(n)]
    adv = torch.cat([a.reshape(-1) for _, _, a in groups]).float()         # (N,)
    mb = MicroBatch(prompt_ids, prompt_mask, repeats.to(device), completion_ids.to(device), mask.to(device),
                    adv.to(device), sampler_logp.to(device), torch.tensor(out_index, device=device),
                    completion_ids.reshape(-1)[out_index].to(device), int(mask.sum()) if counted else 0,
                    N if counted else 0, attention_pairs([len(p) for p in prompts], lengths, repeats.tolist()))
    if layout:  # the one row the pass reads: "packed" (no padding) or "padded"
        mb.packed = packed_layout(prompts, comps, [len(cs) for _, cs, _ in groups], prompt_ids.shape[1], T, device,
                                  pad_id if layout == "padded" else None)
    return mb


def attention_pairs(prompt_lengths, completion_lengths, repeats):
    """Causal (query, key) pairs: each prompt once over itself, each completion over its prompt and itself."""
    owner = [i for i, n in enumerate(repeats) for _ in range(n)]
    return (sum(p * (p + 1) // 2 for p in prompt_lengths)
            + sum(c * prompt_lengths[i] + c * (c + 1) // 2 for c, i in zip(completion_lengths, owner)))


def packed_layout(prompts, comps, repeats, P, T, device, pad_id=None):
    """The Packed layout of prompts (b lists of ids, left-padded to P in attention's rows) and comps (N Completions,
    repeats[i] of them per prompt, right-padded to T). With pad_id the row holds the padding too, every prompt P
    tokens and every completion T: the padded pass, which computes the same numbers at the padding's cost."""
    owner = [i for i, n in enumerate(repeats) for _ in range(n)]
    rows_p = [[pad_id] * (P - len(p)) + p if pad_id is not None else p for p in prompts]
    rows_t = [c.token_ids + [pad_id] * (T - len(c.token_ids)) if pad_id is not None else c.token_ids for c in comps]
    ids = [t for r in rows_p + rows_t for t in r]
    lead = [len(r) - len(p) for r, p in zip(rows_p, prompts)]          # each prompt row's leading padding
    positions = [max(0, k - n) for r, n in zip(rows_p, lead) for k in range(len(r))]
    positions += [len(prompts[i]) + t for r, i in zip(rows_t, owner) for t in range(len(r))]
    starts_p = [sum(len(r) for r in rows_p[:i]) for i in range(len(rows_p))]
    dest = [i * P + P - len(r) + k for i, r in enumerate(rows_p) for k in range(len(r))]
    dest += [len(prompts) * P + j * T + t for j, r in enumerate(rows_t) for t in range(len(r))]
    before, at = [], starts_p[-1] + len(rows_p[-1])  # a first token is predicted from its prompt's last, the others
    for r, c, i in zip(rows_t, comps, owner):       # from the one before; a completion of no tokens predicts none
        before += ([starts_p[i] + len(rows_p[i]) - 1] + list(range(at, at + len(c.token_ids) - 1)))[:len(c.token_ids)]
        at += len(r)
    as_t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    prompt_pos = [[-1] * (P - len(p)) + list(range(len(p))) for p in prompts]
    tail_pos = [[len(prompts[i]) + t for t in range(T)] for i in owner]
    return Packed(as_t(ids)[None], as_t(positions)[None], as_t(dest), as_t(owner), as_t(prompt_pos), as_t(tail_pos),
                  as_t(before))


# Cutting a step's groups ---------------------------------------------------------------------------


def cut(groups, cfg, pad_id, device, layout):
    """This rank's micro-batches, built, from its groups [(prompt, completions, adv (G,))]: by tokens when
    cfg.micro_batch_tokens is set (every rank must call it: the groups move between ranks), else by count.
    layout: "packed", "padded", or None for a model whose forward the packed pass does not reproduce."""
    budget, size = cfg.micro_batch_tokens, cfg.micro_batch_size
    parts = by_tokens(groups, budget, shared=layout is not None) if budget else by_count(groups, size)
    return [build(part, pad_id, device, layout) for part in parts]


def by_count(groups, size):
    """Micro-batches of `size` sequences from groups [(prompt, completions, adv)], prompts in order of length;
    a group is split where `size` cuts it."""
    by_length = sorted(range(len(groups)), key=lambda g: len(groups[g][0]))
    seqs = [(g, j) for g in by_length for j in range(len(groups[g][1]))]
    out = []
    for s in range(0, len(seqs), size):
        part = seqs[s:s + size]
        owners = list(dict.fromkeys(g for g, _ in part))                   # distinct prompts, in order
        out.append([(groups[g][0], [groups[g][1][j] for h, j in part if h == g],
                     groups[g][2][[j for h, j in part if h == g]]) for g in owners])
    return out


_warned = set()


def by_tokens(groups, budget, shared=True):
    """Every rank's groups, [(prompt, completions, adv (G,))] each, in micro-batches of at most `budget` tokens,
    dealt to the ranks: returns this rank's micro-batches, as many on every rank (empty ones where needed).
    A group's tokens are what its pass computes: its prompt once (shared) or once per completion (a model's own
    forward on full sequences), and its completions."""
    world, rank = dist.world_size(), dist.rank()
    sizes = dist.all_gather_object([len(p) * (1 if shared else len(cs)) + sum(len(c.token_ids) for c in cs)
                                    for p, cs, _ in groups])
    ids = sorted(((r, i) for r in range(world) for i in range(len(sizes[r]))), key=lambda g: (-sizes[g[0]][g[1]], g))
    bins, room = [], []
    for g in ids:  # first fit, longest first
        size = sizes[g[0]][g[1]]
        if size > budget and "long" not in _warned:
            _warned.add("long")
            dist.print0(f"warning: a group of {size} tokens is longer than --micro-batch-tokens {budget}: "
                        "it runs alone")
        at = next((k for k, r in enumerate(room) if r >= size), len(bins))  # none with room: a new bin
        if at == len(bins):
            bins.append([])
            room.append(budget)
        bins[at].append(g)
        room[at] -= size
    per_rank = math.ceil(len(bins) / world)
    load, count, owner = [0] * world, [0] * world, {}
    for b in sorted(range(len(bins)), key=lambda b: (room[b], b)):  # fullest first, to the least loaded rank
        r = min((r for r in range(world) if count[r] < per_rank), key=lambda r: (load[r], r))
        owner[b] = r
        load[r] += budget - room[b]
        count[r] += 1
    outgoing = [{} for _ in range(world)]
    for b, r in owner.items():
        for g in bins[b]:
            if g[0] == rank:
                outgoing[r][g] = groups[g[1]]
    received = {g: entry for part in dist.exchange_objects(outgoing) for g, entry in part.items()}
    mine = [[received[g] for g in bins[b]] for b in sorted(owner) if owner[b] == rank]
    return mine + [[] for _ in range(per_rank - len(mine))]  # build() makes an empty micro-batch of []
