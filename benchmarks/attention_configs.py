"""Sweep the Triton decode attention's launch choices on a GPU and print us/step per configuration (with the
Triton partial kernel throughout, also where kernels/decode_attention.cu would serve).

    python benchmarks/attention_configs.py --context 32768

Shapes are Llama-3-8B's (32 query / 8 KV heads, d=128), int4 with g32 scales; the timing is CUDA-graph
replay over distinct layers' caches, as `kvq bench kernels`. Put the winner in
kvq.kernels.decode_attention.LaunchConfig.
"""

import argparse
import itertools
from functools import partial

import torch

from kvq.bench import packed_layers, time_per_layer
from kvq.kernels import decode_attention


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, nargs="+", default=[8192, 32768])
    args = parser.parse_args()
    results = []
    for tokens in args.context:
        caches = packed_layers(tokens, 8, 128, 32, "cuda")
        window = torch.randn(1, 8, 8, 128, device="cuda", dtype=torch.float16)
        query = torch.randn(1, 32, 128, device="cuda", dtype=torch.float16)
        maps = torch.linalg.qr(torch.randn(128, 128, device="cuda"))[0]
        step = partial(decode_attention.decode_attention, query, maps)
        tail = (window, window, maps.T, 128 ** -0.5)
        for block, warps, stages, waves in itertools.product((32, 64, 128), (2, 4), (1, 2, 3, 4, 5), (None, 2, 4, 8)):
            decode_attention.LAUNCH = decode_attention.LaunchConfig(block, warps, stages, waves, partial="triton")
            try:
                seconds = time_per_layer(lambda k, v, step=step, tail=tail: step(k, v, *tail), caches, "cuda")
            except Exception as error:  # a configuration that does not fit is skipped, and said so
                print(f"T={tokens} block={block} warps={warps} stages={stages} waves={waves}: {type(error).__name__}")
                continue
            results.append((tokens, seconds * 1e6, block, warps, stages, waves))
    for tokens in args.context:
        ranked = sorted((r for r in results if r[0] == tokens), key=lambda r: r[1])
        for r in ranked[:5]:
            print(f"T={r[0]}: {r[1]:.1f} us  block={r[2]} warps={r[3]} stages={r[4]} waves={r[5]}")


if __name__ == "__main__":
    main()
