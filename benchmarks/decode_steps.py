"""Per-step times of HF generate with an fp16 DynamicCache and the fused int4 cache, alternating, to see
which steps differ (the first step's graph captures, window flushes, host stalls) where `kvq bench decode`
reports medians.

    python benchmarks/decode_steps.py --prompt 32768

Llama-3-8B architecture with random fp16 weights, as `kvq bench decode`.
"""

import argparse
import statistics

import torch
from transformers import DynamicCache, LlamaForCausalLM

from kvq.apply import QuantizerBank, kv_geometry
from kvq.bench import _generate_steps, llama3_8b_like
from kvq.cache import QuantizedKVCache
from kvq.quant import QuantSpec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", type=int, default=32768)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    config = llama3_8b_like()
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(config, dtype=torch.float16).eval()
    bank = QuantizerBank(QuantSpec("srft", 4, "per_group", 32), kv_geometry(config))
    caches = {"fp16": lambda: DynamicCache(config=config), "kvq": lambda: QuantizedKVCache(bank, config, fused=True)}
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
