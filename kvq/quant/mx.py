"""OCP Microscaling (MX) KV formats: MXFP4, MXFP6 (e2m3, e3m2) and MXFP8 (e4m3, e5m2).

Per the OCP MX v1.0 spec (Sec. 5-6): each block of 32 coordinates shares one E8M0 scale X = 2^(floor(log2
max|x|) - emax), emax the exponent of the element format's largest normal, and each coordinate is stored as
the element format's code of x / X, rounded to nearest-even and saturated. Bits per element: the element
width plus 8/32.

Method card. Follows the spec's conversion as torchao 0.18 implements it (`to_mx`, ScaleCalculationMode.FLOOR;
a block of zeros gets scale 2^-127, decoded as zeros); codes and scales equal torchao's. Engines that ship
MXFP4 weights (gpt-oss, ggml's MXFP4 type) round ties differently; this is the spec's rounding.
"""

from dataclasses import dataclass
from typing import Literal

import torch

from kvq.quant.base import Packed, Quantizer
from kvq.quant.blocks import merge_blocks, require_blocks, split_blocks
from kvq.quant.config import QuantizerConfig, register_quantizer
from kvq.quant.minifloat import FORMATS, MiniFloat
from kvq.quant.packing import pack, unpack
from kvq.quant.spec import Site

BLOCK = 32
E8M0_BIAS = 127
F32_MANTISSA_BITS = 23
F32_MIN_NORMAL = torch.finfo(torch.float32).tiny


@dataclass
class MXPacked(Packed):
    codes: torch.Tensor  # uint8, element codes packed little-end first (kvq.quant.packing)
    scales: torch.Tensor  # uint8 (..., blocks): biased E8M0 exponents
    dtype: torch.dtype


def e8m0_scale(amax: torch.Tensor, element: MiniFloat) -> torch.Tensor:
    """Biased E8M0 exponent of each block: floor(log2 amax) read from amax's float32 exponent bits, minus emax."""
    unbiased = ((amax.view(torch.int32) >> F32_MANTISSA_BITS) & 0xFF) - E8M0_BIAS - element.max_power_of_two
    return (unbiased.clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS).to(torch.uint8)


def e8m0_value(biased: torch.Tensor) -> torch.Tensor:
    return (biased.to(torch.int32) << F32_MANTISSA_BITS).view(torch.float32)


class MX(Quantizer):
    def __init__(self, element: MiniFloat):
        self.element = element

    def encode(self, x: torch.Tensor) -> MXPacked:
        blocks = split_blocks(x, BLOCK, f"mx {self.element.name}")
        scales = e8m0_scale(blocks.abs().amax(-1, keepdim=True), self.element)
        codes = self.element.encode(blocks / e8m0_value(scales).clamp(min=F32_MIN_NORMAL))
        return MXPacked(pack(merge_blocks(codes), self.element.bits), scales.squeeze(-1), x.dtype)

    def decode(self, packed: MXPacked) -> torch.Tensor:
        n_blocks = packed.scales.shape[-1]
        codes = unpack(packed.codes, self.element.bits, n_blocks * BLOCK, signed=False)
        codes = codes.reshape(*codes.shape[:-1], n_blocks, BLOCK)
        values = self.element.decode(codes) * e8m0_value(packed.scales).unsqueeze(-1)
        return merge_blocks(values).to(packed.dtype)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        return self.element.bits + 8 / BLOCK

    def packing_reason(self) -> str | None:
        return "MX codes run through the reference cache; the fused cache holds integer codes only"


@register_quantizer("mx")
@dataclass(frozen=True)
class MXConfig(QuantizerConfig):
    """OCP MX: blocks of 32 with an E8M0 scale; element fp4 (e2m1), fp6 (e2m3, e3m2) or fp8 (e4m3, e5m2)."""

    element: Literal["e2m1", "e2m3", "e3m2", "e4m3", "e5m2"] = "e2m1"
    seeded = False

    def build(self, site: Site, seed: int) -> Quantizer:
        require_blocks(site.d, BLOCK, f"mx {self.element}")
        return MX(FORMATS[self.element])
