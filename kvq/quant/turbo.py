"""TurboQuant-style quantization (Zandieh et al. 2025, as summarized in the SRFT paper's Sec. 2).

A random rotation makes the coordinates of a unit vector near-Gaussian with variance 1/d, so one
fixed Lloyd-Max codebook for N(0, 1/d) at b bits serves every coordinate; the norm is kept in fp16.
With `qjl_residual`, the residual r = x - x_hat is sketched by 1-bit QJL (d sign bits and |r| in
fp16) and its unbiased estimate sqrt(pi/2)/m |r| S^T sign(S r) is added back on decode.
"""

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from kvq.errors import KvqError
from kvq.quant.base import Packed, Quantizer
from kvq.quant.packing import pack, packed_row_bytes, unpack
from kvq.rotations import Rotation


@lru_cache(maxsize=16)
def lloyd_max_gaussian(bits: int, iterations: int = 200) -> torch.Tensor:
    """The 2^bits Lloyd-Max reconstruction levels for a standard Gaussian (ascending)."""
    grid = torch.linspace(-8, 8, 200_001, dtype=torch.float64)
    density = torch.exp(-grid**2 / 2)
    levels = torch.linspace(-2.5, 2.5, 1 << bits, dtype=torch.float64) * (1 + bits / 4)
    for _ in range(iterations):
        edges = (levels[1:] + levels[:-1]) / 2
        cell = torch.bucketize(grid, edges)
        mass = torch.zeros_like(levels).index_add_(0, cell, density)
        moment = torch.zeros_like(levels).index_add_(0, cell, density * grid)
        levels = torch.where(mass > 0, moment / mass.clamp_min(1e-300), levels)
    return levels.float()


def gaussian_sketch(m: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(m, d, generator=torch.Generator().manual_seed(seed))


@dataclass
class TurboPacked(Packed):
    codes: torch.Tensor
    norm: torch.Tensor  # fp16 (..., T, 1)
    residual_signs: torch.Tensor | None
    residual_norm: torch.Tensor | None
    shape: tuple[int, ...]
    dtype: torch.dtype


class TurboQuant(Quantizer):
    def __init__(self, rotation: Rotation, bits: int, qjl_residual: bool = False, seed: int = 0):
        if not 1 <= bits <= 8:
            raise KvqError(f"turbo bits must be in 1..8, got {bits}")
        self.rotation = rotation
        self.bits = bits
        self.qjl_residual = qjl_residual
        self.seed = seed

    def _levels(self, d: int, device) -> torch.Tensor:
        return (lloyd_max_gaussian(self.bits) / math.sqrt(d)).to(device)

    def _sketch(self, d: int, device) -> torch.Tensor:
        return gaussian_sketch(d, d, self.seed).to(device)

    def _reconstruct(self, codes: torch.Tensor, norm: torch.Tensor, d: int) -> torch.Tensor:
        unit = self._levels(d, codes.device)[codes.long()]
        return self.rotation.inverse(unit) * norm.float()

    def encode(self, x: torch.Tensor) -> TurboPacked:
        d = x.shape[-1]
        xf = x.float()
        norm = xf.norm(dim=-1, keepdim=True).to(torch.float16)
        unit = self.rotation.forward(xf / norm.float().clamp_min(1e-12))
        levels = self._levels(d, x.device)
        edges = (levels[1:] + levels[:-1]) / 2
        codes = torch.bucketize(unit, edges)
        signs = residual_norm = None
        if self.qjl_residual:
            residual = xf - self._reconstruct(codes, norm, d)
            residual_norm = residual.norm(dim=-1, keepdim=True).to(torch.float16)
            signs = pack((residual @ self._sketch(d, x.device).T >= 0).to(torch.int16), 1)
        return TurboPacked(pack(codes.to(torch.int16), self.bits), norm, signs, residual_norm, tuple(x.shape), x.dtype)

    def decode(self, packed: TurboPacked) -> torch.Tensor:
        d = packed.shape[-1]
        codes = unpack(packed.codes, self.bits, d, signed=False)
        x = self._reconstruct(codes, packed.norm, d)
        if packed.residual_signs is not None:
            signs = unpack(packed.residual_signs, 1, d, signed=False).float() * 2 - 1
            sketch = self._sketch(d, x.device)
            x = x + math.sqrt(math.pi / 2) / d * packed.residual_norm.float() * (signs @ sketch)
        return x.to(packed.dtype)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        bits = packed_row_bytes(d, self.bits) * 8 / d + 16 / d
        if self.qjl_residual:
            bits += packed_row_bytes(d, 1) * 8 / d + 16 / d
        return bits
