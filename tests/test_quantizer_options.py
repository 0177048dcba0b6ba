import pytest

from kvq.errors import KvqError
from kvq.quant import QUANTIZERS, QuantSpec, Site, build_quantizer


@pytest.mark.parametrize("role", ["k", "v"])
@pytest.mark.parametrize("name", QUANTIZERS.names())
def test_every_quantizer_rejects_a_knob_it_does_not_declare(name, role):
    with pytest.raises(KvqError, match=f"{name} has no option 'no_such_knob'"):
        build_quantizer(QuantSpec(name, options={"no_such_knob": 1}), Site(0, role, 64))


@pytest.mark.parametrize("role", ["k", "v"])
@pytest.mark.parametrize("name", QUANTIZERS.names())
def test_declared_knobs_are_type_checked(name, role):
    declared = QUANTIZERS.get(name).options()
    for knob in declared:
        with pytest.raises(KvqError, match=f"{name} option '{knob}' must be"):
            build_quantizer(QuantSpec(name, options={knob: [1]}), Site(0, role, 64))
