"""Fused int4/int8 decode attention (query length 1) over a packed, rotated KV cache.

Open-TQ-Metal Alg. 1 with FlashDecoding's split-K (Sec. 3.2, Eq. 5): each program reads packed K/V
codes and their scales directly, dequantizes in registers, keeps an online softmax over its slice of
the sequence and writes a partial (o_c, m_c, l_c); a reduce pass combines the partials. One program
serves all query heads of a KV head (GQA), so every KV byte is read once.

Packed codes live in the quantizers' rotated, lambda-scaled domains (y = lam * R x). With
query_map = R_k^T diag(1/lam_k) and output_map = diag(1/lam_v) R_v: q . k = (q query_map) . y_k and
sum_i p_i v_i = (sum_i p_i y_v,i) output_map. The wrapper maps the query once (a d x d product: inside
every program it cost more GPU time than it saved host time); the packed splits accumulate in the
value domain and the residual-window split (exact tokens) in the model's, and the reduce pass maps the
packed sum back before adding the window's, so the window needs no per-step rotation.

`decode_attention` dispatches to Triton on CUDA and to `decode_attention_reference` (dequantize to the
model's domain, then SDPA) elsewhere; the GPU tests check the two agree.
"""

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from kvq.quant.rotated import RotatedPacked
from kvq.quant.scalar import ScalarPacked, ScalarQuantizer

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the reference path serves
    triton = None

MIN_DOT = 16  # tl.dot needs every dimension >= 16
WIDE_HEAD = 256  # from this head_dim on, shallower pipelining keeps the K/V tiles inside shared memory


@dataclass
class LaunchConfig:
    """Tile and pipelining choices. Defaults: the fastest of benchmarks/attention_configs.py's sweep on an
    H100 at 8K and 32K tokens (Llama-3-8B shapes, int4 g32)."""

    block: int = 64
    num_warps: int = 2
    num_stages: int = 1
    waves: int = 4  # programs per SM to aim for when splitting the sequence


LAUNCH = LaunchConfig()


@dataclass
class PackedKV:
    """Packed codes (B, H, T, d*bits/8) uint8 and fp32 scales (B, H, T, groups) of one role."""

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.head_dim // self.scales.shape[-1]

    def as_packed(self, dtype: torch.dtype) -> RotatedPacked:
        """The same codes as the reference quantizers' packed dataclass (for kvq.kernels.decode)."""
        shape = (*self.codes.shape[:-1], self.head_dim)
        return RotatedPacked(ScalarPacked(self.codes, self.scales.unsqueeze(-1), None, None, shape, dtype))

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


def supported(keys: PackedKV, query_heads: int) -> bool:
    return (triton is not None and keys.codes.is_cuda and keys.bits in (4, 8)
            and keys.head_dim // 2 >= MIN_DOT and keys.head_dim & (keys.head_dim - 1) == 0
            and query_heads % keys.codes.shape[1] == 0)


def decode_attention(query, query_map, keys: PackedKV, values: PackedKV, window_keys, window_values, output_map,
                     scale: float):
    arguments = (query, query_map, keys, values, window_keys, window_values, output_map, scale)
    if supported(keys, query.shape[1]):
        return _decode_attention_triton(*arguments)
    return decode_attention_reference(*arguments)


if triton is not None:

    @triton.jit
    def _load_packed(codes_ptr, scales_ptr, tokens, valid, BITS: tl.constexpr, HALF: tl.constexpr,
                     GROUPS: tl.constexpr, BLOCK: tl.constexpr):
        """Even and odd coordinates of a (BLOCK, d) tile, dequantized in registers (fp16).

        codes_ptr / scales_ptr point at this head's rows (HALF * BITS // 4 bytes, GROUPS scales each);
        a group's scale is loaded once and broadcast over its GROUP / 2 pairs.
        """
        pairs = tl.arange(0, HALF)
        row_bytes: tl.constexpr = HALF * BITS // 4
        if BITS == 4:
            byte = tl.load(codes_ptr + tokens[:, None] * row_bytes + pairs[None, :], mask=valid[:, None], other=0)
            byte = byte.to(tl.int32)
            even = ((byte & 0xF) ^ 8) - 8
            odd = ((byte >> 4) ^ 8) - 8
        else:
            at = codes_ptr + tokens[:, None] * row_bytes + 2 * pairs[None, :]
            even = tl.load(at, mask=valid[:, None], other=0).to(tl.int8, bitcast=True).to(tl.int32)
            odd = tl.load(at + 1, mask=valid[:, None], other=0).to(tl.int8, bitcast=True).to(tl.int32)
        groups = tl.arange(0, GROUPS)
        scale = tl.load(scales_ptr + tokens[:, None] * GROUPS + groups[None, :], mask=valid[:, None], other=0.0)
        per_group: tl.constexpr = HALF // GROUPS
        even = tl.reshape(tl.reshape(even.to(tl.float32), (BLOCK, GROUPS, per_group)) * scale[:, :, None],
                          (BLOCK, HALF))
        odd = tl.reshape(tl.reshape(odd.to(tl.float32), (BLOCK, GROUPS, per_group)) * scale[:, :, None],
                         (BLOCK, HALF))
        return even.to(tl.float16), odd.to(tl.float16)

    @triton.jit
    def _load_window(ptr, tokens, valid, HALF: tl.constexpr):
        pairs = tl.arange(0, HALF)
        even = tl.load(ptr + tokens[:, None] * (2 * HALF) + 2 * pairs[None, :], mask=valid[:, None], other=0.0)
        odd = tl.load(ptr + tokens[:, None] * (2 * HALF) + 2 * pairs[None, :] + 1, mask=valid[:, None], other=0.0)
        return even.to(tl.float16), odd.to(tl.float16)

    @triton.jit
    def _online_softmax_step(q_even, q_odd, k_even, k_odd, v_even, v_odd, valid, m_i, l_i, acc_even, acc_odd):
        scores = tl.dot(q_even, tl.trans(k_even)) + tl.dot(q_odd, tl.trans(k_odd))
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p16 = p.to(tl.float16)
        acc_even = acc_even * alpha[:, None] + tl.dot(p16, v_even)
        acc_odd = acc_odd * alpha[:, None] + tl.dot(p16, v_odd)
        return m_new, l_i, acc_even, acc_odd

    @triton.jit(do_not_specialize=["n_packed", "n_window", "tokens_per_split", "n_packed_splits"])
    def _partial_kernel(
        q_ptr, qrot_ptr, kc_ptr, ks_ptr, vc_ptr, vs_ptr, kw_ptr, vw_ptr, o_ptr, m_ptr, l_ptr,
        n_packed, n_window, tokens_per_split, n_packed_splits, kv_heads, capacity, window_capacity, scale,
        GQA: tl.constexpr, GQA_PAD: tl.constexpr, HALF: tl.constexpr, BITS: tl.constexpr,
        K_GROUPS: tl.constexpr, V_GROUPS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """Codes and scales are (B, Hkv, capacity, .) buffers, windows (B, Hkv, window_capacity, d), all
        contiguous; q and q @ query_map (B, Hq, d); partials (B, Hq, splits, d) and (B, Hq, splits).
        Packed splits score q @ query_map against the codes; the last split scores q against the window."""
        pid_bh = tl.program_id(0)
        split = tl.program_id(1)
        n_splits = tl.num_programs(1)
        b = pid_bh // kv_heads
        rows = tl.arange(0, GQA_PAD)
        heads = (pid_bh % kv_heads) * GQA + rows
        row_ok = rows < GQA
        pairs = tl.arange(0, HALF)
        q_offset = (b * kv_heads * GQA + heads[:, None]) * (2 * HALF)
        q_base = tl.where(split < n_packed_splits, qrot_ptr, q_ptr) + q_offset
        q_even = (tl.load(q_base + 2 * pairs[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * scale)
        q_odd = (tl.load(q_base + 2 * pairs[None, :] + 1, mask=row_ok[:, None], other=0.0).to(tl.float32) * scale)
        q_even, q_odd = q_even.to(tl.float16), q_odd.to(tl.float16)
        m_i = tl.full([GQA_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GQA_PAD], tl.float32)
        acc_even = tl.zeros([GQA_PAD, HALF], tl.float32)
        acc_odd = tl.zeros([GQA_PAD, HALF], tl.float32)
        row = pid_bh.to(tl.int64) * capacity
        if split < n_packed_splits:
            start = split * tokens_per_split
            end = tl.minimum(start + tokens_per_split, n_packed)
            kc = kc_ptr + row * (HALF * BITS // 4)
            vc = vc_ptr + row * (HALF * BITS // 4)
            ks = ks_ptr + row * K_GROUPS
            vs = vs_ptr + row * V_GROUPS
            for t0 in range(start, end, BLOCK):
                tokens = t0 + tl.arange(0, BLOCK)
                valid = tokens < end
                k_even, k_odd = _load_packed(kc, ks, tokens, valid, BITS, HALF, K_GROUPS, BLOCK)
                v_even, v_odd = _load_packed(vc, vs, tokens, valid, BITS, HALF, V_GROUPS, BLOCK)
                m_i, l_i, acc_even, acc_odd = _online_softmax_step(
                    q_even, q_odd, k_even, k_odd, v_even, v_odd, valid, m_i, l_i, acc_even, acc_odd)
        else:
            window_row = pid_bh.to(tl.int64) * window_capacity * (2 * HALF)
            for t0 in range(0, n_window, BLOCK):
                tokens = t0 + tl.arange(0, BLOCK)
                valid = tokens < n_window
                k_even, k_odd = _load_window(kw_ptr + window_row, tokens, valid, HALF)
                v_even, v_odd = _load_window(vw_ptr + window_row, tokens, valid, HALF)
                m_i, l_i, acc_even, acc_odd = _online_softmax_step(
                    q_even, q_odd, k_even, k_odd, v_even, v_odd, valid, m_i, l_i, acc_even, acc_odd)
        stat = (b * kv_heads * GQA + heads) * n_splits + split
        o_base = o_ptr + stat[:, None] * (2 * HALF)
        tl.store(o_base + 2 * pairs[None, :], acc_even, mask=row_ok[:, None])
        tl.store(o_base + 2 * pairs[None, :] + 1, acc_odd, mask=row_ok[:, None])
        tl.store(m_ptr + stat, m_i, mask=row_ok)
        tl.store(l_ptr + stat, l_i, mask=row_ok)

    @triton.jit
    def _reduce_kernel(o_ptr, m_ptr, l_ptr, omap_ptr, out_ptr, n_splits, D: tl.constexpr, SPLITS: tl.constexpr):
        """Eq. 5, o = sum_c e^{m_c - m} o_c / sum_c e^{m_c - m} l_c, with the packed splits' sum mapped by
        output_map (d, d) before the window split (the last) is added; one program per (batch, query head)."""
        bh = tl.program_id(0)
        splits = tl.arange(0, SPLITS)
        packed = splits < n_splits - 1
        ok = splits < n_splits
        m = tl.load(m_ptr + bh * n_splits + splits, mask=ok, other=float("-inf"))
        l_c = tl.load(l_ptr + bh * n_splits + splits, mask=ok, other=0.0)
        m_max = tl.max(m, 0)
        weight = tl.where(ok, tl.exp(m - m_max), 0.0)
        cols = tl.arange(0, D)
        rows = tl.arange(0, D)
        o = tl.load(o_ptr + (bh * n_splits + splits[:, None]) * D + cols[None, :], mask=ok[:, None], other=0.0)
        packed_sum = tl.sum(tl.where(packed[:, None], o * weight[:, None], 0.0), 0)
        window_sum = tl.sum(tl.where(packed[:, None], 0.0, o * weight[:, None]), 0)
        output_map = tl.load(omap_ptr + rows[:, None] * D + cols[None, :])
        mapped = tl.sum(packed_sum[:, None] * output_map, 0)  # row vector @ output_map
        out = (mapped + window_sum) / tl.sum(l_c * weight, 0)
        tl.store(out_ptr + bh * D + cols, out.to(out_ptr.dtype.element_ty))


@lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_plan(n_packed: int, programs_per_split: int, device: torch.device) -> tuple[int, int]:
    """(splits over the packed tokens, tokens per split): enough programs to fill every SM ~4 times."""
    block = LAUNCH.block
    if n_packed == 0:
        return 0, block
    target = LAUNCH.waves * _multiprocessors(device)
    splits = max(1, min(-(-target // programs_per_split), -(-n_packed // block)))
    per_split = -(-n_packed // splits)
    per_split = -(-per_split // block) * block
    return -(-n_packed // per_split), per_split


def _rows_buffer(t: torch.Tensor) -> int:
    """Rows allocated per (batch, head) of a (B, H, rows, width) view into a contiguous buffer."""
    if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] or t.stride(0) != t.shape[1] * t.stride(1):
        raise ValueError("decode attention needs views of contiguous (B, H, rows, width) buffers")
    return t.stride(1) // t.shape[-1]


_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _workspace(batch: int, q_heads: int, n_splits: int, d: int, device: torch.device):
    """Partial sums, maxima and normalizers, reused across calls and layers (kernels run in stream order)."""
    key = (batch, q_heads, n_splits, d, device)
    if key not in _workspaces:
        partial = torch.empty(batch, q_heads, n_splits, d, device=device, dtype=torch.float32)
        maxima = torch.empty(batch, q_heads, n_splits, device=device, dtype=torch.float32)
        _workspaces[key] = (partial, maxima, torch.empty_like(maxima))
    return _workspaces[key]


def _decode_attention_triton(query, query_map, keys: PackedKV, values: PackedKV, window_keys, window_values,
                             output_map, scale):
    batch, q_heads, d = query.shape
    dtype = query.dtype
    kv_heads = keys.codes.shape[1]
    n_packed, n_window = keys.codes.shape[2], window_keys.shape[2]
    query, output_map = query.float().contiguous(), output_map.float().contiguous()
    mapped_query = query @ query_map.float()
    capacity = _rows_buffer(keys.codes)
    if not (capacity == _rows_buffer(keys.scales) == _rows_buffer(values.codes) == _rows_buffer(values.scales)):
        raise ValueError("packed K and V codes and scales must share one row capacity")
    window_capacity = _rows_buffer(window_keys)
    if _rows_buffer(window_values) != window_capacity:
        raise ValueError("window K and V must share one row capacity")
    packed_splits, per_split = _split_plan(n_packed, batch * kv_heads, query.device)
    n_splits = packed_splits + 1  # the last program takes the residual window
    partial, maxima, sums = _workspace(batch, q_heads, n_splits, d, query.device)
    gqa = q_heads // kv_heads
    _partial_kernel[(batch * kv_heads, n_splits)](
        query, mapped_query, keys.codes, keys.scales, values.codes, values.scales, window_keys, window_values, partial,
        maxima, sums, n_packed, n_window, per_split, packed_splits, kv_heads, capacity, window_capacity, scale,
        GQA=gqa, GQA_PAD=max(MIN_DOT, triton.next_power_of_2(gqa)), HALF=d // 2, BITS=keys.bits,
        K_GROUPS=keys.scales.shape[-1], V_GROUPS=values.scales.shape[-1], BLOCK=LAUNCH.block,
        num_warps=LAUNCH.num_warps, num_stages=1 if d >= WIDE_HEAD else LAUNCH.num_stages,
    )
    out = torch.empty(batch, q_heads, d, device=query.device, dtype=dtype)
    _reduce_kernel[(batch * q_heads,)](partial, maxima, sums, output_map, out, n_splits, D=d,
                                       SPLITS=triton.next_power_of_2(n_splits))
    return out


def packed_read_bytes(batch: int, kv_heads: int, tokens: int, d: int, bits: int, group: int) -> int:
    """Bytes a decode step reads from the packed cache: codes and fp32 scales of K and V."""
    return 2 * batch * kv_heads * tokens * (d * bits // 8 + 4 * d // group)
