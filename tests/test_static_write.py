"""kvq.ops.write_rows: a static cache's write of new rows, K's and V's in one call where they share a layout, on CPU
(the reference: kvq::quantize and three copies per role) and on CUDA (one kernel for every role, which must write what
the reference writes, bit for bit)."""

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


ROLES = {"k": ("k",), "kv": ("k", "v")}


def _forms(spec: QuantSpec, device: str, roles=("k",)) -> list:
    """The roles' forms of layer 0: one layout, each role its own rotation (K's and V's seeds differ)."""
    bank = QuantizerBank(spec, KVGeometry(1, 3, 128))
    return [bank.get(0, role).packed_form().on(torch.device(device)) for role in roles]


def _buffers(form, batch: int, heads: int, dtype: torch.dtype, device: str, seed: int = 5):
    layout, generator = form.layout, torch.Generator(device).manual_seed(seed)
    codes = torch.randint(0, 256, (batch, heads, CAPACITY, layout.code_bytes), dtype=torch.uint8, device=device,
                          generator=generator)
    scales = torch.randn(batch, heads, CAPACITY, layout.stats, device=device, generator=generator)
    ring = torch.randn(batch, heads, WINDOW, layout.head_dim, device=device, generator=generator).to(dtype)
    return codes, scales.to(layout.stats_dtype), ring


@pytest.mark.parametrize("roles", ROLES.values(), ids=ROLES.keys())
@pytest.mark.parametrize("tokens, start", [(1, 0), (1, 21), (5, 6), (13, 3), (CAPACITY - 2, 2)])
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_rows_land_at_the_positions_the_length_names_and_the_newest_window_in_the_ring(spec, tokens, start, roles):
    forms = _forms(spec, "cpu", roles)
    rows = [torch.randn(2, 3, tokens, 128, generator=torch.Generator().manual_seed(tokens + i))
            for i in range(len(roles))]
    buffers = [_buffers(form, 2, 3, torch.float32, "cpu", seed=5 + i) for i, form in enumerate(forms)]
    before = [[t.clone() for t in role] for role in buffers]
    ops.write_rows(rows, forms, *zip(*buffers, strict=True), torch.tensor(start))
    written = torch.arange(start, start + tokens)
    kept = torch.ones(CAPACITY, dtype=torch.bool)
    kept[written] = False
    for role_rows, form, (codes, scales, ring), earlier in zip(rows, forms, buffers, before, strict=True):
        expected_codes, expected_stats = ops.quantize(role_rows, form)  # each role in its own rotation
        assert torch.equal(codes[:, :, written], expected_codes)
        assert torch.equal(scales[:, :, written].view(torch.uint8), expected_stats.view(torch.uint8))
        assert torch.equal(codes[:, :, kept], earlier[0][:, :, kept])
        assert torch.equal(scales[:, :, kept].view(torch.uint8), earlier[1][:, :, kept].view(torch.uint8))
        for slot in range(WINDOW):  # each ring slot: the newest row written at a position of its residue, or as it was
            newest = [p for p in written.tolist()[-WINDOW:] if p % WINDOW == slot]
            expected = role_rows[:, :, newest[-1] - start] if newest else earlier[2][:, :, slot]
            assert torch.equal(ring[:, :, slot], expected)


def test_roles_of_different_layouts_are_refused_in_one_write():
    forms = [*_forms(KERNEL_WRITES["srft4-g32"], "cpu"), *_forms(KERNEL_WRITES["int8-token"], "cpu")]
    rows = [torch.randn(1, 3, 1, 128) for _ in forms]
    buffers = [_buffers(form, 1, 3, torch.float32, "cpu") for form in forms]
    with pytest.raises(ValueError, match="one layout"):
        ops.write_rows(rows, forms, *zip(*buffers, strict=True), torch.tensor(0))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("roles", ROLES.values(), ids=ROLES.keys())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens, start", [(1, 0), (1, 29), (13, 3), (CAPACITY - 1, 1)])
@pytest.mark.parametrize("spec", KERNEL_WRITES.values(), ids=KERNEL_WRITES.keys())
def test_the_cuda_kernel_writes_what_the_reference_writes(spec, tokens, start, dtype, roles):
    from kvq.kernels.dispatch import kernel_write_rows

    forms = _forms(spec, "cuda", roles)
    layout = forms[0].layout
    generator = torch.Generator("cuda").manual_seed(1)
    rows = [torch.randn(2, 3, tokens, 128, device="cuda", generator=generator).to(dtype) for _ in roles]
    fused = [_buffers(form, 2, 3, dtype, "cuda", seed=5 + i) for i, form in enumerate(forms)]
    reference = [[t.clone() for t in role] for role in fused]
    length = torch.tensor(start, device="cuda")
    assert kernel_write_rows(rows, [form.rotation_input for form in forms], [form.lam for form in forms], layout,
                             [form.codebook for form in forms], *map(list, zip(*fused, strict=True)), length)
    for role_rows, form, buffers in zip(rows, forms, reference, strict=True):
        ops.write_rows_through_quantize(role_rows, form.rotation_input, form.lam, layout, form.codebook,
                                        form.layer_scale, *buffers, length)
    for role, got_buffers, expected_buffers in zip(roles, fused, reference, strict=True):
        for name, got, expected in zip(("codes", "stats", "ring"), got_buffers, expected_buffers, strict=True):
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), (role, name)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("spec", QUANTIZE_WRITES.values(), ids=QUANTIZE_WRITES.keys())
def test_layouts_the_kernel_does_not_write_are_written_by_their_quantize_on_cuda(spec):
    from kvq.kernels.dispatch import kernel_write_rows

    (form,) = _forms(spec, "cuda")
    rows = torch.randn(1, 3, 2, 128, device="cuda", dtype=torch.float16)
    codes, scales, ring = _buffers(form, 1, 3, torch.float16, "cuda")
    length = torch.tensor(4, device="cuda")
    assert not kernel_write_rows([rows], [form.rotation_input], [form.lam], form.layout, [form.codebook], [codes],
                                 [scales], [ring], length)
    ops.write_rows([rows], [form], [codes], [scales], [ring], length)
    expected_codes, expected_stats = ops.quantize(rows, form)
    assert torch.equal(codes[:, :, 4:6], expected_codes)
    assert torch.equal(scales[:, :, 4:6].view(torch.uint8), expected_stats.view(torch.uint8))
