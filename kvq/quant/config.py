"""Typed quantizer configs, registered at their class: each method's one source of its knobs, defaults and checks.

A config is a frozen dataclass. Its fields named as QuantSpec's scalar fields (bits, granularity, group_size,
symmetric, scale_dtype) take the spec's values; every other field is an option (YAML `options:`, the CLI's
`--option key=value` or `NAME,key=value`), with its default here. The CLI, sweep YAML and expansion,
`kvq list` and error messages all read the registered classes, so a new method is one new file:

    @register_quantizer("toy")
    @dataclass(frozen=True)
    class ToyConfig(QuantizerConfig):
        bits: int
        knob: int = 3

        def build(self, site: Site, seed: int) -> Quantizer: ...
"""

import types
import typing
from dataclasses import MISSING, dataclass, fields
from functools import cache
from typing import Any, ClassVar, Literal

from kvq.errors import KvqError
from kvq.quant.base import Quantizer
from kvq.quant.spec import QuantSpec, Site
from kvq.registry import Registry

SCALAR_FIELDS = frozenset({"bits", "granularity", "group_size", "symmetric", "scale_dtype"})


@dataclass(frozen=True)
class QuantizerConfig:
    """`seeded`: whether the seed changes what is built (False: a sweep runs one seed only)."""

    name: ClassVar[str] = ""
    seeded: ClassVar[bool] = True

    def build(self, site: Site, seed: int) -> Quantizer:
        """The quantizer of one (layer, K|V) site; `seed` is the spec's, which site.seed(seed) makes the
        site's own."""
        raise NotImplementedError

    @classmethod
    def uses(cls) -> frozenset[str]:
        """The QuantSpec scalar fields it reads."""
        return frozenset(f.name for f in fields(cls)) & SCALAR_FIELDS

    @classmethod
    def options(cls) -> dict[str, Any]:
        """Option name -> default (MISSING for none)."""
        return {f.name: f.default for f in fields(cls) if f.name not in SCALAR_FIELDS}


QUANTIZERS: Registry[type[QuantizerConfig]] = Registry("quantizer")


def register_quantizer(name: str):
    """Registers a QuantizerConfig subclass under the name YAML and the CLI use."""

    def add(cls: type[QuantizerConfig]) -> type[QuantizerConfig]:
        cls.name = name
        for option in cls.options():
            _arms(_hints(cls)[option])  # an option type the checks cannot read fails here, at import
        return QUANTIZERS.register(name)(cls)

    return add


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _arms(hint) -> tuple:
    """The alternatives of an option's annotation: types, or Literal values (as ('literal', values))."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return (("literal", typing.get_args(hint)),)
    if origin in (typing.Union, types.UnionType):
        return tuple(arm for part in typing.get_args(hint) for arm in _arms(part))
    if hint in (int, float, bool, str, type(None)):
        return (hint,)
    raise TypeError(f"option annotation {hint!r}: use int, float, bool, str, None, Literal or unions of them")


def _matches(value, arm) -> bool:
    if isinstance(arm, tuple):
        return value in arm[1] and not isinstance(value, bool)
    if arm is bool or isinstance(value, bool):
        return arm is bool and isinstance(value, bool)
    if arm is float:
        return isinstance(value, (int, float))
    return isinstance(value, arm)


def _expected(arms: tuple) -> str:
    literal = [arm for arm in arms if isinstance(arm, tuple)]
    if literal and len(arms) == 1:
        return "one of " + ", ".join(map(str, literal[0][1]))
    return " or ".join("None" if arm is type(None) else arm.__name__ if not isinstance(arm, tuple)
                       else "one of " + ", ".join(map(str, arm[1])) for arm in arms)


def check_options(spec: QuantSpec) -> None:
    """spec.options against the quantizer's declared knobs, so a typo or a knob the method does not
    have is an error rather than a silent default (and a cell id that changes nothing)."""
    cls = QUANTIZERS.get(spec.quantizer)
    declared = cls.options()
    for key, value in spec.options.items():
        if key not in declared:
            known = f"options: {', '.join(declared)}" if declared else "it takes no options"
            raise KvqError(f"{spec.quantizer} has no option {key!r}; {known}")
        arms = _arms(_hints(cls)[key])
        if not any(_matches(value, arm) for arm in arms):
            raise KvqError(f"{spec.quantizer} option {key!r} must be {_expected(arms)}, got {value!r}")


def config_for(spec: QuantSpec) -> QuantizerConfig:
    """The spec as its quantizer's typed config (options checked)."""
    check_options(spec)
    cls = QUANTIZERS.get(spec.quantizer)
    return cls(**{name: getattr(spec, name) for name in cls.uses()}, **spec.options)


def describe(cls: type[QuantizerConfig]) -> str:
    """One line for `kvq list`: the spec fields it reads and its options with their defaults."""
    parts = sorted(cls.uses())
    for option, default in cls.options().items():
        hint = _expected(_arms(_hints(cls)[option]))
        parts.append(f"{option}: {hint}" + ("" if default is MISSING else f" = {default!r}"))
    return ", ".join(parts) + ("" if cls.seeded else "; unseeded")
