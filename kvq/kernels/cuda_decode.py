"""The CUDA kernels of fused decode attention (csrc/decode_attention.cu, built by NVRTC): which shapes they
serve, their builds, and the query map in the fragment order their partial kernel reads.

Its fragment layouts turn codes into tensor-core operands in registers, which Triton's layouts do not allow,
and each of its programs maps its own query (an mma per warp on the map in fragment_order), which spares the
step the map kernel's launch and its round trip through memory. Its reduce pass takes all of a query head's
partials in one round trip, where the Triton reduce needs a chain of loads per split.
"""

import ctypes
import weakref
from functools import lru_cache

import torch

from kvq.kernels.backends import CudaLaunch
from kvq.kernels.launch import properties
from kvq.kernels.plan import KERNEL_SCALE_DTYPES
from kvq.kernels.source import DTYPE_DEFINES, PROGRAMMATIC_CUDA, kernel_text

HEAD_DIM = 128  # csrc/decode_attention.cu's KVQ_D
GROUPS = 4  # its scale groups per row (32 coordinates each)
MAX_GQA = 4  # its query heads per KV head
MMA_TILE = 16  # rows and columns of an m16n8k16 A fragment
NIBBLE = 4  # codes narrower than this are widened into nibbles as the kernel reads them, and must be unsigned
NIBBLE_BITS = (2, 3, NIBBLE)  # widths it reads as nibbles: values' (KVQ_VALUE_BITS), KIVI's and codebook keys'
KEY_BITS = (*NIBBLE_BITS, 8)  # its KVQ_KEY_BITS builds
TILE = 16  # tokens per warp step: per-channel key groups are whole tiles, and splits start on one


class DecodeArguments(ctypes.Structure):
    """csrc/decode_attention.cu's kvq_decode_args, field for field."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "query_map", "query", "key_codes", "key_scales", "value_codes", "value_scales", "key_levels", "value_levels",
        "window_keys", "window_values", "partial", "maxima", "sums", "lengths")] + [(name, ctypes.c_uint) for name in (
            "n_packed", "n_window", "tokens_per_split", "n_packed_splits", "gqa", "capacity",
            "window_capacity")] + [("scale", ctypes.c_float), ("device_lengths", ctypes.c_uint)]

    @classmethod
    def of(cls, buffers: list[torch.Tensor], counts: list[int], scale: float, device_lengths: bool):
        """buffers: the fourteen pointers in field order; counts: the seven counts in field order."""
        return cls(*(t.data_ptr() for t in buffers), *counts, scale, int(device_lengths))


def builds_on(device: torch.device) -> bool:
    """csrc/decode_attention.cu needs sm_80 (mma.sync m16n8k16, cp.async); Triton serves older GPUs."""
    return properties(device).major >= 8


def reduce_fits(query: torch.Tensor) -> bool:
    """The reduce pass serves (B, Hq, d) queries of head_dim 128, after either partial kernel (they write the
    same partials)."""
    return query.shape[-1] == HEAD_DIM and query.dtype in DTYPE_DEFINES and builds_on(query.device)


def _codebook_fits(keys, values) -> bool:
    """2-4-bit codebook codes for both roles (TurboQuant_mse's, iq4_nl's), each role's table all its codes' levels,
    with fp16 scales: one per token (a norm, in rows whose stats a tile copies 8 tokens at a time, so each head's rows
    start 16-byte aligned) or one per group of 32 coordinates."""
    per_token = keys.scales.shape[-1] == values.scales.shape[-1] == 1
    aligned = all(p.scales.data_ptr() % 16 == 0 and p.scales.stride(1) % 8 == 0 for p in (keys, values))
    return (keys.bits in NIBBLE_BITS and values.bits in NIBBLE_BITS and keys.symmetric and values.symmetric
            and keys.float_mantissa is None and values.float_mantissa is None
            and all(p.codebook.numel() == 1 << p.bits for p in (keys, values)) and keys.token_group == 1
            and keys.scales.dtype == torch.float16
            and (keys.scales.shape[-1] == values.scales.shape[-1] == GROUPS or (per_token and aligned)))


def token_scales(keys) -> bool:
    """Whether a build for these K (PackedKV) reads one scale per token (KVQ_TOKEN_SCALE)."""
    return keys.codebook is not None and keys.scales.shape[-1] == 1


def partial_fits(query: torch.Tensor, keys, values, window: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """The shapes csrc/decode_attention.cu is written for (its header): V in scale groups of 32 per token; K alike, or
    KIVI's 2-4-bit keys (fp16 stats per channel over token groups that are whole tiles); K and V both symmetric or
    both with offsets, codes narrower than 4 bits with offsets only; or both 2-4-bit codebook codes
    (_codebook_fits); the window in the query's dtype. keys, values: PackedKV."""
    if (keys.codebook is None) != (values.codebook is None):
        return False
    stats = GROUPS * (1 + (not values.symmetric))
    if keys.codebook is not None:
        codes_fit = _codebook_fits(keys, values)  # both roles' stats too
    elif keys.token_group > 1:
        codes_fit = (keys.bits in NIBBLE_BITS and keys.token_group % TILE == 0 and keys.scales.shape[-1] == 2 * HEAD_DIM
                     and keys.scales.dtype == torch.float16 and not values.symmetric
                     and values.scales.shape[-1] == stats)
    else:
        codes_fit = (keys.bits in KEY_BITS and keys.symmetric == values.symmetric
                     and keys.scales.shape[-1] == values.scales.shape[-1] == stats
                     and (min(keys.bits, values.bits) >= NIBBLE or not keys.symmetric))
    return (builds_on(query.device) and codes_fit and values.bits in NIBBLE_BITS and keys.head_dim == HEAD_DIM
            and values.token_group == 1
            and keys.scales.dtype == values.scales.dtype and keys.scales.dtype in KERNEL_SCALE_DTYPES
            and query.shape[1] // keys.codes.shape[1] <= MAX_GQA and query.dtype in DTYPE_DEFINES
            and window[0].dtype == window[1].dtype == query.dtype)


def source(dtype: torch.dtype, scale_dtype: torch.dtype = torch.float32, key_bits: int = 4,
           offsets: bool = False, key_channels: int = 0, codebook: bool = False, token_scale: bool = False,
           value_bits: int = 4) -> str:
    """The translation unit of the partial and reduce kernels for query, window and output elements of
    `dtype`, scales of `scale_dtype`, keys of `key_bits` and values of `value_bits`, unsigned codes with offsets
    where `offsets`, keys with stats per channel over groups of `key_channels` tokens where it is set, codebook codes
    where `codebook`, and one scale per token where `token_scale`."""
    defines = (f"#define KVQ_ELEM_{DTYPE_DEFINES[dtype]}\n#define KVQ_SCALE_HALF {int(scale_dtype == torch.float16)}\n"
               f"#define KVQ_KEY_BITS {key_bits}\n#define KVQ_VALUE_BITS {value_bits}\n"
               f"#define KVQ_OFFSETS {int(offsets)}\n"
               f"#define KVQ_KEY_CHANNELS {key_channels}\n#define KVQ_CODEBOOK {int(codebook)}\n"
               f"#define KVQ_TOKEN_SCALE {int(token_scale)}\n")
    files = (PROGRAMMATIC_CUDA, "decode_primitives.cuh", "decode_attention.cu")
    return defines + "".join(kernel_text(name) for name in files)


def partial_kernel_for(query: torch.Tensor, keys, values) -> CudaLaunch:
    """The partial kernel's build for this query, K and V (PackedKV, where partial_fits)."""
    key_channels = keys.token_group if keys.token_group > 1 else 0
    codebook = keys.codebook is not None
    offsets = not keys.symmetric and not codebook
    return partial_kernel(query.dtype, keys.scales.dtype, keys.bits, offsets, key_channels, codebook,
                          token_scales(keys), values.bits, query.device)


@lru_cache(maxsize=16)
def partial_kernel(dtype: torch.dtype, scale_dtype: torch.dtype, key_bits: int, offsets: bool, key_channels: int,
                   codebook: bool, token_scale: bool, value_bits: int, device: torch.device) -> CudaLaunch:
    return CudaLaunch.compile(source(dtype, scale_dtype, key_bits, offsets, key_channels, codebook, token_scale,
                                     value_bits), "kvq_decode_partial", device)


@lru_cache(maxsize=8)
def reduce_kernel(dtype: torch.dtype, device: torch.device) -> CudaLaunch:
    """The reduce pass for outputs of `dtype` (the scales' dtype is not read)."""
    return CudaLaunch.compile(source(dtype), "kvq_decode_reduce", device)


def fragment_order(matrix: torch.Tensor) -> torch.Tensor:
    """A d x d map (x -> x @ matrix) as kvq_map_query takes it: matrix^T in fp16, cut into m16n8k16 A
    fragments, (m-tile, k-step, lane, register, half): lane (r, c) of tile (i, s) holds rows r and r + 8,
    columns 2c, 2c + 1 and 2c + 8, 2c + 9 of block (i, s), so a warp reads a step in one 16-byte load per lane.

    Kept per map while it lives and is not modified in place, so a captured step launches no conversion. The
    map is found by its address, as a compiled step hands the op another tensor object over the same memory;
    made inside a CUDA graph capture that finds none kept, the fragments are the graph's own and are not kept
    (a compiled step's graph pool must own every tensor allocated in it)."""
    key = (matrix.data_ptr(), matrix.device, tuple(matrix.shape))
    hit = _fragments.get(key)
    if hit is not None:
        source, version, fragments = hit
        kept = source()
        if kept is not None and kept.data_ptr() == key[0] and kept._version == version:
            return fragments
    tiles = matrix.shape[0] // MMA_TILE
    blocks = matrix.T.to(torch.float16).reshape(tiles, MMA_TILE, tiles, MMA_TILE).permute(0, 2, 1, 3)
    lane, register, half = (torch.arange(n, device=matrix.device) for n in (32, 4, 2))
    rows = lane[:, None, None] // 4 + 8 * (register[None, :, None] % 2)  # broadcast over `half`
    columns = 2 * (lane[:, None, None] % 4) + 8 * (register[None, :, None] // 2) + half
    fragments = blocks[:, :, rows, columns].contiguous()
    if not (matrix.is_cuda and torch.cuda.is_current_stream_capturing()):
        def forget(dead: weakref.ref) -> None:
            if key in _fragments and _fragments[key][0] is dead:
                del _fragments[key]

        _fragments[key] = (weakref.ref(matrix, forget), matrix._version, fragments)
    return fragments


_fragments: dict[tuple, tuple] = {}  # (address, device, shape) -> (the map, its _version when built, fragments)
