"""Sweep the Triton decode attention's launch choices on a GPU and print us/step per configuration (with the
Triton partial kernel throughout, also where csrc/decode_attention.cu would serve).

    python benchmarks/attention_configs.py --context 32768

Shapes are Llama-3-8B's (32 query / 8 KV heads, d=128), int4 with g32 scales; the timing is CUDA-graph
replay over distinct layers' caches, as `kvq bench kernels`. Put the winner in
kvq.kernels.launch.LAUNCH_TABLE under the device's compute capability.
"""

import argparse
import itertools

import torch

from kvq import ops
from kvq.bench.kernels import packed_layers
from kvq.bench.timing import time_per_layer


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
        for block, warps, stages, waves in itertools.product((32, 64, 128), (2, 4), (1, 2, 3, 4, 5), (None, 2, 4, 8)):
            launch = ops.LaunchConfig(block, warps, stages, waves, partial="triton")

            def step(keys, values, launch=launch, query=query, window=window, maps=maps):
                reads = ops.DecodeStep(keys, values, (window, window), maps, maps.T)
                return ops.decode_attention(query, reads, 128 ** -0.5, launch=launch)

            try:
                seconds = time_per_layer(step, caches, "cuda")
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
