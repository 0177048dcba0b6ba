from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvq.quant.layout import PackedForm


@dataclass
class Packed:
    """Base for packed representations: every tensor field is real storage and counts towards bits."""

    def storage_bits(self) -> int:
        # the instance dict holds exactly the fields, at a fraction of dataclasses.fields' cost (the
        # fused cache meters every flush of every layer)
        return sum(value.numel() * value.element_size() * 8 for value in vars(self).values()
                   if isinstance(value, torch.Tensor))


class Quantizer(ABC):
    """Quantizes tensors of shape (..., tokens, d) along the last dim.

    `bits_per_element(d, n_tokens)` is the exact storage cost of one encode call over `n_tokens`
    tokens of width d: payload, scales (in their stored dtype), zero points and outlier side data.
    Calibration constants shared by all tokens of a layer (lambda, rotations, codebooks) are model
    parameters, not per-token storage, and are not counted.
    """

    @abstractmethod
    def encode(self, x: torch.Tensor) -> Packed: ...

    @abstractmethod
    def decode(self, packed: Packed) -> torch.Tensor: ...

    @abstractmethod
    def bits_per_element(self, d: int, n_tokens: int) -> float: ...

    stored_bits = 0
    stored_elements = 0
    # Consecutive positions whose codes share stats (KIVI's keys: a scale per channel over a group of tokens): a
    # cache quantizes them together once the group is whole and holds the tokens short of one exact until then.
    token_group = 1

    def packed_form(self) -> "PackedForm | None":
        """The PackedLayout, with its constants, that kernels and the fused cache read this quantizer's storage
        in; None where there is none (packing_reason says why)."""
        return None

    def calibrated_form(self, x: torch.Tensor) -> "PackedForm | None":
        """packed_form() for a store whose first K/V is x: where the layout is layer_scaled, the quantizer calibrates
        its layer scale on x (unless it has already, as its own first encode would) and the form holds it."""
        return self.packed_form()

    def packing_reason(self) -> str | None:
        return f"{type(self).__name__} declares no packed layout"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize-dequantize: what the model sees when this quantizer sits on its KV path.

        Also meters the storage, so data-dependent costs (outliers, residual windows) are reported
        as measured rather than assumed."""
        return self.decode(self.metered_encode(x))

    def metered_encode(self, x: torch.Tensor) -> Packed:
        return self.meter(self.encode(x), x.numel())

    def rewind(self, n_elements: int, bits_per_element: float) -> None:
        """Takes back an earlier call's storage of n_elements that a later call encodes again (tokens held exact
        until their token group is whole)."""
        self.stored_bits -= round(n_elements * bits_per_element)
        self.stored_elements -= n_elements

    def meter(self, packed: Packed, n_elements: int) -> Packed:
        """Adds one encode call's storage to the running totals (also for kernel-made packings)."""
        self.stored_bits += packed.storage_bits()
        self.stored_elements += n_elements
        return packed
