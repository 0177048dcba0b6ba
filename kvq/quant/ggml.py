"""llama.cpp's quantized KV cache (`-ctk / -ctv q4_0 | q4_1 | q5_0 | q5_1 | q8_0 | iq4_nl`), with its Hadamard
rotation.

Each head vector is cut into blocks of 32 coordinates, and each block is stored as ggml stores it:
- q4_0 / q5_0: scale d = m / -8 (-16), where m is the block's value of largest magnitude, codes
  trunc(x / d + 8.5) (16.5) clipped to 4 (5) bits; fp16 d. 4.5 (5.5) bits per element.
- q4_1 / q5_1: d = (max - min) / 15 (31), codes trunc((x - min) / d + 0.5); fp16 d and min. 5 (6) bits.
- q8_0: d = max|x| / 127, codes rounded half away from zero; fp16 d. 8.5 bits.
- iq4_nl: codes index the 16 non-uniform levels of kvalues_iq4nl, chosen with d = m / -127; the stored fp16 d
  is then refitted by least squares with weights x^2, as ggml's KV write (set_rows / cpy, `ntry = -1`) does.
The encode arithmetic is gguf.quants' (float32, scales quantized after use), so codes and bytes equal
`gguf.quants.quantize` for every type it implements (all but iq4_nl, which gguf only dequantizes).

`hadamard` (default on, as llama.cpp since b6920, PR 21038): before quantization, keys are multiplied by the
orthonormal Walsh-Hadamard matrix of the largest power-of-two block (at least 64) dividing head_dim, values
by the 64 x 64 one, block-diagonally; llama.cpp rotates queries the same way and rotates the attention output
back, which equals decoding through the inverse rotation here. It applies when head_dim is a multiple of 64,
as in llama.cpp.

The q4_0, q4_1, q5_0, q5_1 and q8_0 blocks are kvq packed layouts (`packed_form`, scheme "ggml"): a block's codes
less its type's zero (8 or 16 for q4_0 and q5_0) are signed codes of 4, 5 or 8 bits with the fp16 d as a group-32
scale, and the _1 types' codes unsigned with d and m as scale and offset, so kvq's packed cache holds them in as
many bytes and its decode kernels read them, and kvq.ops writes them with this arithmetic (`layout_codes`). The
layout packs a row's codes neighbour by neighbour, not ggml's block byte order. iq4_nl without the rotation is a
codebook layout: its codes index kvalues_iq4nl (as floats) with the fp16 d as a group-32 scale. After the rotation it
has none: a rotation block spans two 32-coordinate blocks, whose scales a lookup table cannot follow back through it.

Method card. Follows ggml-quants.c / gguf-py 0.19 and llama-kv-cache.cpp. Rotation products run in float32
with torch's matmul rather than ggml's, so rotated values may differ from llama.cpp's in the last bit.
"""

from dataclasses import dataclass
from typing import Literal

import torch

from kvq.quant.base import Packed, Quantizer
from kvq.quant.blocks import merge_blocks, pack_nibbles, require_blocks, split_blocks, unpack_nibbles
from kvq.quant.config import QuantizerConfig, register_quantizer
from kvq.quant.layout import PackedForm, PackedLayout
from kvq.quant.packing import pack
from kvq.quant.spec import Site
from kvq.rotations import BlockDiagonal, Identity

BLOCK = 32
ROTATION_MIN = 64
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# bits per element of each type's block: payload and fp16 side data over 32 coordinates
TYPE_BITS = {"q4_0": 18 * 8 / BLOCK, "q4_1": 20 * 8 / BLOCK, "q5_0": 22 * 8 / BLOCK, "q5_1": 24 * 8 / BLOCK,
             "q8_0": 34 * 8 / BLOCK, "iq4_nl": 18 * 8 / BLOCK}
# the types a packed layout holds: (code bits, signed) -> type, and the zero a signed type's codes are stored less
LAYOUT_TYPES = {(4, True): "q4_0", (5, True): "q5_0", (8, True): "q8_0", (4, False): "q4_1", (5, False): "q5_1"}
CODE_ZERO = {"q4_0": 8, "q5_0": 16, "q8_0": 0}


@dataclass
class GGMLPacked(Packed):
    """One ggml block per 32 coordinates, field by field: (..., blocks, ...) tensors."""

    scale: torch.Tensor  # float16 (..., blocks, 1): d
    minimum: torch.Tensor | None  # float16 (..., blocks, 1): m of the _1 types
    low: torch.Tensor  # uint8: q8_0's 32 code bytes, or 16 bytes of low nibbles (code j | code j + 16 << 4)
    high: torch.Tensor | None  # uint8 (..., blocks, 4): the fifth bits of q5 codes, little-endian
    dtype: torch.dtype


def signed_extreme(blocks: torch.Tensor) -> torch.Tensor:
    """Each block's value of largest magnitude, the first one on ties (numpy's argmax, ggml's strict >)."""
    return blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """ggml's roundf as gguf.quants.np_roundf writes it."""
    magnitude = x.abs()
    floored = magnitude.floor()
    return torch.sign(x) * (floored + (2 * (magnitude - floored)).floor())


def inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def nearest_level(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """ggml's best_index_int8: the nearest level, the upper one on ties."""
    upper = torch.searchsorted(levels, x.contiguous(), right=True).clamp(1, len(levels) - 1)
    lower = upper - 1
    take_lower = (x - levels[lower]) < (levels[upper] - x)
    return torch.where(take_lower, lower, upper).clamp(0, len(levels) - 1)


def pack_fifth_bits(codes: torch.Tensor) -> torch.Tensor:
    """Bit j of a q5 block's 32-bit qh is bit 4 of code j; stored as 4 little-endian bytes."""
    bits = ((codes >> 4) & 1).reshape(*codes.shape[:-1], 4, 8).to(torch.int32)
    return (bits << torch.arange(8, device=codes.device, dtype=torch.int32)).sum(-1).to(torch.uint8)


def unpack_fifth_bits(high: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, device=high.device, dtype=torch.uint8)
    return ((high.unsqueeze(-1) >> shifts) & 1).reshape(*high.shape[:-1], BLOCK)


def block_codes(blocks: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """ggml's quantize of float32 blocks (..., blocks, 32) of a q4/q5/q8 type: int32 codes, d (float32, fp16 once
    stored) and the _1 types' fp16 minimum."""
    minimum = None
    if kind in ("q4_0", "q5_0"):
        levels = 16 if kind == "q4_0" else 32
        d = signed_extreme(blocks) / -(levels // 2)
        codes = torch.trunc(blocks * inverse(d) + (levels // 2 + 0.5)).clamp(0, levels - 1)
    elif kind in ("q4_1", "q5_1"):
        levels = 16 if kind == "q4_1" else 32
        lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        d = (hi - lo) / (levels - 1)
        codes = torch.trunc((blocks - lo) * inverse(d) + 0.5).clamp(0, levels - 1)
        minimum = lo.to(torch.float16)
    else:
        d = blocks.abs().amax(-1, keepdim=True) / 127
        codes = round_half_away(blocks * inverse(d))
    return codes.to(torch.int32), d, minimum


def iq4_nl_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's iq4_nl KV write of float32 blocks (..., blocks, 32): level indices chosen with d = m / -127, then d
    refitted by least squares with weights x^2 (float32, fp16 once stored)."""
    levels = iq4_nl_levels(blocks.device)
    d = signed_extreme(blocks) / levels[0]
    codes = nearest_level(blocks * inverse(d), levels)
    q = levels[codes]
    weight = blocks * blocks
    sum_qx, sum_qq = (weight * q * blocks).sum(-1, keepdim=True), (weight * q * q).sum(-1, keepdim=True)
    refit = torch.where(sum_qq > 0, sum_qx / sum_qq.clamp(min=torch.finfo(torch.float32).tiny), d)
    return codes, refit


def iq4_nl_levels(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(IQ4_NL_LEVELS, dtype=torch.float32, device=device)


def layout_codes(y: torch.Tensor, layout: PackedLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated float32 rows (n, d) -> the layout's codes (n, d * bits / 8) and fp16 stats (n, d / 32 scales, then
    as many minima for the _1 types): ggml's arithmetic, each signed type's codes less its zero; iq4_nl's (a
    codebook layout) level indices and d."""
    if layout.codebook:
        codes, d = iq4_nl_codes(split_blocks(y, BLOCK, "iq4_nl"))
        return pack(merge_blocks(codes), layout.bits), d.to(torch.float16).squeeze(-1)
    kind = LAYOUT_TYPES[(layout.bits, layout.symmetric)]
    codes, d, minimum = block_codes(split_blocks(y, BLOCK, kind), kind)
    if kind in CODE_ZERO:
        codes = codes - CODE_ZERO[kind]
    stats = [d.to(torch.float16)] if minimum is None else [d.to(torch.float16), minimum]
    return pack(merge_blocks(codes), layout.bits), torch.cat([s.squeeze(-1) for s in stats], dim=-1)


class GGMLBlocks(Quantizer):
    def __init__(self, kind: str, rotation: BlockDiagonal | None, d: int):
        self.kind = kind
        self.rotation = rotation  # applied block-diagonally along head_dim, its own inverse; or None
        self.d = d
        self._form: PackedForm | None = None

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() if self.rotation is None else self.rotation.forward(x.float())

    def encode(self, x: torch.Tensor) -> GGMLPacked:
        blocks = split_blocks(self._rotate(x), BLOCK, self.kind)
        high = None
        if self.kind == "iq4_nl":
            codes, d = iq4_nl_codes(blocks)
            codes, minimum = codes.to(torch.int32), None
        else:
            codes, d, minimum = block_codes(blocks, self.kind)
        if self.kind == "q8_0":
            low = codes.to(torch.int8).view(torch.uint8)
        else:
            low = pack_nibbles(codes & 0x0F)
            high = pack_fifth_bits(codes) if self.kind.startswith("q5") else None
        return GGMLPacked(d.to(torch.float16), minimum, low, high, x.dtype)

    def codes(self, packed: GGMLPacked) -> torch.Tensor:
        """The integer code of each coordinate (..., blocks, 32)."""
        if self.kind == "q8_0":
            return packed.low.view(torch.int8).to(torch.int32)
        codes = unpack_nibbles(packed.low).to(torch.int32)
        if packed.high is not None:
            codes = codes | (unpack_fifth_bits(packed.high).to(torch.int32) << 4)
        return codes

    def decode(self, packed: GGMLPacked) -> torch.Tensor:
        codes, d = self.codes(packed).float(), packed.scale.float()
        if self.kind in ("q4_0", "q5_0"):
            blocks = d * (codes - (8 if self.kind == "q4_0" else 16))
        elif self.kind in ("q4_1", "q5_1"):
            blocks = d * codes + packed.minimum.float()
        elif self.kind == "q8_0":
            blocks = codes * d
        else:
            blocks = d * iq4_nl_levels(codes.device)[codes.long()]
        return self._rotate(merge_blocks(blocks)).to(packed.dtype)  # H is its own inverse

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        return TYPE_BITS[self.kind]

    def packing_reason(self) -> str | None:
        if self.kind == "iq4_nl" and self.rotation is not None:
            return ("iq4_nl after llama.cpp's Hadamard rotation has no packed layout: a rotation block spans two "
                    "32-coordinate blocks, whose scales its level table cannot follow (hadamard: false has one)")
        return None

    def packed_form(self) -> PackedForm | None:
        if self.packing_reason() is not None:
            return None
        if self._form is None and self.kind == "iq4_nl":
            layout = PackedLayout(self.d, 4, BLOCK, torch.float16, codebook=True, scheme="ggml")
            self._form = PackedForm.unrotated(layout, iq4_nl_levels())
        elif self._form is None:
            bits, symmetric = next(key for key, kind in LAYOUT_TYPES.items() if kind == self.kind)
            rotation = self.rotation or Identity(self.d)
            layout = PackedLayout(self.d, bits, BLOCK, torch.float16, symmetric, rotation.kind, scheme="ggml")
            self._form = PackedForm(layout, torch.ones(self.d), rotation.matrix(),
                                    block=None if self.rotation is None else self.rotation.block)
        return self._form


def walsh_hadamard(n: int) -> torch.Tensor:
    """ggml_gen_hadamard's matrix: Sylvester's construction with entries +-(1 / sqrtf(n)) in float32."""
    index = torch.arange(n)
    parity = torch.zeros(n, n, dtype=torch.int64)
    for bit in range(n.bit_length()):
        parity ^= ((index[:, None] >> bit) & (index[None, :] >> bit)) & 1
    entry = (1 / torch.tensor(float(n)).sqrt().double()).float()
    return torch.where(parity.bool(), -entry, entry)


def rotation_block(role: str, d: int) -> int | None:
    """llama.cpp's rotation size: keys the largest power of two (from 64) dividing head_dim, values 64; none
    when head_dim is not a multiple of 64."""
    if d % ROTATION_MIN:
        return None
    if role == "v":
        return ROTATION_MIN
    n = ROTATION_MIN
    while d % (2 * n) == 0:
        n *= 2
    return n


@register_quantizer("ggml")
@dataclass(frozen=True)
class GGMLConfig(QuantizerConfig):
    """llama.cpp KV block types, 32 coordinates a block, after llama.cpp's Hadamard rotation unless hadamard=false."""

    type: Literal["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl"] = "q4_0"
    hadamard: bool = True
    seeded = False

    def build(self, site: Site, seed: int) -> Quantizer:
        require_blocks(site.d, BLOCK, f"ggml {self.type}")
        n = rotation_block(site.role, site.d) if self.hadamard else None
        return GGMLBlocks(self.type, BlockDiagonal(walsh_hadamard(n), site.d) if n else None, site.d)
