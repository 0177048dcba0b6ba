"""One contract over every registered quantizer, at both sites: what a harness comparing methods relies on.

The checks take a registry name, so a method registered anywhere (tests/test_toy_quantizer.py) runs them too.
"""

import pytest
import torch

from kvq import ops
from kvq.quant import QUANTIZERS, QuantSpec, Site, build_quantizer, is_seeded
from kvq.quant.rotated import RotatedPacked

D, TOKENS = 64, 40  # 40 tokens: a whole 32-token group and a partial one


def build(name: str, role: str, seed: int = 0, granularity: str = "per_token"):
    return build_quantizer(QuantSpec(name, 4, granularity, 32, seed=seed), Site(3, role, D))


def half_input() -> torch.Tensor:
    return torch.randn(2, 3, TOKENS, D, generator=torch.Generator().manual_seed(0)).to(torch.float16)


def assert_keeps_shape_and_dtype_and_measures_the_bits_it_states(name: str, role: str) -> None:
    x = half_input()
    quantizer = build(name, role)
    packed = quantizer.metered_encode(x)
    y = quantizer.decode(packed)
    assert y.shape == x.shape and y.dtype == x.dtype and torch.isfinite(y).all()
    assert quantizer.stored_bits / x.numel() == pytest.approx(quantizer.bits_per_element(D, TOKENS), rel=1e-12)
    relative_error = float(((y.float() - x.float()) ** 2).mean() / (x.float() ** 2).mean())
    assert relative_error < 1.0  # it carries information about x; each method's accuracy is tested on its own


def assert_is_a_function_of_its_seed(name: str) -> None:
    x = torch.randn(1, 2, TOKENS, D, generator=torch.Generator().manual_seed(1))
    first, again, other = (build(name, "k", seed)(x) for seed in (0, 0, 1))
    assert torch.equal(first, again)
    assert torch.equal(first, other) != is_seeded(QuantSpec(name, 4))


def assert_packed_layout_round_trips_through_the_ops(name: str, granularity: str) -> None:
    """A quantizer that declares a PackedLayout stores exactly that layout (its bits per element are the
    layout's codes and scales), and kvq.ops' reference quantize/dequantize reproduce its own encode/decode."""
    quantizer = build(name, "k", granularity=granularity)
    form = quantizer.calibrated_form(half_input())  # a layer scale, where the layout has one, fixed by its first K/V
    if form is None:
        assert quantizer.packing_reason()
        return
    layout = form.layout
    if layout.token_group > 1 or layout.codebook:  # KIVI's keys, TurboQuant's codebook codes: its own encode
        assert_the_ops_decode_its_codes_as_it_does(quantizer, form)
        return
    row_bits = 8 * (layout.code_bytes + layout.stats * layout.scale_dtype.itemsize)
    assert quantizer.bits_per_element(D, TOKENS) == row_bits / D
    x = half_input()
    codes, scales = ops.quantize(x, form)
    expected = quantizer.encode(x)
    assert codes.shape == (*x.shape[:-1], layout.code_bytes) and scales.shape == (*x.shape[:-1], layout.stats)
    packed = ops.encode(quantizer, x)
    assert torch.equal(packed.inner.codes, codes)
    if isinstance(expected, RotatedPacked):  # an engine's own storage (llama.cpp's blocks) orders its bytes its way
        assert torch.equal(packed.inner.codes, expected.inner.codes)
    assert torch.equal(ops.decode(quantizer, packed), quantizer.decode(expected))
    for dtype in (torch.float16, torch.float32):  # what hook and cache mode measure, in either model dtype
        through_ops, direct = (build(name, "k", granularity=granularity) for _ in range(2))
        assert torch.equal(ops.roundtrip(through_ops, x.to(dtype)), direct(x.to(dtype)))
        assert through_ops.stored_bits == direct.stored_bits and through_ops.stored_elements == direct.stored_elements


def assert_the_ops_decode_its_codes_as_it_does(quantizer, form) -> None:
    """A layout whose encode the ops leave to the quantizer (stats spanning tokens, codebook codes): over whole
    token groups it stores the layout's codes and a stats row per group (per token), and the ops decode them to
    what the quantizer's own decode gives."""
    layout = form.layout
    whole = half_input()[..., :TOKENS // layout.token_group * layout.token_group, :]
    stats_bits = 8 * layout.stats * layout.stats_dtype.itemsize / layout.token_group
    assert quantizer.bits_per_element(D, whole.shape[-2]) == (8 * layout.code_bytes + stats_bits) / D
    codes, stats = ops.quantize(whole, form)
    assert stats.shape == (*whole.shape[:-2], whole.shape[-2] // layout.token_group, layout.stats)
    assert torch.equal(ops.dequantize(codes, stats, form, whole.dtype), quantizer.decode(quantizer.encode(whole)))


@pytest.mark.parametrize("role", ["k", "v"])
@pytest.mark.parametrize("name", QUANTIZERS.names())
def test_the_ops_round_trip_is_every_quantizers_own(name, role):
    """What hook and cache mode run (kvq.ops.roundtrip) is the quantizer's own quantize-dequantize, metered alike,
    over 40 tokens: a whole 32-token group and a partial one, which KIVI keeps exact in both roles."""
    x = half_input().float()
    through_ops, direct = (build(name, role) for _ in range(2))
    assert torch.equal(ops.roundtrip(through_ops, x), direct(x))
    assert (through_ops.stored_bits, through_ops.stored_elements) == (direct.stored_bits, direct.stored_elements)


@pytest.mark.parametrize("role", ["k", "v"])
@pytest.mark.parametrize("name", QUANTIZERS.names())
def test_every_quantizer_keeps_shape_and_dtype_and_measures_the_bits_it_states(name, role):
    assert_keeps_shape_and_dtype_and_measures_the_bits_it_states(name, role)


@pytest.mark.parametrize("name", QUANTIZERS.names())
def test_every_quantizer_is_a_function_of_its_seed(name):
    assert_is_a_function_of_its_seed(name)


@pytest.mark.parametrize("granularity", ["per_token", "per_group", "per_channel"])
@pytest.mark.parametrize("name", QUANTIZERS.names())
def test_every_declared_packed_layout_round_trips_through_the_ops(name, granularity):
    assert_packed_layout_round_trips_through_the_ops(name, granularity)
