"""The decode attention step with the CUDA partial kernel (kernels/decode_attention.cu) against the Triton
one, alternating in one run, beside fp16 SDPA: us per step, and the partial kernel alone.

    python benchmarks/attention_partials.py --context 1024 8192 32768 131072

Shapes and timing are `kvq bench kernels`': Llama-3-8B attention (32 query / 8 KV heads, d=128) over int4
g32 caches, CUDA-graph replays cycling through 4 layers' caches.
"""

import argparse
import dataclasses

from attention_step import fp16_sdpa_us

from kvq.bench import attention_step, time_per_layer
from kvq.kernels import decode_attention


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    default = decode_attention.LAUNCH
    try:
        for tokens in args.context:
            _, caches, q16, step = attention_step("cuda", tokens, 32, 8, 128, 32)
            sdpa = fp16_sdpa_us(q16, tokens, len(caches), 8)
            times: dict[str, list[float]] = {}
            for _ in range(args.repeats):
                for partial in ("cuda", "triton"):
                    for label, kernels in ((partial, default.kernels), (f"{partial} partial only", ("partial",))):
                        decode_attention.LAUNCH = dataclasses.replace(default, partial=partial, kernels=kernels)
                        times.setdefault(label, []).append(time_per_layer(step, caches, "cuda") * 1e6)
            decode_attention.LAUNCH = default
            print(f"T={tokens}: fp16 SDPA {sdpa:.2f} us; " + "; ".join(
                f"{label} " + " / ".join(f"{t:.2f}" for t in values) for label, values in times.items())
                + f"; vs SDPA: cuda {sdpa / min(times['cuda']):.2f}x, triton {sdpa / min(times['triton']):.2f}x")
    finally:
        decode_attention.LAUNCH = default


if __name__ == "__main__":
    main()
