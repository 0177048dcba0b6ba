"""OCP Microscaling (MX) KV formats: MXFP4, MXFP6 (e2m3, e3m2) and MXFP8 (e4m3, e5m2).

Per the OCP MX v1.0 spec (Sec. 5-6): each block of 32 coordinates shares one E8M0 scale X = 2^(floor(log2
max|x|) - emax), emax the exponent of the element format's largest normal, and each coordinate is stored as
the element format's code of x / X, rounded to nearest-even and saturated. Bits per element: the element
width plus 8/32.

Method card. Follows the spec's conversion as torchao 0.18 implements it (`to_mx`, ScaleCalculationMode.FLOOR;
a block of zeros gets scale 2^-127, decoded as zeros); codes and scales equal torchao's. Engines that ship
MXFP4 weights (gpt-oss, ggml's MXFP4 type) round ties differently; this is the spec's rounding.

The codes are a kvq packed layout (`packed_form`, scheme "mx_<element>"): indices into the element format's values,
with the E8M0 scale byte per block as the layout's scale, so the static cache holds exactly what is counted and the
decode kernels read the codes.
"""

from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from kvq.quant.base import Packed, Quantizer
from kvq.quant.blocks import merge_blocks, require_blocks, split_blocks
from kvq.quant.config import QuantizerConfig, register_quantizer
from kvq.quant.layout import E8M0, MX_SCHEMES, PackedForm, PackedLayout
from kvq.quant.minifloat import E8M0_BIAS, F32_MANTISSA_BITS, FORMATS, MiniFloat, e8m0_value
from kvq.quant.packing import pack, unpack
from kvq.quant.spec import Site

BLOCK = 32
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


def block_codes(x: torch.Tensor, element: MiniFloat) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., d) -> packed element codes (..., d * bits / 8) and E8M0 scales (..., d / 32): the spec's conversion."""
    blocks = split_blocks(x, BLOCK, f"mx {element.name}")
    scales = e8m0_scale(blocks.abs().amax(-1, keepdim=True), element)
    codes = element.encode(blocks / e8m0_value(scales).clamp(min=F32_MIN_NORMAL))
    return pack(merge_blocks(codes), element.bits), scales.squeeze(-1)


class MX(Quantizer):
    def __init__(self, element: MiniFloat, d: int):
        self.element = element
        self.d = d
        self._form: PackedForm | None = None

    def encode(self, x: torch.Tensor) -> MXPacked:
        return MXPacked(*block_codes(x, self.element), x.dtype)

    def decode(self, packed: MXPacked) -> torch.Tensor:
        n_blocks = packed.scales.shape[-1]
        codes = unpack(packed.codes, self.element.bits, n_blocks * BLOCK, signed=False)
        codes = codes.reshape(*codes.shape[:-1], n_blocks, BLOCK)
        values = self.element.decode(codes) * e8m0_value(packed.scales).unsqueeze(-1)
        return merge_blocks(values).to(packed.dtype)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        return self.element.bits + 8 / BLOCK

    def packing_reason(self) -> None:
        return None

    def packed_form(self) -> PackedForm:
        """The element format's values indexed by code, an E8M0 scale per block of 32."""
        if self._form is None:
            layout = PackedLayout(self.d, self.element.bits, BLOCK, E8M0, codebook=True,
                                  scheme=f"mx_{self.element.name}")
            self._form = PackedForm.unrotated(layout, self.element.levels())
        return self._form


def _layout_codes(element: MiniFloat, y: torch.Tensor, layout: PackedLayout) -> tuple[torch.Tensor, torch.Tensor]:
    return block_codes(y, element)


LAYOUT_CODES = {scheme: partial(_layout_codes, FORMATS[scheme.removeprefix("mx_")]) for scheme in MX_SCHEMES}


@register_quantizer("mx")
@dataclass(frozen=True)
class MXConfig(QuantizerConfig):
    """OCP MX: blocks of 32 with an E8M0 scale; element fp4 (e2m1), fp6 (e2m3, e3m2) or fp8 (e4m3, e5m2)."""

    element: Literal["e2m1", "e2m3", "e3m2", "e4m3", "e5m2"] = "e2m1"
    seeded = False

    def build(self, site: Site, seed: int) -> Quantizer:
        require_blocks(site.d, BLOCK, f"mx {self.element}")
        return MX(FORMATS[self.element], site.d)
