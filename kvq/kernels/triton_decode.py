"""The Triton kernels of fused decode attention (kvq.kernels.decode_attention describes the algorithm) and a
launcher that skips Triton's per-call argument binding.

partial_kernel covers every shape csrc/decode_attention.cu does not: int8 codes, head sizes other than 128,
more query heads per KV head, GPUs before sm_80. map_query_kernel maps the query into the codes' domain
before it; reduce_kernel combines the partials where the CUDA reduce does not serve (head_dim other than 128).
"""

import torch
import triton
import triton.language as tl

MIN_DOT = 16  # tl.dot needs every dimension >= 16


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
        # one 16-bit load per coordinate pair, as int4 reads one byte per pair: the low byte is the even
        # coordinate, and arithmetic shifts sign-extend each byte
        words = codes_ptr.to(tl.pointer_type(tl.int16)) + tokens[:, None] * (row_bytes // 2) + pairs[None, :]
        word = tl.load(words, mask=valid[:, None], other=0)
        even = ((word << 8) >> 8).to(tl.float16)
        odd = (word >> 8).to(tl.float16)
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
def _online_softmax_step(query, k_bias, keys, k_scales, values, v_scales, valid, state, GQA_P: tl.constexpr,
                         BLOCK: tl.constexpr):
    """One tile of Alg. 1 with the scales kept out of the products: row block g of the query holds its
    group-g coordinates only, so one dot gives every group's share of q . codes, and each share meets
    its token's scale in float32; likewise row block g of the weights carries p * (group-g V scale)
    and keeps its own columns at the end (_own_columns). The codes enter the tensor cores exact, the
    keys' with biases, whose product with each query row (k_bias, (rows,)) leaves each tile's shares.
    query, keys, values: (even, odd) coordinate halves; state: (m_i, l_i, acc_even, acc_odd)."""
    q_even, q_odd = query
    k_even, k_odd = keys
    v_even, v_odd = values
    m_i, l_i, acc_even, acc_odd = state
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
def _query_bias(query, BITS: tl.constexpr):
    """Each query row's product with the biases of int4 keys: q_even . 1032 + q_odd . 1152, where q_odd
    was divided by 16 (_grouped_query's odd scale); zeros for int8 keys."""
    q_even, q_odd = query
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
def _grouped_query(ptr, row_offset, row_ok, scales, HALF: tl.constexpr, GROUPS: tl.constexpr, GQA_P: tl.constexpr):
    """(GROUPS * GQA_P, HALF) even and odd query coordinates times scales[0] and scales[1], fp16; row
    block g keeps group g's coordinates and zeros elsewhere. row_offset / row_ok: (GQA_P,) element
    offsets, validity."""
    scale, odd_scale = scales
    pairs = tl.arange(0, HALF)
    rows = tl.arange(0, GROUPS * GQA_P)
    mine = (pairs[None, :] // (HALF // GROUPS)) == (rows // GQA_P)[:, None]
    at = ptr + _by_group(row_offset, GROUPS)[:, None] + 2 * pairs[None, :]
    mask = mine & _by_group(row_ok, GROUPS)[:, None]
    even = tl.load(at, mask=mask, other=0.0).to(tl.float32) * scale
    odd = tl.load(at + 1, mask=mask, other=0.0).to(tl.float32) * odd_scale
    return even.to(tl.float16), odd.to(tl.float16)

@triton.jit(do_not_specialize=["counts"])
def partial_kernel(queries, keys, values, window, partials, lengths_ptr, counts, scale, SHAPE: tl.constexpr,
                   DEVICE_LENGTHS: tl.constexpr, PDL: tl.constexpr):
    """queries: (q, q @ query_map), (B, Hq, d); keys, values: (codes, scales), (B, Hkv, capacity, .) buffers;
    window: (keys, values), (B, Hkv, window_capacity, d); partials: (sums (B, Hq, splits, d), maxima and
    normalizers (B, Hq, splits)); all contiguous. counts: (n_packed, n_window, tokens_per_split, capacity,
    window_capacity); SHAPE: (GQA, GQA_P, HALF, K_BITS, V_BITS, K_GROUPS, V_GROUPS, BLOCK): K and V codes
    of their own widths (4 or 8).
    Packed splits score q @ query_map against the codes; the last split scores q against the window,
    whose exact values pass through the same grouped step with unit scales. DEVICE_LENGTHS: the token
    counts come from lengths_ptr (see device_lengths) instead of counts."""
    GQA: tl.constexpr = SHAPE[0]
    GQA_P: tl.constexpr = SHAPE[1]
    HALF: tl.constexpr = SHAPE[2]
    K_BITS: tl.constexpr = SHAPE[3]
    V_BITS: tl.constexpr = SHAPE[4]
    K_GROUPS: tl.constexpr = SHAPE[5]
    V_GROUPS: tl.constexpr = SHAPE[6]
    BLOCK: tl.constexpr = SHAPE[7]
    q_ptr, qmap_ptr = queries
    o_ptr, m_ptr, l_ptr = partials
    n_packed, n_window, tokens_per_split, capacity, window_capacity = counts
    _await_previous_kernel(PDL)
    if DEVICE_LENGTHS:
        packed_and_window = tl.load(lengths_ptr)
        n_packed = (packed_and_window >> 32).to(tl.int32)
        n_window = (packed_and_window & 0xFFFFFFFF).to(tl.int32)
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    rows = tl.arange(0, GQA_P)
    row_ok = rows < GQA
    head_rows = pid_bh * GQA + rows  # (batch, KV head) bh holds query heads GQA bh .. GQA bh + GQA - 1
    q_offset = head_rows * (2 * HALF)
    m_i = tl.full([GQA_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GQA_P], tl.float32)
    acc_even = tl.zeros([V_GROUPS * GQA_P, HALF], tl.float32)
    acc_odd = tl.zeros([V_GROUPS * GQA_P, HALF], tl.float32)
    row = pid_bh.to(tl.int64) * capacity
    if split < n_splits - 1:
        query = _grouped_query(qmap_ptr, q_offset, row_ok, (scale, scale / HIGH_STEP if K_BITS == 4 else scale),
                               HALF, K_GROUPS, GQA_P)
        k_bias = _query_bias(query, K_BITS)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, n_packed)
        kc = keys[0] + row * (HALF * K_BITS // 4)
        vc = values[0] + row * (HALF * V_BITS // 4)
        ks = keys[1] + row * K_GROUPS
        vs = values[1] + row * V_GROUPS
        for t0 in range(start, end, BLOCK):
            tokens = t0 + tl.arange(0, BLOCK)
            valid = tokens < end
            m_i, l_i, acc_even, acc_odd = _online_softmax_step(
                query, k_bias, _load_codes(kc, tokens, valid, K_BITS, HALF, VALUES=False),
                _load_scales(ks, tokens, valid, K_GROUPS), _load_codes(vc, tokens, valid, V_BITS, HALF, VALUES=True),
                _load_scales(vs, tokens, valid, V_GROUPS), valid, (m_i, l_i, acc_even, acc_odd), GQA_P, BLOCK)
    else:
        query = _grouped_query(q_ptr, q_offset, row_ok, (scale, scale), HALF, K_GROUPS, GQA_P)
        window_row = pid_bh.to(tl.int64) * window_capacity * (2 * HALF)
        no_bias = tl.zeros([K_GROUPS * GQA_P], tl.float32)
        k_unit = tl.full([K_GROUPS, WINDOW_BLOCK], 1.0, tl.float32)
        v_unit = tl.full([V_GROUPS, WINDOW_BLOCK], 1.0, tl.float32)
        for t0 in range(0, n_window, WINDOW_BLOCK):
            tokens = t0 + tl.arange(0, WINDOW_BLOCK)
            valid = tokens < n_window
            m_i, l_i, acc_even, acc_odd = _online_softmax_step(
                query, no_bias, _load_window(window[0] + window_row, tokens, valid, HALF), k_unit,
                _load_window(window[1] + window_row, tokens, valid, HALF), v_unit, valid, (m_i, l_i, acc_even, acc_odd),
                GQA_P, WINDOW_BLOCK)
    stat = head_rows * n_splits + split
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
def map_query_kernel(q_ptr, map_ptr, out_ptr, D: tl.constexpr, COLS: tl.constexpr, PDL: tl.constexpr):
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
def reduce_kernel(o_ptr, m_ptr, l_ptr, omap_ptr, out_ptr, n_splits, D: tl.constexpr, SPLITS: tl.constexpr,
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


_compiled: dict[tuple, object] = {}


def _argument_key(argument):
    if isinstance(argument, tuple):  # an int in a tuple keys by what Triton could specialize it on
        return tuple((a == 1, a % 16 == 0) if isinstance(a, int) else _argument_key(a) for a in argument)
    if isinstance(argument, torch.Tensor):
        return argument.dtype, argument.data_ptr() % 16 == 0
    return type(argument)


def compiled_kernel(kernel, args: tuple, constants: dict):
    """The Triton build of kernel(*args, **constants), compiled and loaded on first use.

    Triton's dispatch binds and specializes every argument again on each call, host time that decode
    pays per layer per token. These kernels take no integer specialization (do_not_specialize), so what
    selects a build is the constants and each tensor's dtype and 16-byte alignment, which is the key here.
    """
    device = next(t for t in _tensors(args)).device
    key = (kernel, tuple(_argument_key(a) for a in args), tuple(constants.items()), device)
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = kernel.warmup(*args, grid=(1,), **constants)
        compiled._init_handles()  # loads the binary, which gives n_regs (as Triton's softmax tutorial does)
        _compiled[key] = compiled
    return compiled


def _tensors(args):
    for argument in args:
        if isinstance(argument, tuple):
            yield from _tensors(argument)
        elif isinstance(argument, torch.Tensor):
            yield argument


def launch(kernel, grid: tuple, args: tuple, build=None, **constants) -> None:
    """kernel[grid](*args, **constants) through the build's own launcher (see compiled_kernel); `build`:
    that build, where the caller has it already."""
    params = [constants[name] for name in kernel.arg_names[len(args):]]
    (build or compiled_kernel(kernel, args, constants))[(*grid, 1, 1)[:3]](*args, *params)
