"""Which quantizers the fused kernels implement, and the constants a kernel build needs.

A kernel covers RotatedQuantizer(identity | SRHT | SRFT, symmetric int4/int8 with fp32 or fp16 scales per
token or per power-of-two group, optional lambda) at power-of-two head_dim: the SRFT paper's fused
kernel (Sec. 3.2) and its scaled-g32 variant (Sec. 7.1). Anything else keeps the torch reference.
"""

import math
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from kvq.quant.rotated import LAMBDA_FLOOR, RotatedPacked, RotatedQuantizer
from kvq.quant.scalar import ScalarPacked, ScalarQuantizer
from kvq.rotations import SRFT, SRHT, Identity

ROTATION_CODES = {Identity: 0, SRHT: 1, SRFT: 2}
KERNEL_BITS = (4, 8)
KERNEL_SCALE_DTYPES = (torch.float32, torch.float16)
THREADS_PER_GROUP = 128  # Metal threadgroups; one vector per thread
# CUDA blocks: one warp, twelve to an SM (kernels/entry_cuda.cu). Each warp prefetches the rows of the warp
# ~0.6 of a wave on, so a warp never waits on its block's others; wider blocks measured no faster.
CUDA_BLOCK = 32


def twiddle_literals(d: int) -> str:
    """cos, sin of pi k / (d/2) for k < d/2, float32 values as C literals (9 significant digits: exact)."""
    angles = math.pi * torch.arange(d // 2, dtype=torch.float64) / (d // 2)
    pairs = torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1).flatten().float().tolist()
    return ", ".join(f"{value:.8e}f" for value in pairs)


@dataclass(frozen=True)
class KernelPlan:
    d: int
    bits: int
    group: int
    rotation: int
    signs: torch.Tensor
    lam: torch.Tensor | None
    scale_dtype: torch.dtype = torch.float32

    @property
    def code_bytes(self) -> int:
        return self.d * self.bits // 8

    @property
    def groups(self) -> int:
        return self.d // self.group

    def on(self, device: torch.device) -> "KernelPlan":
        """The same plan with its constants (signs, float32 lambda) on `device`."""
        lam = self.lam.to(device=device, dtype=torch.float32) if self.lam is not None else None
        return replace(self, signs=self.signs.to(device), lam=lam)

    @cached_property
    def sign_words(self) -> dict[int, torch.Tensor]:
        """Per element size in bytes (2 or 4): the signs as int32 XOR masks over the 32-bit words that
        hold a vector of such elements (a sign flip is exact, and one logic op per word)."""
        return {size: _sign_masks(self.signs, size) for size in (2, 4)}

    @cached_property
    def kernel_lam(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(lambda floored as RotatedQuantizer floors it, its reciprocal): what quantize multiplies by and
        what dequantize multiplies by, or None without lambda."""
        if self.lam is None:
            return None
        floored = self.lam.clamp_min(LAMBDA_FLOOR).contiguous()
        return floored, 1.0 / floored

    @cached_property
    def define_items(self) -> tuple[tuple[str, int | str], ...]:
        """defines() as the kernel caches' key, made once: formatting the twiddle table is host time
        that would otherwise be paid at every flush of the fused cache."""
        return tuple(self.defines().items())

    def defines(self) -> dict[str, int | str]:
        return {"KVQ_D": self.d, "KVQ_GROUP": self.group, "KVQ_BITS": self.bits, "KVQ_ROT": self.rotation,
                "KVQ_BLOCK": CUDA_BLOCK, "KVQ_TWIDDLES": twiddle_literals(self.d),
                "KVQ_SCALE_HALF": int(self.scale_dtype == torch.float16)}


def _sign_masks(signs: torch.Tensor, element_bytes: int) -> torch.Tensor:
    per_word, width = 4 // element_bytes, 8 * element_bytes
    negative = (signs < 0).to(torch.int64).view(-1, per_word)
    masks = (negative << (torch.arange(per_word, device=signs.device) * width + width - 1)).sum(-1)
    return (masks - (masks >> 31 << 32)).to(torch.int32)  # bit 31 set: the int32 with that bit pattern


def _power_of_two(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def packing_reason(quantizer) -> str | None:
    """None when the quantizer packs as the kernels and the fused cache store codes: a rotated symmetric
    int4/int8 scalar quantizer with float32 or float16 per-token or per-group scales; else why not."""
    inner = getattr(quantizer, "inner", None)
    if not isinstance(quantizer, RotatedQuantizer) or not isinstance(inner, ScalarQuantizer):
        return f"{type(quantizer).__name__} is not a rotated scalar quantizer"
    if inner.bits not in KERNEL_BITS or not inner.symmetric or inner.scale_dtype not in KERNEL_SCALE_DTYPES:
        return "packed kernels and the fused cache need symmetric int4/int8 codes with float32 or float16 scales"
    if inner.granularity not in ("per_token", "per_group"):
        return f"granularity {inner.granularity} has no kernel (per_channel scales span tokens)"
    return None


def packed_codes(codes: torch.Tensor, scales: torch.Tensor, shape: tuple, dtype: torch.dtype) -> RotatedPacked:
    """Kernel-layout codes (..., bytes) and scales (..., groups) as the reference quantizers' packed
    dataclass, so the reference can check and decode them."""
    return RotatedPacked(ScalarPacked(codes, scales.unsqueeze(-1), None, None, tuple(shape), dtype))


def unsupported_reason(quantizer) -> str | None:
    """None when a fused kernel implements this quantizer exactly; else why not."""
    reason = packing_reason(quantizer)
    if reason:
        return reason
    inner = quantizer.inner
    if type(quantizer.rotation) not in ROTATION_CODES:
        return f"rotation {type(quantizer.rotation).__name__} has no kernel (learned rotations run in torch)"
    d = quantizer.rotation.d
    if not _power_of_two(d) or not 8 <= d <= 512:
        return f"kernels need a power-of-two head_dim in 8..512, got {d}"
    if inner.granularity == "per_group" and not (_power_of_two(inner.group_size) and inner.group_size >= 2):
        return f"kernels need a power-of-two group size >= 2, got {inner.group_size}"
    return None


def plan_for(quantizer) -> KernelPlan | None:
    if unsupported_reason(quantizer) is not None:
        return None
    inner, rotation = quantizer.inner, quantizer.rotation
    group = rotation.d if inner.granularity == "per_token" else inner.group_size
    signs = getattr(rotation, "signs", torch.ones(rotation.d))
    return KernelPlan(rotation.d, inner.bits, group, ROTATION_CODES[type(rotation)], signs.float(), quantizer.lam,
                      inner.scale_dtype)
