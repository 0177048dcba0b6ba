"""Typed description of one quantizer configuration, shared by the CLI and sweep YAML."""

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from kvq.errors import KvqError

ROLES = ("k", "v")


@dataclass(frozen=True)
class QuantSpec:
    """What to build at every (layer, K|V) site. `options` holds method-specific knobs (e.g. HQMQ's S)."""

    quantizer: str = "srft"
    bits: int = 4
    granularity: str = "per_token"
    group_size: int = 32
    symmetric: bool = True
    scale_dtype: str = "float32"
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    calibration: str | None = None  # path of a `kvq calibrate` artifact
    center: str = "none"  # key pre-conditioning (kvq.center): none, bias, mean or post_rope_mean

    def label(self) -> str:
        from kvq.quant import used_fields  # the registry imports this module
        from kvq.quant.scalar import GROUPED

        uses = used_fields(self.quantizer)
        parts = [self.quantizer]
        if "bits" in uses:
            parts.append(f"{self.bits}b")
        if "granularity" in uses:
            parts.append(self.granularity)
        if "group_size" in uses and (self.granularity in GROUPED or "granularity" not in uses):
            parts.append(f"g{self.group_size}")
        if "symmetric" in uses and not self.symmetric:
            parts.append("asym")
        parts += [f"{key}={value}" for key, value in sorted(self.options.items())]
        if self.calibration:
            parts.append(f"cal={Path(self.calibration).stem}")
        if self.center != "none":
            parts.append(f"center={self.center}")
        return "-".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Learned:
    """What a calibration artifact gives one site: base-rotation seed, learned R and lambda."""

    seed: int
    rotation: torch.Tensor | None = None
    lam: torch.Tensor | None = None


@dataclass(frozen=True)
class Site:
    """One place a quantizer sits: a layer's K or V stream of head vectors of width d."""

    layer: int
    role: str
    d: int
    learned: Learned | None = None

    def seed(self, base_seed: int) -> int:
        """Distinct, reproducible seed per (seed, layer, role): the rotation changes per layer."""
        return base_seed * 1_000_003 + self.layer * 2 + ROLES.index(self.role)


def check_role(role: str) -> str:
    if role not in ROLES:
        raise KvqError(f"role must be 'k' or 'v', got {role!r}")
    return role


def parse_spec(text: str) -> QuantSpec | None:
    """'fp' -> None (no quantization); else NAME[:BITS[:GRANULARITY[:GROUP]]][,key=value...].

    e.g. 'int:4', 'srft:4:per_channel_group:32', 'hqmq,S=24,r=6,outlier_c=3', 'kivi:4,residual=32'; `center=`
    sets the spec's key pre-conditioning (kvq.center), every other key a method option.
    """
    if text == "fp":
        return None
    head, *pairs = text.split(",")
    name, *fields_ = head.split(":")
    if len(fields_) > 3 or not name:
        raise KvqError(f"bad quantizer spec {text!r}: use NAME[:BITS[:GRANULARITY[:GROUP]]][,key=value...]")
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise KvqError(f"bad option {pair!r} in {text!r}: use key=value")
        options[key] = parse_scalar(value)
    try:
        numbers = [int(fields_[0])] if fields_ else []
        group = [int(fields_[2])] if len(fields_) > 2 else []
    except ValueError as exc:
        raise KvqError(f"bad quantizer spec {text!r}: bits and group size are integers") from exc
    kwargs: dict[str, Any] = {"quantizer": name, "options": options}
    if "center" in options:
        kwargs["center"] = str(options.pop("center"))
    if numbers:
        kwargs["bits"] = numbers[0]
    if len(fields_) > 1:
        kwargs["granularity"] = fields_[1]
    if group:
        kwargs["group_size"] = group[0]
    return QuantSpec(**kwargs)


def parse_scalar(text: str):
    """'3' -> 3, '0.5' -> 0.5, 'true' -> True, anything else stays a string."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)
