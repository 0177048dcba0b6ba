"""Fused int4/int8 decode attention (query length 1) over a packed, rotated KV cache.

Open-TQ-Metal Alg. 1 with FlashDecoding's split-K (Sec. 3.2, Eq. 5): each program reads packed K/V
codes and their scales directly, turns the codes into fp16 integers in registers (a magic-number
conversion whose key biases the query takes out), keeps an online softmax over its slice of the sequence
and writes a partial (o_c, m_c, l_c); a reduce pass combines the partials. One program serves all
query heads of a KV head (GQA), so every KV byte is read once. Scales never multiply the codes: the
query's rows are laid out once per scale group (see _online_softmax_step), so each group's share of
q . k meets its scale in float32 after the tensor-core product, and the probabilities carry the V
scales into the second product.

Packed codes live in the quantizers' rotated, lambda-scaled domains (y = lam * R x). With
query_map = R_k^T diag(1/lam_k) and output_map = diag(1/lam_v) R_v: q . k = (q query_map) . y_k and
sum_i p_i v_i = (sum_i p_i y_v,i) output_map. The packed splits accumulate in the value domain and the
residual-window split (exact tokens) in the model's, and the reduce pass maps the packed sum back before
adding the window's, so the window needs no per-step rotation.

The partials come from kernels/decode_attention.cu (CUDA, through NVRTC) where the shape fits it (head_dim
128, int4 K and V in scale groups of 32, at most 4 query heads per KV head: Llama-3-8B's, `kvq bench
kernels`' shapes), at every sequence length; from the Triton _partial_kernel otherwise. Its fragment layouts
turn codes into tensor-core operands in registers, which Triton's layouts do not allow (see its header), and
each of its programs maps its own query (an mma per warp on the map in fragment_order), which spares the step
the map kernel's launch and its round trip through memory. The Triton step maps the query
once, in its own kernel (inside every Triton program the d x d product cost more GPU time than it saved host
time).

The step's kernels (map, partials, reduce; or partials and reduce) are launched programmatically dependent on
compute capability 9.0, so each one's launch overlaps the kernel before it (_await_previous_kernel).

At head_dim 128 the reduce pass is kernels/decode_attention.cu's kvq_decode_reduce, after either partial
kernel: all of a query head's partials in one round trip, where the Triton _reduce_kernel (kept for other
head sizes) needs a chain of loads per split.

`decode_attention` dispatches to these kernels on CUDA and to `decode_attention_reference` (dequantize to
the model's domain, then SDPA) elsewhere; the GPU tests check the two agree.
"""

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from kvq.kernels.backends import CudaLaunch
from kvq.kernels.plan import KERNEL_SCALE_DTYPES, packed_codes
from kvq.kernels.source import DTYPE_DEFINES, KERNEL_DIR
from kvq.quant.rotated import RotatedPacked
from kvq.quant.scalar import ScalarQuantizer

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the reference path serves
    triton = None

MIN_DOT = 16  # tl.dot needs every dimension >= 16
MAX_ROWS = 64  # query rows x scale groups per program beyond which the accumulators spill: reference path
WIDE_HEAD = 256  # from this head_dim on, shallower pipelining keeps the K/V tiles inside shared memory
MAP_COLUMNS = 32  # output columns per program of the query map and the reduce: more programs, shorter chains


@dataclass
class LaunchConfig:
    """Tile and pipelining choices; the defaults are the fastest of benchmarks/attention_configs.py's sweeps
    (Llama-3-8B shapes, int4 g32; runs/bench/LOG.md has the measurements). Four stages keep three tiles in
    flight; more leave shared memory for too few programs. Each SM is bound by the loads its programs keep in
    flight, not by HBM, so the sequence is split into as many programs as the SMs hold at once (waves=None;
    from the compiled kernel's registers and shared memory): a program per SM more queues behind the others,
    one fewer leaves loads unissued."""

    block: int = 64
    num_warps: int = 2
    num_stages: int = 4
    waves: int | None = None  # programs per SM to aim for when splitting the sequence; None: as many as fit
    programmatic: bool = True  # programmatic dependent launch where the device has it
    # the step's kernels to launch: benchmarks/attention_pieces.py leaves some out to time the rest (the
    # output is then wrong)
    kernels: tuple[str, ...] = ("map", "partial", "reduce")
    # "cuda": kernels/decode_attention.cu's partial kernel where the shape and length fit; "triton": always Triton
    partial: str = "cuda"


LAUNCH = LaunchConfig()


@dataclass
class PackedKV:
    """Packed codes (B, H, T, d*bits/8) uint8 and fp32 or fp16 scales (B, H, T, groups) of one role."""

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    head_dim: int

    def rows(self, n: int) -> "PackedKV":
        """The first n tokens."""
        return PackedKV(self.codes[..., :n, :], self.scales[..., :n, :], self.bits, self.head_dim)

    @property
    def group(self) -> int:
        return self.head_dim // self.scales.shape[-1]

    def as_packed(self, dtype: torch.dtype) -> RotatedPacked:
        """The same codes as the reference quantizers' packed dataclass (for kvq.kernels.decode)."""
        return packed_codes(self.codes, self.scales, (*self.codes.shape[:-1], self.head_dim), dtype)

    def dequantized(self) -> torch.Tensor:
        """float32 codes x scales in the quantizer's rotated domain (the reference ScalarQuantizer decode;
        per-token scales are the one-group case)."""
        return ScalarQuantizer(self.bits, "per_group", self.group).decode(self.as_packed(torch.float32).inner)


def decode_attention_reference(query, query_map, keys: PackedKV, values: PackedKV, window_keys, window_values,
                               output_map, scale: float) -> torch.Tensor:
    """query (B, Hq, d) -> attention output (B, Hq, d) in the query's dtype, all in the model's domain."""
    k = torch.cat([keys.dequantized() @ query_map.T, window_keys.float()], dim=-2)
    v = torch.cat([values.dequantized() @ output_map, window_values.float()], dim=-2)
    out = F.scaled_dot_product_attention(query.float().unsqueeze(-2), k, v, scale=scale,
                                         enable_gqa=query.shape[1] != k.shape[1])
    return out.squeeze(-2).to(query.dtype)


def supported(keys: PackedKV, values: PackedKV, query_heads: int) -> bool:
    kv_heads = keys.codes.shape[1]
    return (triton is not None and keys.codes.is_cuda and keys.bits in (4, 8)
            and keys.head_dim // 2 >= MIN_DOT and keys.head_dim & (keys.head_dim - 1) == 0
            and query_heads % kv_heads == 0
            and _grouped_rows(query_heads // kv_heads, keys.scales.shape[-1], values.scales.shape[-1]) <= MAX_ROWS)


def decode_attention(query, query_map, keys: PackedKV, values: PackedKV, window_keys, window_values, output_map,
                     scale: float):
    arguments = (query, query_map, keys, values, window_keys, window_values, output_map, scale)
    if supported(keys, values, query.shape[1]):
        return _decode_attention_gpu(*arguments)
    return decode_attention_reference(*arguments)


if triton is not None:

    # Two's-complement nibbles to fp16 integers: spread 4 bytes over 16-bit lanes, then place each nibble
    # under exponent 1024 while flipping its sign bit ((n & 0xF) ^ 8 = n + 8), a low nibble in mantissa
    # bits 0-3 (1024 + n + 8), a high one in bits 4-7 (1024 + 16 (n + 8)). Outputs: low nibbles, then
    # high nibbles, of the 4 bytes. _BIASED_NIBBLES stops there, 8 values per 6 instructions, for keys,
    # whose query takes the biases out (see _query_bias); _EXACT_NIBBLES also subtracts them, 8 values per
    # 10 instructions, for values, whose accumulators would otherwise carry the biases across a whole
    # split (the tensor cores' float32 sums truncate: 5e-4 max abs error at 8K tokens in the GPU test).
    _BIASED_NIBBLES = """
    {
    .reg .b32 lo, hi;
    prmt.b32 lo, $4, 0, 0x4140;
    prmt.b32 hi, $4, 0, 0x4342;
    lop3.b32 $0, lo, 0x000F000F, 0x64086408, 0x6a;
    lop3.b32 $1, hi, 0x000F000F, 0x64086408, 0x6a;
    lop3.b32 $2, lo, 0x00F000F0, 0x64806480, 0x6a;
    lop3.b32 $3, hi, 0x00F000F0, 0x64806480, 0x6a;
    """
    _BIASED_NIBBLES_TO_F16 = tl.constexpr(_BIASED_NIBBLES + "}")
    _EXACT_NIBBLES_TO_F16 = tl.constexpr(_BIASED_NIBBLES + """
    .reg .b32 low_bias, high_step, high_bias;
    mov.b32 low_bias, 0x64086408;
    mov.b32 high_step, 0x2c002c00;
    mov.b32 high_bias, 0xd480d480;
    sub.f16x2 $0, $0, low_bias;
    sub.f16x2 $1, $1, low_bias;
    fma.rn.f16x2 $2, $2, high_step, high_bias;
    fma.rn.f16x2 $3, $3, high_step, high_bias;
    }""")  # 1032 + n - 1032; (1152 + 16 n) / 16 - 72
    LOW_BIAS = tl.constexpr(1032.0)  # a biased low nibble n reads 1032 + n
    HIGH_BIAS = tl.constexpr(1152.0)  # a biased high nibble n reads 1152 + 16 n
    HIGH_STEP = tl.constexpr(16.0)
    WINDOW_BLOCK = tl.constexpr(MIN_DOT)  # residual windows are ~16 tokens

    @triton.jit
    def _load_codes(codes_ptr, tokens, valid, BITS: tl.constexpr, HALF: tl.constexpr, VALUES: tl.constexpr):
        """Even and odd coordinates of a (BLOCK, d) tile of codes as fp16 integers (codes_ptr: this head's
        rows of HALF * BITS // 4 bytes); int4 keys come biased (_BIASED_NIBBLES_TO_F16). For values the
        conversion is marked impure, which pins it where it is written: Triton otherwise moves the tile's
        layout change ahead of it, to shift bytes rather than halves, and as V's products run over tokens
        that gathers the bytes one at a time from shared memory."""
        pairs = tl.arange(0, HALF)
        row_bytes: tl.constexpr = HALF * BITS // 4
        if BITS == 4:
            byte = tl.load(codes_ptr + tokens[:, None] * row_bytes + pairs[None, :], mask=valid[:, None], other=0)
            even, odd = tl.inline_asm_elementwise(_EXACT_NIBBLES_TO_F16 if VALUES else _BIASED_NIBBLES_TO_F16,
                                                  "=r,=r,=r,=r,r", [byte], dtype=(tl.float16, tl.float16),
                                                  is_pure=not VALUES, pack=4)
        else:
            at = codes_ptr + tokens[:, None] * row_bytes + 2 * pairs[None, :]
            even = tl.load(at, mask=valid[:, None], other=0).to(tl.int8, bitcast=True).to(tl.float16)
            odd = tl.load(at + 1, mask=valid[:, None], other=0).to(tl.int8, bitcast=True).to(tl.float16)
        return even, odd

    @triton.jit
    def _load_scales(scales_ptr, tokens, valid, GROUPS: tl.constexpr):
        """(GROUPS, BLOCK) float32 scales of a tile (stored as float32 or fp16): one row per scale group."""
        groups = tl.arange(0, GROUPS)
        scales = tl.load(scales_ptr + tokens[None, :] * GROUPS + groups[:, None], mask=valid[None, :], other=0.0)
        return scales.to(tl.float32)

    @triton.jit
    def _load_window(ptr, tokens, valid, HALF: tl.constexpr):
        """Even and odd coordinates of a (BLOCK, d) tile of exact K or V rows, fp16: whole rows are read
        and split in registers (strided reads of each half took one load per element)."""
        dims = tl.arange(0, 2 * HALF)
        rows = tl.load(ptr + tokens[:, None] * (2 * HALF) + dims[None, :], mask=valid[:, None], other=0.0)
        even, odd = tl.split(tl.reshape(rows, (tokens.shape[0], HALF, 2)))
        return even.to(tl.float16), odd.to(tl.float16)

    @triton.jit
    def _by_group(x, GROUPS: tl.constexpr):
        """(GQA_P,) -> (GROUPS * GQA_P,): x repeated once per scale group (entry g * GQA_P + h)."""
        return tl.reshape(tl.broadcast_to(x[None, :], (GROUPS, x.shape[0])), (GROUPS * x.shape[0],))

    @triton.jit
    def _online_softmax_step(q_even, q_odd, k_bias, k_even, k_odd, k_scales, v_even, v_odd, v_scales, valid, m_i,
                             l_i, acc_even, acc_odd, GQA_P: tl.constexpr, BLOCK: tl.constexpr):
        """One tile of Alg. 1 with the scales kept out of the products: row block g of the query holds its
        group-g coordinates only, so one dot gives every group's share of q . codes, and each share meets
        its token's scale in float32; likewise row block g of the weights carries p * (group-g V scale)
        and keeps its own columns at the end (_own_columns). The codes enter the tensor cores exact, the
        keys' with biases, whose product with each query row (k_bias, (rows,)) leaves each tile's shares."""
        K_GROUPS: tl.constexpr = k_scales.shape[0]
        V_GROUPS: tl.constexpr = v_scales.shape[0]
        shares = tl.dot(q_odd, tl.trans(k_odd), tl.dot(q_even, tl.trans(k_even))) - k_bias[:, None]
        scores = tl.sum(tl.reshape(shares, (K_GROUPS, GQA_P, BLOCK)) * k_scales[:, None, :], 0)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        weights = tl.reshape(p[None, :, :] * v_scales[:, None, :], (V_GROUPS * GQA_P, BLOCK)).to(tl.float16)
        alpha = _by_group(alpha, V_GROUPS)[:, None]
        acc_even = tl.dot(weights, v_even, acc_even * alpha)
        acc_odd = tl.dot(weights, v_odd, acc_odd * alpha)
        return m_new, l_i, acc_even, acc_odd

    @triton.jit
    def _query_bias(q_even, q_odd, BITS: tl.constexpr):
        """Each query row's product with the biases of int4 keys: q_even . 1032 + q_odd . 1152, where q_odd
        was divided by 16 (_grouped_query's odd_scale); zeros for int8 keys."""
        if BITS == 4:
            return LOW_BIAS * tl.sum(q_even.to(tl.float32), 1) + HIGH_BIAS * tl.sum(q_odd.to(tl.float32), 1)
        return tl.zeros([q_even.shape[0]], tl.float32)

    @triton.jit
    def _own_columns(acc, GQA_P: tl.constexpr):
        """(GROUPS * GQA_P, HALF) -> (GQA_P, HALF): each coordinate from its own group's row block."""
        GROUPS: tl.constexpr = acc.shape[0] // GQA_P
        HALF: tl.constexpr = acc.shape[1]
        own = (tl.arange(0, HALF)[None, :] // (HALF // GROUPS)) == tl.arange(0, GROUPS)[:, None]
        return tl.sum(tl.where(own[:, None, :], tl.reshape(acc, (GROUPS, GQA_P, HALF)), 0.0), 0)

    @triton.jit
    def _grouped_query(ptr, row_offset, row_ok, scale, odd_scale, HALF: tl.constexpr, GROUPS: tl.constexpr,
                       GQA_P: tl.constexpr):
        """(GROUPS * GQA_P, HALF) even and odd query coordinates times `scale` and `odd_scale`, fp16; row
        block g keeps group g's coordinates and zeros elsewhere. row_offset / row_ok: (GQA_P,) element
        offsets, validity."""
        pairs = tl.arange(0, HALF)
        rows = tl.arange(0, GROUPS * GQA_P)
        mine = (pairs[None, :] // (HALF // GROUPS)) == (rows // GQA_P)[:, None]
        at = ptr + _by_group(row_offset, GROUPS)[:, None] + 2 * pairs[None, :]
        mask = mine & _by_group(row_ok, GROUPS)[:, None]
        even = tl.load(at, mask=mask, other=0.0).to(tl.float32) * scale
        odd = tl.load(at + 1, mask=mask, other=0.0).to(tl.float32) * odd_scale
        return even.to(tl.float16), odd.to(tl.float16)

    @triton.jit(do_not_specialize=["n_packed", "n_window", "tokens_per_split", "n_packed_splits", "kv_heads",
                                   "capacity", "window_capacity"])
    def _partial_kernel(
        q_ptr, qmap_ptr, kc_ptr, ks_ptr, vc_ptr, vs_ptr, kw_ptr, vw_ptr, o_ptr, m_ptr, l_ptr, lengths_ptr,
        n_packed, n_window, tokens_per_split, n_packed_splits, kv_heads, capacity, window_capacity, scale,
        GQA: tl.constexpr, GQA_P: tl.constexpr, HALF: tl.constexpr, BITS: tl.constexpr,
        K_GROUPS: tl.constexpr, V_GROUPS: tl.constexpr, BLOCK: tl.constexpr, DEVICE_LENGTHS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Codes and scales are (B, Hkv, capacity, .) buffers, windows (B, Hkv, window_capacity, d), all
        contiguous; q and q @ query_map (B, Hq, d); partials (B, Hq, splits, d) and (B, Hq, splits).
        Packed splits score q @ query_map against the codes; the last split scores q against the window,
        whose exact values pass through the same grouped step with unit scales. DEVICE_LENGTHS: the token
        counts come from lengths_ptr (see device_lengths) instead of n_packed and n_window."""
        _await_previous_kernel(PDL)
        if DEVICE_LENGTHS:
            counts = tl.load(lengths_ptr)
            n_packed = (counts >> 32).to(tl.int32)
            n_window = (counts & 0xFFFFFFFF).to(tl.int32)
        pid_bh = tl.program_id(0)
        split = tl.program_id(1)
        n_splits = tl.num_programs(1)
        b = pid_bh // kv_heads
        rows = tl.arange(0, GQA_P)
        heads = (pid_bh % kv_heads) * GQA + rows
        row_ok = rows < GQA
        q_offset = (b * kv_heads * GQA + heads) * (2 * HALF)
        m_i = tl.full([GQA_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GQA_P], tl.float32)
        acc_even = tl.zeros([V_GROUPS * GQA_P, HALF], tl.float32)
        acc_odd = tl.zeros([V_GROUPS * GQA_P, HALF], tl.float32)
        row = pid_bh.to(tl.int64) * capacity
        if split < n_packed_splits:
            q_even, q_odd = _grouped_query(qmap_ptr, q_offset, row_ok, scale,
                                           scale / HIGH_STEP if BITS == 4 else scale, HALF, K_GROUPS, GQA_P)
            k_bias = _query_bias(q_even, q_odd, BITS)
            start = split * tokens_per_split
            end = tl.minimum(start + tokens_per_split, n_packed)
            kc = kc_ptr + row * (HALF * BITS // 4)
            vc = vc_ptr + row * (HALF * BITS // 4)
            ks = ks_ptr + row * K_GROUPS
            vs = vs_ptr + row * V_GROUPS
            for t0 in range(start, end, BLOCK):
                tokens = t0 + tl.arange(0, BLOCK)
                valid = tokens < end
                k_even, k_odd = _load_codes(kc, tokens, valid, BITS, HALF, VALUES=False)
                v_even, v_odd = _load_codes(vc, tokens, valid, BITS, HALF, VALUES=True)
                m_i, l_i, acc_even, acc_odd = _online_softmax_step(
                    q_even, q_odd, k_bias, k_even, k_odd, _load_scales(ks, tokens, valid, K_GROUPS), v_even, v_odd,
                    _load_scales(vs, tokens, valid, V_GROUPS), valid, m_i, l_i, acc_even, acc_odd, GQA_P, BLOCK)
        else:
            q_even, q_odd = _grouped_query(q_ptr, q_offset, row_ok, scale, scale, HALF, K_GROUPS, GQA_P)
            window_row = pid_bh.to(tl.int64) * window_capacity * (2 * HALF)
            no_bias = tl.zeros([K_GROUPS * GQA_P], tl.float32)
            k_unit = tl.full([K_GROUPS, WINDOW_BLOCK], 1.0, tl.float32)
            v_unit = tl.full([V_GROUPS, WINDOW_BLOCK], 1.0, tl.float32)
            for t0 in range(0, n_window, WINDOW_BLOCK):
                tokens = t0 + tl.arange(0, WINDOW_BLOCK)
                valid = tokens < n_window
                k_even, k_odd = _load_window(kw_ptr + window_row, tokens, valid, HALF)
                v_even, v_odd = _load_window(vw_ptr + window_row, tokens, valid, HALF)
                m_i, l_i, acc_even, acc_odd = _online_softmax_step(
                    q_even, q_odd, no_bias, k_even, k_odd, k_unit, v_even, v_odd, v_unit, valid, m_i, l_i, acc_even,
                    acc_odd, GQA_P, WINDOW_BLOCK)
        stat = (b * kv_heads * GQA + heads) * n_splits + split
        o_base = o_ptr + stat[:, None] * (2 * HALF)
        pairs = tl.arange(0, HALF)
        tl.store(o_base + 2 * pairs[None, :], _own_columns(acc_even, GQA_P), mask=row_ok[:, None])
        tl.store(o_base + 2 * pairs[None, :] + 1, _own_columns(acc_odd, GQA_P), mask=row_ok[:, None])
        tl.store(m_ptr + stat, m_i, mask=row_ok)
        tl.store(l_ptr + stat, l_i, mask=row_ok)

    @triton.jit
    def _await_previous_kernel(PDL: tl.constexpr):
        """With programmatic dependent launch (compute capability 9.0 on), a kernel may start while the one before it in
        the stream still runs, once that one's programs have all started: the launch and the setup below
        overlap it. Its programs then block here until it has finished and its writes are visible, so
        every read of an earlier kernel's output, and every write, must come after this call."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def _map_query_kernel(q_ptr, map_ptr, out_ptr, D: tl.constexpr, COLS: tl.constexpr, PDL: tl.constexpr):
        """out = q @ query_map in float32, one program per (batch, query head) and block of COLS columns:
        each reads its slice of the map in one round trip (the step's short kernels are latency-bound)."""
        bh = tl.program_id(0)
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        rows = tl.arange(0, D)
        query_map = tl.load(map_ptr + rows[:, None] * D + cols[None, :])
        _await_previous_kernel(PDL)
        q = tl.load(q_ptr + bh * D + rows).to(tl.float32)
        tl.store(out_ptr + bh * D + cols, tl.sum(q[:, None] * query_map, 0))

    @triton.jit(do_not_specialize=["n_splits"])
    def _reduce_kernel(o_ptr, m_ptr, l_ptr, omap_ptr, out_ptr, n_splits, D: tl.constexpr, SPLITS: tl.constexpr,
                       COLS: tl.constexpr, PDL: tl.constexpr):
        """Eq. 5, o = sum_c e^{m_c - m} o_c / sum_c e^{m_c - m} l_c, with the packed splits' sum mapped by
        output_map (d, d) before the window split (the last) is added; one program per (batch, query head)
        and block of COLS output columns."""
        bh = tl.program_id(0)
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        rows = tl.arange(0, D)
        output_map = tl.load(omap_ptr + rows[:, None] * D + cols[None, :])
        _await_previous_kernel(PDL)
        splits = tl.arange(0, SPLITS)
        ok = splits < n_splits
        m = tl.load(m_ptr + bh * n_splits + splits, mask=ok, other=float("-inf"))
        l_c = tl.load(l_ptr + bh * n_splits + splits, mask=ok, other=0.0)
        m_max = tl.max(m, 0)
        weight = tl.where(ok, tl.exp(m - m_max), 0.0)
        packed_weight = tl.where(splits < n_splits - 1, weight, 0.0)
        window_weight = tl.sum(tl.where(splits == n_splits - 1, weight, 0.0), 0)
        o = tl.load(o_ptr + (bh * n_splits + splits[:, None]) * D + rows[None, :], mask=ok[:, None], other=0.0)
        packed_sum = tl.sum(o * packed_weight[:, None], 0)
        mapped = tl.sum(packed_sum[:, None] * output_map, 0)
        window = tl.load(o_ptr + (bh * n_splits + n_splits - 1) * D + cols)
        out = (mapped + window * window_weight) / tl.sum(l_c * weight, 0)
        tl.store(out_ptr + bh * D + cols, out.to(out_ptr.dtype.element_ty))


# The CUDA partial kernel serves every sequence length its shapes fit: its step was the faster at every length
# timed against Triton's (runs/bench/LOG.md), because it maps the query inside and turns codes into tensor-core
# operands in registers.
CUDA_HEAD_DIM = 128  # kernels/decode_attention.cu's KVQ_D


def _cuda_kernels_build(device: torch.device) -> bool:
    """kernels/decode_attention.cu needs sm_80 (mma.sync m16n8k16, cp.async); Triton serves older GPUs."""
    return _properties(device).major >= 8


def _cuda_reduce_fits(query) -> bool:
    """kernels/decode_attention.cu's reduce pass serves (B, Hq, d) queries of head_dim 128, after either
    partial kernel (they write the same partials)."""
    return query.shape[-1] == CUDA_HEAD_DIM and query.dtype in DTYPE_DEFINES and _cuda_kernels_build(query.device)


def _cuda_partial_fits(query, keys: PackedKV, values: PackedKV, window_keys, window_values) -> bool:
    """The shapes kernels/decode_attention.cu is written for (its header), with the window in the query's dtype."""
    return (LAUNCH.partial == "cuda" and _cuda_kernels_build(query.device)
            and keys.bits == values.bits == 4
            and keys.head_dim == CUDA_HEAD_DIM
            and keys.scales.shape[-1] == values.scales.shape[-1] == 4
            and keys.scales.dtype == values.scales.dtype and keys.scales.dtype in KERNEL_SCALE_DTYPES
            and query.shape[1] // keys.codes.shape[1] <= 4 and query.dtype in DTYPE_DEFINES
            and window_keys.dtype == window_values.dtype == query.dtype)


def cuda_partial_source(dtype: torch.dtype, scale_dtype: torch.dtype = torch.float32,
                        kernel_text: str | None = None) -> str:
    """The translation unit of the CUDA partial and reduce kernels for query, window and output elements of
    `dtype` and scales of `scale_dtype`: the text of kernels/decode_attention.cu, or `kernel_text`, an edited copy of it
    (benchmarks/attention_timeline.py)."""
    if kernel_text is None:
        kernel_text = (KERNEL_DIR / "decode_attention.cu").read_text()
    half_scales = int(scale_dtype == torch.float16)
    return f"#define KVQ_ELEM_{DTYPE_DEFINES[dtype]}\n#define KVQ_SCALE_HALF {half_scales}\n" + kernel_text


def build_cuda_partial(source: str, device: torch.device) -> CudaLaunch:
    """A cuda_partial_source compiled for `device`."""
    return CudaLaunch.compile(source, "kvq_decode_partial", device)


@lru_cache(maxsize=8)
def _cuda_partial_kernel(dtype: torch.dtype, scale_dtype: torch.dtype, device: torch.device) -> CudaLaunch:
    return build_cuda_partial(cuda_partial_source(dtype, scale_dtype), device)


MMA_TILE = 16  # rows and columns of an m16n8k16 A fragment


def fragment_order(matrix: torch.Tensor) -> torch.Tensor:
    """A d x d map (x -> x @ matrix) as kernels/decode_attention.cu's kvq_map_query takes it: matrix^T in fp16,
    cut into m16n8k16 A fragments, (m-tile, k-step, lane, register, half): lane (r, c) of tile (i, s) holds rows
    r and r + 8, columns 2c, 2c + 1 and 2c + 8, 2c + 9 of block (i, s), so a warp reads a step in one 16-byte
    load per lane.

    Kept per tensor while it lives and is not modified in place, so a captured step launches no conversion."""
    hit = _fragments.get(matrix)
    if hit is not None and hit[0] == matrix._version:
        return hit[1]
    tiles = matrix.shape[0] // MMA_TILE
    blocks = matrix.T.to(torch.float16).reshape(tiles, MMA_TILE, tiles, MMA_TILE).permute(0, 2, 1, 3)
    lane, register, half = (torch.arange(n, device=matrix.device) for n in (32, 4, 2))
    rows = lane[:, None, None] // 4 + 8 * (register[None, :, None] % 2)  # broadcast over `half`
    columns = 2 * (lane[:, None, None] % 4) + 8 * (register[None, :, None] // 2) + half
    fragments = blocks[:, :, rows, columns].contiguous()
    _fragments[matrix] = (matrix._version, fragments)
    return fragments


_fragments = WeakIdKeyDictionary()  # map tensor -> (its _version when built, its fragments)


@lru_cache(maxsize=8)
def _cuda_reduce_kernel(dtype: torch.dtype, device: torch.device) -> CudaLaunch:
    """kernels/decode_attention.cu's reduce pass for outputs of `dtype` (the scales' dtype is not read)."""
    return CudaLaunch.compile(cuda_partial_source(dtype), "kvq_decode_reduce", device)


@lru_cache(maxsize=8)
def _properties(device: torch.device):
    return torch.cuda.get_device_properties(device)


def _programmatic_launch(device: torch.device) -> bool:
    """Programmatic dependent launch (see _await_previous_kernel) needs compute capability 9.0."""
    return LAUNCH.programmatic and _properties(device).major >= 9


def _padded_heads(gqa: int, k_groups: int, v_groups: int) -> int:
    """Query rows per scale group in the kernel: a power of two >= GQA, with >= MIN_DOT rows in all."""
    return max(1 << (gqa - 1).bit_length(), MIN_DOT // min(k_groups, v_groups, MIN_DOT))


def _grouped_rows(gqa: int, k_groups: int, v_groups: int) -> int:
    return _padded_heads(gqa, k_groups, v_groups) * max(k_groups, v_groups)


REGISTERS_PER_SM = 65536  # every NVIDIA GPU since Maxwell
REGISTER_GRANULE = 256  # registers are allocated per warp in blocks of 256
SHARED_RESERVED_PER_PROGRAM = 1024  # the driver's share of shared memory per resident block (sm_80 on)


def resident_programs(registers: int, shared_bytes: int, num_warps: int, shared_per_sm: int,
                      threads_per_sm: int) -> int:
    """Programs of a kernel (registers per thread, shared bytes per program) that one SM holds at once."""
    warp_registers = -(-registers * 32 // REGISTER_GRANULE) * REGISTER_GRANULE
    by_registers = REGISTERS_PER_SM // (warp_registers * num_warps)
    by_shared = shared_per_sm // (shared_bytes + SHARED_RESERVED_PER_PROGRAM)
    return max(1, min(by_registers, by_shared, threads_per_sm // (32 * num_warps)))


def _resident_programs_of(build, device: torch.device) -> int:
    properties = _properties(device)
    return resident_programs(build.n_regs, build.metadata.shared, build.metadata.num_warps,
                             properties.shared_memory_per_multiprocessor, properties.max_threads_per_multi_processor)


def _split_plan(n_packed: int, programs_per_split: int, resident: int, device: torch.device) -> tuple[int, int]:
    """(splits over the packed tokens, tokens per split): as many packed programs as fill every SM `resident`
    times (LAUNCH.waves times where set), and never more: a program past what the SMs hold at once starts only
    when another ends, then streams its whole split alone at the end; so the splits round down. Each head's
    window program comes on top: it is short, and takes the first slot that frees."""
    target = (LAUNCH.waves or resident) * _properties(device).multi_processor_count
    return split_counts(n_packed, programs_per_split, target, LAUNCH.block)


def split_counts(n_packed: int, programs_per_split: int, programs: int, block: int) -> tuple[int, int]:
    """(splits, tokens per split, a multiple of `block`) of n_packed tokens, each split taken by
    `programs_per_split` programs, for at most `programs` programs in all (one split at least)."""
    if n_packed == 0:
        return 0, block
    splits = max(1, min(programs // programs_per_split, -(-n_packed // block)))
    per_split = -(-n_packed // splits)
    per_split = -(-per_split // block) * block
    return -(-n_packed // per_split), per_split


def _rows_buffer(t: torch.Tensor) -> int:
    """Rows allocated per (batch, head) of a (B, H, rows, width) view into a contiguous buffer."""
    batch_stride, head_stride, row_stride, column_stride = t.stride()
    heads, width = t.shape[1], t.shape[3]
    if column_stride != 1 or row_stride != width or batch_stride != heads * head_stride:
        raise ValueError("decode attention needs views of contiguous (B, H, rows, width) buffers")
    return head_stride // width


_compiled: dict[tuple, object] = {}


def _argument_key(argument):
    if isinstance(argument, torch.dtype):  # stands for a 16-byte aligned tensor (see _compiled_kernel)
        return argument, True
    if isinstance(argument, torch.Tensor):
        return argument.dtype, argument.data_ptr() % 16 == 0
    return type(argument)


def _compiled_kernel(kernel, args: tuple, constants: dict):
    """The Triton build of kernel(*args, **constants), compiled and loaded on first use.

    Triton's dispatch binds and specializes every argument again on each call, tens of microseconds of
    host time per launch that decode pays per layer per token. These kernels take no integer
    specialization (do_not_specialize), so what selects a build is the constants and each tensor's dtype
    and 16-byte alignment, which is the key here. An argument may be a dtype, standing for an aligned
    tensor of it (Triton's warmup takes those), to size a launch before its buffers exist.
    """
    key = (kernel, tuple(_argument_key(a) for a in args), tuple(constants.items()), args[0].device)
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = kernel.warmup(*args, grid=(1,), **constants)
        compiled._init_handles()  # loads the binary, which gives n_regs (as Triton's softmax tutorial does)
        _compiled[key] = compiled
    return compiled


def _launch(kernel, grid: tuple, args: tuple, build=None, **constants) -> None:
    """kernel[grid](*args, **constants) through the build's own launcher (see _compiled_kernel); `build`:
    that build, where the caller has it already."""
    params = [constants[name] for name in kernel.arg_names[len(args):]]
    (build or _compiled_kernel(kernel, args, constants))[(*grid, 1, 1)[:3]](*args, *params)


_workspaces: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _workspace(batch: int, q_heads: int, n_splits: int, d: int, device: torch.device):
    """Mapped query, partial sums, maxima and normalizers, reused across calls, layers and captured
    graphs (their kernels run in stream order)."""
    key = (batch, q_heads, n_splits, d, device)
    if key not in _workspaces:
        partial = torch.empty(batch, q_heads, n_splits, d, device=device, dtype=torch.float32)
        maxima = torch.empty(batch, q_heads, n_splits, device=device, dtype=torch.float32)
        mapped_query = torch.empty(batch, q_heads, d, device=device, dtype=torch.float32)
        _workspaces[key] = (mapped_query, partial, maxima, torch.empty_like(maxima))
    return _workspaces[key]


def device_lengths(n_packed: int, n_window: int) -> int:
    """Both token counts in one int64 (packed << 32 | window), so one fill updates them on the device."""
    return n_packed << 32 | n_window


def _decode_attention_gpu(query, query_map, keys: PackedKV, values: PackedKV, window_keys, window_values,
                          output_map, scale, lengths: torch.Tensor | None = None, out: torch.Tensor | None = None):
    """With `lengths` (a one-element int64 CUDA tensor holding device_lengths(...)) the kernels read the
    token counts from the device and split the buffers' whole capacity, so one launch sequence, captured
    once, serves every length up to it (DecodeGraph); the views' own lengths are then ignored."""
    batch, q_heads, d = query.shape
    kv_heads = keys.codes.shape[1]
    n_packed, n_window = keys.codes.shape[2], window_keys.shape[2]
    query, output_map = query.contiguous(), output_map.float().contiguous()
    capacity = _rows_buffer(keys.codes)
    if not (capacity == _rows_buffer(keys.scales) == _rows_buffer(values.codes) == _rows_buffer(values.scales)):
        raise ValueError("packed K and V codes and scales must share one row capacity")
    window_capacity = _rows_buffer(window_keys)
    if _rows_buffer(window_values) != window_capacity:
        raise ValueError("window K and V must share one row capacity")
    pdl = _programmatic_launch(query.device)
    gqa = q_heads // kv_heads
    constants = dict(
        GQA=gqa, GQA_P=_padded_heads(gqa, keys.scales.shape[-1], values.scales.shape[-1]), HALF=d // 2,
        BITS=keys.bits, K_GROUPS=keys.scales.shape[-1], V_GROUPS=values.scales.shape[-1], BLOCK=LAUNCH.block,
        DEVICE_LENGTHS=lengths is not None, PDL=pdl, launch_pdl=pdl, num_warps=LAUNCH.num_warps,
        num_stages=1 if d >= WIDE_HEAD else LAUNCH.num_stages)

    lengths_pointer = query if lengths is None else lengths  # unread without lengths

    def partial_args(mapped_query, partial, maxima, sums, per_split, packed_splits) -> tuple:
        return (query, mapped_query, keys.codes, keys.scales, values.codes, values.scales, window_keys, window_values,
                partial, maxima, sums, lengths_pointer, n_packed, n_window, per_split, packed_splits, kv_heads,
                capacity, window_capacity, float(scale))

    tokens = n_packed if lengths is None else capacity
    cuda_partial = _cuda_partial_fits(query, keys, values, window_keys, window_values)
    if cuda_partial:
        cuda_kernel = _cuda_partial_kernel(query.dtype, keys.scales.dtype, query.device)
        resident = cuda_kernel.resident_blocks
    else:
        build = _compiled_kernel(_partial_kernel, partial_args(*[torch.float32] * 4, 0, 0), constants)
        resident = _resident_programs_of(build, query.device)
    packed_splits, per_split = _split_plan(tokens, batch * kv_heads, resident, query.device)
    n_splits = packed_splits + 1  # the last program takes the residual window
    mapped_query, partial, maxima, sums = _workspace(batch, q_heads, n_splits, d, query.device)
    columns = min(d, MAP_COLUMNS)
    if "map" in LAUNCH.kernels and not cuda_partial:  # the CUDA partial kernel maps the query itself
        _launch(_map_query_kernel, (batch * q_heads, d // columns),
                (query, query_map.float().contiguous(), mapped_query), D=d, COLS=columns, PDL=pdl, launch_pdl=pdl)
    if "partial" in LAUNCH.kernels and cuda_partial:
        cuda_kernel((batch * kv_heads, n_splits), [
            fragment_order(query_map), query, keys.codes, keys.scales, values.codes, values.scales, window_keys,
            window_values, partial, maxima, sums, lengths_pointer, n_packed, n_window, per_split, packed_splits,
            kv_heads, gqa, capacity, window_capacity, float(scale), int(lengths is not None)], programmatic=pdl)
    elif "partial" in LAUNCH.kernels:
        _launch(_partial_kernel, (batch * kv_heads, n_splits),
                partial_args(mapped_query, partial, maxima, sums, per_split, packed_splits), build, **constants)
    if out is None:
        out = torch.empty(batch, q_heads, d, device=query.device, dtype=query.dtype)
    if "reduce" in LAUNCH.kernels and _cuda_reduce_fits(query):
        _cuda_reduce_kernel(query.dtype, query.device)(
            batch * q_heads, [partial, maxima, sums, output_map, out, n_splits], programmatic=pdl)
    elif "reduce" in LAUNCH.kernels:
        _launch(_reduce_kernel, (batch * q_heads, d // columns), (partial, maxima, sums, output_map, out, n_splits),
                D=d, SPLITS=triton.next_power_of_2(n_splits), COLS=columns, PDL=pdl, launch_pdl=pdl)
    return out


class DecodeGraph:
    """decode_attention for one cache layer, replayed as a CUDA graph.

    A host-bound generate loop pays each eager call's host time per layer per token: three Triton
    launches with their argument handling cost more host time than an fp16 layer's cat + SDPA, and a
    replay of the same kernels less (benchmarks/decode_overhead.py measures both). It takes whole buffers and the token
    counts, which the kernels read from a device tensor that the graph itself steps by one token, so the
    graph is captured again only when a buffer, the maps, the scale or the query's shape change (a packed
    store grows every ~6% of its length). The returned tensor is the graph's output buffer: valid until
    the next call.
    """

    def __init__(self):
        self.signature: tuple | None = None
        self.graph = None
        self.fused = False
        self.captures = 0
        self.query = self.out = self.lengths = None
        self.written_lengths: int | None = None

    def __call__(self, query, query_map, keys: PackedKV, values: PackedKV, window_keys, window_values, output_map,
                 scale: float, n_packed: int, n_window: int,
                 writes: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])) -> torch.Tensor:
        """decode_attention over the first n_packed rows of the packed buffers `keys`, `values` and the
        first n_window rows of the window buffers. `writes`: (targets, sources) the caller still owes those
        buffers (the newest token's window rows), copied first, in the same dispatch as the query."""
        arguments = (query, query_map, keys, values, window_keys, window_values, output_map, scale)
        # buffers, not views: an empty view's data pointer differs from its buffer's
        signature = (query.shape, query.dtype, query.device, float(scale), *(t.data_ptr() for t in (
            query_map, output_map, keys.codes, keys.scales, values.codes, values.scales, window_keys, window_values)),
            keys.codes.shape, window_keys.shape)
        counts = device_lengths(n_packed, n_window)
        if signature != self.signature:
            self.signature = signature
            self.fused = supported(keys, values, query.shape[1])
            if self.fused:
                self._capture(arguments, counts)
        if not self.fused:
            if writes[0]:
                torch._foreach_copy_(*writes)
            return decode_attention_reference(query, query_map, keys.rows(n_packed), values.rows(n_packed),
                                              window_keys[..., :n_window, :], window_values[..., :n_window, :],
                                              output_map, scale)
        # Each replay first adds one to the device's counts (the window grows a token per step), so only a
        # flush or a jump costs a fill: one launch fewer per layer per token.
        if self.written_lengths != counts - 1:
            self.lengths.fill_(counts - 1)
        self.written_lengths = counts
        targets, sources = writes
        torch._foreach_copy_([self.query, *targets], [query, *sources])
        self.graph.replay()
        return self.out

    def _capture(self, arguments: tuple, counts: int) -> None:
        query = arguments[0]
        self.captures += 1
        self.graph = None  # frees the old graph before the new one is instantiated
        self.query = torch.empty_like(query)
        self.out = torch.empty_like(query)
        # The eager run below, which compiles the kernels and allocates the workspace outside the capture,
        # reads the true counts; a replay finds them less one token (see __call__), which after a flush that
        # left the window empty is no count at all (the window's borrows from the packed).
        self.lengths = torch.full((1,), counts, dtype=torch.int64, device=query.device)

        def run():
            _decode_attention_gpu(self.query, *arguments[1:], lengths=self.lengths, out=self.out)

        run()
        self.lengths.fill_(counts - 1)
        self.written_lengths = counts - 1
        # torch.cuda.graph() would also synchronize, collect garbage and empty the allocator's cache at
        # every capture; a side stream that waits on this one is all a capture needs.
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(query.device)
        current = torch.cuda.current_stream(query.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            self.lengths.add_(1)
            run()
            graph.capture_end()
        current.wait_stream(stream)
        self.graph = graph


def packed_read_bytes(batch: int, kv_heads: int, tokens: int, d: int, bits: int, group: int,
                      scale_bytes: int = 4) -> int:
    """Bytes a decode step reads from the packed cache: codes and scales (`scale_bytes` each) of K and V."""
    return 2 * batch * kv_heads * tokens * (d * bits // 8 + scale_bytes * d // group)
