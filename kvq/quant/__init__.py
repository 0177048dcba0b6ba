"""Quantizer registry: YAML/CLI names -> factories building one quantizer per (layer, K|V) site."""

from collections.abc import Callable
from dataclasses import dataclass, field

from kvq.errors import KvqError
from kvq.quant.base import Packed, Quantizer
from kvq.quant.hqmq import HQMQ
from kvq.quant.kivi import KIVI
from kvq.quant.polar import PolarQuant
from kvq.quant.qjl import QJLKeys
from kvq.quant.rotated import RotatedQuantizer
from kvq.quant.scalar import ScalarQuantizer
from kvq.quant.spec import Learned, QuantSpec, Site
from kvq.quant.split import ChannelSplit
from kvq.quant.turbo import TurboQuant
from kvq.registry import Registry
from kvq.rotations import ROTATIONS, Composed, MatrixRotation, build_rotation

SCALAR_FIELDS = frozenset({"bits", "granularity", "group_size", "symmetric", "scale_dtype"})


OptionKinds = dict[str, type | tuple[type, ...]]


@dataclass(frozen=True)
class QuantizerEntry:
    build: Callable[[QuantSpec, Site], Quantizer]
    seeded: bool  # False: the seed changes nothing, so a sweep runs one seed only
    uses: frozenset[str] = SCALAR_FIELDS  # the QuantSpec scalar fields it reads; other knobs are spec.options
    options: OptionKinds = field(default_factory=dict)  # the spec.options keys it reads, with their types


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


def check_options(spec: QuantSpec) -> None:
    """spec.options against the quantizer's declared knobs, so a typo or a knob the method does not
    have is an error rather than a silent default (and a cell id that changes nothing)."""
    allowed = QUANTIZERS.get(spec.quantizer).options
    for key, value in spec.options.items():
        if key not in allowed:
            known = f"options: {', '.join(allowed)}" if allowed else "it takes no options"
            raise KvqError(f"{spec.quantizer} has no option {key!r}; {known}")
        kinds = allowed[key] if isinstance(allowed[key], tuple) else (allowed[key],)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise KvqError(f"{spec.quantizer} option {key!r} must be {names}, got {value!r}")


def used_fields(name: str) -> frozenset[str]:
    return QUANTIZERS.get(name).uses


def _hqmq(spec: QuantSpec, site: Site) -> Quantizer:
    knobs = spec.options
    return HQMQ(knobs.get("S", 24), knobs.get("r", 4), knobs.get("outlier_c"), site.seed(spec.seed),
                knobs.get("index_bits", "fractional"))


QUANTIZERS.register("hqmq")(QuantizerEntry(_hqmq, seeded=True, uses=frozenset(), options={
    "S": int, "r": int, "outlier_c": (int, float), "index_bits": str}))


def _kivi(spec: QuantSpec, site: Site) -> Quantizer:
    return KIVI(site.role, spec.bits, spec.group_size)


QUANTIZERS.register("kivi")(QuantizerEntry(_kivi, seeded=False, uses=frozenset({"bits", "group_size"})))


def _turbo(spec: QuantSpec, site: Site) -> Quantizer:
    """variant mse (Alg. 1) everywhere, or prod (Alg. 2) on keys with mse on values; with `outliers`
    channels per `outlier_group` tokens at `outlier_bits` beside the rest at `bits` (ChannelSplit)."""
    knobs = spec.options
    variant = knobs.get("variant", "mse")
    if variant not in TURBO_VARIANTS:
        raise KvqError(f"turbo option 'variant' must be one of {', '.join(TURBO_VARIANTS)}, got {variant!r}")
    seed = site.seed(spec.seed)

    def instance(d: int, bits: int, seed: int) -> TurboQuant:
        rotation = build_rotation(knobs.get("rotation", "srft"), d, seed)
        return TurboQuant(rotation, bits, prod=variant == "prod" and site.role == "k", seed=seed)

    count = knobs.get("outliers", 0)
    if not count:
        return instance(site.d, spec.bits, seed)
    outliers = instance(count, knobs.get("outlier_bits", spec.bits + 1), seed + OUTLIER_SEED_OFFSET)
    regular = instance(site.d - count, spec.bits, seed)
    return ChannelSplit(site.d, count, knobs.get("outlier_group", 32), outliers, regular)


TURBO_VARIANTS = ("mse", "prod")
OUTLIER_SEED_OFFSET = 1 << 40  # past every site seed, so the two instances' rotations are independent
QUANTIZERS.register("turbo")(QuantizerEntry(_turbo, seeded=True, uses=frozenset({"bits"}), options={
    "rotation": str, "variant": str, "outliers": int, "outlier_bits": int, "outlier_group": int}))


def _polar(spec: QuantSpec, site: Site) -> Quantizer:
    knobs = spec.options
    rotation = build_rotation(knobs.get("rotation", "srft"), site.d, site.seed(spec.seed))
    return PolarQuant(rotation, spec.bits, knobs.get("upper_bits", 2), knobs.get("levels", 4))


QUANTIZERS.register("polar")(QuantizerEntry(_polar, seeded=True, uses=frozenset({"bits"}),
                                            options={"upper_bits": int, "levels": int, "rotation": str}))


def _qjl(spec: QuantSpec, site: Site) -> Quantizer:
    """Keys: QJL sketch with m = options.m rows (default 2 d), or initial_m rows in the first
    initial_layers layers (the official code's larger sketch for early layers); values: the spec's
    scalar quantizer."""
    if site.role == "k":
        knobs = spec.options
        rows = knobs.get("m", 2 * site.d)
        if site.layer < knobs.get("initial_layers", 0):
            rows = knobs.get("initial_m", rows)
        return QJLKeys(site.d, rows, site.seed(spec.seed), knobs.get("orthogonal", True),
                       knobs.get("outliers", 0), knobs.get("outlier_group", 32))
    return scalar_from_spec(spec)


QUANTIZERS.register("qjl")(QuantizerEntry(_qjl, seeded=True, options={
    "m": int, "initial_layers": int, "initial_m": int, "orthogonal": bool, "outliers": int, "outlier_group": int}))


def build_quantizer(spec: QuantSpec, site: Site) -> Quantizer:
    check_options(spec)
    return QUANTIZERS.get(spec.quantizer).build(spec, site)


def is_seeded(spec: QuantSpec) -> bool:
    """Whether the seed changes this quantizer; a calibration artifact fixes the seed it was made with."""
    return QUANTIZERS.get(spec.quantizer).seeded and not spec.calibration


__all__ = [
    "QUANTIZERS", "Learned", "Packed", "QuantSpec", "Quantizer", "QuantizerEntry", "Site", "build_quantizer",
    "check_options", "is_seeded", "scalar_from_spec", "used_fields",
]
