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

The float formats' writes too (MX's element codes with an E8M0 scale per block of 32, FP8's with an fp32 scale per
token or its layer's one scale, NVFP4's with an E4M3 scale per block of 16 under its layer's), bit for bit
kvq.quant.mx's, kvq.quant.fp8's and kvq.quant.nvfp4's arithmetic on CUDA: each static-cache step writes them, and in
torch each is a few dozen small kernels.
"""

import torch
import triton
import triton.language as tl

from kvq.kernels.triton_codes import float_bits_to_f16
from kvq.kernels.triton_decode import per_coordinate
from kvq.kernels.triton_launch import launch
from kvq.quant.layout import E4M3_STATS, MX_SCHEMES, NVFP4_SCHEME, PackedLayout
from kvq.quant.mx import BLOCK as MX_BLOCK
from kvq.quant.nvfp4 import BLOCK as NVFP4_BLOCK
from kvq.quant.nvfp4 import SMALLEST_SCALE

ROUND_TO_INTEGER = tl.constexpr(12582912.0)  # 1.5 * 2^23
KERNEL_BITS = (2, 4, 8)  # widths whose codes fill whole bytes per channel block
FLOAT_KERNEL_BITS = (4, 8)  # float formats whose codes fill whole bytes (FP6's span bytes)
MAX_TILE = 4096  # tokens x channels per program: float32 values held in registers
F32_MIN_NORMAL = tl.constexpr(torch.finfo(torch.float32).tiny)
E4M3_SMALLEST = tl.constexpr(SMALLEST_SCALE)  # NVFP4's block scales' clamp


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


@triton.jit
def _float_codes(v, BITS: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, MAX_VALUE: tl.constexpr):
    """A float format's codes (int32) of float32 v, as MiniFloat.encode computes them: |v| saturated at MAX_VALUE,
    its binade e = max(floor(log2 |v|), 1 - BIAS) (read from the float32 exponent field), r = |v| 2^(M - e) (exact)
    rounded half to even; code = ((e + BIAS - 1) << M) + r, which is the exponent field e + BIAS over mantissa
    r - 2^M where r >= 2^M, a subnormal's mantissa r in the lowest binade, and carries into the next field where
    r rounds up to 2^(M + 1); the sign bit from v's (negative zero keeps it)."""
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    magnitude = tl.minimum(tl.abs(v), MAX_VALUE)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    binade = tl.maximum(exponent, 1 - BIAS)
    to_steps = ((MANTISSA - binade + 127) << 23).to(tl.float32, bitcast=True)
    steps = (magnitude * to_steps + ROUND_TO_INTEGER) - ROUND_TO_INTEGER
    return (((binade + BIAS - 1) << MANTISSA) + steps.to(tl.int32)) | (sign << (BITS - 1))


@triton.jit(do_not_specialize=["n"])
def float_codes_kernel(rows_ptr, codes_ptr, scales_ptr, layer_scale_ptr, n, D: tl.constexpr, ROWS: tl.constexpr,
                       BITS: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, MAX_VALUE: tl.constexpr,
                       EMAX: tl.constexpr, BLOCK: tl.constexpr, SCALING: tl.constexpr):
    """One program per ROWS rows (n, D) of any float dtype -> codes (n, D * BITS / 8) uint8 and scales, by SCALING:
    - "mx": MX's (kvq.quant.mx.block_codes: per block of BLOCK coordinates the E8M0 byte of floor(log2 amax) - EMAX,
      clamped to [0, 255], and x divided by its value, floored at float32's least normal), (n, D / BLOCK) uint8;
    - "token": FP8's per-token scale (kvq.quant.fp8: amax times the float32 reciprocal of MAX_VALUE, as torch's CUDA
      division by a number is, and x / scale where it is positive, else 0), (n, 1) float32;
    - "layer": FP8's layer scale s read from layer_scale_ptr, the same division, and no scales written;
    - "nvfp4": NVFP4's (kvq.quant.nvfp4.block_codes): per block of BLOCK the E4M3 code of amax / MAX_VALUE / s
      clamped to [2^-6, 448], and x times (1 / s) / that E4M3 value, (n, D / BLOCK) E4M3 bytes."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < n
    x = tl.load(rows_ptr + rows[:, None].to(tl.int64) * D + tl.arange(0, D)[None, :], mask=ok[:, None],
                other=0.0).to(tl.float32)
    BLOCKS: tl.constexpr = D // BLOCK if BLOCK > 0 else 1
    block_columns = rows[:, None].to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)[None, :]
    if SCALING == "mx":
        amax = tl.max(tl.reshape(tl.abs(x), (ROWS, BLOCKS, BLOCK)), 2)
        exponent_field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        biased = tl.minimum(tl.maximum(exponent_field - EMAX, 0), 255)
        scale = tl.maximum((biased << 23).to(tl.float32, bitcast=True), F32_MIN_NORMAL)
        v = tl.math.div_rn(x, per_coordinate(scale, ROWS, BLOCKS, BLOCK))
        tl.store(scales_ptr + block_columns, biased.to(tl.uint8), mask=ok[:, None])
    elif SCALING == "nvfp4":
        layer_scale = tl.full((ROWS, BLOCKS), tl.load(layer_scale_ptr), tl.float32)
        amax = tl.max(tl.reshape(tl.abs(x), (ROWS, BLOCKS, BLOCK)), 2)
        block_scale = tl.math.div_rn(amax * (1.0 / MAX_VALUE), layer_scale)
        block_scale = tl.minimum(tl.maximum(block_scale, E4M3_SMALLEST), 448.0)
        scale_codes = _float_codes(block_scale, 8, 3, 7, 448.0)  # E4M3: 3 mantissa bits, bias 7, largest 448
        inverse = tl.math.div_rn(tl.full((ROWS, BLOCKS), 1.0, tl.float32), layer_scale)
        factor = tl.math.div_rn(inverse, float_bits_to_f16(scale_codes, 8, 3).to(tl.float32))
        v = x * per_coordinate(factor, ROWS, BLOCKS, BLOCK)
        tl.store(scales_ptr + block_columns, scale_codes.to(tl.uint8), mask=ok[:, None])
    elif SCALING == "layer":
        scale = tl.load(layer_scale_ptr)
        v = tl.where(scale > 0, tl.math.div_rn(x, tl.full((ROWS, D), scale, tl.float32)), 0.0)
    else:
        scale = tl.max(tl.abs(x), 1) * (1.0 / MAX_VALUE)
        v = tl.where(scale[:, None] > 0, tl.math.div_rn(x, tl.broadcast_to(scale[:, None], (ROWS, D))), 0.0)
        tl.store(scales_ptr + rows, scale, mask=ok)
    codes = _float_codes(v, BITS, MANTISSA, BIAS, MAX_VALUE)
    row_bytes: tl.constexpr = D * BITS // 8
    if BITS == 4:  # kvq.quant.packing: coordinate 2j in byte j's low nibble, 2j + 1 in its high one
        even, odd = tl.split(tl.reshape(codes, (ROWS, row_bytes, 2)))
        codes = even | (odd << 4)
    tl.store(codes_ptr + rows[:, None].to(tl.int64) * row_bytes + tl.arange(0, row_bytes)[None, :],
             codes.to(tl.uint8), mask=ok[:, None])


def unsupported_reason(layout: PackedLayout, lam: torch.Tensor | None) -> str | None:
    """None when a kernel here writes this layout exactly (KIVI's token groups, FP8's and MX's float codes); else why
    the reference does."""
    if layout.rotation != "identity" or lam is not None:
        return "token-group stats and float codes after a rotation or lambda are written by the reference"
    if layout.element is not None:
        if layout.bits not in FLOAT_KERNEL_BITS or layout.head_dim & (layout.head_dim - 1):
            return (f"the float-codes kernel writes {'/'.join(map(str, FLOAT_KERNEL_BITS))}-bit elements at a "
                    f"power-of-two head_dim, not {layout.bits}-bit at {layout.head_dim}")
        return None
    if layout.bits not in KERNEL_BITS or layout.scale_dtype != torch.float16 or layout.symmetric:
        return f"the token-group kernel writes asymmetric {'/'.join(map(str, KERNEL_BITS))}-bit codes with fp16 stats"
    group, d = layout.token_group, layout.head_dim
    if group & (group - 1) or d & (d - 1) or d < 8 or group * min(d, 32) > MAX_TILE:
        return f"the token-group kernel needs power-of-two head_dim >= 8 and token group <= {MAX_TILE // 32}"
    return None


def quantize(rows: torch.Tensor, layout: PackedLayout,
             layer_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, d) rows -> codes and stats in a layout unsupported_reason accepts (a layer_scaled one's under
    layer_scale)."""
    if layout.element is not None:
        return quantize_float_codes(rows, layout, layer_scale)
    return quantize_token_groups(rows, layout)


def quantize_float_codes(rows: torch.Tensor, layout: PackedLayout,
                         layer_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, d) rows -> an FP8, MX or NVFP4 layout's codes (n, code_bytes) and scales (n, layout.stats)."""
    n, d = rows.shape
    element = layout.element
    codes = torch.empty(n, layout.code_bytes, dtype=torch.uint8, device=rows.device)
    scales = torch.empty(n, layout.stats, dtype=layout.stats_dtype, device=rows.device)
    if layout.scheme in MX_SCHEMES:
        scaling, block = "mx", MX_BLOCK
    elif layout.scheme == NVFP4_SCHEME:
        scaling, block = "nvfp4", NVFP4_BLOCK
    else:
        scaling, block = "layer" if layout.layer_scaled else "token", 0
    stats = scales.view(torch.uint8) if scales.dtype == E4M3_STATS else scales  # E4M3 written as its bytes
    per_row = max(1, MAX_TILE // 2 // d)
    if n:
        launch(float_codes_kernel, (-(-n // per_row),),
               (rows.contiguous(), codes, stats, stats if layer_scale is None else layer_scale, n), D=d,
               ROWS=per_row, BITS=element.bits, MANTISSA=element.mantissa_bits, BIAS=element.bias,
               MAX_VALUE=element.max_value, EMAX=element.max_power_of_two, BLOCK=block, SCALING=scaling)
    return codes, scales


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
