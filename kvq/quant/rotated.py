from dataclasses import dataclass

import torch

from kvq.quant.base import Packed, Quantizer
from kvq.rotations import Rotation

LAMBDA_FLOOR = 1e-6


@dataclass
class RotatedPacked(Packed):
    inner: Packed

    def storage_bits(self) -> int:
        return self.inner.storage_bits()


class RotatedQuantizer(Quantizer):
    """rotate -> optional per-coordinate lambda -> inner quantizer; decode divides by lambda
    (clamped at 1e-6, SRFT paper Sec. 5.1) and rotates back."""

    def __init__(self, rotation: Rotation, inner: Quantizer, lam: torch.Tensor | None = None):
        self.rotation = rotation
        self.inner = inner
        self.lam = lam

    def _lam(self, like: torch.Tensor) -> torch.Tensor:
        return self.lam.to(device=like.device, dtype=torch.float32).clamp_min(LAMBDA_FLOOR)

    def encode(self, x: torch.Tensor) -> RotatedPacked:
        y = self.rotation.forward(x.float())
        if self.lam is not None:
            y = y * self._lam(y)
        return RotatedPacked(self.inner.encode(y))

    def decode(self, packed: RotatedPacked) -> torch.Tensor:
        y = self.inner.decode(packed.inner).float()
        if self.lam is not None:
            y = y / self._lam(y)
        return self.rotation.inverse(y)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        return self.inner.bits_per_element(d, n_tokens)
