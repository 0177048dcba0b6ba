"""The KV formats serving engines ship, checked bit for bit against independent references: torch's float8
casts, torchao's MX and NVFP4 quantizers, gguf-py's ggml blocks (quantize and dequantize), and MLX's own
`mx.quantize`; on random tensors and on K/V captured from a built-in model."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEVICES, loaded, requires_models

from kvq import ops
from kvq.errors import KvqError
from kvq.quant import QuantSpec, Site, build_quantizer
from kvq.quant.fp8 import FP8
from kvq.quant.ggml import GGMLBlocks, rotation_block, walsh_hadamard
from kvq.quant.minifloat import E2M1, E2M3, E3M2, E4M3, E5M2, FORMATS, TORCH_FLOAT8
from kvq.quant.mlx_affine import MLXAffine
from kvq.quant.mx import MX
from kvq.quant.nvfp4 import NVFP4
from kvq.quant.packing import unpack

gguf_quants = pytest.importorskip("gguf.quants")
GGML_TYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl"]


def wide_range(shape, seed=0) -> torch.Tensor:
    """Gaussian rows with per-row magnitudes over several decades, a zero block and a constant block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(2 * torch.randn(*shape[:-1], 1, generator=g))
    x[..., 0, :32] = 0
    x[..., 1, :32] = 1.5
    return x


@pytest.fixture(scope="module")
def captured_kv() -> dict[str, torch.Tensor]:
    """Layer 0 and a middle layer's K and V of SmolLM2 on a real text, as (1, vectors, 64)."""
    from kvq.capture import capture_kv
    from kvq.data import token_windows

    lm = loaded("smollm2-135m")
    windows = token_windows(lm.tokenizer, "shakespeare", 128, 1, split="calib")
    captured = capture_kv(lm.model, windows, "hook", max_vectors=256)
    return {f"{role}{layer}": captured[(layer, role)].unsqueeze(0) for layer in (0, 15) for role in "kv"}


# --- element formats -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_minifloat_equals_torch_float8_casts(name):
    element = FORMATS[name]
    x = torch.cat([wide_range((50, 64)).flatten() * 30, torch.tensor([0.0, -0.0, 448, 464, 470, 500, -1e9, 2**-9,
                                                                      2**-10, 3 * 2**-11, 57344, 61440])])
    reference = x.clamp(-element.max_value, element.max_value).to(TORCH_FLOAT8[name])
    assert torch.equal(element.encode(x), reference.view(torch.uint8))
    assert torch.equal(element.decode(element.encode(x)), reference.float())
    assert torch.equal(element.round(x), reference.float())


@pytest.fixture(scope="module")
def torchao(tmp_path_factory) -> dict[str, torch.Tensor]:
    """torchao's conversions of wide_range((2, 3, 40, 64)) and of a fine line through the FP4/FP6 ranges, computed
    in their own process from the reference install scripts/setup.sh makes (.venv/references)."""
    references = Path(sys.prefix) / "references"
    if not (references / "torchao").is_dir():
        pytest.skip("torchao reference not installed (scripts/setup.sh installs it in <venv>/references)")
    folder = tmp_path_factory.mktemp("torchao")
    line = torch.cat([torch.linspace(-30, 30, 60001), wide_range((20, 64)).flatten().clamp(-40, 40)])
    torch.save({"blocks": wide_range((2, 3, 40, 64)), "line": line}, folder / "in.pt")
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("torchao_reference.py")), str(folder / "in.pt"),
                           str(folder / "out.pt")], env={**os.environ, "PYTHONPATH": str(references)},
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return {"line": line, **torch.load(folder / "out.pt")}


def test_fp4_and_fp6_elements_equal_torchao(torchao):
    for element in (E2M1, E2M3, E3M2):
        assert torch.equal(element.encode(torchao["line"]), torchao[f"element/{element.name}"]), element.name
    assert torch.equal(E2M1.decode(torch.arange(16)), torch.tensor(
        [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]))


# --- MX -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["e2m1", "e2m3", "e3m2", "e4m3", "e5m2"])
def test_mx_codes_scales_and_values_equal_torchao(torchao, name):
    x = wide_range((2, 3, 40, 64))
    quantizer = MX(FORMATS[name], 64)
    packed = quantizer.encode(x)
    assert torch.equal(packed.scales, torchao[f"mx/{name}/scales"])
    assert torch.equal(unpack(packed.codes, FORMATS[name].bits, 64, signed=False).reshape(x.shape),
                       torchao[f"mx/{name}/codes"])
    assert torch.equal(quantizer.decode(packed), torchao[f"mx/{name}/values"])
    assert quantizer.bits_per_element(64, 40) == FORMATS[name].bits + 0.25


def test_mx_fp4_codes_equal_ggml_mxfp4_away_from_ties():
    """gguf's MXFP4 (ggml's) shares the spec's scale and element grid but rounds ties to the smaller magnitude;
    on data without ties its scales are the spec's, and so are its codes but for the sign of a zero (ggml writes
    a negative value that rounds to zero as +0, the spec keeps its sign)."""
    x = wide_range((3, 40, 64))[:, 2:]  # no constant or zero block: no ties
    packed = MX(E2M1, 64).encode(x)
    blocks = gguf_quants.quantize(x.numpy(), gguf_quants.GGMLQuantizationType.MXFP4).reshape(-1, 17)
    ggml_codes = torch.from_numpy(blocks[:, 1:].copy())
    ggml_codes = torch.cat([ggml_codes & 0x0F, ggml_codes >> 4], dim=-1)
    codes = unpack(packed.codes, 4, 64, signed=False).reshape(-1, 32)
    assert torch.equal(torch.from_numpy(blocks[:, 0].copy()), packed.scales.reshape(-1))
    negative_zero = 8
    assert torch.equal(ggml_codes.to(codes.dtype), torch.where(codes == negative_zero, 0, codes))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["e2m1", "e2m3", "e3m2", "e4m3", "e5m2"])
def test_mx_as_a_packed_layout_holds_its_codes_and_e8m0_scales(name, device, caplog):
    """kvq.ops writes MX's packed layout with the spec's arithmetic (on CUDA a Triton kernel for the 4- and 8-bit
    elements): the same codes, the E8M0 scale bytes as the layout's scales (one byte per block, as counted),
    decoding to what MX's decode gives."""
    quantizer = MX(FORMATS[name], 64)
    form = quantizer.packed_form()
    assert form.layout.codebook and form.layout.scale_dtype == torch.uint8 and form.layout.group_size == 32
    x = wide_range((2, 3, 40, 64), seed=1).to(device)
    x[0, 0, 2, 5] = -0.0
    with caplog.at_level(logging.INFO, logger="kvq.kernels"):
        codes, stats = ops.quantize(x, form)
    if device == "cuda" and name in ("e2m1", "e4m3", "e5m2"):  # the kernel wrote them
        assert not [r for r in caplog.records if r.getMessage().startswith("kvq::quantize")]
    packed = quantizer.encode(x)
    assert torch.equal(codes, packed.codes) and torch.equal(stats, packed.scales)
    assert torch.equal(ops.quantize(x.half(), form)[0], quantizer.encode(x.half()).codes)
    assert codes.numel() * 8 + stats.numel() * 8 == quantizer.bits_per_element(64, 40) * x.numel()
    assert torch.equal(ops.dequantize(codes, stats, form, x.dtype), quantizer.decode(packed))


# --- NVFP4 ----------------------------------------------------------------------------------------------

def test_nvfp4_codes_and_block_scales_equal_torchao(torchao):
    x = wide_range((2, 3, 40, 64))
    quantizer = NVFP4(64)
    packed = quantizer.encode(x)
    assert torch.equal(quantizer.layer_scale, torchao["nvfp4/layer_scale"])
    assert torch.equal(packed.scales, torchao["nvfp4/scales"])
    assert torch.equal(unpack(packed.codes, 4, 64, signed=False).reshape(x.shape), torchao["nvfp4/codes"])
    assert quantizer.bits_per_element(64, 40) == 4.5


def test_nvfp4_decodes_as_ggml_reads_its_blocks():
    """ggml's NVFP4 block (64 values: four UE4M3 scales, then 8 bytes of nibbles per 16) with the layer scale
    at 1: gguf's dequantize of kvq's codes and scales equals kvq's decode."""
    x = wide_range((3, 40, 64)) / 100
    quantizer = NVFP4(64)
    quantizer.layer_scale = torch.tensor(1.0)
    packed = quantizer.encode(x)
    codes = unpack(packed.codes, 4, 64, signed=False).reshape(-1, 4, 16)
    nibbles = (codes[..., :8] | (codes[..., 8:] << 4)).to(torch.uint8).reshape(-1, 32)
    blocks = torch.cat([packed.scales.reshape(-1, 4), nibbles], dim=-1).numpy()
    reference = gguf_quants.dequantize(blocks, gguf_quants.GGMLQuantizationType.NVFP4)
    assert np.array_equal(reference.reshape(-1), quantizer.decode(packed).numpy().reshape(-1))


# --- llama.cpp blocks -----------------------------------------------------------------------------------

def ggml_bytes(packed) -> np.ndarray:
    """kvq's block fields laid out as ggml's block structs (d, [m], [qh], qs), row after row."""
    parts = [packed.scale.view(torch.uint8)]
    parts += [packed.minimum.view(torch.uint8)] if packed.minimum is not None else []
    parts += [packed.high] if packed.high is not None else []
    parts.append(packed.low)
    return torch.cat(parts, -1).reshape(*packed.low.shape[:-2], -1).numpy()


def check_against_gguf(kind: str, x: torch.Tensor) -> None:
    quantizer = GGMLBlocks(kind, None, 64)
    packed = quantizer.encode(x)
    stored = ggml_bytes(packed)
    qtype = getattr(gguf_quants.GGMLQuantizationType, kind.upper())
    if kind != "iq4_nl":  # gguf-py ships no IQ4_NL quantizer
        assert np.array_equal(stored, gguf_quants.quantize(x.numpy(), qtype)), kind
    assert np.array_equal(quantizer.decode(packed).numpy(), gguf_quants.dequantize(stored, qtype)), kind
    block_bytes = gguf_quants.GGML_QUANT_SIZES[qtype][1]
    assert quantizer.bits_per_element(x.shape[-1], x.shape[-2]) == block_bytes * 8 / 32
    assert packed.storage_bits() == stored.size * 8


@pytest.mark.parametrize("kind", GGML_TYPES)
def test_ggml_blocks_are_byte_identical_to_gguf_on_random_tensors(kind):
    check_against_gguf(kind, wide_range((2, 3, 40, 64)))


@requires_models
@pytest.mark.model
@pytest.mark.parametrize("kind", GGML_TYPES)
def test_ggml_blocks_are_byte_identical_to_gguf_on_real_kv(kind, captured_kv):
    for x in captured_kv.values():
        check_against_gguf(kind, x)


def test_iq4_nl_keeps_the_initial_codes_and_refits_the_scale():
    """ggml's KV write picks codes with d = m / -127 and stores the least-squares d (weights x^2) for them, so
    the stored scale's weighted error is no larger than the first scale's for those codes (up to fp16 rounding
    of either scale), and smaller on almost every block."""
    x = wide_range((40, 64))
    quantizer = GGMLBlocks("iq4_nl", None, 64)
    packed = quantizer.encode(x)
    levels = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]).float()
    blocks = x.reshape(40, 2, 32)
    first = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)) / -127
    q = levels[quantizer.codes(packed).long()]
    scaled = torch.where(first == 0, 0, blocks / first)  # ggml's id = 0 for a zero block
    assert torch.equal(q, levels[scaled.unsqueeze(-1).sub(levels).abs().argmin(-1)])
    weighted = lambda d: (blocks**2 * (blocks - d * q) ** 2).sum(-1)  # noqa: E731
    stored, first_stored = packed.scale.float(), first.half().float()  # both as an fp16 scale is stored
    assert (weighted(stored) <= weighted(first_stored) * (1 + 1e-2) + 1e-6 * (blocks**4).sum(-1)).all()
    assert (weighted(stored) < weighted(first_stored)).float().mean() > 0.9


@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_ggml_blocks_as_packed_layouts_hold_ggmls_codes_and_scales(kind, hadamard):
    """kvq.ops writes a ggml type's packed layout with ggml's arithmetic: each code (less q4_0's and q5_0's zero), d
    and m equal the quantizer's own block fields, in as many bytes, and decode to what its decode gives."""
    quantizer = build_quantizer(QuantSpec("ggml", options={"type": kind, "hadamard": hadamard}), Site(0, "k", 128))
    form = quantizer.packed_form()
    assert form.layout.rotation == ("blocks" if hadamard else "identity") and form.layout.scheme == "ggml"
    x = wide_range((2, 3, 40, 128))
    codes, stats = ops.quantize(x, form)
    packed = quantizer.encode(x)
    zero = {"q4_0": 8, "q5_0": 16}.get(kind, 0)
    signed = unpack(codes, form.layout.bits, 128, signed=form.layout.symmetric).to(torch.int32)
    assert torch.equal(signed + zero, quantizer.codes(packed).reshape(signed.shape))
    assert torch.equal(stats[..., :4], packed.scale.squeeze(-1))
    if packed.minimum is not None:
        assert torch.equal(stats[..., 4:], packed.minimum.squeeze(-1))
    assert 8 * (codes.numel() + 2 * stats.numel()) == packed.storage_bits()
    assert torch.equal(ops.dequantize(codes, stats, form, x.dtype), quantizer.decode(packed))


def test_iq4_nl_without_the_rotation_is_a_codebook_layout_of_ggmls_codes_and_scales():
    """iq4_nl with hadamard: false is a codebook layout: kvq.ops writes ggml's level indices and refitted d (the
    group-32 fp16 scale) as the quantizer's own blocks hold them, in as many bytes, decoding to its decode. After the
    rotation, whose blocks span two scale blocks, it has no layout and says why."""
    quantizer = build_quantizer(QuantSpec("ggml", options={"type": "iq4_nl", "hadamard": False}), Site(0, "k", 128))
    form = quantizer.packed_form()
    layout = form.layout
    assert layout.codebook and layout.scale_dtype == torch.float16 and layout.group_size == 32
    x = wide_range((2, 3, 40, 128))
    codes, stats = ops.quantize(x, form)
    packed = quantizer.encode(x)
    indices = unpack(codes, 4, 128, signed=False).to(torch.int32)
    assert torch.equal(indices, quantizer.codes(packed).reshape(indices.shape))
    assert torch.equal(stats, packed.scale.squeeze(-1))
    assert 8 * (codes.numel() + 2 * stats.numel()) == packed.storage_bits()
    assert torch.equal(ops.dequantize(codes, stats, form, x.dtype), quantizer.decode(packed))
    rotated = build_quantizer(QuantSpec("ggml", options={"type": "iq4_nl"}), Site(0, "k", 128))
    assert rotated.packed_form() is None and "hadamard: false" in rotated.packing_reason()


@pytest.mark.parametrize("d,k_block,v_block", [(64, 64, 64), (128, 128, 64), (256, 256, 64), (192, 64, 64),
                                               (96, None, None)])
def test_ggml_rotation_sizes_follow_llama_cpp(d, k_block, v_block):
    assert rotation_block("k", d) == k_block and rotation_block("v", d) == v_block


def test_ggml_hadamard_is_orthonormal_and_rotated_blocks_equal_gguf_on_rotated_input():
    h = walsh_hadamard(128)
    assert torch.allclose(h @ h.T, torch.eye(128), atol=1e-6) and torch.equal(h, h.T)
    x = wide_range((2, 40, 256))
    quantizer = build_quantizer(QuantSpec("ggml", options={"type": "q4_0"}), Site(0, "k", 256))
    rotated = (x.reshape(2, 40, 1, 256) @ walsh_hadamard(256)).reshape(x.shape)
    assert np.array_equal(ggml_bytes(quantizer.encode(x)),
                          gguf_quants.quantize(rotated.numpy(), gguf_quants.GGMLQuantizationType.Q4_0))
    v = build_quantizer(QuantSpec("ggml", options={"type": "q8_0"}), Site(0, "v", 256))
    assert torch.allclose(v(x), x, rtol=0.05, atol=0.02 * float(x.abs().max()))  # rotated back on decode


# --- MLX ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mlx_affine_equals_mx_quantize(bits, dtype):
    mx = pytest.importorskip("mlx.core")
    x = wide_range((2, 3, 40, 128)).to(dtype)
    quantizer = MLXAffine(bits, 64, 128)
    packed = quantizer.encode(x)
    codes, scales, biases = mx.quantize(mx.array(x.numpy()), group_size=64, bits=bits)
    assert np.array_equal(np.array(codes).view(np.uint8).reshape(packed.codes.shape), packed.codes.numpy())
    assert np.array_equal(np.array(scales).astype(np.float16).reshape(packed.scales.shape), packed.scales.numpy())
    assert np.array_equal(np.array(biases).astype(np.float16).reshape(packed.biases.shape), packed.biases.numpy())
    assert quantizer.bits_per_element(128, 40) == bits + 0.5


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_mlx_affine_as_a_packed_layout_holds_its_codes_scales_and_biases(bits):
    """kvq.ops writes MLX affine's packed layout with MLX's arithmetic: the same codes, and its fp16 scales and biases
    as the layout's scales and offsets, in as many bytes, decoding to what its decode gives."""
    quantizer = MLXAffine(bits, 64, 128)
    form = quantizer.packed_form()
    assert form.layout.scheme == "mlx" and not form.layout.symmetric
    x = wide_range((2, 3, 40, 128))
    codes, stats = ops.quantize(x, form)
    packed = quantizer.encode(x)
    assert torch.equal(codes, packed.codes)
    assert torch.equal(stats, torch.cat([packed.scales, packed.biases], dim=-2).squeeze(-1))
    assert 8 * (codes.numel() + 2 * stats.numel()) == packed.storage_bits()
    assert torch.equal(ops.dequantize(codes, stats, form, x.dtype), quantizer.decode(packed))


# --- FP8 ------------------------------------------------------------------------------------------------

def test_fp8_scales():
    x = wide_range((1, 2, 40, 64)) / 50
    unit = FP8(E4M3, "unit", 64)
    assert torch.equal(unit.encode(x).codes, x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    token = FP8(E5M2, "token", 64)
    scale = x.abs().amax(-1, keepdim=True) / 57344
    expected = torch.where(scale > 0, x / scale, 0).to(torch.float8_e5m2)
    assert torch.equal(token.encode(x).codes, expected.view(torch.uint8))
    assert token.bits_per_element(64, 40) == 8 + 32 / 64
    head = FP8(E4M3, "head", 64)
    head.encode(x)
    assert head.calibrated.shape == (1, 2, 1, 1)
    assert torch.equal(head.calibrated.flatten(), x.abs().amax(dim=(0, 2, 3)) / 448)
    louder = head(10 * x)  # the calibrated scale stays, so a louder input saturates at 448 x scale
    assert torch.equal(louder.abs().amax(dim=(0, 2, 3)), (448 * head.calibrated).flatten())
    assert head.bits_per_element(64, 40) == 8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_fp8_with_token_scales_as_a_packed_layout_holds_its_codes_and_scales(name, device):
    """Per-token scales make FP8 a packed layout (indices into the format's values, an fp32 scale per token) that
    kvq.ops writes with FP8's own arithmetic (on CUDA a Triton kernel)."""
    quantizer = FP8(FORMATS[name], "token", 64)
    form = quantizer.packed_form()
    x = (wide_range((2, 3, 40, 64), seed=2) / 50).to(device)
    x[1, 1, 3] = 0  # a row of zeros: scale 0, codes 0
    codes, stats = ops.quantize(x, form)
    packed = quantizer.encode(x)
    assert torch.equal(codes, packed.codes) and torch.equal(stats, packed.token_scales)
    assert torch.equal(ops.dequantize(codes, stats, form, x.dtype), quantizer.decode(packed))
    assert torch.equal(form.on(x.device).codebook[codes.long()], FORMATS[name].decode(codes))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, scale", [("e4m3", "tensor"), ("e5m2", "tensor"), ("e4m3", "unit"), ("nvfp4", "")])
def test_formats_under_a_layer_scale_as_packed_layouts_hold_their_codes_and_no_more(name, scale, device, caplog):
    """FP8 under one calibrated (or unit) scale stores its codes alone, as vLLM does, and NVFP4 its codes and E4M3
    block scales: the layer scale is the form's, fixed by the quantizer's first K/V, whether its own encode or the
    form's calibration saw it first. kvq.ops writes them with the formats' arithmetic (on CUDA a Triton kernel),
    holding exactly the counted bits, and decodes them as the quantizers do."""
    quantizer = NVFP4(64) if name == "nvfp4" else FP8(FORMATS[name], scale, 64)
    assert quantizer.packed_form().layout.layer_scaled
    if scale != "unit":
        assert quantizer.packed_form().layer_scale is None
        with pytest.raises(ValueError, match="calibrated_form"):
            ops.quantize(torch.ones(1, 64), quantizer.packed_form())
    first, later = ((wide_range((2, 3, 40, 64), seed=seed) / 50).to(device) for seed in (3, 4))
    form = quantizer.calibrated_form(first)
    assert torch.equal(quantizer.calibrated_form(later).layer_scale, form.layer_scale)  # fixed by the first
    with caplog.at_level(logging.INFO, logger="kvq.kernels"):
        codes, stats = ops.quantize(later, form)
    if device == "cuda":  # the kernel wrote them
        assert not [r for r in caplog.records if r.getMessage().startswith("kvq::quantize")]
    packed = quantizer.encode(later)
    assert torch.equal(codes, packed.codes)
    if name == "nvfp4":
        assert stats.dtype == torch.float8_e4m3fn and torch.equal(stats.view(torch.uint8), packed.scales)
    else:
        assert stats.shape == (2, 3, 40, 0)
    assert codes.numel() * 8 + stats.numel() * 8 == quantizer.bits_per_element(64, 40) * later.numel()
    assert torch.equal(ops.dequantize(codes, stats, form, later.dtype), quantizer.decode(packed))
    fresh = NVFP4(64) if name == "nvfp4" else FP8(FORMATS[name], scale, 64)
    fresh.encode(first)  # its own encode calibrates: the same form
    assert torch.equal(fresh.packed_form().layer_scale.cpu(), form.layer_scale.cpu())


def test_fp8_with_a_scale_per_head_has_no_packed_layout():
    quantizer = FP8(E4M3, "head", 64)
    assert quantizer.packed_form() is None and "one scale per layer" in quantizer.packing_reason()


# --- bad input ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,d,fragment", [
    (QuantSpec("nvfp4"), 24, "nvfp4 stores blocks of 16 coordinates; head_dim 24"),
    (QuantSpec("mx"), 48, "blocks of 32 coordinates; head_dim 48"),
    (QuantSpec("ggml", options={"type": "q8_0"}), 80, "ggml q8_0 stores blocks of 32"),
    (QuantSpec("mlx", bits=4, group_size=64), 96, "head_dim 96 is not a multiple of 64"),
    (QuantSpec("mlx", bits=7, group_size=64), 128, "mlx affine bits must be one of 2, 3, 4, 5, 6, 8"),
])
def test_a_format_that_cannot_hold_the_head_dim_is_refused_at_build(spec, d, fragment):
    with pytest.raises(KvqError, match=fragment):
        build_quantizer(spec, Site(0, "k", d))
