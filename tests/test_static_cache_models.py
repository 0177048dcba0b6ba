"""The static cache on real models, SRFT-4 in groups of 32 alone, with Qwen2's fp boundary layers and with 8-bit keys
(K8/V4; policies that help it on Qwen2.5, RESULTS.md), KIVI-2 and KIVI-4 (the frontier there), TurboQuant-3 and -4
(SmolLM2's) and formats engines ship (llama.cpp's q4_0, MXFP4, NVFP4, FP8 under a calibrated scale): a prompt
prefilled, then tokens of the text teacher-forced one decode step at a time, through the static cache (decode steps
attending from the codes) and through the reference protocol cache; each step's log-probability of the text's next
token must agree to float rounding.

A whole-sequence perplexity through the static cache is not this comparison: there every token after the window
is quantized by a decode step, and a code that one last bit flips changes every later step, so the two caches'
perplexities differ by the quantization noise itself. Each decode step below reads the same codes in both.
"""

import pytest
import torch
from conftest import DEVICES, loaded, requires_models

from kvq.apply import QuantizerBank, kv_geometry, quantized_kv
from kvq.cache import fused_decoding
from kvq.data import token_windows
from kvq.policy import parse_policy
from kvq.protocol import Protocol
from kvq.quant import QuantSpec
from kvq.static_cache import StaticQuantizedCache

PROMPT, STEPS = 120, 8
LAYOUTS = {  # (base spec, per-site policy, window): KIVI's window holds a whole 32-token key group
    "srft4-g32": (QuantSpec("srft", 4, "per_group", 32), None, 8),
    "srft4-g32-fp-boundary": (QuantSpec("srft", 4, "per_group", 32),
                              {"layers": [{"first": 1, "use": "fp"}, {"last": 1, "use": "fp"}]}, 8),
    "srft4-g32-k8v4": (QuantSpec("srft", 4, "per_group", 32), {"k": {"bits": 8}}, 8),  # vLLM's K8/V4 mix
    "kivi2-g32": (QuantSpec("kivi", 2, group_size=32), None, 32),
    "kivi4-g32": (QuantSpec("kivi", 4, group_size=32), None, 32),
    "turbo3": (QuantSpec("turbo", 3), None, 8),
    "turbo4": (QuantSpec("turbo", 4), None, 8),
    "ggml-q4_0": (QuantSpec("ggml", options={"type": "q4_0"}), None, 8),  # with llama.cpp's Hadamard rotation
    "mxfp4": (QuantSpec("mx"), None, 8),
    "nvfp4": (QuantSpec("nvfp4"), None, 8),  # the layer scales the reference cache's first encode calibrates
    "fp8-tensor": (QuantSpec("fp8", options={"scale": "tensor"}), None, 8),
}


def step_log_probs(model, cache, tokens: torch.Tensor) -> torch.Tensor:
    """(STEPS,) log-probabilities of the text's tokens PROMPT+1.. after a PROMPT-token prefill, one step each."""
    out = []
    with torch.no_grad():
        logits = model(tokens[:, :PROMPT], past_key_values=cache, use_cache=True).logits[:, -1]
        for i in range(PROMPT, PROMPT + STEPS):
            out.append(logits.float().log_softmax(-1)[0, tokens[0, i]])
            logits = model(tokens[:, i:i + 1], past_key_values=cache, use_cache=True).logits[:, -1]
    return torch.stack(out)


def layout_bank(lm, layout: str) -> QuantizerBank:
    spec, policy, _ = LAYOUTS[layout]
    return QuantizerBank(spec, kv_geometry(lm.model.config), policy=parse_policy(policy))


def reference_log_probs(lm, layout: str, tokens: torch.Tensor, bank: QuantizerBank | None = None) -> torch.Tensor:
    """step_log_probs of the model where it is (device, dtype) through the reference protocol cache under `layout`
    (with `bank`'s quantizers where given, else a new bank's)."""
    protocol = Protocol(LAYOUTS[layout][2], exact_prefill=True)
    with quantized_kv(lm.model, bank or layout_bank(lm, layout), "cache", protocol) as fresh:
        return step_log_probs(lm.model, fresh()["past_key_values"], tokens)


def log_probs_three_ways(lm, layout: str, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """step_log_probs of the model where it is (device, dtype) through the reference protocol cache under `layout`,
    through fp's cache, and through the static cache under `layout`."""
    bank, window = layout_bank(lm, layout), LAYOUTS[layout][2]
    reference = reference_log_probs(lm, layout, tokens, bank)
    with quantized_kv(lm.model, None, "cache") as fresh:
        fp = step_log_probs(lm.model, fresh()["past_key_values"], tokens)
    static = StaticQuantizedCache(bank, lm.model.config, PROMPT + STEPS, window)
    with fused_decoding(lm.model, static):
        fused = step_log_probs(lm.model, static, tokens)
    return reference, fp, fused


@requires_models
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_decode_steps_through_the_static_cache_score_as_the_protocol_cache(name, layout, device):
    """The model runs in fp32 on every device, so the caches differ by what the static cache's own arithmetic
    rounds: float32's on the CPU (the torch reference), the fused kernels' fp16 tensor-core operands on CUDA, where
    the bound is looser. In fp16 the model's arithmetic alone moves some layouts' protocol caches by more than that
    bound (benchmarks/static_cache_fp16_floor.py gives each layout's fp16 rounding)."""
    lm = loaded(name)
    lm.model.to(device, torch.float32)
    try:
        tokens = token_windows(lm.tokenizer, "shakespeare", PROMPT + STEPS, 1).to(device)
        reference, fp, fused = log_probs_three_ways(lm, layout, tokens)
    finally:
        lm.model.to("cpu", torch.float32)
    gap = (fused - reference).abs().max().item()
    # rounding grows with the numbers rounded: SRFT-4 alone collapses Qwen2.5, whose log-probabilities then grow large
    assert gap < (1e-4 if device == "cpu" else 1e-2) * max(1.0, reference.abs().max().item())
    assert (reference - fp).abs().max().item() > 10 * gap  # the quantization shows, and the caches agree on it
