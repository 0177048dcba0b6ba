"""What one decode attention step reads besides the query, and the reference attention over it.

The fused kernels (kvq.kernels.decode_attention, CUDA only) and the torch reference (here, every device) read
the same DecodeStep; kvq.ops picks between them. This module runs on every device, so a cell measured on a CPU
imports it and none of the kernels' modules.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvq.kernels.stats import packed_codes, per_token_stats
from kvq.quant.codebooks import decode_unit_vector
from kvq.quant.layout import PackedForm, group_scales
from kvq.quant.packing import unpack
from kvq.quant.rotated import RotatedPacked
from kvq.quant.scalar import ScalarQuantizer
from kvq.rotations import Identity


@dataclass
class PackedKV:
    """Packed codes (B, H, T, d*bits/8) uint8 and fp32 or fp16 scales (B, H, T, groups) of one role; unsigned
    codes with offsets after the scales (B, H, T, 2 groups) where not `symmetric`; one stats row per
    `token_group` tokens (B, H, T / token_group, .) where the stats span tokens; unsigned indices into `codebook`
    where it is set, with fp32, fp16, E8M0 or E4M3 scales, or none (B, H, T, 0): a layer_scaled layout's codes, whose
    layer scale the DecodeStep's maps carry (kvq.quant.layout). `float_mantissa`: where the codes are a
    float format's bit patterns (sign, exponent, this many mantissa bits; bias 2^(exponent bits - 1) - 1, as every
    kvq.quant.minifloat element format has), whose values the codebook holds, so a kernel may compute them from the
    bits instead."""

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    head_dim: int
    symmetric: bool = True
    token_group: int = 1
    codebook: torch.Tensor | None = None
    float_mantissa: int | None = None

    @classmethod
    def holding(cls, codes: torch.Tensor, scales: torch.Tensor, form: PackedForm) -> "PackedKV":
        """Codes and stats written in form's layout (kvq.ops.quantize), with the constants that read them."""
        layout, element = form.layout, form.layout.element
        return cls(codes, scales, layout.bits, layout.head_dim, layout.symmetric, layout.token_group,
                   form.on(codes.device).codebook, None if element is None else element.mantissa_bits)

    def rows(self, n: int) -> "PackedKV":
        """The first n tokens (and the stats rows they read)."""
        stats_rows = -(-n // self.token_group)
        return PackedKV(self.codes[..., :n, :], self.scales[..., :stats_rows, :], self.bits, self.head_dim,
                        self.symmetric, self.token_group, self.codebook, self.float_mantissa)

    def token_stats(self) -> torch.Tensor:
        """The stats row each token reads, one per token (B, H, T, .)."""
        return per_token_stats(self.scales, self.token_group, self.codes.shape[-2])

    @property
    def stats_dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def groups(self) -> int:
        """Scale groups per row (one where there are no stats)."""
        stats = self.scales.shape[-1]
        return 1 if not stats else stats if self.symmetric else stats // 2

    @property
    def group(self) -> int:
        return self.head_dim // self.groups

    def as_packed(self, dtype: torch.dtype) -> RotatedPacked:
        """The same codes as the reference quantizers' packed dataclass."""
        return packed_codes(self.codes, self.token_stats(), (*self.codes.shape[:-1], self.head_dim), dtype,
                            self.symmetric)

    def dequantized(self) -> torch.Tensor:
        """float32 codes x scales (+ offsets) in the quantizer's rotated domain (the reference ScalarQuantizer
        decode; per-token scales are the one-group case), or the codebook's levels times their group's scale (the
        levels alone without stats: the layer scale is the maps')."""
        if self.codebook is not None:
            codes = unpack(self.codes, self.bits, self.head_dim, signed=False)
            return decode_unit_vector(codes, group_scales(self.scales, None), Identity(self.head_dim), self.codebook)
        return ScalarQuantizer(self.bits, "per_group", self.group, self.symmetric).decode(
            self.as_packed(torch.float32).inner)


@dataclass(frozen=True)
class DecodeStep:
    """What one decode attention step reads besides the query: packed K and V, the exact window's K and V
    rows (B, Hkv, n_window, d), and the domain maps (kvq.cache.DomainMaps): query_map (d, d) takes the query
    into the keys' coded domain, output_map (d, d) the values' back."""

    keys: PackedKV
    values: PackedKV
    window: tuple[torch.Tensor, torch.Tensor]
    query_map: torch.Tensor
    output_map: torch.Tensor


def decode_attention_reference(query: torch.Tensor, step: DecodeStep, scale: float) -> torch.Tensor:
    """query (B, Hq, d) -> attention output (B, Hq, d) in the query's dtype, all in the model's domain."""
    k = torch.cat([step.keys.dequantized() @ step.query_map.T, step.window[0].float()], dim=-2)
    v = torch.cat([step.values.dequantized() @ step.output_map, step.window[1].float()], dim=-2)
    out = F.scaled_dot_product_attention(query.float().unsqueeze(-2), k, v, scale=scale,
                                         enable_gqa=query.shape[1] != k.shape[1])
    return out.squeeze(-2).to(query.dtype)


def device_lengths(n_packed: int, n_window: int) -> int:
    """Both token counts in one int64 (packed << 32 | window), so one fill updates them on the device."""
    return n_packed << 32 | n_window


def packed_read_bytes(batch: int, kv_heads: int, tokens: int, d: int, bits: int, group: int,
                      scale_bytes: int = 4) -> int:
    """Bytes a decode step reads from the packed cache: codes and scales (`scale_bytes` each) of K and V."""
    return 2 * batch * kv_heads * tokens * (d * bits // 8 + scale_bytes * d // group)
