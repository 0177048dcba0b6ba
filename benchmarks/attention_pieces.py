"""Where a fused decode attention step's time goes: the step's kernels (query map, split-K partials, reduce;
the CUDA partial kernel maps the query itself, and no map kernel runs with it) timed together, alone and in
pairs, by leaving the others out (LaunchConfig.kernels).

    python benchmarks/attention_pieces.py --context 1024 8192 32768

Shapes and timing are `kvq bench kernels`': Llama-3-8B attention (32 query / 8 KV heads, d=128) over int4
g32 caches, CUDA-graph replays cycling through 4 layers' caches. A trivial kernel's graph launch is timed
beside them for scale.
"""

import argparse
import dataclasses

import torch

from kvq.bench import attention_step, time_call, time_per_layer
from kvq.kernels import decode_attention

PIECES = {"full step": ("map", "partial", "reduce"), "partial only": ("partial",), "map only": ("map",),
          "reduce only": ("reduce",), "map + partial": ("map", "partial"), "partial + reduce": ("partial", "reduce")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    default = decode_attention.LAUNCH
    for tokens in args.context:
        _, caches, _, step = attention_step("cuda", tokens, 32, 8, 128, 32)
        for label, kernels in PIECES.items():
            decode_attention.LAUNCH = dataclasses.replace(default, kernels=kernels)
            times = [time_per_layer(step, caches, "cuda") * 1e6 for _ in range(args.repeats)]
            print(f"T={tokens} {label}: " + " / ".join(f"{t:.2f}" for t in times) + " us")
        decode_attention.LAUNCH = default
    counter = torch.zeros(1, device="cuda")
    trivial = [time_call(lambda: [counter.add_(1) for _ in range(4)], "cuda", graph=True) / 4 * 1e6
               for _ in range(args.repeats)]
    print("one trivial kernel per graph launch: " + " / ".join(f"{t:.2f}" for t in trivial) + " us")


if __name__ == "__main__":
    main()
