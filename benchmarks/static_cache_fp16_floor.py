"""Per layout of tests/test_static_cache_models.py on a built-in model in fp16 on a device: the fused static
cache's gap to the protocol cache and the quantization's effect (protocol cache against fp), beside the fp16
floor (the unquantized model's log-probabilities in fp16 against fp32 on the same device) and the layout's own
rounding (the protocol cache's log-probabilities in fp16 against fp32), so the test's bound can be read against
the rounding that fp16 alone makes.

    python benchmarks/static_cache_fp16_floor.py cuda [--model smollm2-135m] [layout ...]
"""
import argparse
import sys

import torch

sys.path.insert(0, "tests")
import test_static_cache_models as t
from conftest import loaded

from kvq.apply import quantized_kv
from kvq.data import token_windows

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("device")
parser.add_argument("--model", default="smollm2-135m")
parser.add_argument("layouts", nargs="*", help=f"of {', '.join(t.LAYOUTS)} (default: all)")
args = parser.parse_intermixed_args()
if set(args.layouts) - set(t.LAYOUTS):
    parser.error(f"unknown layouts {sorted(set(args.layouts) - set(t.LAYOUTS))}")
device = args.device
lm = loaded(args.model)
tokens = token_windows(lm.tokenizer, "shakespeare", t.PROMPT + t.STEPS, 1).to(device)


def fp_log_probs(dtype):
    lm.model.to(device, dtype)
    with quantized_kv(lm.model, None, "cache") as fresh:
        return t.step_log_probs(lm.model, fresh()["past_key_values"], tokens).float()


fp32, fp16 = fp_log_probs(torch.float32), fp_log_probs(torch.float16)
print(f"fp16 floor {(fp32 - fp16).abs().max().item():.5f}")
for layout in args.layouts or t.LAYOUTS:
    lm.model.to(device, torch.float32)
    reference_fp32 = t.reference_log_probs(lm, layout, tokens)
    lm.model.to(device, torch.float16)
    reference, fp, fused = (log_probs.float() for log_probs in t.log_probs_three_ways(lm, layout, tokens))
    gap, effect = (fused - reference).abs().max().item(), (reference - fp).abs().max().item()
    print(f"{layout:24s} gap {gap:.5f}  quantization {effect:.5f}  ratio {effect / gap:.1f}  "
          f"reference max {reference.abs().max().item():.3f}  "
          f"reference fp16 - fp32 {(reference - reference_fp32).abs().max().item():.5f}")
