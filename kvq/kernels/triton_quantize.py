"""KIVI's key quantize as a Triton kernel: codes per token with a scale and an offset per channel over each group of
`token_group` tokens (PackedLayout.token_group), bit for bit the reference's arithmetic (kvq.quant.scalar's
asymmetric per-channel encode, KIVI Sec. 3.2): lo = min, span = max - lo over the group's tokens in float32; offset =
fp16(lo), scale = fp16(span / qmax) (1 where span is 0); code = round-half-even((x - offset) / scale) clamped to
[0, qmax]; codes packed little-end first (kvq.quant.packing). The reference's arithmetic is torch's on CUDA, which
divides by a Python number as a product with its float32 reciprocal (span * (1 / qmax)) and by a tensor exactly.

The static cache re-quantizes a key group at every write that touches it (kvq.static_cache), so this runs each decode
step of every layer; in torch that is a dozen small kernels. Divisions are IEEE (div_rn: Triton's `/` is not) and the
rounding adds and subtracts 1.5 * 2^23, which rounds a float32 below 2^22 in magnitude to an integer, half to even, as
torch.round does.
"""

import torch
import triton
import triton.language as tl

from kvq.kernels.triton_decode import launch
from kvq.quant.layout import PackedLayout

ROUND_TO_INTEGER = tl.constexpr(12582912.0)  # 1.5 * 2^23
KERNEL_BITS = (2, 4, 8)  # widths whose codes fill whole bytes per channel block
MAX_TILE = 4096  # tokens x channels per program: float32 values held in registers


@triton.jit
def token_group_quantize_kernel(rows_ptr, codes_ptr, stats_ptr, D: tl.constexpr, GROUP: tl.constexpr,
                                CHANNELS: tl.constexpr, BITS: tl.constexpr):
    """One program per (token group, block of CHANNELS channels): rows (n, D) of any float dtype -> codes
    (n, D * BITS / 8) uint8 and stats (n / GROUP, 2 D) fp16, scales then offsets."""
    group = tl.program_id(0)
    channels = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
    tokens = group * GROUP + tl.arange(0, GROUP)
    x = tl.load(rows_ptr + tokens[:, None].to(tl.int64) * D + channels[None, :]).to(tl.float32)
    qmax: tl.constexpr = (1 << BITS) - 1
    lo = tl.min(x, 0)
    span = tl.max(x, 0) - lo
    offset = lo.to(tl.float16)
    scale = tl.where(span > 0, span * (1.0 / qmax), 1.0).to(tl.float16)
    ratio = tl.math.div_rn(x - offset.to(tl.float32)[None, :], tl.broadcast_to(scale.to(tl.float32)[None, :], x.shape))
    rounded = (ratio + ROUND_TO_INTEGER) - ROUND_TO_INTEGER
    codes = tl.minimum(tl.maximum(rounded, 0.0), qmax).to(tl.int32)
    PER_BYTE: tl.constexpr = 8 // BITS
    BYTES: tl.constexpr = CHANNELS // PER_BYTE
    shifts = tl.arange(0, PER_BYTE) * BITS
    packed = tl.sum(tl.reshape(codes, (GROUP, BYTES, PER_BYTE)) << shifts[None, None, :], 2)
    byte_columns = tl.program_id(1) * BYTES + tl.arange(0, BYTES)
    tl.store(codes_ptr + tokens[:, None].to(tl.int64) * (D // PER_BYTE) + byte_columns[None, :], packed.to(tl.uint8))
    stats_row = stats_ptr + group.to(tl.int64) * (2 * D)
    tl.store(stats_row + channels, scale)
    tl.store(stats_row + D + channels, offset)


def unsupported_reason(layout: PackedLayout, lam: torch.Tensor | None) -> str | None:
    """None when the kernel writes this token-group layout exactly; else why the reference does."""
    if layout.rotation != "identity" or lam is not None:
        return "token-group stats after a rotation or lambda are written by the reference"
    if layout.bits not in KERNEL_BITS or layout.scale_dtype != torch.float16 or layout.symmetric:
        return f"the token-group kernel writes asymmetric {'/'.join(map(str, KERNEL_BITS))}-bit codes with fp16 stats"
    group, d = layout.token_group, layout.head_dim
    if group & (group - 1) or d & (d - 1) or d < 8 or group * min(d, 32) > MAX_TILE:
        return f"the token-group kernel needs power-of-two head_dim >= 8 and token group <= {MAX_TILE // 32}"
    return None


def quantize_token_groups(rows: torch.Tensor, layout: PackedLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, d) rows, n a multiple of the token group -> codes (n, code_bytes) and stats (n / token_group, 2 d)."""
    n, d = rows.shape
    group = layout.token_group
    codes = torch.empty(n, layout.code_bytes, dtype=torch.uint8, device=rows.device)
    stats = torch.empty(n // group, layout.stats, dtype=torch.float16, device=rows.device)
    channels = min(d, 32)
    if n:
        launch(token_group_quantize_kernel, (n // group, d // channels), (rows.contiguous(), codes, stats), D=d,
               GROUP=group, CHANNELS=channels, BITS=layout.bits)
    return codes, stats
