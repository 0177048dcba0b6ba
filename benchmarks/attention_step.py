"""The fused decode attention step of whichever kvq the import path holds: us per step, CUDA-graph replays
cycling through 4 layers' caches (`kvq bench kernels`' timing and shapes: 32 query / 8 KV heads, d=128, int4
g32; --kv-heads changes the heads, 4 query heads to each), the best of --repeats, optionally beside fp16 SDPA
(one median per context). Another tree's library on PYTHONPATH times it in the same device call, for a
same-run comparison:

    git worktree add /tmp/before 5b1fcbe
    PYTHONPATH=/tmp/before python benchmarks/attention_step.py --label before
    PYTHONPATH=. python benchmarks/attention_step.py --label after --sdpa
"""

import argparse
import dataclasses

import torch
import torch.nn.functional as F

from kvq.bench import attention_step, time_per_layer
from kvq.kernels import decode_attention


def fp16_sdpa_us(q16: torch.Tensor, tokens: int, layers: int, kv_heads: int) -> float:
    """fp16 SDPA over `layers` distinct fp16 caches of `tokens` tokens, us per layer."""
    caches = [tuple(torch.randn(1, kv_heads, tokens, 128, device="cuda", dtype=torch.float16) for _ in range(2))
              for _ in range(layers)]
    return time_per_layer(lambda k, v: F.scaled_dot_product_attention(q16, k, v, enable_gqa=True), caches,
                          "cuda") * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default="step")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    parser.add_argument("--scales", nargs="+", default=["float32", "float16"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--partial", help="LaunchConfig.partial, cuda or triton (default: the library's)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads, each with 4 query heads")
    parser.add_argument("--sdpa", action="store_true", help="also time fp16 SDPA on fp16 caches")
    args = parser.parse_args()
    if args.partial is not None:
        decode_attention.LAUNCH = dataclasses.replace(decode_attention.LAUNCH, partial=args.partial)
    for tokens in args.contexts:
        sdpa = None  # SDPA reads fp16 caches: the packed scales' dtype does not change it
        for scales in args.scales:
            _, caches, q16, step = attention_step("cuda", tokens, 4 * args.kv_heads, args.kv_heads, 128, 32,
                                                  scale_dtype=scales)
            fused = min(time_per_layer(step, caches, "cuda") for _ in range(args.repeats)) * 1e6
            line = f"{args.label} {scales} scales, {tokens} tokens: fused {fused:.2f} us"
            if args.sdpa:
                sdpa = sdpa if sdpa is not None else fp16_sdpa_us(q16, tokens, len(caches), args.kv_heads)
                line += f", fp16 SDPA {sdpa:.2f} us, {sdpa / fused:.2f}x"
            print(line, flush=True)


if __name__ == "__main__":
    main()
