"""Quantizer registry: YAML/CLI names -> factories building one quantizer per (layer, K|V) site."""

from collections.abc import Callable
from dataclasses import dataclass

from kvq.quant.base import Packed, Quantizer
from kvq.quant.rotated import RotatedQuantizer
from kvq.quant.scalar import ScalarQuantizer
from kvq.quant.spec import Learned, QuantSpec, Site
from kvq.registry import Registry
from kvq.rotations import ROTATIONS, Composed, MatrixRotation, build_rotation


@dataclass(frozen=True)
class QuantizerEntry:
    build: Callable[[QuantSpec, Site], Quantizer]
    seeded: bool  # False: the seed changes nothing, so a sweep runs one seed only


QUANTIZERS: Registry[QuantizerEntry] = Registry("quantizer")


def scalar_from_spec(spec: QuantSpec) -> ScalarQuantizer:
    return ScalarQuantizer(spec.bits, spec.granularity, spec.group_size, spec.symmetric, spec.scale_dtype)


def _rotated_scalar(rotation_name: str) -> QuantizerEntry:
    def build(spec: QuantSpec, site: Site) -> Quantizer:
        learned = site.learned
        rotation = build_rotation(rotation_name, site.d, site.seed(learned.seed if learned else spec.seed))
        if learned and learned.rotation is not None:
            rotation = Composed(rotation, MatrixRotation(learned.rotation))
        return RotatedQuantizer(rotation, scalar_from_spec(spec), learned.lam if learned else None)

    return QuantizerEntry(build, seeded=rotation_name != "identity")


QUANTIZERS.register("int")(_rotated_scalar("identity"))
for _name in ROTATIONS.names():
    QUANTIZERS.register(_name)(_rotated_scalar(_name))


def build_quantizer(spec: QuantSpec, site: Site) -> Quantizer:
    return QUANTIZERS.get(spec.quantizer).build(spec, site)


def is_seeded(spec: QuantSpec) -> bool:
    """Whether the seed changes this quantizer; a calibration artifact fixes the seed it was made with."""
    return QUANTIZERS.get(spec.quantizer).seeded and not spec.calibration


__all__ = [
    "QUANTIZERS", "Learned", "Packed", "QuantSpec", "Quantizer", "QuantizerEntry", "Site", "build_quantizer",
    "is_seeded", "scalar_from_spec",
]
