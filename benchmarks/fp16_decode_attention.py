"""One fp16 decode step's attention over a static cache, per path a user's model may take, against its K/V floor.

    python benchmarks/fp16_decode_attention.py [--contexts 8192,32768,131072] [--batches 1,8]

Llama-3-8B's attention shapes (32 query heads, 8 KV heads, d 128), one query token, a static cache of
`context` positions whose last 16 are unwritten and masked, so every path gets a mask, as a static cache's
decode step does. Paths: transformers' sdpa function (which repeats K/V per query head under a mask),
kvq.gqa_attention's (SDPA with enable_gqa), each eager and compiled as the step loop compiles its step (without
its CUDA graphs: each sample is replayed from a graph of its own), and SDPA with enable_gqa and no mask, which
takes the flash kernel and attends the unwritten tail too (a speed reference, not a correct step). Times are
CUDA-graph replays cycling through kvq.bench.timing.LAYERS distinct caches; the floor is the K/V bytes at the measured
copy rate.
"""

import argparse

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvq.bench import timing
from kvq.generate import STEP_COMPILE_OPTIONS
from kvq.gqa_attention import gqa_sdpa_attention

Q_HEADS, KV_HEADS, D, UNWRITTEN = 32, 8, 128, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192,32768,131072")
    parser.add_argument("--batches", default="1,8")
    args = parser.parse_args()
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = Q_HEADS // KV_HEADS, True
    compile_options = {k: v for k, v in STEP_COMPILE_OPTIONS.items() if k != "triton.cudagraphs"}

    def transformers_sdpa(q, k, v, mask):
        return sdpa_attention_forward(module, q, k, v, mask, scaling=D**-0.5)[0]

    def kvq_gqa_sdpa(q, k, v, mask):
        return gqa_sdpa_attention(module, q, k, v, mask, scaling=D**-0.5)[0]

    def unmasked_flash(q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=D**-0.5, enable_gqa=True)

    paths = {"transformers sdpa, eager": transformers_sdpa, "kvq gqa sdpa, eager": kvq_gqa_sdpa,
             "transformers sdpa, compiled": torch.compile(transformers_sdpa, options=compile_options, dynamic=False),
             "kvq gqa sdpa, compiled": torch.compile(kvq_gqa_sdpa, options=compile_options, dynamic=False),
             "SDPA enable_gqa, no mask (flash)": unmasked_flash}
    bandwidth = timing.copy_bandwidth("cuda")
    print(f"copy rate {bandwidth / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("| context | batch | path | us per layer | K/V floor us | x floor | max abs diff vs transformers |")
    print("|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            query = torch.randn(batch, Q_HEADS, 1, D, device="cuda", dtype=torch.float16)
            mask = torch.ones(batch, 1, 1, context, device="cuda", dtype=torch.bool)
            mask[..., context - UNWRITTEN:] = False
            layers = [tuple(torch.randn(batch, KV_HEADS, context, D, device="cuda", dtype=torch.float16)
                            for _ in range(2)) for _ in range(timing.LAYERS)]
            floor_us = 2 * batch * KV_HEADS * context * D * 2 / bandwidth * 1e6
            reference = transformers_sdpa(query, *layers[0], mask)
            for name, path in paths.items():
                with torch.no_grad():
                    difference = (path(query, *layers[0], mask) - reference).abs().max().item()
                    seconds = timing.time_per_layer(lambda k, v, p=path, q=query, m=mask: p(q, k, v, m), layers, "cuda")
                print(f"| {context} | {batch} | {name} | {seconds * 1e6:.1f} | {floor_us:.1f} | "
                      f"{seconds * 1e6 / floor_us:.2f} | {difference:.1e} |", flush=True)
            del layers
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
