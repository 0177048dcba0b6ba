"""How many RoPE pairs of the keys' pre-RoPE mean must move with position for a centering to work as `center: mean`
does? TurboQuant_mse-4 on Qwen2.5-Coder-0.5B, cache mode, every key quantized, KL to fp, keys less: the pre-RoPE
mean moved by RoPE (`center: mean`), the post-RoPE constant (`center: post_rope_mean`, which the static cache
stores), and hybrids: the moved mean on the m pairs per head where the pre-RoPE mean is largest, the post-RoPE
constant on the rest. A fast path would pay for each moved pair with a score correction per token; the constant is
free (softmax ignores it).

    python scripts/center_pairs_probe.py [--pairs 2,4,8,16] [--seed 0] [--corpus shakespeare] [--windows 2]
"""
import argparse

import torch

from kvq import models
from kvq.apply import QuantizerBank, kv_geometry
from kvq.center import KeyCenter, mean_offsets
from kvq.data import token_windows
from kvq.ppl import perplexity
from kvq.quant import QuantSpec

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--pairs", default="2,4,8,16")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--corpus", default="shakespeare")
parser.add_argument("--windows", type=int, default=2)
args = parser.parse_args()

lm = models.load("qwen2.5-coder-0.5b")
model = lm.model.eval()
geometry = kv_geometry(model.config)
d, layers = geometry.head_dim, list(range(geometry.n_layers))
calibration = token_windows(lm.tokenizer, args.corpus, 512, args.windows, "calib", at_most=True)
windows = token_windows(lm.tokenizer, args.corpus, 512, args.windows, split="eval")
pre_rope = mean_offsets(model, layers, d, calibration, "cache", 2)
post_rope = mean_offsets(model, layers, d, calibration, "cache", 2, after_rope=True)
fp_log_probs: list = []
perplexity(model, windows, None, "cache", 2, keep_log_probs=fp_log_probs)


class MovedOnPairs(KeyCenter):
    """The pre-RoPE mean moved by RoPE on the channels `moved` marks, the post-RoPE constant on the others."""

    def __init__(self, moved: dict[int, torch.Tensor]):
        super().__init__(model, pre_rope, 0)
        self.moved = moved

    def offset(self, layer, keys, rotated):
        mask = self.moved[layer].to(keys.device)[None, :, None, :]
        constant = post_rope[layer].to(keys.device)[None, :, None, :]
        return torch.where(mask, super().offset(layer, keys, rotated), constant)


def largest_pairs(m: int) -> dict[int, torch.Tensor]:
    """Per layer and head, the channels of the m RoPE pairs (rotate_half's i and i + d/2) of largest mean."""
    masks = {}
    for layer in layers:
        energy = pre_rope[layer][:, :d // 2] ** 2 + pre_rope[layer][:, d // 2:] ** 2
        pairs = torch.zeros_like(energy, dtype=torch.bool).scatter_(1, energy.topk(m, dim=-1).indices, True)
        masks[layer] = torch.cat([pairs, pairs], dim=-1)
    return masks


centers = [("moved mean (center: mean)", KeyCenter(model, pre_rope, 0)),
           ("post-RoPE constant (post_rope_mean)", KeyCenter(model, post_rope, 0, fixed=frozenset(layers)))]
centers += [(f"moved on {m} of {d // 2} pairs", MovedOnPairs(largest_pairs(m)))
            for m in map(int, args.pairs.split(","))]
for label, center in centers:
    bank = QuantizerBank(QuantSpec("turbo", 4, seed=args.seed, center="mean"), geometry)
    bank.center = center
    result = perplexity(model, windows, bank, "cache", 2, reference=fp_log_probs)
    print(f"{label:38s} KL {result.divergence.kld:.4f}  PPL {result.ppl:.3f}", flush=True)
