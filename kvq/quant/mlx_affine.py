"""mlx-lm's quantized KV cache (`--kv-bits B --kv-group-size G`): MLX's affine quantization of keys and values.

Per group of G coordinates (default 64) with b bits, n = 2^b - 1, as `mx.quantize(mode="affine")` computes it:
the scale s = max((max - min) / n, 1e-7), signed towards the group's edge of larger magnitude (min if
|min| > |max|, else max); the edge e is made exactly representable: q0 = round(e / s), and where q0 != 0,
s = e / q0 and the bias is e, else the bias is 0; codes are round((x - bias) / s) clipped to [0, n]. Scale and
bias are stored in the K/V dtype (16 bits each). Bits per element: b + 32 / G.

mlx-lm's `quantized_kv_start` (keep the cache in full precision until it holds that many tokens, then
quantize all of it) is the protocol's business, not the quantizer's: its nearest form is `exact_prefill`
(the prompt exact, generated tokens quantized), kvq.protocol.

The codes are a kvq packed layout (`packed_form`, scheme "mlx"): unsigned b-bit codes with the fp16 scale and bias
as a group's scale and offset, so kvq's packed cache holds them in as many bytes and its decode kernels read them,
and kvq.ops writes them with this arithmetic (`layout_codes`).

Method card. Follows MLX 0.32 (`mx.quantize`, affine): codes, scales and biases equal `mlx.core.quantize` on
float32 and fp16 input, with scale and bias stored in fp16 whatever the model dtype (as mlx-lm with an fp16
model stores them). Decoding is in float32, as MLX's quantized attention matmuls accumulate; MLX's standalone
fp16 `dequantize` rounds the product and the sum separately and may differ in the last fp16 bit.
"""

from dataclasses import dataclass

import torch

from kvq.errors import KvqError
from kvq.quant.base import Packed, Quantizer
from kvq.quant.blocks import merge_blocks, require_blocks, split_blocks
from kvq.quant.config import QuantizerConfig, register_quantizer
from kvq.quant.layout import PackedForm, PackedLayout
from kvq.quant.packing import pack, unpack
from kvq.quant.spec import Site

MLX_BITS = (2, 3, 4, 5, 6, 8)
SCALE_FLOOR = 1e-7
SIDE_BITS = 16


@dataclass
class AffinePacked(Packed):
    codes: torch.Tensor  # uint8, b-bit codes packed little-end first
    scales: torch.Tensor  # float16 (..., groups, 1)
    biases: torch.Tensor  # float16 (..., groups, 1)
    dtype: torch.dtype


class MLXAffine(Quantizer):
    def __init__(self, bits: int, group_size: int, d: int):
        if bits not in MLX_BITS:
            raise KvqError(f"mlx affine bits must be one of {', '.join(map(str, MLX_BITS))}, got {bits}")
        self.bits = bits
        self.group_size = group_size
        self.d = d
        self._form: PackedForm | None = None

    def quantize(self, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float32 codes, scales and biases of (..., groups, G), before the side data is stored."""
        levels = (1 << self.bits) - 1
        hi, lo = groups.amax(-1, keepdim=True), groups.amin(-1, keepdim=True)
        min_is_edge = lo.abs() > hi.abs()
        scale = ((hi - lo) / levels).clamp(min=SCALE_FLOOR)
        scale = torch.where(min_is_edge, scale, -scale)
        edge = torch.where(min_is_edge, lo, hi)
        q0 = torch.round(edge / scale)
        scale = torch.where(q0 != 0, edge / q0, scale)
        bias = torch.where(q0 == 0, torch.zeros_like(edge), edge)
        codes = torch.round((groups - bias) / scale).clamp(0, levels)
        return codes, scale, bias

    def encode(self, x: torch.Tensor) -> AffinePacked:
        codes, scale, bias = self.quantize(split_blocks(x, self.group_size, "mlx affine"))
        return AffinePacked(pack(merge_blocks(codes), self.bits), scale.half(), bias.half(), x.dtype)

    def decode(self, packed: AffinePacked) -> torch.Tensor:
        n_groups = packed.scales.shape[-2]
        codes = unpack(packed.codes, self.bits, n_groups * self.group_size, signed=False).float()
        groups = codes.reshape(*codes.shape[:-1], n_groups, self.group_size)
        return merge_blocks(groups * packed.scales.float() + packed.biases.float()).to(packed.dtype)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        return self.bits + 2 * SIDE_BITS / self.group_size

    def packed_form(self) -> PackedForm:
        if self._form is None:
            layout = PackedLayout(self.d, self.bits, self.group_size, torch.float16, symmetric=False, scheme="mlx")
            self._form = PackedForm.unrotated(layout)
        return self._form

    def packing_reason(self) -> None:
        return None


def layout_codes(y: torch.Tensor, layout: PackedLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 rows (n, d) -> the layout's codes (n, d * bits / 8) and fp16 stats (n, scales then biases): MLX's
    arithmetic (MLXAffine.quantize)."""
    quantizer = MLXAffine(layout.bits, layout.group_size, layout.head_dim)
    codes, scale, bias = quantizer.quantize(split_blocks(y, layout.group_size, "mlx affine"))
    return pack(merge_blocks(codes), layout.bits), torch.cat([scale.half(), bias.half()], dim=-2).squeeze(-1)


@register_quantizer("mlx")
@dataclass(frozen=True)
class MLXAffineConfig(QuantizerConfig):
    """MLX affine: b-bit codes per group of group_size coordinates, fp16 scale and bias per group."""

    bits: int
    group_size: int
    seeded = False

    def build(self, site: Site, seed: int) -> Quantizer:
        require_blocks(site.d, self.group_size, "mlx affine")
        return MLXAffine(self.bits, self.group_size, site.d)
