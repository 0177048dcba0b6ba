"""KIVI baseline (Liu et al. 2024, as used in the HQMQ paper Sec. 4.8).

Asymmetric quantization, K per-channel over groups of `group_size` tokens and V per-token in groups
of `group_size` channels, fp16 scales and zero points; the tokens of a write that do not fill a whole
group stay in fp16 until they do, as in KIVI's streaming cache.

Method card. KIVI's full-precision window of recent tokens is not this quantizer's: it is the shared
evaluation protocol's `window` (kvq.protocol), which gives every method the same exact window and
charges it in the bits per element, so KIVI is compared at its true cost. Under a protocol with a window, the
eager protocol cache (kvq.apply) and the static cache hold a group's tokens exact until later writes make it
whole (`token_group`), as KIVI's streaming cache does; the default protocol's write cache encodes each write
alone.

Packed layouts (kvq.quant.layout): keys are unsigned codes per token with a scale and an offset per channel and
token group (group_size 1 over `token_group` tokens), values unsigned codes with a scale and an offset per token
and channel group, both with fp16 stats.
"""

from dataclasses import dataclass

import torch

from kvq.quant.base import Packed, Quantizer
from kvq.quant.config import QuantizerConfig, register_quantizer
from kvq.quant.layout import PackedForm, PackedLayout
from kvq.quant.scalar import ScalarPacked, ScalarQuantizer
from kvq.quant.spec import Site


@dataclass
class KIVIPacked(Packed):
    quantized: ScalarPacked | None
    residual: torch.Tensor  # fp16, the tokens short of a whole group
    shape: tuple[int, ...]

    def storage_bits(self) -> int:
        inner = self.quantized.storage_bits() if self.quantized is not None else 0
        return inner + self.residual.numel() * 16


class KIVI(Quantizer):
    def __init__(self, role: str, bits: int, group_size: int, d: int):
        self.role = role
        self.group_size = self.token_group = group_size
        granularity = "per_channel" if role == "k" else "per_group"
        self.inner = ScalarQuantizer(bits, granularity, group_size, symmetric=False, scale_dtype="float16")
        self.inner.grouping(d)  # a value group that does not divide head_dim fails here, at build
        if role == "k":
            layout = PackedLayout(d, bits, 1, torch.float16, symmetric=False, token_group=group_size)
        else:
            layout = PackedLayout(d, bits, group_size, torch.float16, symmetric=False)
        self._form = PackedForm.unrotated(layout)

    def quantized_tokens(self, n_tokens: int) -> int:
        return n_tokens // self.group_size * self.group_size

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """K: (..., T, d) -> (..., T/G, G, d) so per-channel stats cover one token group."""
        if self.role != "k":
            return x
        return x.reshape(*x.shape[:-2], x.shape[-2] // self.group_size, self.group_size, x.shape[-1])

    def encode(self, x: torch.Tensor) -> KIVIPacked:
        n_quant = self.quantized_tokens(x.shape[-2])
        head, tail = x[..., :n_quant, :], x[..., n_quant:, :]
        quantized = self.inner.encode(self._grouped(head)) if n_quant else None
        return KIVIPacked(quantized, tail.to(torch.float16), tuple(x.shape))

    def decode(self, packed: KIVIPacked) -> torch.Tensor:
        parts = []
        if packed.quantized is not None:
            head = self.inner.decode(packed.quantized)
            parts.append(head.reshape(*packed.shape[:-2], -1, packed.shape[-1]))
        parts.append(packed.residual.to(parts[0].dtype if parts else torch.float32))
        return torch.cat(parts, dim=-2)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        n_quant = self.quantized_tokens(n_tokens)
        inner = self.inner.bits_per_element(d, self.group_size) if n_quant else 0.0
        return (n_quant * inner + (n_tokens - n_quant) * 16) / n_tokens

    def packed_form(self) -> PackedForm:
        return self._form

    def packing_reason(self) -> None:
        return None


@register_quantizer("kivi")
@dataclass(frozen=True)
class KIVIConfig(QuantizerConfig):
    """K per channel over groups of group_size tokens, V per token in groups of group_size channels."""

    bits: int
    group_size: int
    seeded = False

    def build(self, site: Site, seed: int) -> Quantizer:
        return KIVI(site.role, self.bits, self.group_size, site.d)
