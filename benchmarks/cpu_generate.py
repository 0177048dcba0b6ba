"""One passkey request's greedy generate on CPU with the fp DynamicCache and with each kvq cache a CPU user
runs, taking turns, median seconds per request and the ratio to fp in the same run.

    python benchmarks/cpu_generate.py [--model smollm2-135m] [--length 1024] [--new-tokens 16] [--repeats 3]

Caches: fp DynamicCache; cache mode as `kvq lmeval --mode cache` runs it (every write quantize-dequantized,
QuantizedWriteCache); the same under the papers' protocol (`--window 128 --exact-prefill`, window attention);
kvq's packed QuantizedKVCache (codes and scales held, 16-token exact window); kvq's static cache (the same window)
through kvq.generate, as `kvq generate --device cpu` runs it.
"""

import argparse
import statistics
import time

import torch

from kvq import models
from kvq.apply import quantized_kv
from kvq.cache import QuantizedKVCache
from kvq.experiment import make_bank
from kvq.generate import decode_routing, generate, static_cache
from kvq.longctx import RetrievalSpec, passkey_docs
from kvq.protocol import Protocol
from kvq.quant import QuantSpec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quant", default="srft:4")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    name, bits = args.quant.split(":")
    lm = models.load(args.model)
    model, tokenizer = lm.model, lm.tokenizer
    bank = make_bank(args.model, model.config, QuantSpec(name, int(bits)))
    text = passkey_docs(tokenizer, RetrievalSpec(lengths=(args.length,), depths=(0.5,)))[0]["input"]
    prompt = tokenizer(text, return_tensors="pt").input_ids

    def under(quant_bank, protocol=Protocol()):
        def run():
            with quantized_kv(model, quant_bank, "cache", protocol) as fresh:
                return model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, **fresh())
        return run

    def packed():
        cache = QuantizedKVCache(bank, model.config, residual=16)
        return model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, past_key_values=cache)

    def static():
        cache = static_cache(model, QuantSpec(name, int(bits)), 1, prompt.shape[1] + args.new_tokens)
        with decode_routing(model, cache):
            new = generate(model, prompt, cache, args.new_tokens, stop_tokens=[tokenizer.eos_token_id])[0]
        return torch.cat([prompt[0], new])[None]

    rows = {"fp DynamicCache": under(None), "kvq cache mode": under(bank),
            "kvq cache mode, window 128 + exact prefill": under(bank, Protocol(128, True)),
            "kvq packed QuantizedKVCache": packed, "kvq static cache, kvq.generate": static}
    seconds: dict[str, list[float]] = {label: [] for label in rows}
    outputs = {}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for label, run in rows.items():
                start = time.perf_counter()
                outputs[label] = run()
                seconds[label].append(time.perf_counter() - start)
    fp = statistics.median(seconds["fp DynamicCache"])
    print(f"{args.model}, {prompt.shape[1]}-token passkey prompt, {args.new_tokens} new tokens, {args.quant}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}, caches taking turns")
    print("| cache | s per request | vs fp | tokens equal fp's |")
    print("|---|---|---|---|")
    for label, times in seconds.items():
        median = statistics.median(times)
        same = torch.equal(outputs[label], outputs["fp DynamicCache"])
        print(f"| {label} | {median:.2f} | {median / fp:.2f}x | {same} |")


if __name__ == "__main__":
    main()
