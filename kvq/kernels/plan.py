"""Which packed layouts the fused kernels implement, and what a kernel build and launch need from one.

A kernel covers the PackedLayout of a rotation (identity | SRHT | SRFT) with optional lambda and 2-, 3-, 4- or 8-bit
codes, symmetric or with offsets, with fp32 or fp16 scales per token or per power-of-two group, at power-of-two
head_dim (rows of whole 32-bit words of codes): the SRFT paper's fused kernel (Sec. 3.2) and its scaled-g32 variant
(Sec. 7.1); and, after the same rotations, TurboQuant_mse's codebook codes of 2-4 bits with an fp16 norm per token
(its Alg. 1). Other layouts take the reference. Imported on an accelerator only (kvq.kernels.dispatch).
"""

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.utils.weak import WeakIdKeyDictionary

from kvq.quant.codebooks import NORM_FLOOR, midpoints
from kvq.quant.layout import PackedLayout

ROTATION_CODES = {"identity": 0, "srht": 1, "srft": 2}
KERNEL_BITS = (2, 3, 4, 8)
CODEBOOK_KERNEL_BITS = (2, 3, 4)
KERNEL_SCALE_DTYPES = (torch.float32, torch.float16)
THREADS_PER_GROUP = 128  # Metal threadgroups; one vector per thread
# CUDA blocks: one warp, twelve to an SM (csrc/entry_cuda.cu). Each warp prefetches the rows of the warp
# ~0.6 of a wave on, so a warp never waits on its block's others; wider blocks are no faster.
CUDA_BLOCK = 32


def twiddle_literals(d: int) -> str:
    """cos, sin of pi k / (d/2) for k < d/2, float32 values as C literals (9 significant digits: exact)."""
    angles = math.pi * torch.arange(d // 2, dtype=torch.float64) / (d // 2)
    pairs = torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1).flatten().float().tolist()
    return ", ".join(f"{value:.8e}f" for value in pairs)


def _power_of_two(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def unsupported_reason(layout: PackedLayout) -> str | None:
    """None when a fused kernel implements this layout exactly; else why not."""
    if layout.token_group > 1:
        return ("the shared kernel body writes stats per token: stats spanning tokens (KIVI's keys) are written by "
                "Triton on CUDA (kvq.kernels.triton_quantize), else by the reference")
    if layout.codebook and not _is_turbo_mse(layout):
        return ("the kernels write and read codebook codes of 2-4 bits with an fp16 norm per token (TurboQuant_mse's); "
                "other codebook layouts take the reference")
    if layout.rotation not in ROTATION_CODES:
        return f"rotation kind {layout.rotation} has no kernel (learned rotations run in torch)"
    if not layout.codebook and (layout.bits not in KERNEL_BITS or layout.scale_dtype not in KERNEL_SCALE_DTYPES):
        return "kernels need 2-, 3-, 4- or 8-bit codes with float32 or float16 scales"
    if not _power_of_two(layout.head_dim) or not 8 <= layout.head_dim <= 512:
        return f"kernels need a power-of-two head_dim in 8..512, got {layout.head_dim}"
    if layout.head_dim * layout.bits % 32:
        return f"kernels need rows of whole 32-bit words of codes, not {layout.head_dim} x {layout.bits} bits"
    if not (_power_of_two(layout.group_size) and layout.group_size >= 2):
        return f"kernels need a power-of-two group size >= 2, got {layout.group_size}"
    return None


def _is_turbo_mse(layout: PackedLayout) -> bool:
    """TurboQuant_mse's codes, as its own arithmetic writes them (kvq.quant.codebooks.encode_unit_vector)."""
    return (layout.scheme == "kvq" and layout.bits in CODEBOOK_KERNEL_BITS and layout.group_size == layout.head_dim
            and layout.scale_dtype == torch.float16 and not layout.layer_scaled)


@lru_cache(maxsize=64)
def kernel_defines(layout: PackedLayout) -> tuple[tuple[str, int | str], ...]:
    """The build's defines, made once per layout: formatting the twiddle table is host time that would
    otherwise be paid at every flush of the fused cache."""
    return (("KVQ_D", layout.head_dim), ("KVQ_GROUP", layout.group_size), ("KVQ_BITS", layout.bits),
            ("KVQ_ROT", ROTATION_CODES[layout.rotation]), ("KVQ_BLOCK", CUDA_BLOCK),
            ("KVQ_TWIDDLES", twiddle_literals(layout.head_dim)),
            ("KVQ_SCALE_HALF", int(layout.scale_dtype == torch.float16)), ("KVQ_ASYM", int(not layout.symmetric)),
            ("KVQ_CODEBOOK", int(layout.codebook)), ("KVQ_NORM_FLOOR", f"{NORM_FLOOR:.8e}f"))


@dataclass(frozen=True)
class KernelConstants:
    """A form's constants as the kernels read them: per element size in bytes (2 or 4), the signs as int32
    XOR masks over the 32-bit words that hold a vector of such elements (a sign flip is exact, and one
    logic op per word); lambda (floored) and its reciprocal, or None; a codebook's float32 midpoints and its
    levels, or None."""

    sign_words: dict[int, torch.Tensor]
    lam: tuple[torch.Tensor, torch.Tensor] | None
    codebook: tuple[torch.Tensor, torch.Tensor] | None = None

    def arguments(self, dtype: torch.dtype, reciprocal: bool) -> list:
        """sign_words, lambda (its reciprocal for dequantize), has_lam, the codebook's midpoints (its levels for
        dequantize), for vectors of `dtype` (a pointer that its build does not read stands in for an absent
        lambda or codebook)."""
        words = self.sign_words[dtype.itemsize]
        book = words if self.codebook is None else self.codebook[int(reciprocal)]
        if self.lam is None:
            return [words, words, 0, book]
        return [words, self.lam[int(reciprocal)], 1, book]


_constants = WeakIdKeyDictionary()  # signs tensor -> (its lambda, its codebook, their KernelConstants)


def kernel_constants(signs: torch.Tensor, lam: torch.Tensor | None,
                     codebook: torch.Tensor | None = None) -> KernelConstants:
    """Made once per (signs, lambda, codebook) of tensors (a form's on a device, PackedForm.on), so a launch
    converts nothing."""
    if lam is not None and codebook is not None:
        raise ValueError("the kernels' codebook codes take no lambda")
    hit = _constants.get(signs)
    if hit is None or hit[0] is not lam or hit[1] is not codebook:
        pair = None if lam is None else (lam.float().contiguous(), 1.0 / lam.float())
        levels = None if codebook is None else codebook.float().contiguous()
        book = None if levels is None else (midpoints(levels), levels)
        hit = _constants[signs] = (lam, codebook, KernelConstants(
            {size: _sign_masks(signs, size) for size in (2, 4)}, pair, book))
    return hit[2]


def _sign_masks(signs: torch.Tensor, element_bytes: int) -> torch.Tensor:
    per_word, width = 4 // element_bytes, 8 * element_bytes
    negative = (signs < 0).to(torch.int64).view(-1, per_word)
    masks = (negative << (torch.arange(per_word, device=signs.device) * width + width - 1)).sum(-1)
    return (masks - (masks >> 31 << 32)).to(torch.int32)  # bit 31 set: the int32 with that bit pattern
