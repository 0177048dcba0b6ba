"""Fused decode attention (query length 1) over a packed, rotated KV cache of 2-8-bit or codebook codes.

Open-TQ-Metal Alg. 1 with FlashDecoding's split-K (Sec. 3.2, Eq. 5): each program reads packed K/V
codes and their scales directly, turns the codes into fp16 integers in registers (a magic-number
conversion whose key biases the query takes out), keeps an online softmax over its slice of the sequence
and writes a partial (o_c, m_c, l_c); a reduce pass combines the partials. One program serves all
query heads of a KV head (GQA), so every KV byte is read once. Scales mostly stay out of the products: the
query's rows are laid out once per scale group, so each group's share of q . k meets its scale in
float32 after the tensor-core product, and the probabilities carry the V scales into the second product.
An asymmetric layout's unsigned codes decode as c * s + z: its offsets add z times the group's query sum to a
key's score, and the probabilities' sum against z to the values. KIVI's keys, with a scale and an offset per channel
over each group of tokens, fold into the query: q . k = sum_i (q_i s_i) c_i + sum_i q_i z_i, the scaled query
made once per group in the CUDA partial. Where a row block per scale group would cost more than the arithmetic in
the Triton partial (KIVI's per-channel keys, NVFP4's blocks of 16, value groups behind keys of one row block:
_row_blocks), it instead decodes the tile in registers, one fp16 FMA per coordinate. Codebook codes
(TurboQuant_mse's, and the float formats': FP8's, MX's and NVFP4's element values) become their levels in registers (a
lookup in the small float32 table; for a float format, arithmetic on the code's bits) and their scales (TurboQuant's
per-token norm, FP8's per-token scale, MX's E8M0 byte per block read as a power of two, NVFP4's E4M3 byte per block)
serve as the groups' scales, or unit scales where the layout stores none (FP8 under one scale per layer); a layer
scale (NVFP4's, FP8's) is the query and output maps';
for TurboQuant the query, mapped by R^T, and the output, mapped back by R, make the attention run in the rotated
domain, as the paper's decode does.

Packed codes live in the quantizers' rotated, lambda-scaled domains (y = lam * R x). With
query_map = R_k^T diag(1/lam_k) and output_map = diag(1/lam_v) R_v: q . k = (q query_map) . y_k and
sum_i p_i v_i = (sum_i p_i y_v,i) output_map. The packed splits accumulate in the value domain and the
residual-window split (exact tokens) in the model's, and the reduce pass maps the packed sum back before
adding the window's, so the window needs no per-step rotation.

The partials come from csrc/decode_attention.cu (kvq.kernels.cuda_decode) where the shape fits it (head_dim
128, 2-4-bit V in scale groups of 32, 2-8-bit K alike or KIVI's 2-4-bit keys with fp16 stats, K and V both
symmetric or both with offsets, codes below 4 bits with offsets only; or 2-4-bit codebook codes on both sides with
fp16 scales, TurboQuant_mse's norm per token or iq4_nl's scale per 32 coordinates; at most 4 query heads per KV
head), at every sequence length; from the Triton partial kernel (kvq.kernels.triton_decode) otherwise, after a
kernel that maps the query. The reduce is the CUDA one at head_dim 128, else Triton's. On compute capability 9.0
the step's kernels are launched programmatically dependent, so each one's launch overlaps the kernel before it.

`decode_attention` dispatches to these kernels on CUDA and to `decode_attention_reference` (dequantize to
the model's domain, then SDPA) elsewhere; the GPU tests check the two agree.
"""

import dataclasses
import math

import torch

from kvq.kernels import cuda_decode
from kvq.kernels.launch import LaunchConfig, launch_for, programmatic_launch, split_plan, triton_resident_programs
from kvq.kernels.step import DecodeStep, PackedKV, decode_attention_reference
from kvq.quant.layout import E4M3_STATS

try:
    from kvq.kernels import triton_decode, triton_launch
except ImportError:  # CPU installs: the reference path serves
    triton_decode = triton_launch = None

MAX_ROWS = 64  # query rows x scale groups per program beyond which the accumulators spill: reference path
WIDE_HEAD = 256  # from this head_dim on, shallower pipelining keeps the K/V tiles inside shared memory
MAP_COLUMNS = 32  # output columns per program of the query map and the reduce: more programs, shorter chains


def _padded_heads(gqa: int, k_groups: int, v_groups: int) -> int:
    """Query rows per scale group in the Triton kernel: a power of two >= GQA, with >= MIN_DOT rows in all."""
    return max(1 << (gqa - 1).bit_length(), triton_decode.MIN_DOT // min(k_groups, v_groups, triton_decode.MIN_DOT))


def _float_mantissa(packed: PackedKV) -> int:
    """The partial's FLOAT_MANTISSA: the mantissa bits of float-format codes, -1 for codes of any other kind."""
    return -1 if packed.float_mantissa is None else packed.float_mantissa


def _stats_kind(packed: PackedKV) -> int:
    """The partial's K_SCALES / V_SCALES: how the stats are held (triton_decode.STATS_*)."""
    if not packed.scales.shape[-1]:
        return triton_decode.STATS_NONE.value
    return triton_decode.STATS_E4M3.value if packed.stats_dtype == E4M3_STATS else triton_decode.STATS_STORED.value


def _row_blocks(keys, values) -> tuple[int, int]:
    """Row blocks of the query (keys) and of the accumulators (values) in the Triton partial: one per scale group,
    or one where each tile decodes its codes in registers. Keys are so decoded where their stats are per channel
    over tokens or NVFP4's E4M3 block scales; values where they are E4M3 ones too, or where the keys take one row
    block: the query's rows are then padded to MIN_DOT, and a row block per value group would repeat that padding."""
    key_blocks = 1 if keys.token_group > 1 or keys.stats_dtype == E4M3_STATS else keys.groups
    value_blocks = 1 if key_blocks == 1 or values.stats_dtype == E4M3_STATS else values.groups
    return key_blocks, value_blocks


def partial_shape(gqa: int, keys, values, block: int) -> tuple[int, ...]:
    """The Triton partial's SHAPE for K and V stored as these layouts (PackedKV) and tiles of `block` tokens."""
    rows = _row_blocks(keys, values)
    return (gqa, _padded_heads(gqa, *rows), keys.head_dim // 2, keys.bits, values.bits, keys.groups, values.groups,
            block, int(not keys.symmetric), int(not values.symmetric), keys.token_group if keys.token_group > 1 else 0,
            int(keys.codebook is not None), int(values.codebook is not None), _float_mantissa(keys),
            _float_mantissa(values), _stats_kind(keys), _stats_kind(values), *rows)


def unsupported_reason(query: torch.Tensor, step: DecodeStep) -> str | None:
    """None when the fused kernels serve this step; else why the reference does."""
    keys, values = step.keys, step.values
    kv_heads = keys.codes.shape[1]
    if not keys.codes.is_cuda:
        return f"fused decode attention runs on CUDA, not {keys.codes.device.type}"
    if query.shape[1] % kv_heads:
        return "query heads must be a multiple of KV heads"
    for role, packed in (("K", keys), ("V", values)):
        if packed.codebook is not None and packed.codebook.dtype != torch.float32:
            return f"fused decode attention reads float32 codebooks, not {packed.codebook.dtype} ({role})"
    return layout_reason(keys, values, query.shape[1] // kv_heads)


def layout_reason(keys, values, gqa: int) -> str | None:
    """None when the fused kernels read K and V stored as these layouts (PackedLayout or PackedKV: bits, head_dim,
    groups, token_group) with `gqa` query heads per KV head; else why not."""
    if triton_decode is None:
        return "triton is not installed"
    for role, packed in (("K", keys), ("V", values)):
        if not 2 <= packed.bits <= 8:
            return f"fused decode attention reads codes of 2-8 bits, not {packed.bits}-bit {role}"
    d = keys.head_dim
    if d // 2 < triton_decode.MIN_DOT or d & (d - 1):
        return f"fused decode attention needs a power-of-two head_dim >= {2 * triton_decode.MIN_DOT}, got {d}"
    if values.token_group > 1:
        return "value stats spanning tokens have no kernel"
    group = keys.token_group
    if group > 1 and (group & (group - 1) or group < triton_decode.MIN_DOT):
        return f"per-channel key stats need a power-of-two token group >= {triton_decode.MIN_DOT}, got {group}"
    rows = _row_blocks(keys, values)
    if _padded_heads(gqa, *rows) * max(rows) > MAX_ROWS:
        return "query heads x scale groups per KV head exceed what one program holds"
    return None


def step_description(query: torch.Tensor, step: DecodeStep) -> str:
    keys, values = step.keys, step.values
    def codes(packed) -> str:
        if packed.codebook is not None:
            return f"{packed.bits}-bit codebook"
        return f"int{packed.bits}" if packed.symmetric else f"uint{packed.bits} (with offsets)"

    key_groups = f"per channel over {keys.token_group} tokens" if keys.token_group > 1 else keys.groups
    return (f"query {tuple(query.shape)} {query.dtype} over {codes(keys)} K and {codes(values)} V of "
            f"{keys.codes.shape[1]} heads in {key_groups} and {values.groups} scale groups")


def decode_attention(query: torch.Tensor, step: DecodeStep, scale: float,
                     launch: LaunchConfig | None = None) -> torch.Tensor:
    """query (B, Hq, d) -> attention output (B, Hq, d): the fused kernels where they serve, else the reference.
    launch: the launch choices (default: kvq.kernels.launch.launch_for the device)."""
    if unsupported_reason(query, step) is None:
        return decode_attention_gpu(query, step, scale, launch or launch_for(query.device))
    return decode_attention_reference(query, step, scale)


def rows_buffer(t: torch.Tensor) -> int:
    """Rows allocated per (batch, head) of a (B, H, rows, width) view into a contiguous buffer."""
    batch_stride, head_stride, row_stride, column_stride = t.stride()
    heads, width = t.shape[1], t.shape[3]
    if column_stride != 1 or row_stride != width or batch_stride != heads * head_stride:
        raise ValueError("decode attention needs views of contiguous (B, H, rows, width) buffers")
    return head_stride // width


_workspaces: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _workspace(batch: int, q_heads: int, n_splits: int, d: int, device: torch.device):
    """Mapped query, partial sums, maxima and normalizers, reused across calls, layers and captured
    graphs (their kernels run in stream order). One first made inside a CUDA graph capture is that graph's
    own and is not kept (a compiled step's graph pool must own every tensor allocated in it)."""
    key = (batch, q_heads, n_splits, d, device)
    if key in _workspaces:
        return _workspaces[key]
    partial = torch.empty(batch, q_heads, n_splits, d, device=device, dtype=torch.float32)
    maxima = torch.empty(batch, q_heads, n_splits, device=device, dtype=torch.float32)
    mapped_query = torch.empty(batch, q_heads, d, device=device, dtype=torch.float32)
    workspace = (mapped_query, partial, maxima, torch.empty_like(maxima))
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _workspaces[key] = workspace
    return workspace


def decode_attention_gpu(query: torch.Tensor, step: DecodeStep, scale: float, launch: LaunchConfig,
                         lengths: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fused step. With `lengths` (a one-element int64 CUDA tensor holding device_lengths(...)) the kernels
    read the token counts from the device and split the buffers' whole capacity, so one launch sequence,
    captured once, serves every length up to it (DecodeGraph); the views' own lengths are then ignored."""
    keys, values = step.keys, step.values
    batch, q_heads, d = query.shape
    kv_heads = keys.codes.shape[1]
    n_packed, n_window = keys.codes.shape[2], step.window[0].shape[2]
    query, output_map = query.contiguous(), step.output_map.float().contiguous()
    capacity = rows_buffer(keys.codes)
    stats_capacities = [rows_buffer(p.scales) * p.token_group for p in (keys, values) if p.scales.shape[-1]]
    if any(rows != capacity for rows in (rows_buffer(values.codes), *stats_capacities)):
        raise ValueError("packed K and V codes and scales must share one row capacity")
    window_capacity = rows_buffer(step.window[0])
    if rows_buffer(step.window[1]) != window_capacity:
        raise ValueError("window K and V must share one row capacity")
    pdl = programmatic_launch(launch, query.device)
    gqa = q_heads // kv_heads
    tokens = n_packed if lengths is None else capacity
    lengths_pointer = query if lengths is None else lengths  # unread without lengths
    cuda_partial = launch.partial == "cuda" and cuda_decode.partial_fits(query, keys, values, step.window)
    if cuda_partial:
        resident = cuda_decode.partial_kernel_for(query, keys, values).resident_blocks
        # splits start on a tile, so that every tile lies in one key group, or its scales rows are 16-byte aligned
        if keys.token_group > 1 or cuda_decode.token_scales(keys):
            launch = dataclasses.replace(launch, block=math.lcm(launch.block, cuda_decode.TILE))
    else:
        if keys.token_group > 1:  # a tile within one token group
            launch = dataclasses.replace(launch, block=min(launch.block, keys.token_group))
        constants = dict(SHAPE=partial_shape(gqa, keys, values, launch.block), DEVICE_LENGTHS=lengths is not None,
                         PDL=pdl, launch_pdl=pdl, num_warps=launch.num_warps,
                         num_stages=1 if d >= WIDE_HEAD else launch.num_stages)
        # sized before the workspace exists, with stand-ins for it and the split's counts
        stand_in = torch.empty(1, device=query.device)
        sizing = triton_launch.compiled_kernel(triton_decode.partial_kernel, _triton_partial_args(
            query, stand_in, step, (stand_in, stand_in, stand_in), lengths_pointer, (0, 0, 0, 0, 0), scale), constants)
        resident = triton_resident_programs(sizing, query.device)
    packed_splits, per_split = split_plan(tokens, batch * kv_heads, resident, launch, query.device)
    n_splits = packed_splits + 1  # the last program takes the residual window
    mapped_query, partial, maxima, sums = _workspace(batch, q_heads, n_splits, d, query.device)
    counts = (n_packed, n_window, per_split, capacity, window_capacity)
    if cuda_partial:
        arguments = cuda_decode.DecodeArguments.of(
            [cuda_decode.fragment_order(step.query_map), query, keys.codes, keys.scales, values.codes, values.scales,
             *(_packed_args(p)[2] for p in (keys, values)), *step.window, partial, maxima, sums, lengths_pointer],
            [n_packed, n_window, per_split, packed_splits, gqa, capacity, window_capacity], float(scale),
            lengths is not None)
        cuda_decode.partial_kernel_for(query, keys, values)((batch * kv_heads, n_splits), [arguments], programmatic=pdl)
    else:
        columns = min(d, MAP_COLUMNS)
        triton_launch.launch(triton_decode.map_query_kernel, (batch * q_heads, d // columns),
                             (query, step.query_map.float().contiguous(), mapped_query), D=d, COLS=columns, PDL=pdl,
                             launch_pdl=pdl)
        triton_launch.launch(triton_decode.partial_kernel, (batch * kv_heads, n_splits), _triton_partial_args(
            query, mapped_query, step, (partial, maxima, sums), lengths_pointer, counts, scale), **constants)
    if out is None:
        out = torch.empty(batch, q_heads, d, device=query.device, dtype=query.dtype)
    if cuda_decode.reduce_fits(query):
        cuda_decode.reduce_kernel(query.dtype, query.device)(
            batch * q_heads, [partial, maxima, sums, output_map, out, n_splits], programmatic=pdl)
    else:
        columns = min(d, MAP_COLUMNS)
        triton_launch.launch(triton_decode.reduce_kernel, (batch * q_heads, d // columns),
                             (partial, maxima, sums, output_map, out, n_splits),
                             D=d, SPLITS=1 << (n_splits - 1).bit_length(), COLS=columns, PDL=pdl, launch_pdl=pdl)
    return out


def _triton_partial_args(query, mapped_query, step: DecodeStep, partials: tuple, lengths_pointer, counts: tuple,
                         scale: float) -> tuple:
    return ((query, mapped_query), _packed_args(step.keys), _packed_args(step.values), step.window, partials,
            lengths_pointer, counts, float(scale))


def _packed_args(packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, stats (E4M3 ones as their bytes) and codebook levels (the stats stand in where there are none: the
    kernel leaves them unread)."""
    stats = packed.scales.view(torch.uint8) if packed.scales.dtype == E4M3_STATS else packed.scales
    return packed.codes, stats, stats if packed.codebook is None else packed.codebook
