"""What a fresh cache per prompt costs the compiled step loop against one cache reset between prompts.

    python benchmarks/step_loop_cache_reuse.py [--prompts 5] [--prompt 512] [--new-tokens 16]

On a small random Llama (host-bound steps, so the step loop's host work shows), each cache kind decodes the
same prompt `--prompts` times through `kvq.generate.generate`: first with a fresh cache each time, then
with one cache and `cache.reset()`. Per prompt: the first decode step, the median step, and how many CUDA
graphs the compiled step has recorded so far (the first prompt also compiles).
"""

import argparse
import statistics

import torch
from transformers import LlamaConfig

from kvq import generate
from kvq.bench import decode


def small_llama() -> LlamaConfig:
    return LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=64, vocab_size=32000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    model = decode.decode_model("cuda", small_llama())
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), device="cuda")
    max_tokens = args.prompt + args.new_tokens
    print("| cache | between prompts | prompt | first step ms | median step ms | graphs recorded |")
    print("|---|---|---|---|---|---|")
    for row in decode.decode_caches(("fp16-static-step", "kvq-int4-static-step")):
        for reuse in (False, True):
            cache = row.setup(model, 1, max_tokens)["past_key_values"]
            for index in range(args.prompts):
                if reuse:
                    cache.reset()
                elif index:
                    cache = row.setup(model, 1, max_tokens)["past_key_values"]
                clock = decode.StepClock(prompt.device)
                with torch.no_grad(), generate.decode_routing(model, cache):
                    generate.generate(model, prompt, cache, args.new_tokens, on_token=clock.tick,
                                      compiled=True)
                steps = clock.seconds()[1]
                print(f"| {row.label} | {'reset' if reuse else 'fresh cache'} | {index + 1} | {steps[0] * 1e3:.2f} | "
                      f"{statistics.median(steps) * 1e3:.2f} | "
                      f"{generate.graphs_recorded()} |", flush=True)


if __name__ == "__main__":
    main()
