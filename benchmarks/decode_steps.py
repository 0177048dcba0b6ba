"""Per-step times of HF generate with each of `kvq bench decode`'s caches, alternating, to see which
steps differ (the first step's graph captures, window flushes, host stalls) where `kvq bench decode`
reports medians.

    python benchmarks/decode_steps.py --prompt 32768

Llama-3-8B architecture with random fp16 weights, as `kvq bench decode`.
"""

import argparse
import statistics

import torch

from kvq.bench import CacheUnavailable, decode_caches, decode_model, generate_run, llama3_8b_like


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", type=int, default=32768)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--caches", default="fp16-dynamic,kvq-int4", help="names as kvq bench decode --caches")
    args = parser.parse_args()
    config = llama3_8b_like()
    model = decode_model("cuda", config)
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt), device="cuda")
    max_tokens = args.prompt + args.new_tokens
    caches = []
    for cache in decode_caches(tuple(args.caches.split(","))):
        try:  # warm-up: kernel builds, compilation, allocator
            generate_run(model, cache.setup(model, 1, max_tokens), prompt, args.new_tokens)
            caches.append(cache)
        except CacheUnavailable as exc:
            print(f"{cache.label}: {exc}")
    for run in range(args.runs):
        for cache in caches:
            steps = generate_run(model, cache.setup(model, 1, max_tokens), prompt, args.new_tokens).steps_s
            print(f"{cache.label} run {run}: median {statistics.median(steps) * 1e3:.2f} ms, "
                  f"mean {statistics.mean(steps) * 1e3:.2f} ms; steps " + " ".join(f"{s * 1e3:.1f}" for s in steps))


if __name__ == "__main__":
    main()
