"""HQMQ: Hurwitz quaternion multiplicative quantization (HQMQ paper Sec. 3, App. B/D).

Each 4-element chunk x of a head vector is a quaternion; its direction is quantized to the best
q_p * q_s with q_p in the 24 Hurwitz units 2T and q_s in a seeded codebook of S random unit quaternions
per (layer, head, K|V) (Eq. 1), its radius to b_r bits against the per-token max chunk norm (fp16).
With Med3x (`outlier_c`), chunks whose norm exceeds C x the median chunk norm of the call are kept as
fp16 4-tuples behind a 1-bit flag, and the per-token radius scale is taken over the remaining chunks.

Bits (Eq. 2, Table 21): a chunk index costs log2(24 S) bits, the paper's accounting, which mixed-radix
coding of a token's indices reaches to within one bit per token; `index_bits: ceil` charges
ceil(log2(24 S)) instead, what plain bit packing stores. This reference keeps indices unpacked.
"""

import math
from dataclasses import dataclass
from typing import Literal

import torch

from kvq.errors import KvqError
from kvq.quant.base import Packed, Quantizer
from kvq.quant.config import QuantizerConfig, register_quantizer
from kvq.quant.quaternion import binary_tetrahedral, hamilton, random_unit_quaternions
from kvq.quant.spec import Site

SECONDARY_SIZES = (24, 48, 96, 192)
RADIUS_BITS = range(2, 7)
SCORE_BUDGET = 1 << 24  # similarity entries evaluated at once: bounds memory on long inputs


@dataclass
class HQMQPacked(Packed):
    index: torch.Tensor  # (..., T, chunks) joint index p * S + s
    radius: torch.Tensor  # (..., T, chunks) b_r-bit radius codes
    scale: torch.Tensor  # (..., T, 1) fp16 per-token radius scale
    outlier: torch.Tensor | None  # (..., T, chunks) bool flags
    outlier_values: torch.Tensor | None  # (n_outliers, 4) fp16
    shape: tuple[int, ...]
    dtype: torch.dtype
    index_bits: float
    radius_bits: int

    def storage_bits(self) -> int:
        chunks = self.index.numel()
        outliers = 0 if self.outlier is None else int(self.outlier.sum())
        tokens = self.scale.numel()
        bits = (chunks - outliers) * (self.index_bits + self.radius_bits) + tokens * 16
        if self.outlier is not None:
            bits += chunks + outliers * 4 * 16
        return bits


class HQMQ(Quantizer):
    def __init__(self, secondary: int = 24, radius_bits: int = 4, outlier_c: float | None = None, seed: int = 0,
                 index_bits: str = "fractional"):
        if secondary < 1:
            raise KvqError(f"hqmq secondary codebook size S must be positive, got {secondary}")
        if radius_bits not in RADIUS_BITS:
            raise KvqError(f"hqmq radius_bits must be in 2..6, got {radius_bits}")
        if outlier_c is not None and outlier_c <= 0:
            raise KvqError(f"hqmq outlier_c must be positive, got {outlier_c}")
        if index_bits not in ("fractional", "ceil"):
            raise KvqError(f"hqmq index_bits must be 'fractional' or 'ceil', got {index_bits!r}")
        self.secondary = secondary
        self.radius_bits = radius_bits
        self.outlier_c = outlier_c
        self.seed = seed
        exact = math.log2(24 * secondary)
        self.index_bits = exact if index_bits == "fractional" else math.ceil(exact)
        self.primary = binary_tetrahedral()
        self._codebooks: dict[int, torch.Tensor] = {}

    def joint_codebook(self, head: int) -> torch.Tensor:
        """(24 S, 4) codewords q_p * q_s, row p * S + s; seeded per head."""
        if head not in self._codebooks:
            secondary = random_unit_quaternions(self.secondary, self.seed * 7919 + head)
            self._codebooks[head] = hamilton(self.primary[:, None, :], secondary[None, :, :]).reshape(-1, 4)
        return self._codebooks[head]

    def _codebooks_for(self, heads: int, device) -> torch.Tensor:
        return torch.stack([self.joint_codebook(h) for h in range(heads)]).to(device)

    @staticmethod
    def _check(x: torch.Tensor) -> None:
        if x.dim() < 3 or x.shape[-1] % 4:
            raise KvqError(f"hqmq needs (..., heads, tokens, d) with d divisible by 4, got {tuple(x.shape)}")

    def _nearest(self, u: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
        """argmax_c <u, c> per chunk; u (..., H, T, C, 4), codebooks (H, K, 4)."""
        tokens = u.shape[-3]
        scores_per_token = u.numel() // 4 // max(1, tokens) * codebooks.shape[1]
        step = max(1, SCORE_BUDGET // max(1, scores_per_token))
        parts = [
            torch.einsum("...htcq,hkq->...htck", u[..., start : start + step, :, :], codebooks).argmax(-1)
            for start in range(0, tokens, step)
        ]
        return torch.cat(parts, dim=-2)

    def encode(self, x: torch.Tensor) -> HQMQPacked:
        self._check(x)
        chunks = x.float().reshape(*x.shape[:-1], x.shape[-1] // 4, 4)
        norms = chunks.norm(dim=-1)
        outlier = None
        outlier_values = None
        regular = torch.ones_like(norms, dtype=torch.bool)
        if self.outlier_c is not None:
            outlier = norms > self.outlier_c * norms.median()
            regular = ~outlier
            outlier_values = chunks[outlier].to(torch.float16)
        levels = (1 << self.radius_bits) - 1
        peak = torch.where(regular, norms, torch.zeros_like(norms)).amax(dim=-1, keepdim=True)
        scale = torch.where(peak > 0, peak, torch.ones_like(peak)).to(torch.float16)
        radius = torch.round(norms * levels / scale.float()).clamp(0, levels).to(torch.uint8)
        directions = chunks / norms.clamp_min(1e-12).unsqueeze(-1)
        index = self._nearest(directions, self._codebooks_for(x.shape[-3], x.device)).to(torch.int16)
        return HQMQPacked(index, radius, scale, outlier, outlier_values, tuple(x.shape), x.dtype,
                          self.index_bits, self.radius_bits)

    def decode(self, packed: HQMQPacked) -> torch.Tensor:
        heads = packed.shape[-3]
        codebooks = self._codebooks_for(heads, packed.index.device)  # (H, K, 4)
        head_index = torch.arange(heads, device=packed.index.device).view(heads, 1, 1)
        directions = codebooks[head_index, packed.index.long()]  # (..., H, T, C, 4)
        levels = (1 << self.radius_bits) - 1
        radius = packed.radius.float() * packed.scale.float() / levels
        chunks = directions * radius.unsqueeze(-1)
        if packed.outlier is not None:
            chunks[packed.outlier] = packed.outlier_values.float()
        return chunks.reshape(packed.shape).to(packed.dtype)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        """Without outliers (Table 21). With Med3x the cost depends on the outlier fraction p (Eq. 2):
        measured per call by HQMQPacked.storage_bits."""
        if d % 4:
            raise KvqError(f"hqmq needs head_dim divisible by 4, got {d}")
        flag = 1 / 4 if self.outlier_c is not None else 0.0
        return (self.index_bits + self.radius_bits) / 4 + 16 / d + flag


@register_quantizer("hqmq")
@dataclass(frozen=True)
class HQMQConfig(QuantizerConfig):
    """S: secondary codebook size; r: radius bits; outlier_c: Med3x threshold (None: off); index_bits:
    'fractional' (log2 of the codebook size) or 'ceil' (whole bits per index)."""

    S: int = 24
    r: int = 4
    outlier_c: int | float | None = None
    index_bits: Literal["fractional", "ceil"] = "fractional"

    def build(self, site: Site, seed: int) -> Quantizer:
        return HQMQ(self.S, self.r, self.outlier_c, site.seed(seed), self.index_bits)
