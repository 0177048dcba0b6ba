"""kvq.ops.write_rows: a static cache's write of new rows, on CPU (the reference: kvq::quantize and three copies) and on
CUDA (one kernel, which must write what the reference writes, bit for bit)."""

import pytest
import torch
from conftest import requires_cuda

from kvq import ops
from kvq.apply import KVGeometry, QuantizerBank
from kvq.quant import QuantSpec

CAPACITY, WINDOW = 40, 8
# layouts kvq_write_rows writes on CUDA, and layouts their quantize writes there (engine formats)
KERNEL_WRITES = {"srft4-g32": QuantSpec("srft", 4, "per_group", 32),
                 "srht2-asym": QuantSpec("srht", 2, "per_group", 32, False), "int8-token": QuantSpec("int", 8),
                 "srft3-g16-fp16": QuantSpec("srft", 3, "per_group", 16, scale_dtype="float16"),
                 "turbo3": QuantSpec("turbo", 3), "turbo4": QuantSpec("turbo", 4)}
QUANTIZE_WRITES = {"mxfp4": QuantSpec("mx"), "fp8-token": QuantSpec("fp8", options={"scale": "token"})}
SPECS = {**KERNEL_WRITES, **QUANTIZE_WRITES}


def _form(spec: QuantSpec, device: str, d: int = 128):
    bank = QuantizerBank(spec, KVGeometry(1, 3, d))
    return bank.get(0, "k").packed_form().on(torch.device(device))


def _buffers(form, batch: int, heads: int, dtype: torch.dtype, device: str):
    layout, generator = form.layout, torch.Generator(device).manual_seed(5)
    codes = torch.randint(0, 256, (batch, heads, CAPACITY, layout.code_bytes), dtype=torch.uint8, device=device,
                          generator=generator)
    scales = torch.randn(batch, heads, CAPACITY, layout.stats, device=device, generator=generator)
    ring = torch.randn(batch, heads, WINDOW, layout.head_dim, device=device, generator=generator).to(dtype)
    return codes, scales.to(layout.stats_dtype), ring


@pytest.mark.parametrize("tokens, start", [(1, 0), (1, 21), (5, 6), (13, 3), (CAPACITY - 2, 2)])
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_rows_land_at_the_positions_the_length_names_and_the_newest_window_in_the_ring(spec, tokens, start):
    form = _form(spec, "cpu")
    rows = torch.randn(2, 3, tokens, 128, generator=torch.Generator().manual_seed(tokens))
    codes, scales, ring = _buffers(form, 2, 3, torch.float32, "cpu")
    before = [t.clone() for t in (codes, scales, ring)]
    ops.write_rows(rows, form, codes, scales, ring, torch.tensor(start))
    expected_codes, expected_stats = ops.quantize(rows, form)
    written = torch.arange(start, start + tokens)
    assert torch.equal(codes[:, :, written], expected_codes)
    assert torch.equal(scales[:, :, written].view(torch.uint8), expected_stats.view(torch.uint8))
    kept = torch.ones(CAPACITY, dtype=torch.bool)
    kept[written] = False
    assert torch.equal(codes[:, :, kept], before[0][:, :, kept])
    assert torch.equal(scales[:, :, kept].view(torch.uint8), before[1][:, :, kept].view(torch.uint8))
    for slot in range(WINDOW):  # each ring slot: the newest written row at a position of that residue, else as it was
        newest = [p for p in written.tolist()[-WINDOW:] if p % WINDOW == slot]
        expected = rows[:, :, newest[-1] - start] if newest else before[2][:, :, slot]
        assert torch.equal(ring[:, :, slot], expected)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens, start", [(1, 0), (1, 29), (13, 3), (CAPACITY - 1, 1)])
@pytest.mark.parametrize("spec", KERNEL_WRITES.values(), ids=KERNEL_WRITES.keys())
def test_the_cuda_kernel_writes_what_the_reference_writes(spec, tokens, start, dtype):
    from kvq.kernels.dispatch import kernel_write_rows

    form = _form(spec, "cuda")
    layout = form.layout
    rows = torch.randn(2, 3, tokens, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).to(dtype)
    fused = _buffers(form, 2, 3, dtype, "cuda")
    reference = [t.clone() for t in fused]
    length = torch.tensor(start, device="cuda")
    assert kernel_write_rows(rows, form.rotation_input, form.lam, layout, form.codebook, *fused, length)
    ops.write_rows_through_quantize(rows, form.rotation_input, form.lam, layout, form.codebook, form.layer_scale,
                                    *reference, length)
    for name, got, expected in zip(("codes", "stats", "ring"), fused, reference, strict=True):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), name


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("spec", QUANTIZE_WRITES.values(), ids=QUANTIZE_WRITES.keys())
def test_layouts_the_kernel_does_not_write_are_written_by_their_quantize_on_cuda(spec):
    from kvq.kernels.dispatch import kernel_write_rows

    form = _form(spec, "cuda")
    rows = torch.randn(1, 3, 2, 128, device="cuda", dtype=torch.float16)
    codes, scales, ring = _buffers(form, 1, 3, torch.float16, "cuda")
    length = torch.tensor(4, device="cuda")
    assert not kernel_write_rows(rows, form.rotation_input, form.lam, form.layout, form.codebook, codes, scales, ring,
                                 length)
    ops.write_rows(rows, form, codes, scales, ring, length)
    expected_codes, expected_stats = ops.quantize(rows, form)
    assert torch.equal(codes[:, :, 4:6], expected_codes)
    assert torch.equal(scales[:, :, 4:6].view(torch.uint8), expected_stats.view(torch.uint8))
