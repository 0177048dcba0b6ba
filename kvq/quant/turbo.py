"""TurboQuant (Zandieh et al. 2025): TurboQuant_mse (Alg. 1) and TurboQuant_prod (Alg. 2).

mse: x is stored as |x| (fp16) and the codes of R x / |x| under the b-bit Lloyd-Max codebook for
N(0, 1/d), the law a coordinate of a randomly rotated unit vector tends to (Sec. 3.1). Theorem 1
gives D_mse = E|x - x~|^2 ~ 0.36, 0.117, 0.03, 0.009 at b = 1..4 for unit x.
prod: (b-1)-bit mse of x, then QJL on the residual r = x - x_mse with d rows of i.i.d. N(0, 1) (one
sign bit per coordinate, |r| in fp16), decoded as x_mse + sqrt(pi/2) / d |r| S^T sign(S r): an unbiased
inner-product estimate at b bits per coordinate in all. Theorem 2 gives
D_prod = d E[(<y, x> - <y, x~>)^2] ~ 1.57, 0.56, 0.18, 0.047 at b = 1..4 for unit x, y.

Method card. kvq applies prod to keys only, whose inner products with queries are what attention
reads; values take mse at b bits. The codebook is Gaussian Lloyd-Max rather than the exact Beta law
of a rotated unit vector's coordinate (the two agree to within the tests' tolerance at head_dim 128).
The rotation is SRFT by default (O(d log d)); `rotation: haar` is the paper's uniform random rotation.
The paper's 2.5- and 3.5-bit KV settings run two instances over outlier and regular channels
(`outliers`, `outlier_bits`, `outlier_group` options; kvq.quant.split.ChannelSplit), the outliers
chosen per token group by norm; which channel counts and bits the paper used per setting is for the
user to set.
"""

import math
from dataclasses import dataclass
from typing import Literal

import torch

from kvq.errors import KvqError
from kvq.quant.base import Packed, Quantizer
from kvq.quant.codebooks import decode_unit_vector, encode_unit_vector, lloyd_max_gaussian
from kvq.quant.config import QuantizerConfig, register_quantizer
from kvq.quant.layout import PackedForm, PackedLayout
from kvq.quant.packing import pack, packed_row_bytes, unpack
from kvq.quant.sketch import SignSketch, SketchPacked
from kvq.quant.spec import Site
from kvq.quant.split import ChannelSplit
from kvq.rotations import Rotation, build_rotation


@dataclass
class TurboPacked(Packed):
    codes: torch.Tensor | None  # None when prod spends its only bit on the residual (b = 1)
    norm: torch.Tensor | None  # fp16 (..., T, 1)
    residual: SketchPacked | None
    shape: tuple[int, ...]
    dtype: torch.dtype

    def storage_bits(self) -> int:
        tensors = [t for t in (self.codes, self.norm) if t is not None]
        own = sum(t.numel() * t.element_size() * 8 for t in tensors)
        return own + (self.residual.storage_bits() if self.residual is not None else 0)


class TurboQuant(Quantizer):
    def __init__(self, rotation: Rotation, bits: int, prod: bool = False, seed: int = 0):
        if not 1 <= bits <= 8:
            raise KvqError(f"turbo bits must be in 1..8, got {bits}")
        self.rotation = rotation
        self.bits = bits
        self.mse_bits = bits - 1 if prod else bits
        self.residual = SignSketch(rotation.d, rotation.d, seed, orthogonal=False) if prod else None
        self._form: PackedForm | None = None

    def _levels(self, d: int, device) -> torch.Tensor:
        return (lloyd_max_gaussian(self.mse_bits) / math.sqrt(d)).to(device)

    def encode(self, x: torch.Tensor) -> TurboPacked:
        d = x.shape[-1]
        xf = x.float()
        codes = norm = None
        approximation = torch.zeros_like(xf)
        if self.mse_bits:
            levels = self._levels(d, x.device)
            codes, norm = encode_unit_vector(xf, self.rotation, levels)
            approximation = decode_unit_vector(codes, norm, self.rotation, levels)
            codes = pack(codes.to(torch.int16), self.mse_bits)
        residual = self.residual.encode(xf - approximation) if self.residual else None
        return TurboPacked(codes, norm, residual, tuple(x.shape), x.dtype)

    def decode(self, packed: TurboPacked) -> torch.Tensor:
        d = packed.shape[-1]
        if packed.codes is None:
            x = torch.zeros(packed.shape, device=packed.residual.norm.device)
        else:
            codes = unpack(packed.codes, self.mse_bits, d, signed=False)
            x = decode_unit_vector(codes, packed.norm, self.rotation, self._levels(d, codes.device))
        if packed.residual is not None:
            x = x + self.residual.estimate(packed.residual)
        return x.to(packed.dtype)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        bits = packed_row_bytes(d, self.mse_bits) * 8 + 16 if self.mse_bits else 0
        if self.residual:
            bits += self.residual.bits_per_vector()
        return bits / d

    def packing_reason(self) -> str | None:
        if self.residual is not None:
            return "TurboQuant_prod's QJL residual has no packed layout"
        if self.mse_bits < 2:
            return "1-bit TurboQuant codes have no packed layout"
        return None

    def packed_form(self) -> PackedForm | None:
        """Codebook codes (kvq.quant.layout): Alg. 1's level indices of R x / |x|, with |x| in fp16 per token."""
        if self.packing_reason() is not None:
            return None
        if self._form is None:
            d = self.rotation.d
            layout = PackedLayout(d, self.mse_bits, d, torch.float16, rotation=self.rotation.kind, codebook=True)
            signs = getattr(self.rotation, "signs", torch.ones(d)).float()
            self._form = PackedForm(layout, signs, self.rotation.matrix(), codebook=self._levels(d, "cpu"))
        return self._form


OUTLIER_SEED_OFFSET = 1 << 40  # past every site seed, so the two instances' rotations are independent


@register_quantizer("turbo")
@dataclass(frozen=True)
class TurboConfig(QuantizerConfig):
    """variant mse (Alg. 1) everywhere, or prod (Alg. 2) on keys with mse on values; with `outliers`
    channels per `outlier_group` tokens at `outlier_bits` (default bits + 1) beside the rest at `bits`
    (ChannelSplit)."""

    bits: int
    rotation: str = "srft"
    variant: Literal["mse", "prod"] = "mse"
    outliers: int = 0
    outlier_bits: int | None = None
    outlier_group: int = 32

    def instance(self, site: Site, d: int, bits: int, seed: int) -> "TurboQuant":
        rotation = build_rotation(self.rotation, d, seed)
        return TurboQuant(rotation, bits, prod=self.variant == "prod" and site.role == "k", seed=seed)

    def build(self, site: Site, seed: int) -> Quantizer:
        seed = site.seed(seed)
        if not self.outliers:
            return self.instance(site, site.d, self.bits, seed)
        outlier_bits = self.outlier_bits if self.outlier_bits is not None else self.bits + 1
        outliers = self.instance(site, self.outliers, outlier_bits, seed + OUTLIER_SEED_OFFSET)
        regular = self.instance(site, site.d - self.outliers, self.bits, seed)
        return ChannelSplit(site.d, self.outliers, self.outlier_group, outliers, regular)
