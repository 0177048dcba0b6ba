"""What a quantizer stores, declared for the kernels: its PackedLayout and the constants that go with it.

A quantizer that stores rows as scalar codes per token or per token-group, symmetric or with offsets (zero
points), after a rotation and a per-channel lambda (y = lam * (R x), SRFT paper Sec. 5.1), or as KIVI's keys
(per channel over groups of tokens), or as indices into a table of levels with a scale per token or per group
(TurboQuant_mse's Lloyd-Max levels and norm; a float format's values, FP8's, MX's and NVFP4's, with their scales and
any scale of the whole layer) declares a PackedForm; kvq.ops and the caches read only that, never the quantizer's
attributes. Quantizers that store anything else declare none.
"""

from dataclasses import dataclass, field

import torch

from kvq.quant.minifloat import FORMATS, MiniFloat, e8m0_value

# Rotations named by kind: the kernels apply these from their sign vector alone. "blocks" is a symmetric block
# applied along head_dim block by block (llama.cpp's Hadamard, kvq.rotations.BlockDiagonal), "matrix" any other
# orthogonal map (learned, composed); only the reference applies those, from the block or the matrix.
SIGNED_ROTATIONS = ("identity", "srht", "srft")
# Who writes a layout's codes: kvq's scalar arithmetic (kvq.quant.scalar: abs-max or min-max scales, round half to
# even), llama.cpp's block arithmetic (kvq.quant.ggml), MLX's affine one (kvq.quant.mlx_affine), vLLM's FP8 with a
# scale per token (kvq.quant.fp8) or the OCP MX spec's (kvq.quant.mx), each with its own scales and rounding; the
# reference runs the engines', and on CUDA a kernel the float formats' (kvq.kernels.triton_quantize), or NVIDIA's
# NVFP4 (kvq.quant.nvfp4). A float format's scheme names its element format too.
FP8_SCHEMES = ("fp8_e4m3", "fp8_e5m2")
MX_SCHEMES = ("mx_e2m1", "mx_e2m3", "mx_e3m2", "mx_e4m3", "mx_e5m2")
NVFP4_SCHEME = "nvfp4_e2m1"
SCHEMES = ("kvq", "ggml", "mlx", *FP8_SCHEMES, *MX_SCHEMES, NVFP4_SCHEME)
FLOAT_SCHEMES = (*FP8_SCHEMES, *MX_SCHEMES, NVFP4_SCHEME)
# Stats held as uint8 are E8M0 scales (the MX spec's powers of two), as float8_e4m3fn E4M3 ones (NVFP4's block
# scales); a codebook layout's only
E8M0 = torch.uint8
E4M3_STATS = torch.float8_e4m3fn


@dataclass(frozen=True)
class PackedLayout:
    """Codes of `bits` bits per coordinate, packed little-end first, one row per token, after rotation
    `rotation`; a scale in `scale_dtype` per `group_size` coordinates and `token_group` tokens, so a stats row
    of head_dim / group_size scales per token (one per token when group_size == head_dim), or, where
    token_group > 1, per token_group consecutive tokens (KIVI's keys: group_size 1, one scale per channel). A
    symmetric layout holds signed codes c and decodes c * scale; an asymmetric one holds unsigned codes c and,
    after its scales, as many offsets of the same dtype, and decodes c * scale + offset: a stats row holds both.
    A `codebook` layout holds unsigned codes indexing its form's codebook and a scale per group of coordinates, and
    decodes R^-1(codebook[c]) * scale: TurboQuant_mse's unit vector's levels, then its norm (one group); a float
    format's values, then its scale per token (FP8) or per block (MX, scales in E8M0; NVFP4, in E4M3).
    A `layer_scaled` layout's values are also multiplied by one float32 scale of the layer, which its form holds once
    the quantizer has calibrated it (NVFP4's per-tensor scale, FP8's calibrated or unit scale); with no
    `scale_dtype` it stores no stats at all: a codebook code's value times the layer scale (FP8 as vLLM stores it).
    `scheme` names the arithmetic that writes the codes (SCHEMES); reading them does not depend on it.
    """

    head_dim: int
    bits: int
    group_size: int
    scale_dtype: torch.dtype | None = torch.float32
    symmetric: bool = True
    rotation: str = "identity"
    token_group: int = 1
    codebook: bool = False
    scheme: str = "kvq"
    layer_scaled: bool = False

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if self.token_group > 1 and self.group_size != 1:
            raise ValueError("stats spanning tokens are per channel: token_group > 1 takes group_size 1")
        if self.codebook and (not self.symmetric or self.token_group > 1):
            raise ValueError("codebook codes take scales per token and no offsets")
        if self.codebook and self.group_size != self.head_dim and self.rotation != "identity":
            # R^-1 (s_g * levels) is not s_g * R^-1 (levels) once a rotation mixes the groups
            raise ValueError("codebook codes with several scale groups take the identity rotation")
        if self.scale_dtype in (E8M0, E4M3_STATS) and not self.codebook:
            raise ValueError("E8M0 and E4M3 scales serve codebook codes only")
        if self.scale_dtype is None and not (self.codebook and self.layer_scaled and self.group_size == self.head_dim):
            raise ValueError("codes without stats are codebook codes scaled by their layer alone")

    @property
    def code_bytes(self) -> int:
        return self.head_dim * self.bits // 8

    @property
    def element(self) -> MiniFloat | None:
        """The float format whose bit patterns a float format's codes are (FP8's, MX's elements): its codebook holds
        their values, which a kernel may also compute from the bits."""
        if self.scheme in FLOAT_SCHEMES:
            return FORMATS[self.scheme.split("_", 1)[1]]
        return None

    @property
    def groups(self) -> int:
        return self.head_dim // self.group_size

    @property
    def stats(self) -> int:
        """Scales, then offsets where the layout is asymmetric, per stats row (none without a scale_dtype)."""
        if self.scale_dtype is None:
            return 0
        return self.groups if self.symmetric else 2 * self.groups

    @property
    def stats_dtype(self) -> torch.dtype:
        """The dtype of the stats buffer (float32, empty, where there are no stats)."""
        return torch.float32 if self.scale_dtype is None else self.scale_dtype


def stat_values(stats: torch.Tensor) -> torch.Tensor:
    """float32 values of stats as a layout stores them: E8M0 exponents as their powers of two, floats (E4M3 too) as
    they are."""
    return e8m0_value(stats) if stats.dtype == E8M0 else stats.float()


def group_scales(stats: torch.Tensor, layer_scale: torch.Tensor | None) -> torch.Tensor:
    """(n, groups) float32 scales of a codebook layout's rows: their stats' values (ones where the layout stores
    none), times the layer scale where there is one, in that order (NVFP4's decode: block scale x tensor scale)."""
    scales = stat_values(stats) if stats.shape[-1] else stats.new_ones(*stats.shape[:-1], 1, dtype=torch.float32)
    return scales if layer_scale is None else scales * layer_scale


@dataclass(frozen=True, eq=False)
class PackedForm:
    """A layout with its constants: `signs` (head_dim,) of the signed rotation (ones for the identity),
    `matrix` (head_dim, head_dim) with R x = x @ matrix.T, lambda floored as decode divides by it, a
    codebook layout's levels (2^bits,) float32, a "blocks" rotation's block (n, n), and a layer_scaled layout's
    layer scale (float32, 0-dim; None until its quantizer has calibrated it: Quantizer.calibrated_form)."""

    layout: PackedLayout
    signs: torch.Tensor
    matrix: torch.Tensor
    lam: torch.Tensor | None = None
    codebook: torch.Tensor | None = None
    block: torch.Tensor | None = None
    layer_scale: torch.Tensor | None = None
    _on: dict = field(default_factory=dict, repr=False)

    @property
    def rotation_input(self) -> torch.Tensor:
        """What kvq::quantize takes as its rotation: the signs of a signed rotation, the block of a "blocks" one,
        else the matrix."""
        if self.layout.rotation in SIGNED_ROTATIONS:
            return self.signs
        return self.block if self.layout.rotation == "blocks" else self.matrix

    @classmethod
    def unrotated(cls, layout: PackedLayout, codebook: torch.Tensor | None = None,
                  layer_scale: torch.Tensor | None = None) -> "PackedForm":
        """The form of a layout written without rotation or lambda (the identity's signs and matrix)."""
        return cls(layout, torch.ones(layout.head_dim), torch.eye(layout.head_dim), codebook=codebook,
                   layer_scale=layer_scale)

    def scaled_by(self, layer_scale: torch.Tensor) -> "PackedForm":
        """The same layout and constants with this layer scale."""
        return PackedForm(self.layout, self.signs, self.matrix, self.lam, self.codebook, self.block,
                          layer_scale.float().reshape(()))

    def on(self, device: torch.device) -> "PackedForm":
        """The same form with its constants on `device`, made once per device."""
        key = str(device)
        if key not in self._on:
            lam, codebook, block, layer_scale = (t.to(device) if t is not None else None
                                                 for t in (self.lam, self.codebook, self.block, self.layer_scale))
            self._on[key] = PackedForm(self.layout, self.signs.to(device), self.matrix.to(device), lam, codebook,
                                       block, layer_scale)
        return self._on[key]
