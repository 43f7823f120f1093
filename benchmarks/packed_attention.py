"""Attention over a packed micro-batch: which kernel, measured before the padding-free update chose one.

    python benchmarks/packed_attention.py                   # on a CUDA GPU: Qwen2.5-1.5B's heads, GSM8K-like lengths
    python benchmarks/packed_attention.py --lengths 8,64    # a quick look on the CPU (no compiled kernels)

One micro-batch of `--groups` prompts of `--prompt-len` tokens with `--group` completions each, their lengths drawn
uniformly from `--lengths` (GSM8K completions of a 1.5B model run about 100 to 1,000 tokens). Each completion token
attends to its own prompt and causally to its own completion; a prompt token causally to its prompt. Forward and
backward of one attention call with Qwen2.5-1.5B's heads (12 query, 2 key-value, 128 wide), for each way:

- padded:     today's rows, each completion right-padded to the longest and its prompt's keys in front, with a
              boolean mask (n, 1, T, P + T) through SDPA (transformers repeats the key-value heads under a mask);
- flex:       every token in one packed row, FlexAttention with a block mask (compiled on CUDA): the masked
              128 x 128 blocks are skipped;
- dense:      the same packed row through SDPA with a dense (L, L) mask: quadratic in the micro-batch's length;
- varlen:     flash attention over variable-length segments (torch.nn.attention.varlen), each completion's keys
              its prompt's and its own, copied into one packed key tensor; where torch has it.

Each is checked against `padded` on every real query (max |difference|) and timed as the median of --reps
forward+backward calls (CUDA events), with the attention FLOPs it does and the FLOPs the mask lets through.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def layout(groups, group, prompt_len, lengths, seed):
    """Prompt lengths (groups,), completion lengths (groups * group,) as lists."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = lengths
    comp = torch.randint(lo, hi + 1, (groups * group,), generator=g).tolist()
    return [prompt_len] * groups, comp


def packed_ids(prompts, comps, group, device):
    """Per packed token: its group, its segment (a prompt or a completion) and whether it is a prompt token."""
    grp, seg, is_prompt = [], [], []
    s = 0
    for i, p in enumerate(prompts):
        grp += [i] * p
        seg += [s] * p
        is_prompt += [True] * p
        s += 1
        for c in comps[i * group:(i + 1) * group]:
            grp += [i] * c
            seg += [s] * c
            is_prompt += [False] * c
            s += 1
    as_t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    return as_t(grp, torch.int32), as_t(seg, torch.int32), as_t(is_prompt, torch.bool)


def dense_mask(grp, seg, is_prompt):
    """(L, L) True = attend: causal, same group, and the same segment or a prompt key."""
    L = grp.shape[0]
    q, k = torch.arange(L, device=grp.device)[:, None], torch.arange(L, device=grp.device)[None, :]
    return (k <= q) & (grp[:, None] == grp[None, :]) & ((seg[:, None] == seg[None, :]) | is_prompt[None, :])


def to_padded(x, prompts, comps, group, heads):
    """Packed (1, h, L, d) -> completion queries (n, h, T, d), prompt-prefixed keys (n, h, P + T, d), the mask
    (n, 1, T, P + T) and where each real completion query sits in both layouts."""
    P, T = max(prompts), max(comps)
    n = len(comps)
    starts, pos = [], 0
    for i, p in enumerate(prompts):
        starts.append(pos)
        pos += p + sum(comps[i * group:(i + 1) * group])
    q_idx, kv_idx, rows, cols = [], [], [], []
    mask = torch.zeros(n, 1, T, P + T, dtype=torch.bool, device=x.device)
    for j, c in enumerate(comps):
        i = j // group
        p = prompts[i]
        c0 = starts[i] + p + sum(comps[i * group:j])
        q_idx.append((j, list(range(c0, c0 + c))))
        kv_idx.append((j, list(range(starts[i], starts[i] + p)), list(range(c0, c0 + c))))
        mask[j, 0, :c, P - p:P] = True
        mask[j, 0, :c, P:P + c] = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
        mask[j, 0, c:, P] = True  # padding queries attend to one key: no fully masked row
        rows += [j] * c
        cols += list(range(c))
    return q_idx, kv_idx, mask, (rows, cols), (P, T)


def fill(x, q_idx, kv_idx, P, T, which):
    n, h, d = len(q_idx), x.shape[1], x.shape[-1]
    if which == "q":
        out = x.new_zeros(n, h, T, d)
        for j, idx in q_idx:
            out[j, :, :len(idx)] = x[0, :, idx]
        return out
    out = x.new_zeros(n, h, P + T, d)
    for j, pidx, cidx in kv_idx:
        out[j, :, P - len(pidx):P] = x[0, :, pidx]
        out[j, :, P:P + len(cidx)] = x[0, :, cidx]
    return out


def timed(fn, reps, cuda):
    fn()  # warm-up (compiles where it compiles)
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=150)
    p.add_argument("--lengths", default="100,1000", help="completion lengths drawn uniformly from LO,HI")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    prompts, comps = layout(args.groups, args.group, args.prompt_len, tuple(map(int, args.lengths.split(","))), args.seed)
    L, n, rep = sum(prompts) + sum(comps), len(comps), args.heads // args.kv_heads
    torch.manual_seed(args.seed)
    q = torch.randn(1, args.heads, L, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, args.kv_heads, L, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, args.kv_heads, L, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(1, args.heads, L, args.head_dim, device=device, dtype=dtype)
    grp, seg, is_prompt = packed_ids(prompts, comps, args.group, device)
    q_idx, kv_idx, pmask, (rows, cols), (P, T) = to_padded(q, prompts, comps, args.group, args.heads)
    real = torch.cat([torch.tensor(idx, device=device) for _, idx in q_idx])  # packed positions of completion queries
    kq, vq = k.detach().repeat_interleave(rep, 1), v.detach().repeat_interleave(rep, 1)
    qp, kp, vp = (fill(t, q_idx, kv_idx, P, T, w) for t, w in ((q.detach(), "q"), (kq, "kv"), (vq, "kv")))
    qp, kp, vp = (t.requires_grad_() for t in (qp, kp, vp))
    gp = fill(grad_out, q_idx, kv_idx, P, T, "q")
    useful = 4 * args.head_dim * args.heads * (sum(c * (prompts[j // args.group] + (c + 1) / 2)
                                                  for j, c in enumerate(comps)) + sum(x * (x + 1) / 2 for x in prompts))
    results = {}

    def padded():
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=pmask)
        out.backward(gp)
        return out

    ref = padded().detach()[torch.tensor(rows, device=device), :, torch.tensor(cols, device=device)]  # (K, h, d)
    results["padded"] = (timed(padded, args.reps, cuda), 4 * args.head_dim * args.heads * n * T * (P + T), ref)

    def check(out_packed):
        return out_packed[0].transpose(0, 1)[real]                       # (K, h, d) in the same order as ref

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def mask_mod(b, h, qi, ki):
            return (ki <= qi) & (grp[qi] == grp[ki]) & ((seg[qi] == seg[ki]) | is_prompt[ki])

        t0 = time.perf_counter()
        block = create_block_mask(mask_mod, None, None, L, L, device=device.type)
        mask_s = time.perf_counter() - t0
        flex = torch.compile(flex_attention) if cuda else flex_attention

        def run_flex():
            out = flex(q, k, v, block_mask=block, enable_gqa=True)
            out.backward(grad_out)
            return out

        density = block.sparsity() if hasattr(block, "sparsity") else float("nan")
        results["flex"] = (timed(run_flex, args.reps, cuda), 4 * args.head_dim * args.heads * L * L * (1 - density / 100),
                           check(run_flex().detach()))
        print(f"flex block mask: {mask_s * 1e3:.1f} ms to build, {density:.1f}% of blocks skipped")
    except Exception as e:  # noqa: BLE001  (a benchmark reports what it could not run)
        print(f"flex: not run ({type(e).__name__}: {str(e)[:200]})")

    if L <= 40000:
        dmask = dense_mask(grp, seg, is_prompt)

        def run_dense():
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=dmask)
            out.backward(grad_out)
            return out

        try:
            results["dense"] = (timed(run_dense, args.reps, cuda), 4 * args.head_dim * args.heads * L * L,
                                check(run_dense().detach()))
        except Exception as e:  # noqa: BLE001
            print(f"dense: not run ({type(e).__name__}: {str(e)[:200]})")

    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters

        # segments: each prompt (keys: itself), then each completion (keys: its prompt, then itself)
        q_seg, k_seg, starts, pos = [], [], [], 0
        for i, pl in enumerate(prompts):
            starts.append(pos)
            pos += pl + sum(comps[i * args.group:(i + 1) * args.group])
        for i, pl in enumerate(prompts):
            pr = list(range(starts[i], starts[i] + pl))
            q_seg.append(pr)
            k_seg.append(pr)
            c0 = starts[i] + pl
            for c in comps[i * args.group:(i + 1) * args.group]:
                cs = list(range(c0, c0 + c))
                q_seg.append(cs)
                k_seg.append(pr + cs)
                c0 += c
        qi = torch.tensor([x for s in q_seg for x in s], device=device)
        ki = torch.tensor([x for s in k_seg for x in s], device=device)
        cu_q = torch.tensor([0] + [len(s) for s in q_seg], device=device).cumsum(0).int()
        cu_k = torch.tensor([0] + [len(s) for s in k_seg], device=device).cumsum(0).int()
        mq, mk = max(map(len, q_seg)), max(map(len, k_seg))

        def run_varlen():
            qq = q[0].transpose(0, 1)[qi]                                 # (Lq, h, d)
            kk, vv = k[0].transpose(0, 1)[ki], v[0].transpose(0, 1)[ki]   # (Lk, hkv, d)
            if "enable_gqa" not in params:  # torch 2.11's varlen_attn has no GQA: repeat the key-value heads
                kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
            causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}  # bottom-right
            out = varlen_attn(qq, kk, vv, cu_q, cu_k, mq, mk, **causal, **({"enable_gqa": True} if "enable_gqa" in params
                                                                           else {}))
            full = torch.zeros(L, args.heads, args.head_dim, device=device, dtype=dtype).index_copy(0, qi, out)
            full.transpose(0, 1)[None].backward(grad_out)
            return full.transpose(0, 1)[None]

        results["varlen"] = (timed(run_varlen, args.reps, cuda), useful, check(run_varlen().detach()))
    except Exception as e:  # noqa: BLE001
        print(f"varlen: not run ({type(e).__name__}: {str(e)[:200]})")

    print(f"\n{len(prompts)} prompts x {args.group} completions, prompt {args.prompt_len}, completions "
          f"{min(comps)}-{max(comps)} (mean {sum(comps) / n:.0f}); packed length {L}, padded {n} x {T} + prompts {P}; "
          f"heads {args.heads}/{args.kv_heads} x {args.head_dim}, {dtype}, {torch.cuda.get_device_name() if cuda else 'CPU'}, "
          f"torch {torch.__version__}")
    print(f"{'way':<8} {'fwd+bwd ms':>11} {'x padded':>9} {'attn GFLOP':>11} {'useful GFLOP':>13} {'max |diff|':>11}")
    base = results["padded"][0]
    for name, (sec, flops, out) in results.items():
        diff = (out.float() - ref.float()).abs().max().item()
        print(f"{name:<8} {sec * 1e3:>11.2f} {sec / base:>9.2f} {flops * 3 / 1e9:>11.1f} {useful * 3 / 1e9:>13.1f} "
              f"{diff:>11.2e}")


if __name__ == "__main__":
    main()
