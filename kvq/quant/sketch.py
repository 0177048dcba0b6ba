"""1-bit Johnson-Lindenstrauss sketches, shared by QJL keys and TurboQuant_prod's residual.

A vector x is stored as sign(S x) (m bits) and |x| (fp16). For S with i.i.d. N(0, 1) rows, the
estimate x_hat = sqrt(pi/2) / m * |x| * S^T sign(S x) is unbiased for every linear functional,
E <q, x_hat> = <q, x> (QJL, Zandieh et al. 2024, Sec. 3; the QJL map inside TurboQuant_prod, Zandieh
et al. 2025, Alg. 2), with variance (pi/2 |q|^2 |x|^2 - <q, x>^2) / m.

`orthogonal_sketch` is the official QJL code's choice: S in blocks of d rows, each block sqrt(d) times
a Haar-random orthogonal matrix, so rows within a block are exactly orthogonal. Each row is still
marginally a rotation-invariant vector of norm sqrt(d), which keeps the estimator unbiased, and within
a block the errors of the rows no longer add up independently, which lowers the variance.
"""

import math
from dataclasses import dataclass

import torch

from kvq.quant.base import Packed
from kvq.quant.packing import pack, packed_row_bytes, unpack
from kvq.rotations import haar_matrix


def gaussian_sketch(m: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(m, d, generator=torch.Generator().manual_seed(seed))


def orthogonal_sketch(m: int, d: int, seed: int) -> torch.Tensor:
    """m x d: ceil(m / d) blocks of sqrt(d) * (Haar d x d), cut to m rows."""
    blocks = [haar_matrix(d, seed * 65_537 + block) for block in range(-(-m // d))]
    return torch.cat(blocks)[:m] * math.sqrt(d)


@dataclass
class SketchPacked(Packed):
    signs: torch.Tensor  # (..., T, ceil(m / 8)) uint8
    norm: torch.Tensor  # (..., T, 1) fp16


class SignSketch:
    """sign(S x) and |x| of vectors x along the last dim; `scaled_signs` and `estimate` read them back."""

    def __init__(self, m: int, d: int, seed: int, orthogonal: bool):
        self.m = m
        self.matrix = (orthogonal_sketch if orthogonal else gaussian_sketch)(m, d, seed)

    def first_rows(self, m: int) -> "SignSketch":
        """The sketch by the first m rows of this one's S (an unbiased sketch of its own)."""
        part = object.__new__(SignSketch)
        part.m, part.matrix = m, self.matrix[:m]
        return part

    def _matrix(self, like: torch.Tensor) -> torch.Tensor:
        return self.matrix.to(like.device)

    def encode(self, x: torch.Tensor) -> SketchPacked:
        xf = x.float()
        signs = pack((xf @ self._matrix(xf).T >= 0).to(torch.int16), 1)
        return SketchPacked(signs, xf.norm(dim=-1, keepdim=True).to(torch.float16))

    def scaled_signs(self, packed: SketchPacked) -> torch.Tensor:
        """(..., T, m) sqrt(pi/2) / m |x| sign(S x): <S q, this> is the estimate of <q, x>."""
        signs = unpack(packed.signs, 1, self.m, signed=False).float() * 2 - 1
        return math.sqrt(math.pi / 2) / self.m * packed.norm.float() * signs

    def estimate(self, packed: SketchPacked) -> torch.Tensor:
        """(..., T, d) x_hat = S^T scaled_signs: unbiased for every <q, x>."""
        scaled = self.scaled_signs(packed)
        return scaled @ self._matrix(scaled)

    def project(self, q: torch.Tensor) -> torch.Tensor:
        return q.float() @ self._matrix(q).T

    def bits_per_vector(self) -> int:
        return packed_row_bytes(self.m, 1) * 8 + 16
