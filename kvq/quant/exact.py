"""The exact site of a mixed policy (kvq.policy's `use: fp`): K/V kept as they are, stored as fp16."""

from dataclasses import dataclass

import torch

from kvq.protocol import FP16_BITS
from kvq.quant.base import Packed, Quantizer


@dataclass
class ExactPacked(Packed):
    values: torch.Tensor


class Exact(Quantizer):
    """Returns its input unchanged and meters 16 bits per element, what a cache holding the site in fp16 stores
    (as kvq.protocol counts the exact window's tokens), whatever dtype the model runs in."""

    def encode(self, x: torch.Tensor) -> ExactPacked:
        return ExactPacked(x)

    def decode(self, packed: ExactPacked) -> torch.Tensor:
        return packed.values

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        return float(FP16_BITS)

    def meter(self, packed: Packed, n_elements: int) -> Packed:
        self.stored_bits += FP16_BITS * n_elements
        self.stored_elements += n_elements
        return packed

    def packing_reason(self) -> str | None:
        return "an exact (fp) site holds no packed codes"
