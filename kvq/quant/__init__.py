"""Quantizer registry: YAML/CLI names -> typed configs (kvq.quant.config) building one quantizer per
(layer, K|V) site. Every module of this package is imported here, so a method registers by existing."""

import importlib
import pkgutil

from kvq.quant.base import Packed, Quantizer
from kvq.quant.config import (
    QUANTIZERS,
    SCALAR_FIELDS,
    QuantizerConfig,
    check_options,
    config_for,
    describe,
    register_quantizer,
)
from kvq.quant.spec import Learned, QuantSpec, Site

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def build_quantizer(spec: QuantSpec, site: Site) -> Quantizer:
    return config_for(spec).build(site, spec.seed)


def used_fields(name: str) -> frozenset[str]:
    return QUANTIZERS.get(name).uses()


def is_seeded(spec: QuantSpec) -> bool:
    """Whether the seed changes this quantizer; a calibration artifact fixes the seed it was made with."""
    return QUANTIZERS.get(spec.quantizer).seeded and not spec.calibration


__all__ = [
    "QUANTIZERS",
    "SCALAR_FIELDS",
    "Learned",
    "Packed",
    "QuantSpec",
    "Quantizer",
    "QuantizerConfig",
    "Site",
    "build_quantizer",
    "check_options",
    "config_for",
    "describe",
    "is_seeded",
    "register_quantizer",
    "used_fields",
]
