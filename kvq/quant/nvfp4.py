"""NVFP4 KV cache (TensorRT-LLM, vLLM and SGLang on Blackwell): E2M1 values, an E4M3 scale per 16 coordinates
and one fp32 scale per layer.

Two-level scaling as NVIDIA defines it: the layer scale is s = amax / (448 * 6); each block's scale is
max|x_block| / 6 / s, clamped to [2^-6, 448] and cast to E4M3 (ties to even); each coordinate is the E2M1
code of x / (s * block scale), saturated at 6. Bits per element: 4 + 8/16 = 4.5.

Method card. Follows torchao 0.18's `nvfp4_quantize` with a per-tensor scale (its float32 arithmetic:
x * ((1 / s) / block scale)); codes and block scales equal torchao's. The layer scale is calibrated as FP8's
(kvq.quant.fp8): fixed by the first K/V the site sees and, as a layer constant, not counted in the bits.

The codes are a kvq packed layout (`packed_form`, scheme "nvfp4_e2m1"): indices into E2M1's 16 values, the E4M3 block
scales as the layout's stats (float8_e4m3fn) and the layer scale as its layer scale, so the static cache holds exactly
what is counted and the decode kernels read the codes, the layer scale folded into the query and output maps.
"""

from dataclasses import dataclass

import torch

from kvq.quant.base import Packed, Quantizer
from kvq.quant.blocks import merge_blocks, require_blocks, split_blocks
from kvq.quant.config import QuantizerConfig, register_quantizer
from kvq.quant.layout import E4M3_STATS, NVFP4_SCHEME, PackedForm, PackedLayout
from kvq.quant.minifloat import E2M1, E4M3
from kvq.quant.packing import pack, unpack
from kvq.quant.spec import Site

BLOCK = 16
SMALLEST_SCALE = torch.finfo(torch.float8_e4m3fn).tiny


@dataclass
class NVFP4Packed(Packed):
    codes: torch.Tensor  # uint8: E2M1 codes, two per byte, neighbours in low then high nibble
    scales: torch.Tensor  # uint8 (..., blocks): E4M3 bit patterns
    dtype: torch.dtype


def block_codes(x: torch.Tensor, layer_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., d) -> packed E2M1 codes (..., d / 2) and E4M3 block scales (..., d / 16) as uint8 bit patterns, under
    the layer scale s: torchao's float32 arithmetic."""
    blocks = split_blocks(x, BLOCK, "nvfp4")
    block_scale = blocks.abs().amax(-1, keepdim=True) / E2M1.max_value / layer_scale
    scales = E4M3.encode(block_scale.clamp(SMALLEST_SCALE, E4M3.max_value))
    scaled = blocks * ((1.0 / layer_scale) / E4M3.decode(scales))
    codes = E2M1.encode(scaled.clamp(-E2M1.max_value, E2M1.max_value))
    return pack(merge_blocks(codes), E2M1.bits), scales.squeeze(-1)


class NVFP4(Quantizer):
    def __init__(self, d: int):
        self.d = d
        self.layer_scale: torch.Tensor | None = None
        self._form: PackedForm | None = None

    def _calibrate(self, x: torch.Tensor) -> torch.Tensor:
        """The layer scale amax / (448 * 6) of float32 x, fixed by the first x."""
        if self.layer_scale is None:
            amax = x.abs().amax()
            self.layer_scale = torch.where(amax > 0, amax, torch.ones_like(amax)) / (E4M3.max_value * E2M1.max_value)
        return self.layer_scale

    def encode(self, x: torch.Tensor) -> NVFP4Packed:
        return NVFP4Packed(*block_codes(x, self._calibrate(x.float())), x.dtype)

    def decode(self, packed: NVFP4Packed) -> torch.Tensor:
        n_blocks = packed.scales.shape[-1]
        codes = unpack(packed.codes, E2M1.bits, n_blocks * BLOCK, signed=False)
        codes = codes.reshape(*codes.shape[:-1], n_blocks, BLOCK)
        values = E2M1.decode(codes) * (E4M3.decode(packed.scales).unsqueeze(-1) * self.layer_scale)
        return merge_blocks(values).to(packed.dtype)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        return E2M1.bits + E4M3.bits / BLOCK

    def packing_reason(self) -> None:
        return None

    def packed_form(self) -> PackedForm:
        """E2M1's values indexed by code, an E4M3 scale per block of 16, the layer scale (None until calibrated)."""
        if self._form is None:
            layout = PackedLayout(self.d, E2M1.bits, BLOCK, E4M3_STATS, codebook=True, scheme=NVFP4_SCHEME,
                                  layer_scaled=True)
            self._form = PackedForm.unrotated(layout, E2M1.levels())
        if self._form.layer_scale is None and self.layer_scale is not None:
            self._form = self._form.scaled_by(self.layer_scale)
        return self._form

    def calibrated_form(self, x: torch.Tensor) -> PackedForm:
        self._calibrate(x.float())
        return self.packed_form()


def layout_codes(y: torch.Tensor, layout: PackedLayout, layer_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 rows (n, d) -> NVFP4.encode's codes and block scales (as float8_e4m3fn stats) under the layer scale."""
    codes, scales = block_codes(y, layer_scale)
    return codes, scales.view(E4M3_STATS)


@register_quantizer("nvfp4")
@dataclass(frozen=True)
class NVFP4Config(QuantizerConfig):
    """E2M1 codes, an E4M3 scale per 16 coordinates, one calibrated fp32 scale per layer."""

    seeded = False

    def build(self, site: Site, seed: int) -> Quantizer:
        require_blocks(site.d, BLOCK, "nvfp4")
        return NVFP4(site.d)
