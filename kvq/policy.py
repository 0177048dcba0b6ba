"""Per-site quantizer policies: K and V settings apart, and per-layer overrides.

A cell's QuantSpec is the base. A SitePolicy changes it per (layer, K|V) site:

    policy:
      k: {bits: 8}                      # K sites: these QuantSpec fields replace the base's
      v: {bits: 4}
      layers:                           # then per layer, by exactly one selector each
        - {first: 2, use: fp}           # the first two layers keep exact K/V
        - {last: 1, use: fp}
        - {layers: [5, "8-11"], k: {granularity: per_channel_group}}
        - {last: 4, k: {center: bias}}  # those layers' keys less k_proj's bias before encoding (kvq.center)

`use: fp` keeps a site exact (fp16, 16 stored bits per element, nothing quantized); `k:` / `v:` inside a layer
rule override that role's fields on those layers. Two rules that select one layer must agree on every field they
both set, so the order of rules never matters. This is how deployed mixes are written: vLLM's K8/V4, KIVI's K
and V granularities, boundary layers kept in fp for Qwen2's k_proj-bias collapse.
"""

from dataclasses import dataclass, field, replace
from typing import Any

from kvq.errors import KvqError
from kvq.quant.spec import ROLES, QuantSpec

FP = "fp"
SPEC_FIELDS = {"quantizer": str, "bits": int, "granularity": str, "group_size": int, "symmetric": bool,
               "scale_dtype": str, "options": dict, "center": str}  # the QuantSpec fields a site may set
RULE_SELECTORS = ("first", "last", "layers")


@dataclass(frozen=True)
class LayerRule:
    """Layers chosen by `first` (the first n), `last` (the last n) or `layers` (indices and "a-b" ranges, both
    ends included); what they get: `fp`, or per-role field overrides."""

    selector: str
    value: Any
    fp: bool = False
    roles: dict[str, dict[str, Any]] = field(default_factory=dict)

    def layers_of(self, n_layers: int) -> set[int]:
        if self.selector == "first":
            return set(range(min(self.value, n_layers)))
        if self.selector == "last":
            return set(range(max(n_layers - self.value, 0), n_layers))
        chosen = set()
        for item in self.value:
            start, end = _bounds(item)
            if end >= n_layers:
                raise KvqError(f"policy.layers: {item!r} is out of range for a model of {n_layers} layers "
                               f"(0..{n_layers - 1})")
            chosen.update(range(start, end + 1))
        return chosen

    def to_dict(self) -> dict[str, Any]:
        value = list(self.value) if self.selector == "layers" else self.value
        return {self.selector: value, **({"use": FP} if self.fp else {}), **self.roles}


@dataclass(frozen=True)
class SitePolicy:
    roles: dict[str, dict[str, Any]] = field(default_factory=dict)  # "k"/"v" -> QuantSpec field overrides
    rules: tuple[LayerRule, ...] = ()

    def site_specs(self, base: QuantSpec, n_layers: int) -> dict[tuple[int, str], QuantSpec | None]:
        """Every (layer, role) site's QuantSpec, None where it stays exact; raises KvqError naming a rule out of
        range or two rules that disagree on a layer."""
        chosen = [(rule, rule.layers_of(n_layers)) for rule in self.rules]
        return {(layer, role): self._site_spec(base, layer, role, [r for r, layers in chosen if layer in layers])
                for layer in range(n_layers) for role in ROLES}

    def _site_spec(self, base: QuantSpec, layer: int, role: str, rules: list[LayerRule]) -> QuantSpec | None:
        overrides = dict(self.roles.get(role, {}))
        settled: dict[str, tuple[Any, LayerRule]] = {}
        exact = None
        for rule in rules:
            if exact is not None and exact.fp != rule.fp:
                raise KvqError(f"policy.layers: {_describe(exact)} and {_describe(rule)} disagree on layer {layer} "
                               "(one keeps it fp, the other quantizes it)")
            exact = rule
            for key, value in rule.roles.get(role, {}).items():
                if key in settled and settled[key][0] != value:
                    raise KvqError(f"policy.layers: {_describe(settled[key][1])} and {_describe(rule)} disagree on "
                                   f"{role}.{key} of layer {layer} ({settled[key][0]!r} vs {value!r})")
                settled[key] = (value, rule)
        if exact is not None and exact.fp:
            return None
        overrides.update({key: value for key, (value, _rule) in settled.items()})
        return replace(base, **overrides) if overrides else base

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {role: dict(fields_) for role, fields_ in self.roles.items()}
        if self.rules:
            out["layers"] = [rule.to_dict() for rule in self.rules]
        return out

    @property
    def is_default(self) -> bool:
        return not self.roles and not self.rules

    def label(self) -> str:
        """Short and unique per policy, e.g. 'k[bits=8] v[bits=4] first2:fp'; '' for the default."""
        def fields_(role_fields: dict) -> str:
            return ",".join(f"{key}={value}" for key, value in sorted(role_fields.items()))

        parts = [f"{role}[{fields_(self.roles[role])}]" for role in ROLES if role in self.roles]
        for rule in self.rules:
            chosen = ",".join(map(str, rule.value)) if rule.selector == "layers" else str(rule.value)
            what = FP if rule.fp else " ".join(f"{role}[{fields_(rule.roles[role])}]" for role in ROLES
                                               if role in rule.roles)
            parts.append(f"{rule.selector}{chosen}:{what}")
        return " ".join(parts)


def _bounds(item) -> tuple[int, int]:
    if isinstance(item, int) and not isinstance(item, bool):
        return item, item
    start, sep, end = str(item).partition("-")
    if sep and start.isdigit() and end.isdigit() and int(start) <= int(end):
        return int(start), int(end)
    raise KvqError(f"policy.layers: {item!r} is not a layer index or an 'a-b' range")


def _describe(rule: LayerRule) -> str:
    return f"{{{rule.selector}: {rule.to_dict()[rule.selector]!r}}}"


def _role_fields(value, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise KvqError(f"policy.{where}: expected a mapping of quantizer fields, got {value!r}")
    for key, item in value.items():
        if key not in SPEC_FIELDS:
            raise KvqError(f"policy.{where}.{key}: unknown field; expected one of {', '.join(SPEC_FIELDS)}")
        kind = SPEC_FIELDS[key]
        if not isinstance(item, kind) or (kind is int and isinstance(item, bool)):
            raise KvqError(f"policy.{where}.{key}: expected {kind.__name__}, got {item!r}")
    return {key: dict(item) if isinstance(item, dict) else item for key, item in value.items()}


def parse_policy(raw: dict | None) -> SitePolicy:
    """A policy from its YAML / JSON form (see the module docstring); raises KvqError naming the bad field."""
    if raw is None:
        return SitePolicy()
    if not isinstance(raw, dict):
        raise KvqError(f"policy: expected a mapping, got {raw!r}")
    for key in raw:
        if key not in (*ROLES, "layers"):
            raise KvqError(f"policy.{key}: unknown field; expected one of k, v, layers")
    roles = {role: _role_fields(raw[role], role) for role in ROLES if role in raw}
    rules = []
    layer_rules = raw.get("layers", [])
    if not isinstance(layer_rules, list):
        raise KvqError("policy.layers: expected a list of rules")
    for index, rule in enumerate(layer_rules):
        where = f"layers[{index}]"
        if not isinstance(rule, dict):
            raise KvqError(f"policy.{where}: expected a mapping, got {rule!r}")
        for key in rule:
            if key not in (*RULE_SELECTORS, "use", *ROLES):
                raise KvqError(f"policy.{where}.{key}: unknown field; expected one of "
                               f"{', '.join((*RULE_SELECTORS, 'use', *ROLES))}")
        selectors = [key for key in RULE_SELECTORS if key in rule]
        if len(selectors) != 1:
            raise KvqError(f"policy.{where}: give exactly one of first, last, layers")
        selector = selectors[0]
        value = rule[selector]
        if selector == "layers":
            value = tuple(value) if isinstance(value, list) else (value,)
            for item in value:
                if _bounds(item)[0] < 0:
                    raise KvqError(f"policy.{where}.layers: {item!r} is negative")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KvqError(f"policy.{where}.{selector}: expected a whole number of layers >= 1, got {value!r}")
        use = rule.get("use")
        if use not in (None, FP):
            raise KvqError(f"policy.{where}.use: only 'fp' is allowed, got {use!r}")
        role_fields = {role: _role_fields(rule[role], f"{where}.{role}") for role in ROLES if role in rule}
        if use == FP and role_fields:
            raise KvqError(f"policy.{where}: 'use: fp' takes no k/v fields")
        if use is None and not role_fields:
            raise KvqError(f"policy.{where}: give 'use: fp' or k/v fields")
        rules.append(LayerRule(selector, value, use == FP, role_fields))
    return SitePolicy(roles, tuple(rules))
