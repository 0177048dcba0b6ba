"""How far the static cache that stores keys less a constant scores from the protocol cache that adds it back.

Usage: python benchmarks/centered_static_cache_gap.py [cpu|cuda]

The tiny models and offsets of test_static_cache's centering test, offsets scaled by 0, 0.5 and 2, a 40-token prompt
and then 30 fixed random tokens fed to every cache (teacher-forced, so no near-tie between two greedy paths can
part them). Prints, per model, layout and scale, the largest logit gap over the steps of the fused run (the CUDA
partials under fused_decoding) and of the same static cache through the torch reference, and the smallest margin
between the protocol cache's top two logits: a greedy test can part where that margin is within twice the gap.
"""
import sys

import torch

sys.path.insert(0, "tests")
from test_static_cache import FRONTIER, centered_bank, greedy, tiny

from kvq.apply import quantized_kv
from kvq.cache import fused_decoding
from kvq.protocol import Protocol
from kvq.quant import QuantSpec
from kvq.static_cache import StaticQuantizedCache

LAYOUTS = {"turbo4": FRONTIER["turbo4"], "srft4": QuantSpec("srft", 4, "per_group", 16)}


def gaps(kind: str, spec: QuantSpec, scale: float, device: str) -> tuple[float, float, float]:
    model = tiny(kind).to(device)
    bank = centered_bank(model, spec, scale)
    prompt = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(1)).to(device)
    fed = torch.randint(0, 101, (2, 30), generator=torch.Generator().manual_seed(3)).to(device)
    with quantized_kv(model, bank, "cache", Protocol(16, exact_prefill=True)) as fresh:
        expected = greedy(model, fresh()["past_key_values"], prompt, 30, follow=fed)[1]
    with fused_decoding(model, static := StaticQuantizedCache(bank, model.config, max_cache_len=72, window=16)):
        fused = greedy(model, static, prompt, 30, follow=fed)[1]
    reference = greedy(model, StaticQuantizedCache(bank, model.config, max_cache_len=72, window=16), prompt, 30,
                       follow=fed)[1]
    top2 = expected.topk(2, -1).values
    margin = (top2[..., 0] - top2[..., 1]).min()
    return (fused - expected).abs().max().item(), (reference - expected).abs().max().item(), margin.item()


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    print("| model | layout | offset scale | fused vs protocol | reference vs protocol | smallest top-2 margin |")
    print("|---|---|---|---|---|---|")
    for kind in ["qwen2", "gemma3"]:
        for name, spec in LAYOUTS.items():
            for scale in [0.0, 0.5, 2.0]:
                fused, reference, margin = gaps(kind, spec, scale, device)
                print(f"| {kind} | {name} | {scale} | {fused:.1e} | {reference:.1e} | {margin:.1e} |")


if __name__ == "__main__":
    main()
