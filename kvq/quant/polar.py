"""PolarQuant (Han et al. 2025): recursive polar transform with angle codebooks.

After a random rotation (preconditioning), coordinates are paired into (radius, angle): level-1 angles
lie in [0, 2 pi), and every higher level pairs the radii of the level below, so its angles lie in
[0, pi/2] and concentrate around pi/4. After `levels` levels the d / 2^levels remaining radii are kept
in fp16; level-1 angles get `bits` bits and higher levels `upper_bits` bits.

Method card. Paper: Sec. 3 (the transform and the angle densities after preconditioning), with its
4 levels at 4 bits for level 1 and 2 bits above as the default (3.875 bits per element with fp16
radii). Each level's angles take the Lloyd-Max codebook of that level's analytic density
(kvq.quant.codebooks.polar_angle_codebook: uniform at level 1, proportional to
(sin psi cos psi)^(2^(level-1) - 1) above), as the paper fits codebooks to the known distributions.
The preconditioning is SRFT by default; `rotation: haar` is a uniformly random rotation.
"""

from dataclasses import dataclass

import torch

from kvq.errors import KvqError
from kvq.quant.base import Packed, Quantizer
from kvq.quant.codebooks import angle_range, nearest_level, polar_angle_codebook
from kvq.quant.config import QuantizerConfig, register_quantizer
from kvq.quant.packing import pack, packed_row_bytes, unpack
from kvq.quant.spec import Site
from kvq.rotations import Rotation, build_rotation


@dataclass
class PolarPacked(Packed):
    angles: list[torch.Tensor]  # packed codes per level
    radii: torch.Tensor  # fp16 (..., d / 2^levels)
    shape: tuple[int, ...]
    dtype: torch.dtype

    def storage_bits(self) -> int:
        return sum(a.numel() * 8 for a in self.angles) + self.radii.numel() * 16


class PolarQuant(Quantizer):
    def __init__(self, rotation: Rotation, bits: int = 4, upper_bits: int = 2, levels: int = 4):
        d = rotation.d
        if levels < 1 or d % (1 << levels):
            raise KvqError(f"polar needs head_dim divisible by 2^levels; d={d}, levels={levels}")
        for name, value in (("bits", bits), ("upper_bits", upper_bits)):
            if not 1 <= value <= 8:
                raise KvqError(f"polar {name} must be in 1..8, got {value}")
        self.rotation = rotation
        self.levels = levels
        self.level_bits = [bits] + [upper_bits] * (levels - 1)

    def _codebook(self, level: int, like: torch.Tensor) -> torch.Tensor:
        return polar_angle_codebook(level, self.level_bits[level]).to(like.device)

    def encode(self, x: torch.Tensor) -> PolarPacked:
        radii = self.rotation.forward(x.float())
        codes = []
        for level, bits in enumerate(self.level_bits):
            pairs = radii.reshape(*radii.shape[:-1], -1, 2)
            angle = torch.atan2(pairs[..., 1], pairs[..., 0])
            if level == 0:
                angle = torch.remainder(angle, angle_range(0))
            codebook = self._codebook(level, angle)
            code = nearest_level(angle, codebook)
            codes.append(pack(code.to(torch.int16), bits))
            radii = pairs.norm(dim=-1)
        return PolarPacked(codes, radii.to(torch.float16), tuple(x.shape), x.dtype)

    def decode(self, packed: PolarPacked) -> torch.Tensor:
        radii = packed.radii.float()
        d = packed.shape[-1]
        for level in reversed(range(self.levels)):
            bits = self.level_bits[level]
            count = d >> (level + 1)
            code = unpack(packed.angles[level], bits, count, signed=False)
            angle = self._codebook(level, radii)[code.long()]
            radii = torch.stack([radii * torch.cos(angle), radii * torch.sin(angle)], dim=-1).flatten(-2)
        return self.rotation.inverse(radii).to(packed.dtype)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        angle_bits = sum(packed_row_bytes(d >> (level + 1), b) * 8 for level, b in enumerate(self.level_bits))
        return (angle_bits + (d >> self.levels) * 16) / d


@register_quantizer("polar")
@dataclass(frozen=True)
class PolarConfig(QuantizerConfig):
    """Level-1 angles at `bits` bits, higher levels' at `upper_bits`, `levels` levels after `rotation`."""

    bits: int
    upper_bits: int = 2
    levels: int = 4
    rotation: str = "srft"

    def build(self, site: Site, seed: int) -> Quantizer:
        return PolarQuant(build_rotation(self.rotation, site.d, site.seed(seed)), self.bits, self.upper_bits,
                          self.levels)
