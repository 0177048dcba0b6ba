"""Per-step times of HF generate with an fp16 DynamicCache and the fused int4 cache, alternating, to see
which steps differ (the first step's graph captures, window flushes, host stalls) where `kvq bench decode`
reports medians.

    python benchmarks/decode_steps.py --prompt 32768

Llama-3-8B architecture with random fp16 weights, as `kvq bench decode`.
"""

import argparse
import statistics

import torch

from kvq.bench import _generate_steps, decode_model_and_caches, llama3_8b_like


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", type=int, default=32768)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    config = llama3_8b_like()
    model, caches = decode_model_and_caches("cuda", config)
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt), device="cuda")
    for make in caches.values():  # warm-up: kernel builds, allocator
        _generate_steps(model, make(), prompt, args.new_tokens)
    for run in range(args.runs):
        for label, make in caches.items():
            _, steps = _generate_steps(model, make(), prompt, args.new_tokens)
            print(f"{label} run {run}: median {statistics.median(steps) * 1e3:.2f} ms, "
                  f"mean {statistics.mean(steps) * 1e3:.2f} ms; steps " + " ".join(f"{s * 1e3:.1f}" for s in steps))


if __name__ == "__main__":
    main()
