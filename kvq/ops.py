"""The one door to kvq's kernels: quantize rows into a PackedLayout, dequantize them, write them into a static
cache's buffers, and attend from packed K/V.

Each is a torch.library custom op (kvq::quantize, kvq::dequantize, kvq::write_rows, kvq::decode_attention) with a
fake implementation, so torch.compile traces through them, and an implementation per device: the fused kernels
on CUDA (and Metal for quantize/dequantize) where they cover the layout, the torch reference elsewhere and
for every layout they do not (logged once, with the reason, under the "kvq.kernels" logger). The
reference is the quantizers' own arithmetic, so kernel and reference agree on every device. kvq::write_rows is
kvq::quantize and index copies wherever its own kernel does not serve, so what it logs is quantize's.

encode / decode take a quantizer: they go through the ops when it declares a PackedForm, and through the
quantizer's own encode / decode when it does not.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvq.kernels import note_fallback
from kvq.kernels.stats import packed_codes, packed_stats, per_token_stats
from kvq.kernels.step import DecodeStep, PackedKV, decode_attention_reference, device_lengths, packed_read_bytes
from kvq.quant import fp8, ggml, mlx_affine, mx, nvfp4
from kvq.quant.base import Packed, Quantizer
from kvq.quant.codebooks import decode_unit_vector, encode_unit_vector
from kvq.quant.layout import E4M3_STATS, NVFP4_SCHEME, SIGNED_ROTATIONS, PackedForm, PackedLayout, group_scales
from kvq.quant.packing import pack, unpack
from kvq.quant.rotated import RotatedPacked
from kvq.quant.scalar import SCALE_DTYPES, ScalarQuantizer
from kvq.rotations import BlockDiagonal, MatrixRotation, Rotation, signed_rotation

if TYPE_CHECKING:
    from kvq.kernels.decode_graph import DecodeGraph
    from kvq.kernels.launch import LaunchConfig

SCALE_DTYPE_NAMES = {dtype: name for name, dtype in SCALE_DTYPES.items()}
# the engines' arithmetic per layout scheme: rotated float32 rows (n, d) (and a layer_scaled layout's layer scale) ->
# codes and stats
ENGINE_CODES = {"ggml": ggml.layout_codes, "mlx": mlx_affine.layout_codes, **fp8.LAYOUT_CODES, **mx.LAYOUT_CODES,
                NVFP4_SCHEME: nvfp4.layout_codes}


def _layout(head_dim: int, bits: int, group_size: int, scale_dtype: torch.dtype | None, symmetric: bool,
            rotation_kind: str, token_group: int, codebook: bool, scheme: str = "kvq",
            layer_scaled: bool = False) -> PackedLayout:
    return PackedLayout(head_dim, bits, group_size, scale_dtype, symmetric, rotation_kind, token_group, codebook,
                        scheme, layer_scaled)


def _rotation(rotation: torch.Tensor, layout: PackedLayout) -> Rotation:
    if layout.rotation in SIGNED_ROTATIONS:
        return signed_rotation(layout.rotation, rotation)
    return BlockDiagonal(rotation, layout.head_dim) if layout.rotation == "blocks" else MatrixRotation(rotation)


def _scalar(layout: PackedLayout, granularity: str = "per_group") -> ScalarQuantizer:
    return ScalarQuantizer(layout.bits, granularity, layout.group_size, layout.symmetric,
                           SCALE_DTYPE_NAMES[layout.scale_dtype])


def reference_quantize(rows: torch.Tensor, rotation: torch.Tensor, lam: torch.Tensor | None,
                       layout: PackedLayout, codebook: torch.Tensor | None = None,
                       layer_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RotatedQuantizer.encode's arithmetic on (n, d) rows -> codes and stats (scales, then any offsets); where
    the stats span tokens, KIVI's per-channel arithmetic over each `token_group` consecutive rows (n a multiple);
    for a codebook layout TurboQuant_mse's (Alg. 1: the norm, then the nearest level of each coordinate of the
    rotated unit vector); for an engine's scheme the engine's arithmetic (ENGINE_CODES), under the layer scale
    where the layout is layer_scaled.
    rotation: the signs (d,) of a signed rotation kind, the block of a "blocks" one, else its matrix (d, d)."""
    if layout.codebook and layout.scheme == "kvq":
        codes, norm = encode_unit_vector(rows.float(), _rotation(rotation, layout), codebook)
        return pack(codes.to(torch.int16), layout.bits), norm
    y = _rotation(rotation, layout).forward(rows.float())
    if layout.layer_scaled:
        return ENGINE_CODES[layout.scheme](y, layout, layer_scale)
    if layout.scheme != "kvq":
        return ENGINE_CODES[layout.scheme](y, layout)
    if lam is not None:
        y = y * lam.float()
    if layout.token_group > 1:
        packed = _scalar(layout, "per_channel").encode(y.view(-1, layout.token_group, layout.head_dim))
    else:
        packed = _scalar(layout).encode(y)
    return packed.codes.reshape(rows.shape[0], layout.code_bytes), packed_stats(packed, layout.groups)


def reference_dequantize(codes: torch.Tensor, scales: torch.Tensor, rotation: torch.Tensor,
                         lam: torch.Tensor | None, layout: PackedLayout, dtype: torch.dtype,
                         codebook: torch.Tensor | None = None, layer_scale: torch.Tensor | None = None) -> torch.Tensor:
    """RotatedQuantizer.decode's arithmetic, in `dtype` (each token group's stats serving its every row); a
    codebook layout's as TurboQuant_mse decodes (the levels rotated back, times the norm), each group's levels times
    its scale where there are several (the float formats'), that scale times the layer scale where there is one."""
    if layout.codebook:
        codes = unpack(codes, layout.bits, layout.head_dim, signed=False)
        return decode_unit_vector(codes, group_scales(scales, layer_scale), _rotation(rotation, layout),
                                  codebook).to(dtype)
    n = codes.shape[0]
    inner = packed_codes(codes, per_token_stats(scales, layout.token_group, n), (n, layout.head_dim), dtype,
                         layout.symmetric).inner
    y = _scalar(layout).decode(inner).float()
    if lam is not None:
        y = y / lam.float()
    return _rotation(rotation, layout).inverse(y).to(dtype)


def _decoded_layout(codes: torch.Tensor, scales: torch.Tensor, bits: int, symmetric: bool, rotation_kind: str,
                    token_group: int, codebook: torch.Tensor | None, layer_scale: torch.Tensor | None) -> PackedLayout:
    d = codes.shape[-1] * 8 // bits
    if not scales.shape[-1]:  # codes scaled by their layer alone
        return _layout(d, bits, d, None, symmetric, rotation_kind, token_group, True, layer_scaled=True)
    groups = scales.shape[-1] if symmetric else scales.shape[-1] // 2
    return _layout(d, bits, d // groups, scales.dtype, symmetric, rotation_kind, token_group, codebook is not None,
                   layer_scaled=layer_scale is not None)


@torch.library.custom_op("kvq::quantize", mutates_args=())
def _quantize(rows: torch.Tensor, rotation: torch.Tensor, lam: torch.Tensor | None, bits: int, group_size: int,
              scale_dtype: torch.dtype | None, symmetric: bool, rotation_kind: str, token_group: int,
              codebook: torch.Tensor | None, scheme: str, layer_scale: torch.Tensor | None) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """(n, d) rows -> codes (n, d * bits / 8) uint8 and stats (n / token_group, layout.stats): d / group_size
    scales, then as many offsets where not `symmetric`; with a codebook, its indices and a scale per group (none
    without a scale_dtype); written by the `scheme`'s arithmetic, under the layer scale where one is given."""
    layout = _layout(rows.shape[-1], bits, group_size, scale_dtype, symmetric, rotation_kind, token_group,
                     codebook is not None, scheme, layer_scale is not None)
    return reference_quantize(rows, rotation, lam, layout, codebook, layer_scale)


@_quantize.register_fake
def _(rows, rotation, lam, bits, group_size, scale_dtype, symmetric, rotation_kind, token_group, codebook, scheme,
      layer_scale):
    n, d = rows.shape
    layout = _layout(d, bits, group_size, scale_dtype, symmetric, rotation_kind, token_group, codebook is not None,
                     scheme, layer_scale is not None)
    return (rows.new_empty(n, layout.code_bytes, dtype=torch.uint8),
            rows.new_empty(n // token_group, layout.stats, dtype=layout.stats_dtype))


@torch.library.custom_op("kvq::dequantize", mutates_args=())
def _dequantize(codes: torch.Tensor, scales: torch.Tensor, rotation: torch.Tensor, lam: torch.Tensor | None,
                bits: int, dtype: torch.dtype, symmetric: bool, rotation_kind: str, token_group: int,
                codebook: torch.Tensor | None, layer_scale: torch.Tensor | None) -> torch.Tensor:
    """codes (n, d * bits / 8) and stats (n / token_group, layout.stats) -> rows (n, d) of `dtype`."""
    layout = _decoded_layout(codes, scales, bits, symmetric, rotation_kind, token_group, codebook, layer_scale)
    return reference_dequantize(codes, scales, rotation, lam, layout, dtype, codebook, layer_scale)


@_dequantize.register_fake
def _(codes, scales, rotation, lam, bits, dtype, symmetric, rotation_kind, token_group, codebook, layer_scale):
    return codes.new_empty(codes.shape[0], codes.shape[-1] * 8 // bits, dtype=dtype)


def _kernel_quantize(rows, rotation, lam, bits, group_size, scale_dtype, symmetric, rotation_kind, token_group,
                     codebook, scheme, layer_scale):
    from kvq.kernels.dispatch import kernel_quantize  # on an accelerator only: CPU cells' digests leave it out

    layout = _layout(rows.shape[-1], bits, group_size, scale_dtype, symmetric, rotation_kind, token_group,
                     codebook is not None, scheme, layer_scale is not None)
    return kernel_quantize(rows, rotation, lam, layout, codebook, layer_scale)


def _kernel_dequantize(codes, scales, rotation, lam, bits, dtype, symmetric, rotation_kind, token_group, codebook,
                       layer_scale):
    from kvq.kernels.dispatch import kernel_dequantize

    layout = _decoded_layout(codes, scales, bits, symmetric, rotation_kind, token_group, codebook, layer_scale)
    return kernel_dequantize(codes, scales, rotation, lam, layout, dtype, codebook, layer_scale)


for _device in ("cuda", "mps"):
    _quantize.register_kernel(_device)(_kernel_quantize)
    _dequantize.register_kernel(_device)(_kernel_dequantize)


@torch.library.custom_op("kvq::write_rows", mutates_args=("codes", "scales", "rings"))
def _write_rows(rows: list[torch.Tensor], rotations: list[torch.Tensor], lams: list[torch.Tensor | None], bits: int,
                group_size: int, scale_dtype: torch.dtype | None, symmetric: bool, rotation_kind: str,
                codebooks: list[torch.Tensor | None], scheme: str, layer_scales: list[torch.Tensor | None],
                codes: list[torch.Tensor], scales: list[torch.Tensor], rings: list[torch.Tensor],
                length: torch.Tensor, after: torch.Tensor | None) -> None:
    """Each role's rows (B, H, T, d) -> their codes and stats, in the layout of one stats row per token these
    arguments name (as kvq::quantize's; the roles' own rotation, lambda, codebook and layer scale), at positions
    length + 0..T-1 of that role's codes (B, H, capacity, code_bytes) and scales (B, H, capacity, stats); the last
    `window` of them exact into its ring (B, H, window, d) at those positions modulo `window`. length: a 0-d int64
    tensor. `after`: a tensor the write must follow, unread (a decode step's query: a compiled step then launches
    the write just before the attention that runs beside it). On CUDA one kernel writes every role of the layouts
    the shared body writes."""
    layout = _written_layout(rows, bits, group_size, scale_dtype, symmetric, rotation_kind, codebooks, scheme,
                             layer_scales)
    _write_each_through_quantize(layout, rows, rotations, lams, codebooks, layer_scales, codes, scales, rings, length)


@_write_rows.register_fake
def _(rows, rotations, lams, bits, group_size, scale_dtype, symmetric, rotation_kind, codebooks, scheme, layer_scales,
      codes, scales, rings, length, after):
    return None


@_write_rows.register_kernel("cuda")
def _(rows, rotations, lams, bits, group_size, scale_dtype, symmetric, rotation_kind, codebooks, scheme, layer_scales,
      codes, scales, rings, length, after):
    from kvq.kernels.dispatch import kernel_write_rows

    layout = _written_layout(rows, bits, group_size, scale_dtype, symmetric, rotation_kind, codebooks, scheme,
                             layer_scales)
    if not kernel_write_rows(rows, rotations, lams, layout, codebooks, codes, scales, rings, length):
        _write_each_through_quantize(layout, rows, rotations, lams, codebooks, layer_scales, codes, scales, rings,
                                     length)


def _written_layout(rows, bits, group_size, scale_dtype, symmetric, rotation_kind, codebooks, scheme,
                    layer_scales) -> PackedLayout:
    return _layout(rows[0].shape[-1], bits, group_size, scale_dtype, symmetric, rotation_kind, 1,
                   codebooks[0] is not None, scheme, layer_scales[0] is not None)


def _write_each_through_quantize(layout: PackedLayout, rows, rotations, lams, codebooks, layer_scales, codes, scales,
                                 rings, length: torch.Tensor) -> None:
    for role in zip(rows, rotations, lams, codebooks, layer_scales, codes, scales, rings, strict=True):
        role_rows, rotation, lam, codebook, layer_scale, role_codes, role_scales, ring = role
        write_rows_through_quantize(role_rows, rotation, lam, layout, codebook, layer_scale, role_codes, role_scales,
                                    ring, length)


def write_rows_through_quantize(rows: torch.Tensor, rotation: torch.Tensor, lam: torch.Tensor | None,
                                layout: PackedLayout, codebook: torch.Tensor | None, layer_scale: torch.Tensor | None,
                                codes: torch.Tensor, scales: torch.Tensor, ring: torch.Tensor,
                                length: torch.Tensor) -> None:
    """kvq::write_rows as kvq::quantize (its kernel or the reference, as the device has them) and three copies: what
    the op runs wherever its own kernel does not serve, and what that kernel must write bit for bit."""
    tokens, window = rows.shape[-2], ring.shape[-2]
    written, stats = torch.ops.kvq.quantize(rows.reshape(-1, layout.head_dim), rotation, lam, layout.bits,
                                            layout.group_size, layout.scale_dtype, layout.symmetric, layout.rotation,
                                            1, codebook, layout.scheme, layer_scale)
    positions = length + torch.arange(tokens, device=rows.device)
    codes.index_copy_(2, positions, written.view(*rows.shape[:-1], layout.code_bytes))
    copy_rows(scales, positions, stats.view(*rows.shape[:-1], layout.stats))
    recent = min(tokens, window)
    ring.index_copy_(2, positions[tokens - recent:] % window, rows[..., tokens - recent:, :])


def copy_rows(buffer: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
    """buffer.index_copy_ along the tokens (dim 2); E4M3 stats as their bytes (torch has no float8 index_copy)."""
    if buffer.dtype == E4M3_STATS:
        buffer, rows = buffer.view(torch.uint8), rows.view(torch.uint8)
    buffer.index_copy_(2, positions, rows)


@torch.library.custom_op("kvq::decode_attention", mutates_args=())
def _decode_attention(query: torch.Tensor, query_map: torch.Tensor, key_codes: torch.Tensor,
                      key_scales: torch.Tensor, value_codes: torch.Tensor, value_scales: torch.Tensor,
                      window_keys: torch.Tensor, window_values: torch.Tensor, output_map: torch.Tensor, scale: float,
                      key_bits: int, value_bits: int, key_symmetric: bool, value_symmetric: bool,
                      key_token_group: int, value_token_group: int, key_codebook: torch.Tensor | None,
                      value_codebook: torch.Tensor | None, key_float_mantissa: int | None,
                      value_float_mantissa: int | None, counts: torch.Tensor | None) -> torch.Tensor:
    """counts: None to attend over every row given, or a one-element int64 tensor holding
    device_lengths(packed rows, window rows): the leading rows of the buffers that count. CUDA runs the kernels
    where the layout has them; everything else the reference."""
    d = query.shape[-1]
    step = DecodeStep(PackedKV(key_codes, key_scales, key_bits, d, key_symmetric, key_token_group, key_codebook,
                               key_float_mantissa),
                      PackedKV(value_codes, value_scales, value_bits, d, value_symmetric, value_token_group,
                               value_codebook, value_float_mantissa),
                      (window_keys, window_values), query_map, output_map)
    if query.is_cuda:
        # The kernels' modules are imported here, on CUDA only: a CPU measurement never loads them (kvq.fingerprint
        # leaves them out of a CPU cell's code digest on that ground).
        from kvq.kernels import decode_attention as attention
        from kvq.kernels.launch import launch_for

        reason = attention.unsupported_reason(query, step)
        if reason is None and counts is None:
            return attention.decode_attention(query, step, scale)
        if reason is None:
            return attention.decode_attention_gpu(query, step, scale, launch_for(query.device), lengths=counts)
        note_fallback("kvq::decode_attention", attention.step_description(query, step), reason)
    return decode_attention_reference(query, _counted(step, counts), scale)


@_decode_attention.register_fake
def _(query, query_map, key_codes, key_scales, value_codes, value_scales, window_keys, window_values, output_map,
      scale, key_bits, value_bits, key_symmetric, value_symmetric, key_token_group, value_token_group, key_codebook,
      value_codebook, key_float_mantissa, value_float_mantissa, counts):
    return torch.empty_like(query)


def _counted(step: DecodeStep, counts: torch.Tensor | None) -> DecodeStep:
    """The step's leading rows that `counts` names (a host read: reference path only)."""
    if counts is None:
        return step
    packed_and_window = int(counts.reshape(()))
    n_packed, n_window = packed_and_window >> 32, packed_and_window & 0xFFFFFFFF
    return DecodeStep(step.keys.rows(n_packed), step.values.rows(n_packed),
                      tuple(w[..., :n_window, :] for w in step.window), step.query_map, step.output_map)


def quantize(rows: torch.Tensor, form: PackedForm) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (..., T, d) -> codes (..., T, d * bits / 8) uint8 and stats (..., T / token_group, layout.stats) in
    form.layout (T a multiple of its token_group)."""
    form = _calibrated(form.on(rows.device))
    layout = form.layout
    codes, scales = torch.ops.kvq.quantize(rows.reshape(-1, layout.head_dim), form.rotation_input, form.lam,
                                           layout.bits, layout.group_size, layout.scale_dtype, layout.symmetric,
                                           layout.rotation, layout.token_group, form.codebook, layout.scheme,
                                           form.layer_scale)
    lead = rows.shape[:-1]
    return codes.view(*lead, layout.code_bytes), scales.view(*lead[:-1], lead[-1] // layout.token_group, layout.stats)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, form: PackedForm, dtype: torch.dtype) -> torch.Tensor:
    """codes (..., T, d * bits / 8) and stats (..., T / token_group, layout.stats) in form.layout -> rows
    (..., T, d) of `dtype`."""
    form = _calibrated(form.on(codes.device))
    layout = form.layout
    rows = torch.ops.kvq.dequantize(codes.reshape(-1, layout.code_bytes),
                                    scales.reshape(codes[..., 0].numel() // layout.token_group, layout.stats),
                                    form.rotation_input, form.lam, layout.bits, dtype, layout.symmetric,
                                    layout.rotation, layout.token_group, form.codebook, form.layer_scale)
    return rows.view(*codes.shape[:-1], layout.head_dim)


def write_rows(rows: Sequence[torch.Tensor], forms: Sequence[PackedForm], codes: Sequence[torch.Tensor],
               scales: Sequence[torch.Tensor], rings: Sequence[torch.Tensor], length: torch.Tensor,
               after: torch.Tensor | None = None) -> None:
    """Each role's rows (B, H, T, d) quantized in its form (every form of one layout, stats per token) into positions
    length + 0..T-1 of its codes and scales (B, H, capacity, .), the last `window` of them exact into its ring
    (B, H, window, d); `length` a 0-d int64 tensor on the rows' device, so a compiled step writes where the cache's
    count says without a host read. A static cache passes K and V together where they share a layout: on CUDA one
    kernel then writes both. `after`: a tensor the write must follow in a compiled step, unread (a decode step's
    query, so that the write launches just before the step's attention)."""
    forms = [_calibrated(form.on(role_rows.device)) for form, role_rows in zip(forms, rows, strict=True)]
    layout = forms[0].layout
    # checked eagerly only: traced, a layout's fields may be symbolic ints, which dynamo cannot compare as a
    # dataclass's; the static cache groups its roles by layout once, when it is built
    if not torch.compiler.is_compiling() and any(form.layout != layout for form in forms):
        raise ValueError("write_rows takes roles of one layout: write each layout's roles in a call of its own")
    torch.ops.kvq.write_rows(list(rows), [form.rotation_input for form in forms], [form.lam for form in forms],
                             layout.bits, layout.group_size, layout.scale_dtype, layout.symmetric, layout.rotation,
                             [form.codebook for form in forms], layout.scheme, [form.layer_scale for form in forms],
                             list(codes), list(scales), list(rings), length, after)


def _calibrated(form: PackedForm) -> PackedForm:
    if form.layout.layer_scaled and form.layer_scale is None:
        raise ValueError("a layer_scaled layout's codes need its layer scale: take the form from the quantizer's "
                         "calibrated_form")
    return form


def decode_attention(query: torch.Tensor, step: DecodeStep, scale: float, counts: torch.Tensor | None = None,
                     launch: "LaunchConfig | None" = None) -> torch.Tensor:
    """query (B, Hq, d) -> attention output (B, Hq, d) over the step's packed K/V and exact window: all their
    rows, or the leading rows `counts` names (a device tensor holding device_lengths(packed, window), so a
    compiled or captured step reads the lengths without a host sync). `launch` (CUDA, every row): the kernels'
    launch choices instead of the device's table, as benchmarks compare them."""
    if launch is not None:
        from kvq.kernels import decode_attention as attention

        return attention.decode_attention(query, step, scale, launch)
    keys, values = step.keys, step.values
    return torch.ops.kvq.decode_attention(query, step.query_map, keys.codes, keys.scales, values.codes,
                                          values.scales, *step.window, step.output_map, float(scale), keys.bits,
                                          values.bits, keys.symmetric, values.symmetric, keys.token_group,
                                          values.token_group, keys.codebook, values.codebook, keys.float_mantissa,
                                          values.float_mantissa, counts)


def decode_layout_reason(keys: PackedLayout, values: PackedLayout, gqa: int) -> str | None:
    """None where CUDA's fused decode attention reads K and V stored in these layouts, with `gqa` query heads per KV
    head; else why the reference would serve. The kernels' modules are imported here, when asked."""
    from kvq.kernels.decode_attention import layout_reason

    return layout_reason(keys, values, gqa)


def _row_form(quantizer: Quantizer) -> PackedForm | None:
    """The quantizer's packed form where its encode is that layout's arithmetic over every row, scalar codes with
    per-token stats, which a kernel may write (encode and decode take rows through the ops). A quantizer whose
    codes share stats across tokens keeps a write's last, partial group exact (KIVI: its keys' layout spans
    tokens, and its values' residual stays exact too), and codebook codes, whose decode no kernel runs, keep their
    quantizer's own arithmetic."""
    form = quantizer.packed_form()
    plain = form is not None and quantizer.token_group == 1 and not form.layout.codebook
    return form if plain else None


def encode(quantizer: Quantizer, x: torch.Tensor) -> Packed:
    """quantizer.encode(x), through kvq::quantize where the quantizer declares a per-token packed layout."""
    form = _row_form(quantizer)
    if form is None:
        return quantizer.encode(x)
    codes, scales = quantize(x, form)
    return packed_codes(codes, scales, x.shape, x.dtype, form.layout.symmetric)


def metered_encode(quantizer: Quantizer, x: torch.Tensor) -> Packed:
    return quantizer.meter(encode(quantizer, x), x.numel())


def roundtrip(quantizer: Quantizer, x: torch.Tensor) -> torch.Tensor:
    """quantizer(x): quantize-dequantize with the storage metered, through the kernels where the quantizer
    declares a packed layout (what hook and cache mode measure on a GPU)."""
    return decode(quantizer, metered_encode(quantizer, x))


def decode(quantizer: Quantizer, packed: Packed) -> torch.Tensor:
    """quantizer.decode(packed), through kvq::dequantize where the quantizer declares a per-token packed layout."""
    form = _row_form(quantizer)
    if form is None or not isinstance(packed, RotatedPacked):
        return quantizer.decode(packed)
    return dequantize(packed.inner.codes, packed_stats(packed.inner, form.layout.groups), form, packed.dtype)


def kernel_builds() -> dict[str, str]:
    """Per device kind: 'ok' where its kernel build compiles and runs here, else why the reference serves."""
    from kvq.kernels import available

    return available()


def decode_graph() -> "DecodeGraph":
    """A CUDA graph of one cache layer's decode attention (kvq.kernels.decode_graph), built on first use."""
    from kvq.kernels.decode_graph import DecodeGraph

    return DecodeGraph()


def __getattr__(name: str):
    """The kernels' launch choices by name (`ops.LaunchConfig`), imported when asked for: a CPU measurement never
    loads the kernels' modules."""
    if name == "LaunchConfig":
        from kvq.kernels.launch import LaunchConfig

        return LaunchConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DecodeStep", "PackedKV", "copy_rows", "decode", "decode_attention", "decode_graph", "dequantize",
           "device_lengths", "encode", "kernel_builds", "metered_encode", "packed_codes", "packed_read_bytes",
           "quantize", "roundtrip", "write_rows"]
