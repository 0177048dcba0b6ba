"""The Triton kernels of fused decode attention (kvq.kernels.decode_attention describes the algorithm; they are
launched through kvq.kernels.triton_launch).

partial_kernel covers every shape csrc/decode_attention.cu does not: codes of 2-8 bits, codebook indices
(TurboQuant_mse's levels, FP8's, MX's and NVFP4's element values), head sizes other than 128, more query heads per KV
head, GPUs before sm_80. map_query_kernel maps the query into the codes' domain before it; reduce_kernel combines the
partials where the CUDA reduce does not serve (head_dim other than 128).
"""

import triton
import triton.language as tl

from kvq.kernels.triton_codes import (
    HIGH_STEP,
    SIGNED_HIGH_BIAS,
    SIGNED_LOW_BIAS,
    UNSIGNED_BIAS,
    float_bits_to_f16,
    levels_held,
    load_codes,
)

MIN_DOT = 16  # tl.dot needs every dimension >= 16


WINDOW_BLOCK = tl.constexpr(MIN_DOT)  # residual windows are ~16 tokens
# How a layout's stats are held (the partial's K_SCALES / V_SCALES): none (codes scaled by their layer alone, which
# the maps carry), as their dtype reads (float32, fp16, E8M0 bytes), or E4M3 bytes (NVFP4's block scales)
STATS_NONE = tl.constexpr(0)
STATS_STORED = tl.constexpr(1)
STATS_E4M3 = tl.constexpr(2)

@triton.jit
def _load_scales(scales_ptr, tokens, valid, GROUPS: tl.constexpr, STATS: tl.constexpr):
    """(GROUPS, BLOCK) float32 scales of a tile (STATS per token): one row per scale group. At scales_ptr + GROUPS:
    the offsets of an asymmetric layout. As stored: float32, fp16, or E8M0 bytes, a byte b being 2^(b - 127),
    float32's exponent field (E4M3 bytes scale their codes in registers: _block_scaled)."""
    groups = tl.arange(0, GROUPS)
    return _stat_values(tl.load(scales_ptr + tokens[None, :] * STATS + groups[:, None], mask=valid[None, :], other=0))

@triton.jit
def _stat_values(stats):
    """float32 values of stored stats: float32 or fp16 as they are, E8M0 bytes b as 2^(b - 127) (float32's exponent
    field)."""
    if stats.dtype == tl.uint8:
        return (stats.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return stats.to(tl.float32)

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
def _online_softmax_step(query, k_bias, keys, k_stats, values, v_stats, valid, state, GQA_P: tl.constexpr,
                         BLOCK: tl.constexpr, K_OFFSETS: tl.constexpr, V_OFFSETS: tl.constexpr):
    """One tile of Alg. 1 with the scales kept out of the products: row block g of the query holds its
    group-g coordinates only, so one dot gives every group's share of q . codes, and each share meets
    its token's scale in float32; likewise row block g of the weights carries p * (group-g V scale)
    and keeps its own columns at the end (_own_columns). The codes enter the tensor cores exact, the
    keys' with biases, whose product with each query row (k_bias, (rows,)) leaves each tile's shares.
    An asymmetric layout's offsets z (decoding c * s + z) add z_g times the group's query sum to a key's
    score, and p z_g to a value group's every coordinate, kept in acc_offset until the end.
    query, keys, values: (even, odd) coordinate halves; k_stats: (scales, offsets, each row's query sum),
    v_stats: (scales, offsets), offsets read only where K_OFFSETS / V_OFFSETS;
    state: (m_i, l_i, acc_even, acc_odd, acc_offset)."""
    q_even, q_odd = query
    k_even, k_odd = keys
    v_even, v_odd = values
    k_scales, k_offsets, q_sums = k_stats
    v_scales, v_offsets = v_stats
    m_i, l_i, acc_even, acc_odd, acc_offset = state
    K_GROUPS: tl.constexpr = k_scales.shape[0]
    V_GROUPS: tl.constexpr = v_scales.shape[0]
    shares = tl.dot(q_odd, tl.trans(k_odd), tl.dot(q_even, tl.trans(k_even))) - k_bias[:, None]
    scaled = tl.reshape(shares, (K_GROUPS, GQA_P, BLOCK)) * k_scales[:, None, :]
    if K_OFFSETS:
        scaled += tl.reshape(q_sums, (K_GROUPS, GQA_P))[:, :, None] * k_offsets[:, None, :]
    scores = tl.sum(scaled, 0)
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    weights = tl.reshape(p[None, :, :] * v_scales[:, None, :], (V_GROUPS * GQA_P, BLOCK)).to(tl.float16)
    alpha = _by_group(alpha, V_GROUPS)
    if V_OFFSETS:
        offset_sums = tl.sum(p[None, :, :] * v_offsets[:, None, :], 2)
        acc_offset = acc_offset * alpha + tl.reshape(offset_sums, (V_GROUPS * GQA_P,))
    acc_even = tl.dot(weights, v_even, acc_even * alpha[:, None])
    acc_odd = tl.dot(weights, v_odd, acc_odd * alpha[:, None])
    return m_new, l_i, acc_even, acc_odd, acc_offset


@triton.jit
def _query_bias(query, NIBBLES: tl.constexpr, SIGNED: tl.constexpr):
    """Each query row's product with the biases of int4 keys read as biased nibbles (NIBBLES), q_even . low +
    q_odd . high, where q_odd was divided by 16 (_grouped_query's odd scale); zeros for keys read exact."""
    q_even, q_odd = query
    if NIBBLES:
        if SIGNED:
            return SIGNED_LOW_BIAS * tl.sum(q_even.to(tl.float32), 1) + SIGNED_HIGH_BIAS * tl.sum(
                q_odd.to(tl.float32), 1)
        return UNSIGNED_BIAS * (tl.sum(q_even.to(tl.float32), 1) + tl.sum(q_odd.to(tl.float32), 1))
    return tl.zeros([q_even.shape[0]], tl.float32)


@triton.jit
def _query_sums(query, NIBBLES: tl.constexpr):
    """Each query row's sum over its group's coordinates (what an offset multiplies), the odd half's division by 16
    for nibbles undone."""
    q_even, q_odd = query
    odd_step: tl.constexpr = HIGH_STEP if NIBBLES else 1.0
    return tl.sum(q_even.to(tl.float32), 1) + odd_step * tl.sum(q_odd.to(tl.float32), 1)


@triton.jit
def _channel_dequantized(codes, stats_ptr, HALF: tl.constexpr, OFFSETS: tl.constexpr):
    """Keys with a scale s and an offset z per channel over a token group (KIVI's): the (even, odd) tiles of c * s + z
    in fp16, one rounding each (codes read exact). Decoded in registers, the tile meets the query as it is; folding
    s into the query instead would re-scale and re-lay out the query, and sum its biases, at every tile. stats_ptr:
    the group's row, scales then offsets."""
    c_even, c_odd = codes
    pairs = tl.arange(0, HALF)
    s_even = tl.load(stats_ptr + 2 * pairs).to(tl.float16)[None, :]
    s_odd = tl.load(stats_ptr + 2 * pairs + 1).to(tl.float16)[None, :]
    if OFFSETS:
        z_even = tl.load(stats_ptr + 2 * HALF + 2 * pairs).to(tl.float16)[None, :]
        z_odd = tl.load(stats_ptr + 2 * HALF + 2 * pairs + 1).to(tl.float16)[None, :]
        return (tl.fma(c_even, tl.broadcast_to(s_even, c_even.shape), tl.broadcast_to(z_even, c_even.shape)),
                tl.fma(c_odd, tl.broadcast_to(s_odd, c_odd.shape), tl.broadcast_to(z_odd, c_odd.shape)))
    return c_even * s_even, c_odd * s_odd

@triton.jit
def _block_scaled(codes, stats_ptr, tokens, valid, STATS: tl.constexpr, BLOCKS: tl.constexpr, OFFSETS: tl.constexpr,
                  KIND: tl.constexpr):
    """Codes with a scale s (and an offset z) per token and block of coordinates, decoded in registers: the (even,
    odd) tiles of c * s (+ z) in fp16 (stats_ptr: this head's rows of STATS stats, BLOCKS scales then the offsets).
    NVFP4's E2M1 values times their E4M3 block scale (KIND STATS_E4M3) are exact in fp16: at most 2 + 4 significant
    bits, between 2^-10 and 6 x 448. Other stats round once to fp16 and decode in one FMA, as KIVI's channel stats
    do. The tile then takes one row block of the query or accumulators instead of one per block of coordinates."""
    c_even, c_odd = codes
    BLOCK: tl.constexpr = c_even.shape[0]
    HALF: tl.constexpr = c_even.shape[1]
    at = stats_ptr + tokens[:, None] * STATS + tl.arange(0, BLOCKS)[None, :]
    stats = tl.load(at, mask=valid[:, None], other=0)
    if KIND == STATS_E4M3:
        scale = float_bits_to_f16(stats.to(tl.int32), 8, 3)
    else:
        scale = _stat_values(stats).to(tl.float16)
    PAIRS: tl.constexpr = HALF // BLOCKS  # coordinate pairs per block
    scale = per_coordinate(scale, BLOCK, BLOCKS, PAIRS)
    if OFFSETS:
        offset = _stat_values(tl.load(at + BLOCKS, mask=valid[:, None], other=0)).to(tl.float16)
        offset = per_coordinate(offset, BLOCK, BLOCKS, PAIRS)
        return tl.fma(c_even, scale, offset), tl.fma(c_odd, scale, offset)
    return c_even * scale, c_odd * scale

@triton.jit
def per_coordinate(block_values, ROWS: tl.constexpr, BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
    """(ROWS, BLOCKS) -> (ROWS, BLOCKS * BLOCK): each block's value at its every coordinate."""
    return tl.reshape(tl.broadcast_to(block_values[:, :, None], (ROWS, BLOCKS, BLOCK)), (ROWS, BLOCKS * BLOCK))


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
    """queries: (q, q @ query_map), (B, Hq, d); keys, values: (codes, stats, codebook), (B, Hkv, capacity, .)
    buffers and the float32 levels codebook codes index (unread without them);
    window: (keys, values), (B, Hkv, window_capacity, d); partials: (sums (B, Hq, splits, d), maxima and
    normalizers (B, Hq, splits)); all contiguous. counts: (n_packed, n_window, tokens_per_split, capacity,
    window_capacity); SHAPE (kvq.kernels.decode_attention.partial_shape): (GQA, GQA_P, HALF, K_BITS, V_BITS,
    K_GROUPS, V_GROUPS, BLOCK, K_OFFSETS, V_OFFSETS, K_TOKEN_GROUP, K_CODEBOOK, V_CODEBOOK, K_FLOAT_MANTISSA,
    V_FLOAT_MANTISSA, K_SCALES, V_SCALES, K_ROWS, V_ROWS): K and V with K_GROUPS / V_GROUPS scale groups per stats
    row, in K_ROWS / V_ROWS row blocks of the query / accumulators, one per scale group or one where each tile
    decodes its codes in registers (_block_scaled); codes of their own widths (2-8 bits), signed, or unsigned with
    offsets after the scales where K_OFFSETS /
    V_OFFSETS (an asymmetric layout), or indices into a codebook with a scale per group (TurboQuant's norm, FP8's
    per-token scale, MX's E8M0 bytes, NVFP4's E4M3 bytes: K_SCALES / V_SCALES STATS_E4M3) where K_CODEBOOK /
    V_CODEBOOK, which are a float format's bits where its *_FLOAT_MANTISSA >= 0, or with no stats at all (unit
    scales: STATS_NONE); where
    K_TOKEN_GROUP > 0, keys with stats per channel over that many tokens (a multiple of BLOCK; K_GROUPS one per
    channel, K_ROWS 1), one stats row per token group, with which each tile decodes its keys in
    registers (_channel_dequantized).
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
    K_OFFSETS: tl.constexpr = SHAPE[8]
    V_OFFSETS: tl.constexpr = SHAPE[9]
    K_TOKEN_GROUP: tl.constexpr = SHAPE[10]
    K_CODEBOOK: tl.constexpr = SHAPE[11]
    V_CODEBOOK: tl.constexpr = SHAPE[12]
    K_FLOAT_MANTISSA: tl.constexpr = SHAPE[13]
    V_FLOAT_MANTISSA: tl.constexpr = SHAPE[14]
    K_SCALES: tl.constexpr = SHAPE[15]
    V_SCALES: tl.constexpr = SHAPE[16]
    K_ROWS: tl.constexpr = SHAPE[17]
    V_ROWS: tl.constexpr = SHAPE[18]
    # decoded in registers: the codes take their stats in each tile, and the offsets with them
    K_DECODED: tl.constexpr = K_TOKEN_GROUP > 0 or K_ROWS < K_GROUPS
    V_DECODED: tl.constexpr = V_ROWS < V_GROUPS
    K_NIBBLES: tl.constexpr = K_BITS == 4 and not K_CODEBOOK and not K_DECODED  # read biased
    K_STATS: tl.constexpr = K_GROUPS * (1 + K_OFFSETS)  # stats per row: scales, then offsets
    V_STATS: tl.constexpr = V_GROUPS * (1 + V_OFFSETS)
    K_SIGNED: tl.constexpr = 1 - K_OFFSETS
    V_SIGNED: tl.constexpr = 1 - V_OFFSETS
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
    acc_even = tl.zeros([V_ROWS * GQA_P, HALF], tl.float32)
    acc_odd = tl.zeros([V_ROWS * GQA_P, HALF], tl.float32)
    acc_offset = tl.zeros([V_ROWS * GQA_P], tl.float32)
    row = pid_bh.to(tl.int64) * capacity
    if split < n_splits - 1:
        query = _grouped_query(qmap_ptr, q_offset, row_ok, (scale, scale / HIGH_STEP if K_NIBBLES else scale), HALF,
                               K_ROWS, GQA_P)
        k_bias = _query_bias(query, K_NIBBLES, K_SIGNED)
        ks = keys[1] + (row // K_TOKEN_GROUP if K_TOKEN_GROUP > 0 else row) * K_STATS
        q_sums = _query_sums(query, K_NIBBLES)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, n_packed)
        k_book = levels_held(keys[2], K_BITS, K_CODEBOOK and K_FLOAT_MANTISSA < 0)
        v_book = levels_held(values[2], V_BITS, V_CODEBOOK and V_FLOAT_MANTISSA < 0)
        kc = keys[0] + row * (HALF * K_BITS // 4)
        vc = values[0] + row * (HALF * V_BITS // 4)
        vs = values[1] + row * V_STATS
        for t0 in range(start, end, BLOCK):
            tokens = t0 + tl.arange(0, BLOCK)
            valid = tokens < end
            k_codes = load_codes(kc, tokens, valid, K_BITS, HALF, not K_NIBBLES, K_SIGNED, k_book, K_CODEBOOK,
                                  K_FLOAT_MANTISSA)
            k_scales = tl.full([1, BLOCK], 1.0, tl.float32)  # where the codes take their scales, or have none
            if K_TOKEN_GROUP > 0:
                k_codes = _channel_dequantized(k_codes, ks + (t0 // K_TOKEN_GROUP) * K_STATS, HALF, K_OFFSETS)
            elif K_DECODED:
                k_codes = _block_scaled(k_codes, ks, tokens, valid, K_STATS, K_GROUPS, K_OFFSETS, K_SCALES)
            elif K_SCALES == STATS_STORED:
                k_scales = _load_scales(ks, tokens, valid, K_GROUPS, K_STATS)
            k_offsets = k_scales  # unread without offsets
            if K_OFFSETS and not K_DECODED:
                k_offsets = _load_scales(ks + K_GROUPS, tokens, valid, K_GROUPS, K_STATS)
            v_codes = load_codes(vc, tokens, valid, V_BITS, HALF, True, V_SIGNED, v_book, V_CODEBOOK,
                                  V_FLOAT_MANTISSA)
            v_scales = tl.full([1, BLOCK], 1.0, tl.float32)
            if V_DECODED:
                v_codes = _block_scaled(v_codes, vs, tokens, valid, V_STATS, V_GROUPS, V_OFFSETS, V_SCALES)
            elif V_SCALES == STATS_STORED:
                v_scales = _load_scales(vs, tokens, valid, V_GROUPS, V_STATS)
            v_offsets = v_scales
            if V_OFFSETS and not V_DECODED:
                v_offsets = _load_scales(vs + V_GROUPS, tokens, valid, V_GROUPS, V_STATS)
            m_i, l_i, acc_even, acc_odd, acc_offset = _online_softmax_step(
                query, k_bias, k_codes, (k_scales, k_offsets, q_sums), v_codes, (v_scales, v_offsets), valid,
                (m_i, l_i, acc_even, acc_odd, acc_offset), GQA_P, BLOCK, K_OFFSETS and not K_DECODED,
                V_OFFSETS and not V_DECODED)
    else:
        query = _grouped_query(q_ptr, q_offset, row_ok, (scale, scale), HALF, K_ROWS, GQA_P)
        window_row = pid_bh.to(tl.int64) * window_capacity * (2 * HALF)
        no_bias = tl.zeros([K_ROWS * GQA_P], tl.float32)
        k_unit = tl.full([K_ROWS, WINDOW_BLOCK], 1.0, tl.float32)
        v_unit = tl.full([V_ROWS, WINDOW_BLOCK], 1.0, tl.float32)
        for t0 in range(0, n_window, WINDOW_BLOCK):
            tokens = t0 + tl.arange(0, WINDOW_BLOCK)
            valid = tokens < n_window
            m_i, l_i, acc_even, acc_odd, acc_offset = _online_softmax_step(
                query, no_bias, _load_window(window[0] + window_row, tokens, valid, HALF), (k_unit, k_unit, no_bias),
                _load_window(window[1] + window_row, tokens, valid, HALF), (v_unit, v_unit), valid,
                (m_i, l_i, acc_even, acc_odd, acc_offset), GQA_P, WINDOW_BLOCK, 0, 0)
    if V_OFFSETS and not V_DECODED:  # the packed splits' offsets, on each row block's own columns (none in the window)
        acc_even += acc_offset[:, None]
        acc_odd += acc_offset[:, None]
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
