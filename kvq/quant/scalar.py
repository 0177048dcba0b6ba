"""Uniform scalar quantization (symmetric or asymmetric, 2-8 bits) at four granularities.

Input is (..., T, d): T tokens of head vectors. Granularities:
- per_token: one scale per head vector.
- per_channel: one scale per coordinate, shared over the T tokens of the encode call (KIVI's K).
- per_group: one scale per group of `group_size` consecutive coordinates of each token.
- per_channel_group: divide by the per-channel abs-max first, then per-group abs-max on the
  rescaled values (the SRFT paper's per_channel_group recipe, Sec. 7.1).
"""

from dataclasses import dataclass

import torch

from kvq.errors import KvqError
from kvq.quant.base import Packed, Quantizer
from kvq.quant.packing import pack, packed_row_bytes, unpack

GRANULARITIES = ("per_token", "per_channel", "per_group", "per_channel_group")
GROUPED = ("per_group", "per_channel_group")  # the granularities that read group_size
SCALE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ScalarPacked(Packed):
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    channel_scale: torch.Tensor | None
    shape: tuple[int, ...]
    dtype: torch.dtype


def round_straight_through(x: torch.Tensor) -> torch.Tensor:
    return x + (torch.round(x) - x).detach()


class ScalarQuantizer(Quantizer):
    def __init__(
        self,
        bits: int,
        granularity: str = "per_token",
        group_size: int = 32,
        symmetric: bool = True,
        scale_dtype: str = "float32",
    ):
        if not 2 <= bits <= 8:
            raise KvqError(f"bits must be in 2..8, got {bits}")
        if granularity not in GRANULARITIES:
            raise KvqError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
        if scale_dtype not in SCALE_DTYPES:
            raise KvqError(f"scale_dtype must be one of {', '.join(SCALE_DTYPES)}, got {scale_dtype!r}")
        if group_size < 1:
            raise KvqError(f"group_size must be positive, got {group_size}")
        self.bits = bits
        self.granularity = granularity
        self.group_size = group_size
        self.symmetric = symmetric
        self.scale_dtype = SCALE_DTYPES[scale_dtype]

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.symmetric else (1 << self.bits) - 1

    def grouping(self, d: int) -> tuple[int, int]:
        """(groups, group width) of the view (..., T, groups, width) whose last dim the stats reduce."""
        if self.granularity == "per_token":
            return 1, d
        if self.granularity == "per_channel":
            return d, 1
        if d % self.group_size:
            raise KvqError(f"group_size {self.group_size} does not divide head_dim {d}")
        return d // self.group_size, self.group_size

    def _stat_dims(self) -> tuple[int, ...]:
        return (-3, -1) if self.granularity == "per_channel" else (-1,)

    def _stored(self, t: torch.Tensor) -> torch.Tensor:
        """Round-trip through the storage dtype so encode uses exactly what decode will see."""
        return t.to(self.scale_dtype)

    def _quantize(self, x: torch.Tensor, round_fn) -> tuple:
        """Codes (float, viewed as (..., T, groups, width)) and the stats that decode needs.

        Shared by encode (round_fn = torch.round) and fake_quant (a straight-through round).
        """
        if x.dim() < 2:
            raise KvqError(f"expected (..., tokens, d), got shape {tuple(x.shape)}")
        groups, width = self.grouping(x.shape[-1])
        xf = x.float()
        channel_scale = None
        if self.granularity == "per_channel_group":
            amax = xf.abs().amax(dim=-2, keepdim=True)
            channel_scale = self._stored(torch.where(amax > 0, amax, torch.ones_like(amax)))
            xf = xf / channel_scale.float()
        xg = xf.reshape(*xf.shape[:-1], groups, width)
        dims = self._stat_dims()
        if self.symmetric:
            amax = xg.abs().amax(dim=dims, keepdim=True)
            scale = self._stored(torch.where(amax > 0, amax / self.qmax, torch.ones_like(amax)))
            codes = round_fn(xg / scale.float()).clamp(-self.qmax, self.qmax)
            offset = None
        else:
            lo = xg.amin(dim=dims, keepdim=True)
            span = xg.amax(dim=dims, keepdim=True) - lo
            offset = self._stored(lo)
            scale = self._stored(torch.where(span > 0, span / self.qmax, torch.ones_like(span)))
            codes = round_fn((xg - offset.float()) / scale.float()).clamp(0, self.qmax)
        return codes, scale, offset, channel_scale

    @staticmethod
    def _dequantize(codes, scale, offset, channel_scale, shape) -> torch.Tensor:
        xg = codes * scale.float()
        if offset is not None:
            xg = xg + offset.float()
        x = xg.reshape(shape)
        return x * channel_scale.float() if channel_scale is not None else x

    def encode(self, x: torch.Tensor) -> ScalarPacked:
        codes, scale, offset, channel_scale = self._quantize(x, torch.round)
        return ScalarPacked(
            codes=pack(codes.reshape(x.shape).to(torch.int16), self.bits),
            scale=scale,
            offset=offset,
            channel_scale=channel_scale,
            shape=tuple(x.shape),
            dtype=x.dtype,
        )

    def decode(self, packed: ScalarPacked) -> torch.Tensor:
        d = packed.shape[-1]
        groups, width = self.grouping(d)
        codes = unpack(packed.codes, self.bits, d, signed=self.symmetric).float()
        codes = codes.reshape(*packed.shape[:-1], groups, width)
        x = self._dequantize(codes, packed.scale, packed.offset, packed.channel_scale, packed.shape)
        return x.to(packed.dtype)

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        """Differentiable quantize-dequantize: rounding passes gradients straight through, scales
        stay differentiable (what calibration trains through)."""
        codes, scale, offset, channel_scale = self._quantize(x, round_straight_through)
        return self._dequantize(codes, scale, offset, channel_scale, x.shape)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        _, width = self.grouping(d)
        scale_bits = torch.finfo(self.scale_dtype).bits
        stats_per_scale = 1 if self.symmetric else 2
        payload = packed_row_bytes(d, self.bits) * 8 / d
        if self.granularity == "per_channel":
            side = stats_per_scale * scale_bits / n_tokens
        else:
            side = stats_per_scale * scale_bits / width
        if self.granularity == "per_channel_group":
            side += scale_bits / n_tokens
        return payload + side
