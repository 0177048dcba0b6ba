"""Fused kernels against the torch reference.

The shared kernel body is compiled for the host with the system C++ compiler and checked against
the reference on CPU; CUDA tests skip without a GPU; the Metal translation unit (which cannot run
here) is at least checked to parse as C++ with Metal's keywords stubbed, so every build compiles the
same body.
"""

import ctypes
import logging
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, random_packed, requires_cuda

from kvq import ops
from kvq.apply import KVGeometry, QuantizerBank
from kvq.cache import DomainMaps
from kvq.kernels import cuda_decode
from kvq.kernels.backends import KernelBackend
from kvq.kernels.decode_attention import decode_attention_gpu
from kvq.kernels.decode_attention import unsupported_reason as step_unsupported_reason
from kvq.kernels.launch import LaunchConfig, resident_programs, split_counts
from kvq.kernels.plan import kernel_constants, kernel_defines, unsupported_reason
from kvq.kernels.source import kernel_text, translation_unit
from kvq.kernels.stats import packed_codes
from kvq.kernels.step import DecodeStep, decode_attention_reference
from kvq.quant import QuantSpec
from kvq.quant.codebooks import NORM_FLOOR, decode_unit_vector, lloyd_max_gaussian, midpoints, nearest_level
from kvq.quant.kivi import KIVI
from kvq.quant.layout import PackedLayout
from kvq.quant.packing import unpack
from kvq.quant.rotated import RotatedQuantizer
from kvq.quant.scalar import ScalarQuantizer
from kvq.rotations import SRFT, SRHT, Composed, Identity, MatrixRotation

ROTATIONS = {"identity": Identity, "srht": SRHT, "srft": SRFT}
TIE_WINDOW = 1e-3  # |frac(y / scale)| this close to 0.5 counts as a rounding tie
MIDPOINT_WINDOW = 1e-5  # a rotated unit vector's coordinate this close to a codebook midpoint counts as a tie
ROTATION_ULPS = 8  # float32 ulps of a vector's largest coordinate that two builds' rotations may differ by


def quantizer(rotation="srft", d=128, bits=4, granularity="per_token", group=32, lam=False, seed=0,
              scales="float32", symmetric=True):
    lam_vector = torch.rand(d, generator=torch.Generator().manual_seed(seed)) + 0.25 if lam else None
    inner = ScalarQuantizer(bits, granularity, group, symmetric, scale_dtype=scales)
    return RotatedQuantizer(ROTATIONS[rotation](d, seed), inner, lam_vector)


def layout(q: RotatedQuantizer):
    return q.packed_form().layout


def test_layouts_cover_the_papers_kernels_and_name_the_rest():
    g32 = layout(quantizer("srft", 128, 4, "per_group", 32, lam=True))
    assert (g32.head_dim, g32.bits, g32.group_size, g32.rotation, g32.groups, g32.code_bytes) == (
        128, 4, 32, "srft", 4, 64)
    assert unsupported_reason(g32) is None
    assert layout(quantizer("srht", 64, 8)).group_size == 64
    learned = RotatedQuantizer(Composed(SRFT(64), MatrixRotation(torch.eye(64))), ScalarQuantizer(4))
    assert layout(learned).rotation == "matrix" and "learned" in unsupported_reason(layout(learned))
    assert quantizer(granularity="per_channel").packed_form() is None
    assert "per_channel" in quantizer(granularity="per_channel").packing_reason()
    assert unsupported_reason(layout(quantizer(bits=3))) is None
    assert "2-, 3-, 4- or 8-bit codes" in unsupported_reason(layout(quantizer(bits=5)))
    assert "whole 32-bit words" in unsupported_reason(layout(quantizer("srft", 8, 3)))
    assert "power-of-two group" in unsupported_reason(layout(quantizer(granularity="per_group", group=24)))
    assert "head_dim" in unsupported_reason(layout(quantizer("srft", 96)))
    assert layout(quantizer(scales="float16")).scale_dtype == torch.float16
    assert dict(kernel_defines(layout(quantizer(scales="float16"))))["KVQ_SCALE_HALF"] == 1
    assert "float32 or float16 scales" in unsupported_reason(layout(quantizer(scales="bfloat16")))


@pytest.mark.parametrize("d, group, q_heads, window_dtype, scales, fits", [
    (128, 32, 32, torch.float16, (torch.float32, torch.float32), True),  # Llama-3-8B's
    (128, 32, 8, torch.float16, (torch.float32, torch.float32), True),  # one query head per KV head
    (64, 32, 16, torch.float16, (torch.float32, torch.float32), False),  # head_dim 64: layouts are for 128
    (128, 128, 32, torch.float16, (torch.float32, torch.float32), False),  # per-token scales
    (128, 32, 56, torch.float16, (torch.float32, torch.float32), False),  # 7 query heads per KV head
    (128, 32, 32, torch.float32, (torch.float32, torch.float32), False),  # window dtype is not the query's
    (128, 32, 32, torch.float16, (torch.float16, torch.float16), True),  # fp16 scales
    (128, 32, 32, torch.float16, (torch.float16, torch.float32), False),  # K and V scales differ
    (128, 32, 32, torch.float16, (torch.bfloat16, torch.bfloat16), False),
])
def test_cuda_partial_kernel_takes_the_shapes_it_is_written_for(d, group, q_heads, window_dtype, scales, fits,
                                                                monkeypatch):
    monkeypatch.setattr(cuda_decode, "properties", lambda device: SimpleNamespace(major=9))  # sm_90
    keys, values = (random_packed(1, 8, 4, d, 4, group, "cpu", scale_dtype=dtype) for dtype in scales)
    query = torch.zeros(1, q_heads, d, dtype=torch.float16)
    window = torch.zeros(1, 8, 2, d, dtype=window_dtype)
    assert cuda_decode.partial_fits(query, keys, values, (window, window)) == fits


@pytest.mark.parametrize("key_form, value_form, fits", [
    # (bits, symmetric, token_group) of K and of V
    ((4, True, 1), (4, True, 1), True),
    ((4, False, 1), (4, False, 1), True),  # unsigned codes with offsets on both sides
    ((8, False, 1), (4, False, 1), True),
    ((4, False, 1), (4, True, 1), False),  # on one side only: the Triton partial
    ((4, True, 1), (4, False, 1), False),
    ((4, False, 32), (4, False, 1), True),  # KIVI-4: keys per channel over 32-token groups
    ((4, False, 16), (4, False, 1), True),
    ((4, False, 128), (4, False, 1), True),
    ((2, False, 32), (2, False, 1), True),  # KIVI-2: 2-bit codes widened as they are read
    ((3, False, 1), (3, False, 1), True),
    ((2, False, 1), (4, False, 1), True),
    ((2, True, 1), (2, True, 1), False),  # narrow two's complement codes: the Triton partial
    ((4, True, 1), (3, True, 1), False),
    ((8, False, 32), (4, False, 1), False),  # int8 keys per channel
    ((4, False, 32), (4, True, 1), False),  # symmetric values behind KIVI's keys
])
@pytest.mark.parametrize("scales", [torch.float16, torch.float32])
def test_cuda_partial_kernel_takes_offsets_on_both_sides_or_on_neither(key_form, value_form, fits, scales,
                                                                        monkeypatch):
    """KIVI's keys fit with fp16 stats only, as KIVI stores them."""
    monkeypatch.setattr(cuda_decode, "properties", lambda device: SimpleNamespace(major=9))
    keys, values = (random_packed(1, 8, 64, 128, bits, 32, "cpu", scale_dtype=scales, symmetric=symmetric,
                                  token_group=token_group) for bits, symmetric, token_group in (key_form, value_form))
    query = torch.zeros(1, 32, 128, dtype=torch.float16)
    window = torch.zeros(1, 8, 2, 128, dtype=torch.float16)
    assert cuda_decode.partial_fits(query, keys, values, (window, window)) == (
        fits and (key_form[2] == 1 or scales == torch.float16))


@pytest.mark.parametrize("key_bits, value_bits, group, tokens, q_heads, scales, fits", [
    (4, 4, 128, 64, 32, torch.float16, True),  # TurboQuant_mse-4: a norm per token
    (4, 4, 128, 60, 32, torch.float16, False),  # rows of norms that do not start 16-byte aligned per head
    (4, 4, 32, 60, 32, torch.float16, True),  # a scale per 32 coordinates (iq4_nl's blocks): rows of 8 bytes
    (4, 4, 128, 64, 40, torch.float16, False),  # 5 query heads per KV head
    (4, 4, 128, 64, 32, torch.float32, False),  # codebook scales are fp16
    (3, 3, 128, 64, 32, torch.float16, True),  # 3-bit codes (TurboQuant_mse-3), widened as they are read
    (4, 3, 128, 64, 32, torch.float16, True),
    (2, 2, 128, 64, 32, torch.float16, True),
    (4, None, 128, 64, 32, torch.float16, False),  # codebook keys beside int4 values
])
def test_cuda_partial_kernel_takes_2_to_4_bit_codebook_codes(key_bits, value_bits, group, tokens, q_heads, scales, fits,
                                                       monkeypatch):
    monkeypatch.setattr(cuda_decode, "properties", lambda device: SimpleNamespace(major=9))
    keys, values = (random_packed(1, 8, tokens, 128, bits or 4, group if bits else 32, "cpu", scale_dtype=scales,
                                  codebook=lloyd_max_gaussian(bits) / 128 ** 0.5 if bits else None)
                    for bits in (key_bits, value_bits))
    query = torch.zeros(1, q_heads, 128, dtype=torch.float16)
    window = torch.zeros(1, 8, 2, 128, dtype=torch.float16)
    assert cuda_decode.partial_fits(query, keys, values, (window, window)) == fits
    assert cuda_decode.token_scales(keys) == (group == 128)


@pytest.mark.parametrize("major, builds", [(7, False), (8, True), (9, True)])
def test_cuda_kernels_serve_from_sm_80_on(major, builds, monkeypatch):
    """csrc/decode_attention.cu's mma.sync m16n8k16 and cp.async need sm_80: Triton serves older GPUs."""
    monkeypatch.setattr(cuda_decode, "properties", lambda device: SimpleNamespace(major=major))
    keys, values = (random_packed(1, 8, 4, 128, 4, 32, "cpu") for _ in range(2))
    query = torch.zeros(1, 32, 128, dtype=torch.float16)
    window = torch.zeros(1, 8, 2, 128, dtype=torch.float16)
    assert cuda_decode.partial_fits(query, keys, values, (window, window)) == builds
    assert cuda_decode.reduce_fits(query) == builds
    assert not cuda_decode.reduce_fits(torch.zeros(1, 32, 64, dtype=torch.float16))  # KVQ_D is 128


@pytest.mark.parametrize("programs", [396, 528])  # 132 SMs x 3 (CUDA partial) or 4 programs
@pytest.mark.parametrize("heads", [1, 5, 7, 8, 24, 40, 600])
@pytest.mark.parametrize("tokens", [1, 63, 4096, 32768, 131075])
def test_split_plan_stays_within_the_programs_the_sms_hold(heads, tokens, programs):
    """No packed split may wait for another to end (7 or 40 (batch, KV head) pairs once asked for 532 and 560
    of 528 programs), and every token lies in one split."""
    splits, per_split = split_counts(tokens, heads, programs, 64)
    assert per_split % 64 == 0 and (splits - 1) * per_split < tokens <= splits * per_split
    assert splits * heads <= max(programs, heads)


def test_fragment_order_is_the_transposed_map_as_mma_reads_its_a_operand():
    """Lane (r, c) of m16n8k16 holds A rows r, r + 8 (registers 0/1, 2/3) at columns 2c, 2c + 1 (registers 0, 1)
    and 2c + 8, 2c + 9 (2, 3): rebuilding A from the lanes' registers must give the map's transpose in fp16."""
    matrix = torch.randn(128, 128, generator=torch.Generator().manual_seed(0))
    fragments = cuda_decode.fragment_order(matrix)
    assert fragments.shape == (8, 8, 32, 4, 2) and fragments.dtype == torch.float16
    rebuilt = torch.empty(128, 128, dtype=torch.float16)
    for lane in range(32):
        r, c = divmod(lane, 4)
        for register in range(4):
            row, column = r + 8 * (register % 2), 2 * c + 8 * (register // 2)
            for tile in range(8):
                for step in range(8):
                    pair = fragments[tile, step, lane, register]
                    rebuilt[16 * tile + row, 16 * step + column:16 * step + column + 2] = pair
    assert torch.equal(rebuilt, matrix.T.to(torch.float16))
    assert cuda_decode.fragment_order(matrix) is fragments  # kept while the map lives unchanged
    matrix.mul_(2)  # modified in place: built again
    assert torch.equal(cuda_decode.fragment_order(matrix), 2 * fragments)


@pytest.mark.parametrize("registers, shared, warps, expected", [
    (255, 22528, 2, 4),  # 8192 registers per warp (256-register granules): 4 x 2 warps fill 65536
    (167, 43008, 2, 5),  # registers would allow 6; shared memory, 43008 + 1024 reserved each, allows 5
    (32, 0, 4, 16),  # 2048 threads per SM, 128 per program
])
def test_resident_programs_follow_an_h100_sms_limits(registers, shared, warps, expected):
    """The decode attention splits its sequence into exactly as many programs as fit at once."""
    assert resident_programs(registers, shared, warps, shared_per_sm=233472, threads_per_sm=2048) == expected


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "asymmetric"])
@pytest.mark.parametrize("rotation", ["identity", "srht", "srft"])
@pytest.mark.parametrize("granularity, bits", [("per_token", 4), ("per_group", 4), ("per_group", 2), ("per_group", 3),
                                               ("per_group", 8)])
def test_cpu_ops_are_the_quantizers_own_arithmetic(rotation, granularity, bits, symmetric):
    q = quantizer(rotation, 64, bits, granularity, 16, lam=True, scales="float16", symmetric=symmetric)
    assert q.packed_form().layout.stats == (1 if granularity == "per_token" else 4) * (1 if symmetric else 2)
    x = torch.randn(2, 3, 10, 64)
    packed, expected = ops.encode(q, x), q.encode(x)
    assert torch.equal(packed.inner.codes, expected.inner.codes)
    assert torch.equal(packed.inner.scale.reshape(expected.inner.scale.shape), expected.inner.scale)
    if symmetric:
        assert packed.inner.offset is None and expected.inner.offset is None
    else:
        assert torch.equal(packed.inner.offset.reshape(expected.inner.offset.shape), expected.inner.offset)
    assert torch.equal(ops.decode(q, packed), q.decode(expected))
    assert packed.storage_bits() == expected.storage_bits()


def test_learned_rotations_take_the_reference_through_their_matrix():
    learned = RotatedQuantizer(Composed(SRFT(64, 1), MatrixRotation(torch.linalg.qr(torch.randn(64, 64))[0])),
                               ScalarQuantizer(4, "per_group", 32))
    x = torch.randn(5, 64)
    torch.testing.assert_close(ops.decode(learned, ops.encode(learned, x)), learned(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["symmetric", "asymmetric", "kivi", "codebook", "mx", "nvfp4", "fp8", "ggml"])
def test_ops_are_custom_ops_that_compile_without_graph_breaks(layout):
    """Per-token codes (signed, or unsigned with offsets), KIVI's (keys per channel over 16-token groups),
    TurboQuant_mse's codebook codes, MXFP4's (a float format's codes, E8M0 scales), NVFP4's (E4M3 scales under a layer
    scale), FP8's under a layer scale (no stats), and llama.cpp's q4_0 blocks after its Hadamard rotation (ggml's
    arithmetic)."""
    token_group = 16 if layout == "kivi" else 1
    if layout == "kivi":
        form = KIVI("k", 4, token_group, 64).packed_form()
    elif layout in ("codebook", "mx", "nvfp4", "fp8"):
        spec = {"codebook": QuantSpec("turbo", 4), "mx": QuantSpec("mx"), "nvfp4": QuantSpec("nvfp4"),
                "fp8": QuantSpec("fp8", options={"scale": "tensor"})}[layout]
        form = QuantizerBank(spec, KVGeometry(1, 2, 64)).get(0, "k").calibrated_form(torch.randn(1, 2, 9, 64))
    elif layout == "ggml":
        bank = QuantizerBank(QuantSpec("ggml", options={"type": "q4_0"}), KVGeometry(1, 2, 64))
        form = bank.get(0, "k").packed_form()
    else:
        form = quantizer("srft", 64, 4, "per_group", 16, lam=True, symmetric=layout == "symmetric").packed_form()
    layout, symmetric = form.layout, form.layout.symmetric
    rows = torch.randn(2 * token_group, 64)
    codes, scales = ops.quantize(rows, form)
    torch.library.opcheck(torch.ops.kvq.quantize.default, (rows, form.rotation_input, form.lam, layout.bits,
                                                           layout.group_size, layout.scale_dtype, symmetric,
                                                           layout.rotation, token_group, form.codebook, layout.scheme,
                                                           form.layer_scale))
    # torch's schema check compares inputs before and after with allclose, which float8 (NVFP4's E4M3 stats) lacks
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic",
              *(("test_schema",) if scales.dtype != torch.float8_e4m3fn else ()))
    torch.library.opcheck(torch.ops.kvq.dequantize.default, (codes, scales, form.rotation_input, form.lam, layout.bits,
                                                             torch.float32, symmetric, layout.rotation, token_group,
                                                             form.codebook, form.layer_scale), test_utils=checks)
    if layout.codebook:
        keys, values = (ops.PackedKV.holding(*ops.quantize(torch.randn(1, 2, 9, 64), form), form) for _ in range(2))
    else:
        keys = random_packed(1, 2, 9, 64, 4, 16, "cpu", symmetric=symmetric, token_group=token_group)
        values = random_packed(1, 2, 9 if token_group == 1 else 16, 64, 4, 16, "cpu", symmetric=symmetric).rows(9)
    window = torch.randn(1, 2, 3, 64)
    step = DecodeStep(keys, values, (window, window), form.matrix.T, form.matrix)
    query = torch.randn(1, 4, 64)

    def round_trip_and_attend(rows, query):
        codes, scales = ops.quantize(rows, form)
        return ops.dequantize(codes, scales, form, torch.float32), ops.decode_attention(query, step, 0.125)

    compiled = torch.compile(round_trip_and_attend, fullgraph=True, backend="eager")
    for got, want in zip(compiled(rows, query), round_trip_and_attend(rows, query), strict=True):
        assert torch.equal(got, want)
    torch.testing.assert_close(ops.decode_attention(query, step, 0.125),
                               decode_attention_reference(query, step, 0.125), atol=0, rtol=0)


class _MetalStub:
    """Just enough of metal_stdlib for a C++ compiler to parse the Metal translation unit."""

    HEADER = """
#define kernel
#define device
#define thread
typedef unsigned int uint; typedef unsigned char uchar; typedef unsigned long ulong;
typedef float half; typedef float bfloat;
struct uint4 { uint x, y, z, w; };
struct half2 { float v[2]; half2(float a, float b) : v{a, b} {} float operator[](int i) const { return v[i]; } };
struct bfloat2 { float v[2]; bfloat2(float a, float b) : v{a, b} {} };
namespace metal {
template <typename T, typename U> T as_type(U);
inline float max(float a, float b) { return a > b ? a : b; }
inline float min(float a, float b) { return a < b ? a : b; }
inline float fabs(float x) { return x < 0 ? -x : x; }
inline float fma(float a, float b, float c) { return a * b + c; }
namespace precise { float sqrt(float); }
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to parse the Metal source")
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "asymmetric"])
@pytest.mark.parametrize("rotation", ["identity", "srht", "srft"])
@pytest.mark.parametrize("in_dtype, out_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.float16)])
def test_metal_translation_unit_parses_with_the_shared_body(tmp_path, rotation, in_dtype, out_dtype, symmetric):
    (tmp_path / "metal_stdlib").write_text(_MetalStub.HEADER)
    defines = dict(kernel_defines(layout(quantizer(rotation, 128, 4, "per_group", 32, symmetric=symmetric))))
    source = translation_unit("metal", defines, in_dtype, out_dtype)
    assert kernel_text("quant_body.h") in source
    unit = tmp_path / "unit.cpp"
    unit.write_text(source)
    result = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-Wno-attributes", "-Wno-unknown-pragmas", "-I",
                             str(tmp_path), str(unit)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def _pre_round(q: RotatedQuantizer, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's y / scale before rounding, per coordinate; `scale` (..., groups, 1): divide by these
    instead of the reference's own."""
    y = q.rotation.forward(x.float())
    if q.lam is not None:
        y = y * q.packed_form().on(x.device).lam
    if scale is None:
        scale = q.inner.encode(y).scale
    scale = scale.float().expand(*scale.shape[:-1], y.shape[-1] // scale.shape[-2])
    return y / scale.reshape(y.shape)


CASES = [
    ("srft", 64, 4, "per_token", 32, False, torch.float32, 4096, "float32"),
    # 2- and 3-bit codes (3-bit ones span bytes and words)
    ("srft", 128, 2, "per_group", 32, False, torch.float32, 1000, "float32"),
    ("srht", 64, 3, "per_token", 64, True, torch.float16, 517, "float16"),
    ("identity", 128, 3, "per_group", 16, False, torch.float32, 300, "float32"),
    ("srft", 256, 2, "per_token", 256, False, torch.bfloat16, 129, "float16"),
    ("srft", 128, 4, "per_group", 32, True, torch.float16, 262144 // 64, "float32"),
    ("srft", 256, 8, "per_group", 2, False, torch.bfloat16, 777, "float32"),
    ("srht", 128, 8, "per_token", 32, True, torch.float32, 1000, "float32"),
    ("srht", 64, 4, "per_group", 16, False, torch.float16, 3, "float32"),
    ("identity", 128, 4, "per_group", 64, True, torch.float32, 513, "float32"),
    ("srft", 512, 4, "per_group", 128, False, torch.float32, 65, "float32"),
    ("srft", 8, 4, "per_token", 32, False, torch.float32, 100, "float32"),
    # the bench's shape (`kvq bench kernels`), a few vectors more: a partial last block after five waves
    ("srft", 128, 4, "per_token", 128, False, torch.float16, 262144 + 77, "float32"),
    # fp16 scales (ScalarQuantizer's scale_dtype float16)
    ("srft", 128, 4, "per_group", 32, True, torch.float16, 262144 // 16, "float16"),
    ("srht", 64, 8, "per_token", 32, False, torch.bfloat16, 1000, "float16"),
    ("identity", 128, 4, "per_group", 16, True, torch.float32, 513, "float16"),
]


def _assert_asymmetric_matches_reference(q: RotatedQuantizer, x: torch.Tensor, codes: torch.Tensor,
                                         stats: torch.Tensor, label: str) -> None:
    """Unsigned codes and per-group scales then offsets (stats (n, 2 groups)): each statistic within 1e-6 of its
    vector's largest magnitude of the reference's (float32), or one fp16 step of the reference's own (fp16); the
    codes the reference's rounding of (y - offset) / scale with the kernel's statistics, but at round-half ties
    (counted)."""
    expected = q.encode(x).inner
    scale, offset = (stat.unsqueeze(-1) for stat in stats.chunk(2, dim=-1))
    assert stats.dtype == expected.scale.dtype == q.inner.scale_dtype
    for got, want in ((scale, expected.scale), (offset, expected.offset)):
        assert got.shape == want.shape
        if got.dtype == torch.float32:
            vector_max = (expected.offset.abs() + expected.scale * q.inner.qmax).amax(dim=(-2, -1), keepdim=True)
            assert ((got - want).abs() <= 1e-6 * vector_max).all()
        else:
            step = torch.maximum(want.float().abs() * 2.0 ** -10, torch.tensor(2.0 ** -24))
            assert ((got.float() - want.float()).abs() <= step).all()
    bits, d = q.inner.bits, x.shape[-1]
    y = q.rotation.forward(x.float())
    if q.lam is not None:
        y = y * q.packed_form().on(x.device).lam
    groups = scale.shape[-2]
    pre_round = ((y.reshape(*y.shape[:-1], groups, -1) - offset.float()) / scale.float()).reshape(y.shape)
    ref_codes = torch.round(pre_round).clamp(0, q.inner.qmax).to(torch.int16)
    codes = unpack(codes, bits, d, signed=False)
    differ = codes != ref_codes
    # A rotated coordinate is reproducible to a few float32 ulps of its vector's largest between a build that fuses
    # multiply-adds (CUDA, an aarch64 host) and torch's; over a group whose span is tiny, that moves its code by
    # those ulps over the group's scale, and the tie window widens by as much.
    ulps = ROTATION_ULPS * torch.finfo(torch.float32).eps * y.abs().amax(-1, keepdim=True)
    drift = (ulps.unsqueeze(-1) / scale.float()).expand(*scale.shape[:-1], d // groups).reshape(y.shape)
    ties = (pre_round.abs().frac() - 0.5).abs() < TIE_WINDOW + drift
    print(f"{label}: {int(differ.sum())} of {differ.numel()} codes differ, all at round-half ties "
          f"({int((differ & (drift > 0.5)).sum())} in groups whose span is within rotation rounding)")
    assert not (differ & ~ties).any()
    assert (codes - ref_codes)[drift <= 0.5].abs().max() <= 1


def _assert_matches_reference(q: RotatedQuantizer, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                              label: str) -> None:
    """Codes equal the reference's except at round-half ties (counted); float32 scales within 1e-6, fp16 scales
    equal, or one fp16 step off where the two float32 scales round to either side of a step (counted), and
    there the codes are the reference's rounding with the kernel's scale."""
    expected = q.encode(x)
    ref_scale = expected.inner.scale
    assert scale.shape == ref_scale.shape and scale.dtype == ref_scale.dtype == q.inner.scale_dtype
    bits, d = q.inner.bits, x.shape[-1]
    codes, ref_codes = unpack(codes, bits, d, signed=True), unpack(expected.inner.codes, bits, d, signed=True)
    # Rotation arithmetic errs by ~1e-7 of a vector's norm, so a scale is compared relative to the largest
    # scale of its vector: exactly 1e-6 relative for per-token scales, and fair to tiny groups.
    vector_max = ref_scale.float().amax(dim=(-2, -1), keepdim=True)
    if scale.dtype == torch.float32:
        assert ((scale - ref_scale).abs() <= 1e-6 * vector_max).all()
        pre_round = _pre_round(q, x)
    else:
        step = torch.maximum(ref_scale.float().abs() * 2.0 ** -10, torch.tensor(2.0 ** -24))  # one fp16 ulp, at most
        moved = scale != ref_scale
        assert ((scale.float() - ref_scale.float()).abs() <= step).all()
        pre_round = _pre_round(q, x, scale)
        recomputed = torch.round(pre_round).clamp(-q.inner.qmax, q.inner.qmax).to(ref_codes.dtype)
        in_moved_group = moved.expand(*moved.shape[:-1], d // moved.shape[-2]).reshape(ref_codes.shape)
        ref_codes = torch.where(in_moved_group, recomputed, ref_codes)
        print(f"{label}: {int(moved.sum())} of {moved.numel()} fp16 scales one step from the reference's")
    differ = codes != ref_codes
    ties = (pre_round.abs().frac() - 0.5).abs() < TIE_WINDOW
    print(f"{label}: {int(differ.sum())} of {differ.numel()} codes differ, all at round-half ties")
    assert not (differ & ~ties).any()
    assert (codes - ref_codes).abs().max() <= 1


def _case(rotation, d, bits, granularity, group, lam, dtype, n, scales, device, symmetric=True):
    q = quantizer(rotation, d, bits, granularity, group, lam, seed=n, scales=scales, symmetric=symmetric)
    x = (torch.randn(n, d, generator=torch.Generator().manual_seed(n)) * 3).to(device, dtype)
    codes = f"int{bits}" if symmetric else f"uint{bits} with offsets"
    return q, x, f"{rotation} d={d} {codes} {granularity} g={group} lam={lam} {dtype} {scales} scales"


def _assert_stats_match_reference(q: RotatedQuantizer, x: torch.Tensor, codes: torch.Tensor, stats: torch.Tensor,
                                  label: str) -> None:
    """stats: (n, groups) scales, or scales then offsets for asymmetric codes."""
    if q.inner.symmetric:
        _assert_matches_reference(q, x, codes, stats.unsqueeze(-1), label)
    else:
        _assert_asymmetric_matches_reference(q, x, codes, stats, label)


class _HostBackend(KernelBackend):
    """The shared body compiled for this CPU (float32 in and out) with g++ on a layout's first launch, as the
    device backends build theirs, called through ctypes; `launches` counts the calls."""

    name = "host"

    def __init__(self, directory):
        self.directory, self.libraries, self.launches = directory, {}, 0

    def _launch(self, packed_layout, name, dtypes, n, args) -> None:
        defines = kernel_defines(packed_layout)
        if defines not in self.libraries:
            stem = self.directory / f"kvq_host_{len(self.libraries)}"
            stem.with_suffix(".cpp").write_text(translation_unit("host", dict(defines), torch.float32, torch.float32))
            subprocess.run(["g++", "-O2", "-shared", "-fPIC", "-o", str(stem.with_suffix(".so")),
                            str(stem.with_suffix(".cpp"))], check=True)
            self.libraries[defines] = ctypes.CDLL(str(stem.with_suffix(".so")))
        self.launches += 1
        getattr(self.libraries[defines], name)(*(ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor)
                                                 else ctypes.c_uint(a) for a in [*args, n]))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the kernel body for the host")
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "asymmetric"])
@pytest.mark.parametrize("rotation, d, bits, granularity, group, lam, dtype, n, scales", CASES)
def test_host_build_of_the_kernel_body_equals_reference(tmp_path, rotation, d, bits, granularity, group, lam, dtype,
                                                        n, scales, symmetric):
    q, x, label = _case(rotation, d, bits, granularity, group, lam, torch.float32, min(n, 2048), scales, "cpu",
                        symmetric)
    form = q.packed_form()
    backend = _HostBackend(tmp_path)
    constants = kernel_constants(form.signs, form.lam)
    codes, stats = backend.quantize(form.layout, constants, x)
    _assert_stats_match_reference(q, x, codes, stats, "host " + label)
    decoded = backend.dequantize(form.layout, constants, codes, stats, torch.float32)
    packed = packed_codes(codes, stats, x.shape, torch.float32, symmetric)
    torch.testing.assert_close(decoded, q.decode(packed), atol=1e-5 * x.abs().max(), rtol=0)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "asymmetric"])
@pytest.mark.parametrize("rotation, d, bits, granularity, group, lam, dtype, n, scales", CASES)
def test_cuda_quantize_kernel_equals_reference(rotation, d, bits, granularity, group, lam, dtype, n, scales,
                                               symmetric):
    q, x, label = _case(rotation, d, bits, granularity, group, lam, dtype, n, scales, "cuda", symmetric)
    codes, stats = ops.quantize(x, q.packed_form())
    assert unsupported_reason(layout(q)) is None
    _assert_stats_match_reference(q, x, codes, stats, label)
    packed = ops.encode(q, x)
    # the inverse kernel reconstructs what the reference decode gives from the same packing
    out = ops.decode(q, packed)
    assert out.dtype == dtype and out.shape == x.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), q.decode(packed).float(), atol=tolerance * x.float().abs().max(), rtol=0)


def _assert_codebook_codes_match_reference(turbo, x: torch.Tensor, codes: torch.Tensor, norms: torch.Tensor,
                                           label: str) -> None:
    """A kernel's TurboQuant_mse codes (packed) and fp16 norms against TurboQuant's own encode of x: norms equal, or
    one fp16 step off where the two float32 norms round to either side of a step (counted), and there the codes
    are the reference's with the kernel's norm; codes equal but for coordinates of the rotated unit vector within
    MIDPOINT_WINDOW of a midpoint between levels (counted), and there one level apart."""
    levels = turbo.packed_form().codebook.to(x.device)
    reference = turbo.encode(x)
    ref_norm = reference.norm
    assert norms.shape == ref_norm.shape and norms.dtype == ref_norm.dtype == torch.float16
    moved = norms != ref_norm
    assert ((norms.float() - ref_norm.float()).abs() <= ref_norm.float().abs() * 2.0 ** -10).all()
    unit = turbo.rotation.forward(x.float() / norms.float().clamp_min(NORM_FLOOR))
    ref_codes = torch.where(moved, nearest_level(unit, levels), unpack(reference.codes, turbo.mse_bits, x.shape[-1],
                                                                       signed=False))
    kernel_codes = unpack(codes, turbo.mse_bits, x.shape[-1], signed=False)
    differ = kernel_codes != ref_codes
    near = (unit[..., None] - midpoints(levels)).abs().amin(-1) < MIDPOINT_WINDOW
    print(f"{label}: {int(moved.sum())} of {moved.numel()} norms one fp16 step from the reference's, "
          f"{int(differ.sum())} of {differ.numel()} codes differ, all at midpoints")
    assert not (differ & ~near).any()
    assert (kernel_codes - ref_codes).abs().max() <= 1


TURBO_CASES = [("srft", 128, 4, 3001), ("srft", 128, 3, 777), ("srft", 64, 2, 500), ("srht", 128, 4, 300),
               ("identity", 256, 3, 200), ("srft", 32, 3, 100), ("srft", 256, 2, 65)]


def _turbo(rotation: str, d: int, bits: int, n: int):
    turbo = QuantizerBank(QuantSpec("turbo", bits, options={"rotation": rotation}), KVGeometry(1, 1, d)).get(0, "k")
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(n)) * 3
    x[0] = 0  # a zero vector: its norm floored before it divides
    return turbo, x, f"turbo {rotation} d={d} {bits}-bit"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the kernel body for the host")
@pytest.mark.parametrize("rotation, d, bits, n", TURBO_CASES)
def test_host_build_writes_and_reads_turboquants_codes_as_its_own_arithmetic(tmp_path, rotation, d, bits, n):
    """The shared kernel body's codebook build (the CUDA and Metal builds' body) against TurboQuant_mse's own
    encode (Alg. 1), its decode against TurboQuant's decode of the same codes and norms."""
    turbo, x, label = _turbo(rotation, d, bits, n)
    form = turbo.packed_form()
    assert unsupported_reason(form.layout) is None
    backend = _HostBackend(tmp_path)
    constants = kernel_constants(form.signs, form.lam, form.codebook)
    codes, norms = backend.quantize(form.layout, constants, x)
    _assert_codebook_codes_match_reference(turbo, x, codes, norms.view(n, 1), "host " + label)
    decoded = backend.dequantize(form.layout, constants, codes, norms, torch.float32)
    expected = decode_unit_vector(unpack(codes, bits, d, signed=False), norms.view(n, 1), turbo.rotation,
                                  form.codebook)
    torch.testing.assert_close(decoded, expected, atol=1e-6 * x.abs().max(), rtol=0)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the kernel body for the host")
def test_on_an_accelerator_the_ops_write_turboquants_codes_with_its_build_and_others_with_the_reference(tmp_path,
                                                                                                      monkeypatch):
    """kvq.ops' quantize and dequantize on an accelerator (kvq.kernels.dispatch), the host build standing in for the
    device's: TurboQuant_mse's codes after the SRFT go to the kernel body, a Haar rotation's (no kernel) to the
    reference, and both equal TurboQuant's own arithmetic."""
    from kvq.kernels import dispatch

    host = _HostBackend(tmp_path)
    monkeypatch.setattr(dispatch, "backend_for", lambda device: host)
    for rotation, launches in (("srft", 2), ("haar", 0)):
        turbo, x, label = _turbo(rotation, 64, 3, 40)
        form, host.launches = turbo.packed_form(), 0
        codes, norms = dispatch.kernel_quantize(x, form.rotation_input, form.lam, form.layout, form.codebook, None)
        _assert_codebook_codes_match_reference(turbo, x, codes, norms, "dispatch " + label)
        decoded = dispatch.kernel_dequantize(codes, norms, form.rotation_input, form.lam, form.layout, torch.float32,
                                             form.codebook, None)
        expected = decode_unit_vector(unpack(codes, 3, 64, signed=False), norms, turbo.rotation, form.codebook)
        torch.testing.assert_close(decoded, expected, atol=1e-6 * x.abs().max(), rtol=0)
        assert host.launches == launches


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rotation, d, bits, n", [*TURBO_CASES, ("srft", 128, 4, 262144 + 77)])
def test_cuda_kernel_writes_and_reads_turboquants_codes_as_its_own_arithmetic(rotation, d, bits, n):
    turbo, x, label = _turbo(rotation, d, bits, n)
    x = x.cuda()
    form = turbo.packed_form()
    codes, norms = ops.quantize(x, form)
    _assert_codebook_codes_match_reference(turbo, x, codes, norms, "cuda " + label)
    expected = decode_unit_vector(unpack(codes, bits, d, signed=False), norms, turbo.rotation,
                                  form.codebook.cuda())
    torch.testing.assert_close(ops.dequantize(codes, norms, form, torch.float32), expected,
                               atol=1e-6 * x.abs().max(), rtol=0)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("partial", ["cuda", "triton"])
@pytest.mark.parametrize("batch, q_heads, kv_heads, d, tokens, window, key_bits, value_bits, group, dtype, scales", [
    (1, 32, 8, 128, 8192, 5, 4, 4, 32, torch.float32, torch.float32),
    (1, 32, 8, 128, 32768, 8, 4, 4, 32, torch.float16, torch.float32),  # `kvq bench kernels`' 32K step
    (2, 8, 8, 64, 100, 0, 4, 4, 64, torch.float32, torch.float32),
    (1, 4, 1, 256, 3000, 15, 8, 8, 256, torch.float32, torch.float32),
    (1, 14, 2, 64, 1, 1, 4, 4, 32, torch.float32, torch.float32),
    (3, 9, 3, 64, 517, 16, 4, 4, 16, torch.float32, torch.float32),
    # shapes of kernels/decode_attention.cu: 1-4 query heads per KV head, ragged tiles, empty window
    (2, 16, 4, 128, 3001, 16, 4, 4, 32, torch.float16, torch.float32),
    (1, 12, 4, 128, 777, 0, 4, 4, 32, torch.bfloat16, torch.float32),
    (1, 8, 8, 128, 70, 3, 4, 4, 32, torch.float16, torch.float32),
    (1, 4, 2, 128, 1, 16, 4, 4, 32, torch.float32, torch.float32),
    # fp16 scales (ScalarQuantizer's scale_dtype float16)
    (1, 32, 8, 128, 32768, 8, 4, 4, 32, torch.float16, torch.float16),
    (2, 16, 4, 128, 3001, 16, 4, 4, 32, torch.float16, torch.float16),
    (3, 9, 3, 64, 517, 16, 4, 4, 16, torch.float32, torch.float16),
    # K and V codes of two widths (a K8/V4 policy's layers, and the reverse)
    (1, 32, 8, 128, 8192, 5, 8, 4, 32, torch.float16, torch.float32),
    (2, 16, 4, 128, 3001, 16, 4, 8, 32, torch.float16, torch.float16),
    (3, 9, 3, 64, 517, 3, 8, 4, 16, torch.float32, torch.float32),
    (1, 4, 1, 256, 1000, 16, 8, 4, 64, torch.float32, torch.float32),
    # int8 K and int4 V in csrc/decode_attention.cu's shapes: ragged tiles, fp16 scales, empty window, one token
    (1, 32, 8, 128, 32768, 8, 8, 4, 32, torch.float16, torch.float32),
    (2, 16, 4, 128, 3001, 16, 8, 4, 32, torch.float16, torch.float16),
    (1, 12, 4, 128, 777, 0, 8, 4, 32, torch.bfloat16, torch.float32),
    (1, 4, 2, 128, 1, 16, 8, 4, 32, torch.float32, torch.float32),
    # 2- and 3-bit codes, which the Triton partial cuts from whole words
    (1, 32, 8, 128, 8192, 5, 2, 2, 32, torch.float16, torch.float16),
    (3, 9, 3, 64, 517, 16, 3, 3, 16, torch.float32, torch.float32),
    (2, 16, 4, 128, 3001, 0, 3, 4, 32, torch.bfloat16, torch.float32),
    (1, 4, 1, 256, 1000, 15, 4, 2, 64, torch.float32, torch.float16),
])
def test_decode_attention_equals_dequantize_then_sdpa(partial, batch, q_heads, kv_heads, d, tokens, window, key_bits,
                                                      value_bits, group, dtype, scales):
    _check_decode_attention(partial, batch, q_heads, kv_heads, d, tokens, window, (key_bits, True),
                            (value_bits, True), group, dtype, scales)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("batch, q_heads, kv_heads, d, tokens, window, keys, values, group, dtype, scales", [
    # (bits, symmetric) of K and of V: unsigned codes with offsets (an asymmetric layout's) on either side
    (1, 32, 8, 128, 32768, 8, (4, False), (4, False), 32, torch.float16, torch.float16),
    (2, 16, 4, 128, 3001, 16, (8, False), (4, False), 32, torch.float16, torch.float32),
    (1, 12, 4, 128, 777, 0, (4, True), (4, False), 32, torch.bfloat16, torch.float16),
    # csrc/decode_attention.cu's shapes with offsets on both sides: 1-4 query heads per KV head, ragged tiles, an
    # empty window, one token, int8 keys, both scale dtypes
    (2, 16, 4, 128, 3001, 16, (4, False), (4, False), 32, torch.bfloat16, torch.float32),
    (1, 12, 4, 128, 777, 0, (8, False), (4, False), 32, torch.float16, torch.float16),
    (1, 8, 8, 128, 70, 3, (4, False), (4, False), 32, torch.float32, torch.float32),
    (1, 4, 2, 128, 1, 16, (4, False), (4, False), 32, torch.float16, torch.float32),
    (1, 32, 8, 128, 32768, 8, (8, False), (4, False), 32, torch.bfloat16, torch.float32),
    (3, 9, 3, 64, 517, 16, (4, False), (8, True), 16, torch.float32, torch.float32),
    (2, 8, 8, 64, 100, 0, (8, False), (8, False), 64, torch.float32, torch.float16),
    (1, 4, 1, 256, 3000, 15, (4, False), (4, False), 256, torch.float32, torch.float32),
    (1, 14, 2, 64, 1, 1, (4, False), (4, True), 32, torch.float32, torch.float32),
    (1, 32, 8, 128, 8192, 8, (2, False), (2, False), 32, torch.float16, torch.float16),
    (3, 9, 3, 64, 517, 16, (3, False), (3, False), 16, torch.float32, torch.float32),
    # codes below 4 bits with offsets, widened in csrc/decode_attention.cu: ragged tiles, an empty window, one token
    (2, 16, 4, 128, 3001, 16, (3, False), (3, False), 32, torch.float16, torch.float32),
    (1, 12, 4, 128, 777, 0, (2, False), (3, False), 32, torch.bfloat16, torch.float16),
    (1, 8, 8, 128, 70, 3, (8, False), (2, False), 32, torch.float32, torch.float32),
    (1, 4, 2, 128, 1, 16, (3, False), (2, False), 32, torch.float16, torch.float16),
])
def test_decode_attention_with_offsets_equals_dequantize_then_sdpa(batch, q_heads, kv_heads, d, tokens, window, keys,
                                                                   values, group, dtype, scales):
    """Offsets on both sides at csrc/decode_attention.cu's shapes take the CUDA partial; on one side only, or at other
    shapes, the Triton partial."""
    _check_decode_attention("cuda", batch, q_heads, kv_heads, d, tokens, window, keys, values, group, dtype, scales)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("role", ["k", "v"])
@pytest.mark.parametrize("bits, d, group", [(2, 64, 32), (3, 128, 16), (4, 128, 32), (4, 64, 64), (8, 256, 128)])
def test_kivi_layouts_through_the_ops_are_kivis_own_arithmetic(bits, d, group, role, device):
    """Keys per channel over groups of tokens, values per token in channel groups: codes, scales and offsets, and
    what they decode to, equal KIVI's own encode and decode of the same whole groups."""
    kivi = KIVI(role, bits, group, d)
    x = (torch.randn(2, 3, 4 * group, d, generator=torch.Generator().manual_seed(bits)) * 3).to(device)
    codes, stats = ops.quantize(x, kivi.packed_form())
    if device == "cuda" and role == "k":  # the token-group kernel writes 2-, 4- and 8-bit keys, bit for bit
        from kvq.kernels import triton_quantize

        assert (triton_quantize.unsupported_reason(kivi.packed_form().layout, None) is None) == (bits != 3)
    if device == "cuda" and unsupported_reason(kivi.packed_form().layout) is None:
        # the values' per-token layout runs the quantize kernel: judged as every kernel case is (round-half ties)
        _assert_asymmetric_matches_reference(RotatedQuantizer(Identity(d), kivi.inner), x.reshape(-1, d),
                                             codes.flatten(0, -2), stats.flatten(0, -2), f"kivi v{bits} d={d} g{group}")
        return
    own = kivi.encode(x).quantized
    assert torch.equal(codes, own.codes.reshape(codes.shape))
    scales, offsets = stats.chunk(2, dim=-1)
    assert torch.equal(scales, own.scale.reshape(scales.shape))
    assert torch.equal(offsets, own.offset.reshape(offsets.shape))
    assert stats.shape[-2] == (4 if role == "k" else 4 * group)  # a stats row per token group, or per token
    assert torch.equal(ops.dequantize(codes, stats, kivi.packed_form(), torch.float32), kivi.decode(kivi.encode(x)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rotation", ["srft", "srht", "haar"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_turbo_codebook_layout_through_the_ops_is_turboquants_own_arithmetic(bits, rotation, device):
    """TurboQuant_mse's codebook codes: kvq.ops' codes and norms equal TurboQuant's own encode, their decode its
    decode (on CUDA, where the kernels write and read the SRFT's and SRHT's, up to counted ties); and decode
    attention over them (in the rotated domain, the query mapped by R^T) equals SDPA over the decoded K/V."""
    geometry = KVGeometry(1, 2, 64)
    bank = QuantizerBank(QuantSpec("turbo", bits, options={"rotation": rotation}), geometry)
    forms, states, own = {}, {}, {}
    generator = torch.Generator().manual_seed(bits)
    for role in ("k", "v"):
        turbo = bank.get(0, role)
        forms[role] = turbo.packed_form()
        x = (torch.randn(2, 2, 37, 64, generator=generator) * 3).to(device)
        codes, norms = ops.quantize(x, forms[role])
        decoded = ops.dequantize(codes, norms, forms[role], torch.float32)
        if device == "cuda" and unsupported_reason(forms[role].layout) is None:
            _assert_codebook_codes_match_reference(turbo, x, codes, norms, f"ops turbo {rotation} {bits}-bit")
            own[role] = decode_unit_vector(unpack(codes, bits, 64, signed=False), norms, turbo.rotation,
                                           forms[role].codebook.to(device))
            torch.testing.assert_close(decoded, own[role], atol=1e-6 * x.abs().max(), rtol=0)
        else:
            packed = turbo.encode(x)
            assert torch.equal(codes, packed.codes) and torch.equal(norms, packed.norm)
            own[role] = turbo.decode(packed)
            assert torch.equal(decoded, own[role])
        states[role] = ops.PackedKV.holding(codes, norms, forms[role])
    empty = torch.zeros(2, 2, 0, 64, device=device)
    step = DomainMaps(forms["k"], forms["v"], torch.device(device)).step(states["k"], states["v"], (empty, empty))
    query = torch.randn(2, 4, 64, generator=generator).to(device)
    expected = F.scaled_dot_product_attention(query.unsqueeze(-2), own["k"], own["v"], scale=0.125, enable_gqa=True)
    # on CUDA the fused kernel reads the codes, its products in fp16: an error within fp16's relative precision of
    # the largest value coordinate (the GPU test over random codebook codes bounds it tighter)
    atol = 1e-5 if device == "cpu" else 2 * torch.finfo(torch.float16).eps * own["v"].abs().max().item()
    torch.testing.assert_close(ops.decode_attention(query, step, 0.125), expected.squeeze(-2), atol=atol, rtol=0)


def test_codebook_layouts_with_several_scale_groups_take_the_identity_rotation():
    """A rotation mixes the groups, so a group's scale cannot follow it: R^-1 (s_g * levels) != s_g * R^-1 (levels)."""
    assert PackedLayout(64, 4, 32, torch.uint8, codebook=True).groups == 2
    assert PackedLayout(64, 4, 64, torch.float16, rotation="srft", codebook=True).groups == 1  # TurboQuant's
    with pytest.raises(ValueError, match="identity rotation"):
        PackedLayout(64, 4, 32, torch.float16, rotation="srft", codebook=True)
    with pytest.raises(ValueError, match="codebook codes only"):
        PackedLayout(64, 4, 32, torch.uint8)
    assert PackedLayout(64, 8, 64, None, codebook=True, layer_scaled=True).stats == 0  # FP8 under a layer scale
    with pytest.raises(ValueError, match="scaled by their layer alone"):
        PackedLayout(64, 8, 64, None, codebook=True)


FLOAT_FORMATS = {"mxfp4": QuantSpec("mx"), "mxfp6-e3m2": QuantSpec("mx", options={"element": "e3m2"}),
                 "mxfp6-e2m3": QuantSpec("mx", options={"element": "e2m3"}),
                 "mxfp8-e4m3": QuantSpec("mx", options={"element": "e4m3"}),
                 "fp8-e4m3-token": QuantSpec("fp8", options={"scale": "token"}),
                 "fp8-e5m2-token": QuantSpec("fp8", options={"format": "e5m2", "scale": "token"}),
                 "fp8-e4m3-tensor": QuantSpec("fp8", options={"scale": "tensor"}),
                 "fp8-e5m2-unit": QuantSpec("fp8", options={"format": "e5m2", "scale": "unit"}),
                 "nvfp4": QuantSpec("nvfp4")}


FLOAT_FORMAT_PAIRS = [("mxfp4", "mxfp4"), ("mxfp6-e3m2", "mxfp8-e4m3"), ("mxfp6-e2m3", "mxfp4"),
                      ("fp8-e4m3-token", "fp8-e4m3-token"), ("fp8-e5m2-token", "mxfp4"), ("nvfp4", "nvfp4"),
                      ("fp8-e4m3-tensor", "fp8-e4m3-tensor"), ("fp8-e5m2-unit", "fp8-e4m3-token"),
                      ("nvfp4", "mxfp4")]
SHAPES = [(1, 32, 8, 128, 4099, 16),  # Llama-3-8B's heads, a length no block size divides
          (2, 9, 3, 64, 517, 0), (1, 14, 2, 64, 1, 1)]
# at head_dim 256 a per-token scale beside MX's 8 blocks would pad the query rows past what one program holds
WIDE = [(1, 4, 1, 256, 300, 15)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key_format, value_format, batch, q_heads, kv_heads, d, tokens, window", [
    *[(*pair, *shape) for pair in FLOAT_FORMAT_PAIRS for shape in SHAPES],
    *[(*pair, *shape) for pair in FLOAT_FORMAT_PAIRS[:4] for shape in WIDE]])
def test_decode_attention_over_float_format_codes_equals_sdpa_over_their_decode(key_format, value_format, batch,
                                                                                q_heads, kv_heads, d, tokens, window,
                                                                                device):
    """MX's, FP8's and NVFP4's layouts: indices into the element format's values, with an E8M0 scale byte per block of
    32 (MX), an fp32 scale per token (FP8) or none, or an E4M3 scale per block of 16 (NVFP4), and a layer scale where
    the format has one (FP8 under a tensor or unit scale, NVFP4), written by kvq.ops with the formats' own arithmetic.
    Decode attention over them (on CUDA the Triton partial, which computes each code's value from its bits and reads
    the E8M0 bytes as powers of two, the layer scales in the maps) equals SDPA over the quantizers' own decode and
    the exact window."""
    generator = torch.Generator().manual_seed(tokens)
    packed, own, forms = {}, {}, {}
    for role, name in (("k", key_format), ("v", value_format)):
        quantizer = QuantizerBank(FLOAT_FORMATS[name], KVGeometry(1, kv_heads, d)).get(0, role)
        x = (torch.randn(batch, kv_heads, tokens, d, generator=generator) * 3).to(device)
        forms[role] = quantizer.calibrated_form(x)
        codes, stats = ops.quantize(x, forms[role])
        own[role] = quantizer.decode(quantizer.encode(x))
        packed[role] = ops.PackedKV.holding(codes, stats, forms[role])
    window_rows = (torch.randn(2, batch, kv_heads, window, d, generator=generator)).to(device)
    maps = DomainMaps(forms["k"], forms["v"], device)
    step = DecodeStep(packed["k"], packed["v"], (window_rows[0], window_rows[1]), maps.query, maps.output)
    query = torch.randn(batch, q_heads, d, generator=generator).to(device)
    keys, values = (torch.cat([own[role], window_rows[i]], dim=-2) for i, role in enumerate("kv"))
    expected = F.scaled_dot_product_attention(query.unsqueeze(-2), keys, values, scale=d ** -0.5,
                                              enable_gqa=True).squeeze(-2)
    if device == "cuda":
        assert step_unsupported_reason(query, step) is None  # the kernels, not the reference
    got = ops.decode_attention(query, step, d ** -0.5)
    # on CUDA the products run in fp16: within a few fp16 steps of the largest value coordinate
    atol = 1e-5 if device == "cpu" else 4 * torch.finfo(torch.float16).eps * values.abs().max().item()
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("batch, q_heads, kv_heads, d, tokens, window, key_bits, value_bits, token_group, group, "
                         "dtype", [
    (1, 32, 8, 128, 32768, 16, 4, 4, 32, 32, torch.float16),  # KIVI-4 at Llama-3-8B's shapes
    (2, 16, 4, 128, 3001, 16, 8, 4, 128, 32, torch.float16),  # a last group not whole
    # int4 keys at csrc/decode_attention.cu's shapes: 1-4 query heads per KV head, groups of 1-8 tiles, one token
    (2, 16, 4, 128, 3001, 16, 4, 4, 128, 32, torch.bfloat16),
    (1, 12, 4, 128, 777, 0, 4, 4, 16, 32, torch.float32),
    (1, 8, 8, 128, 70, 3, 4, 4, 32, 32, torch.float16),
    (1, 4, 2, 128, 1, 16, 4, 4, 32, 32, torch.float16),
    (3, 9, 3, 64, 517, 0, 4, 8, 16, 16, torch.float32),
    (1, 14, 2, 64, 1, 1, 4, 4, 32, 32, torch.bfloat16),
    (1, 4, 1, 256, 1000, 15, 4, 4, 64, 64, torch.float32),
    (2, 8, 8, 64, 100, 5, 8, 8, 32, 64, torch.float16),
    (1, 32, 8, 128, 32768, 16, 2, 2, 32, 32, torch.float16),  # KIVI-2 at Llama-3-8B's shapes
    (3, 9, 3, 64, 517, 0, 3, 3, 16, 16, torch.float32),
    # KIVI-2 and -3 in csrc/decode_attention.cu: a last group not whole, an empty window, one query head per KV head
    (2, 16, 4, 128, 3001, 16, 2, 2, 128, 32, torch.bfloat16),
    (1, 12, 4, 128, 777, 0, 3, 3, 16, 32, torch.float32),
    (1, 8, 8, 128, 70, 3, 2, 4, 32, 32, torch.float16),
])
def test_decode_attention_with_per_channel_keys_equals_dequantize_then_sdpa(batch, q_heads, kv_heads, d, tokens,
                                                                            window, key_bits, value_bits,
                                                                            token_group, group, dtype):
    """KIVI's layouts: keys with a scale and an offset per channel over `token_group` tokens, values with offsets
    per token group of channels, fp16 stats. csrc/decode_attention.cu reads int4 keys at its shapes, each tile's
    group's scales folded into the query, 2- and 3-bit ones widened into int4's nibbles as they are read; the Triton
    partial decodes the others in registers."""
    _check_decode_attention("cuda", batch, q_heads, kv_heads, d, tokens, window, (key_bits, False),
                            (value_bits, False), group, dtype, torch.float16, token_group)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("batch, q_heads, kv_heads, d, tokens, window, key_bits, value_bits, group, dtype", [
    (1, 32, 8, 128, 32768, 16, 4, 4, 128, torch.float16),  # TurboQuant-4 at Llama-3-8B's shapes
    # csrc/decode_attention.cu's codebook shapes: ragged tiles, an empty window, one query head per KV head
    (2, 16, 4, 128, 3000, 16, 4, 4, 128, torch.float16),
    (1, 12, 4, 128, 3000, 0, 4, 4, 128, torch.bfloat16),
    (1, 8, 8, 128, 72, 3, 4, 4, 128, torch.float32),
    (1, 8, 2, 128, 777, 5, 4, 4, 128, torch.float16),  # rows of norms not 16-byte aligned per head: Triton's
    (2, 16, 4, 128, 3001, 16, 4, 4, 32, torch.float16),  # a scale per 32 coordinates (iq4_nl's blocks)
    (2, 16, 4, 128, 3001, 16, 3, 3, 128, torch.float16),
    (3, 9, 3, 64, 517, 0, 2, 4, 64, torch.float32),
    (1, 4, 1, 256, 1000, 15, 4, 3, 256, torch.float32),
    (1, 14, 2, 64, 1, 1, 3, 3, 64, torch.bfloat16),
    # 2- and 3-bit codes in csrc/decode_attention.cu (TurboQuant_mse-3 at Llama-3-8B's shapes): widened as read
    (1, 32, 8, 128, 32768, 16, 3, 3, 128, torch.float16),
    (1, 12, 4, 128, 3000, 0, 2, 2, 128, torch.bfloat16),
    (1, 8, 8, 128, 72, 3, 3, 4, 128, torch.float32),
    (1, 4, 2, 128, 1, 16, 2, 3, 32, torch.float16),
    (1, 8, 2, 128, 777, 5, 5, 8, 128, torch.float16),  # wider codes: their levels gathered, not looked up in registers
])
def test_decode_attention_over_codebook_codes_equals_dequantize_then_sdpa(batch, q_heads, kv_heads, d, tokens,
                                                                          window, key_bits, value_bits, group, dtype):
    """TurboQuant_mse's layout: indices into its Lloyd-Max levels (of a unit vector's coordinates) and an fp16 norm
    per token (or, iq4_nl's, an fp16 scale per group of 32). 2-4-bit codes at head_dim 128 with at most 4 query heads
    per KV head go through the CUDA partial, which widens 2- and 3-bit codes into nibbles and looks their levels up by
    byte permutes, where each head's rows of per-token norms start 16-byte aligned; the rest through the Triton
    partial."""
    _check_decode_attention("cuda", batch, q_heads, kv_heads, d, tokens, window, (key_bits, True), (value_bits, True),
                            group, dtype, torch.float16, codebooks=True)


def _check_decode_attention(partial, batch, q_heads, kv_heads, d, tokens, window, key_form, value_form, group, dtype,
                            scales, token_group=1, codebooks=False):
    (key_bits, key_symmetric), (value_bits, value_symmetric) = key_form, value_form
    generator = torch.Generator().manual_seed(tokens)
    key_levels, value_levels = ((lloyd_max_gaussian(bits) / d ** 0.5 if codebooks else None)
                                for bits in (key_bits, value_bits))
    keys = random_packed(batch, kv_heads, tokens, d, key_bits, group, "cuda", generator, scales, key_symmetric,
                         token_group, key_levels)
    values = random_packed(batch, kv_heads, -(-tokens // token_group) * token_group, d, value_bits, group, "cuda",
                           generator, scales, value_symmetric, codebook=value_levels).rows(tokens)
    window_buffer = torch.randn(2, batch, kv_heads, 16, d, generator=generator).to("cuda", dtype)
    window = (window_buffer[0, :, :, :window], window_buffer[1, :, :, :window])
    query = torch.randn(batch, q_heads, d, generator=generator).to("cuda", dtype)
    rotation, lam = SRFT(d, tokens).matrix(), torch.rand(d, generator=generator) + 0.5
    step = DecodeStep(keys, values, window, (rotation.T / lam).cuda(), (rotation / lam[:, None]).cuda())
    launch = LaunchConfig(partial=partial)
    narrow_signed = min(key_bits, value_bits) < cuda_decode.NIBBLE and key_symmetric
    if partial == "cuda" and d == 128 and key_bits in cuda_decode.KEY_BITS and value_bits in cuda_decode.NIBBLE_BITS \
            and group == 32 and q_heads // kv_heads <= 4 and not codebooks:
        # 2-8-bit keys alike, symmetric or with offsets on both sides (codes below 4 bits with offsets only); KIVI's
        # 2-4-bit keys in groups of tiles
        kivi_keys = (token_group % cuda_decode.TILE == 0 and key_bits <= 4 and not value_symmetric
                     and scales == torch.float16)
        assert cuda_decode.partial_fits(query, keys, values, window) == (
            kivi_keys if token_group > 1 else key_symmetric == value_symmetric and not narrow_signed)
    if partial == "cuda" and codebooks:
        assert cuda_decode.partial_fits(query, keys, values, window) == (
            d == 128 and key_bits in cuda_decode.NIBBLE_BITS and value_bits in cuda_decode.NIBBLE_BITS
            and q_heads // kv_heads <= 4 and (group == 32 or tokens % 8 == 0))
    got, expected = decode_attention_gpu(query, step, d ** -0.5, launch), decode_attention_reference(query, step,
                                                                                                      d ** -0.5)
    # the second call goes through the compiled kernels' own launchers
    assert torch.equal(decode_attention_gpu(query, step, d ** -0.5, launch), got)
    assert step_unsupported_reason(query, step) is None  # the op's kernels, not the reference
    if partial == "cuda":  # the op runs the same kernels
        assert torch.equal(ops.decode_attention(query, step, d ** -0.5), got)
    error = (got.float() - expected.float()).abs().max().item()
    per_channel = f" per channel/{token_group}" if token_group > 1 else " codebook" if codebooks else ""
    print(f"{partial} B={batch} Hq={q_heads} Hkv={kv_heads} d={d} T={tokens}+{window[0].shape[2]} "
          f"K{key_bits}{'' if key_symmetric else 'a'}{per_channel}/V{value_bits}{'' if value_symmetric else 'a'} "
          f"g={group} "
          f"{dtype} {scales} scales: max abs {error:.2e}")
    # fp16 and bf16 outputs are both rounded to the query's dtype: up to an ulp apart on top of the kernel's
    # own error; fp32 keeps the bare bound
    rounding = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps * expected.float().abs().max().item()
    assert error < 2e-3 + rounding


@requires_cuda
@pytest.mark.gpu
def test_layouts_without_a_kernel_take_the_reference_and_say_why_once(caplog):
    q = quantizer("srht", 256, 5, "per_group", 64)  # a layout no other test quantizes
    x = torch.randn(64, 256, device="cuda")
    with caplog.at_level(logging.INFO, logger="kvq.kernels"):
        packed = ops.encode(q, x)
        ops.encode(q, x)
    assert torch.equal(packed.inner.codes.cpu(), q.encode(x.cpu()).inner.codes)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvq::quantize")]
    assert len(said) == 1 and str(layout(q)) in said[0]
    assert said[0].endswith("kernels need 2-, 3-, 4- or 8-bit codes with float32 or float16 scales")
