"""KIVI baseline (Liu et al. 2024, as used in the HQMQ paper Sec. 4.8).

Asymmetric quantization, K per-channel over groups of `group_size` tokens and V per-token in groups
of `group_size` channels, fp16 scales and zero points; the tokens of a write that do not fill a whole
group stay in fp16 until they do, as in KIVI's streaming cache.

Method card. KIVI's full-precision window of recent tokens is not this quantizer's: it is the shared
evaluation protocol's `window` (kvq.protocol), which gives every method the same exact window and
charges it in the bits per element, so KIVI is compared at its true cost.
"""

from dataclasses import dataclass

import torch

from kvq.quant.base import Packed, Quantizer
from kvq.quant.config import QuantizerConfig, register_quantizer
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
    def __init__(self, role: str, bits: int, group_size: int = 32):
        self.role = role
        self.group_size = group_size
        granularity = "per_channel" if role == "k" else "per_group"
        self.inner = ScalarQuantizer(bits, granularity, group_size, symmetric=False, scale_dtype="float16")

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


@register_quantizer("kivi")
@dataclass(frozen=True)
class KIVIConfig(QuantizerConfig):
    """K per channel over groups of group_size tokens, V per token in groups of group_size channels."""

    bits: int
    group_size: int
    seeded = False

    def build(self, site: Site, seed: int) -> Quantizer:
        return KIVI(site.role, self.bits, self.group_size)
