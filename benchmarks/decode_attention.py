"""The HF sampler's decode kernel (minigdpo/sampler.py: decode_attention) against SDPA on a decode step's shapes:
one new token a row against a cache of L positions with padding in it, grouped-query heads (SmolLM2-135M's 9 query
and 3 key heads of 64), milliseconds a call and the largest difference from SDPA's output. The last two columns read
the cache as the sampler's RoomyLayer holds it, the first L positions of a buffer with room for 200 more: its two
matmuls alone on those strided keys, and decode_attention (which copies them first in bf16).

    python benchmarks/decode_attention.py                  # 32 rows, L 160 and 260, fp32 and bf16
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minigdpo.sampler import decode_attention  # noqa: E402


def timed(fn, reps=50):
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn()
    return (time.perf_counter() - t0) / reps * 1e3, out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--lengths", default="160,260")
    args = p.parse_args()
    N, H, K, D = args.rows, 9, 3, 64
    module = torch.nn.Module()
    module.num_key_value_groups = H // K
    print(f"{'L':>4} {'dtype':<9} {'SDPA, repeated keys':>20} {'SDPA, enable_gqa':>17} {'decode_attention':>17}  diff"
          f" {'strided matmuls':>16} {'strided, ours':>14}")
    for L in map(int, args.lengths.split(",")):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            q = torch.randn(N, H, 1, D, dtype=dtype)
            k, v = torch.randn(N, K, L, D, dtype=dtype), torch.randn(N, K, L, D, dtype=dtype)
            mask = torch.ones(N, 1, 1, L, dtype=torch.bool)
            mask[:, :, :, 40:60] = False  # padding between a shared prefix and each prompt's own tokens
            repeated, sdpa = timed(lambda: F.scaled_dot_product_attention(
                q, k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1), attn_mask=mask))
            gqa, _ = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
            ours, out = timed(lambda: decode_attention(module, q, k, v, mask, scaling=D**-0.5)[0])
            diff = (out.float() - sdpa.transpose(1, 2).float()).abs().max().item()
            ks, vs = (torch.cat([t, t.new_zeros(N, K, 200, D)], 2)[:, :, :L] for t in (k, v))  # (N, K, L, D) views
            strided, _ = timed(lambda: (q.view(N, K, H // K, D) @ ks.transpose(2, 3)).softmax(-1) @ vs)
            roomy, _ = timed(lambda: decode_attention(module, q, ks, vs, mask, scaling=D**-0.5)[0])
            print(f"{L:>4} {str(dtype)[6:]:<9} {repeated:>17.3f} ms {gqa:>14.3f} ms {ours:>14.3f} ms  {diff:.1e}"
                  f" {strided:>13.3f} ms {roomy:>11.3f} ms")


if __name__ == "__main__":
    main()
