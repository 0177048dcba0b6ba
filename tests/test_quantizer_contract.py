"""One contract over every registered quantizer, at both sites: what a harness comparing methods relies on."""

import pytest
import torch

from kvq.quant import QUANTIZERS, QuantSpec, Site, build_quantizer, is_seeded
from kvq.quant.rotated import RotatedScalarConfig

D, TOKENS = 64, 40  # 40 tokens: a whole 32-token group and a partial one


def build(name: str, role: str, seed: int = 0):
    return build_quantizer(QuantSpec(name, 4, "per_token", 32, seed=seed), Site(3, role, D))


def half_input() -> torch.Tensor:
    return torch.randn(2, 3, TOKENS, D, generator=torch.Generator().manual_seed(0)).to(torch.float16)


@pytest.mark.parametrize("role", ["k", "v"])
@pytest.mark.parametrize("name", QUANTIZERS.names())
def test_every_quantizer_keeps_shape_and_measures_the_bits_it_states(name, role):
    x = half_input()
    quantizer = build(name, role)
    packed = quantizer.metered_encode(x)
    y = quantizer.decode(packed)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert quantizer.stored_bits / x.numel() == pytest.approx(quantizer.bits_per_element(D, TOKENS), rel=1e-12)
    relative_error = float(((y.float() - x.float()) ** 2).mean() / (x.float() ** 2).mean())
    assert relative_error < 1.0  # it carries information about x; each method's accuracy is tested on its own


ROTATED_DECODE_IN_FLOAT32 = pytest.mark.xfail(
    strict=True, reason="RotatedQuantizer.decode returns the inverse rotation's float32; callers cast")


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=ROTATED_DECODE_IN_FLOAT32)
    if issubclass(QUANTIZERS.get(name), RotatedScalarConfig) else name
    for name in QUANTIZERS.names()])
def test_every_quantizer_decodes_to_its_inputs_dtype(name):
    x = half_input()
    quantizer = build(name, "k")
    assert quantizer.decode(quantizer.encode(x)).dtype == x.dtype


@pytest.mark.parametrize("name", QUANTIZERS.names())
def test_every_quantizer_is_a_function_of_its_seed(name):
    x = torch.randn(1, 2, TOKENS, D, generator=torch.Generator().manual_seed(1))
    first, again, other = (build(name, "k", seed)(x) for seed in (0, 0, 1))
    assert torch.equal(first, again)
    assert torch.equal(first, other) != is_seeded(QuantSpec(name, 4))
