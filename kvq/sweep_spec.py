"""Typed sweep specs (YAML) and their expansion into cells with stable ids."""

import hashlib
import itertools
import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvq.center import CENTERS
from kvq.data import DataSpec
from kvq.errors import KvqError
from kvq.policy import SitePolicy, parse_policy
from kvq.protocol import MODES, Protocol
from kvq.quant import QUANTIZERS, SCALAR_FIELDS, QuantSpec, check_options, is_seeded, used_fields
from kvq.quant.scalar import GRANULARITIES, GROUPED, SCALE_DTYPES
from kvq.yamlspec import Fields, LocatedMapping, load_located

METRICS = ("ppl", "kld")
LMEVAL_PREFIX = "lmeval:"  # metrics "lmeval:<task>" run an lm-eval task per cell
GRID_FIELDS = ("quantizer", "bits", "granularity", "group_size", "symmetric", "scale_dtype", "options",
               "calibration", "center")


@dataclass(frozen=True)
class Grid:
    quantizer: list[str]
    bits: list[int] = field(default_factory=lambda: [4])
    granularity: list[str] = field(default_factory=lambda: ["per_token"])
    group_size: list[int] = field(default_factory=lambda: [32])
    symmetric: list[bool] = field(default_factory=lambda: [True])
    scale_dtype: list[str] = field(default_factory=lambda: ["float32"])
    options: list[dict] = field(default_factory=lambda: [{}])
    calibration: list[str | None] = field(default_factory=lambda: [None])
    center: list[str] = field(default_factory=lambda: ["none"])


@dataclass(frozen=True)
class LmevalSpec:
    limit: int | None = None
    lengths: tuple[int, ...] = (512, 1024)  # for kvq's generated tasks (kvq_passkey, kvq_vt)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)

    def to_dict(self) -> dict:
        return {"limit": self.limit, "lengths": list(self.lengths), "depths": list(self.depths)}


@dataclass(frozen=True)
class SweepSpec:
    name: str
    models: list[str]
    grids: list[Grid]
    data: DataSpec = field(default_factory=DataSpec)
    mode: str = "hook"
    seeds: list[int] = field(default_factory=lambda: [0])
    metrics: list[str] = field(default_factory=lambda: ["ppl"])
    lmeval: LmevalSpec = field(default_factory=LmevalSpec)
    protocols: list[Protocol] = field(default_factory=lambda: [Protocol()])
    policies: list[SitePolicy] = field(default_factory=lambda: [SitePolicy()])
    source: str = ""

    @property
    def lmeval_tasks(self) -> list[str]:
        return [m[len(LMEVAL_PREFIX):] for m in self.metrics if m.startswith(LMEVAL_PREFIX)]


@dataclass(frozen=True)
class Cell:
    model: str
    mode: str
    data: DataSpec
    quant: QuantSpec
    lmeval_tasks: tuple[str, ...] = ()
    lmeval: LmevalSpec = field(default_factory=LmevalSpec)
    protocol: Protocol = field(default_factory=Protocol)
    policy: SitePolicy = field(default_factory=SitePolicy)
    kld: bool = False  # KL divergence to fp and top-1 agreement beside PPL

    def config(self) -> dict[str, Any]:
        config = {"model": self.model, "mode": self.mode, "data": self.data.to_dict(), "quant": self.quant.to_dict()}
        if self.lmeval_tasks:  # only then, so ppl-only cells keep their ids
            config["lmeval"] = {"tasks": list(self.lmeval_tasks), **self.lmeval.to_dict()}
        if not self.protocol.is_default:  # likewise for cells under the default protocol, one policy, PPL alone
            config["protocol"] = self.protocol.to_dict()
        if not self.policy.is_default:
            config["policy"] = self.policy.to_dict()
        if self.kld:
            config["metrics"] = ["ppl", "kld"]
        return config

    def label(self) -> str:
        return " ".join(part for part in (self.quant.label(), self.policy.label(), self.protocol.label()) if part)

    @property
    def id(self) -> str:
        """Hash of the config with default-valued quantizer fields left out, so adding a field with a
        default later keeps the ids (and the finished results) of existing cells."""
        defaults = QuantSpec().to_dict()
        config = self.config()
        config["quant"] = {k: v for k, v in config["quant"].items() if k == "quantizer" or v != defaults[k]}
        blob = json.dumps(config, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def _check_members(fields_: Fields, key: str, values: list, allowed) -> None:
    for value in values:
        if value not in allowed:
            fields_.fail(key, f"{value!r} is not one of {', '.join(map(str, allowed))}")


def _grid(fields_: Fields) -> Grid:
    fields_.unknown_keys(GRID_FIELDS)
    defaults = Grid(quantizer=[])
    grid = Grid(
        quantizer=fields_.get_list("quantizer", str, required=True),
        bits=fields_.get_list("bits", int, defaults.bits),
        granularity=fields_.get_list("granularity", str, defaults.granularity),
        group_size=fields_.get_list("group_size", int, defaults.group_size),
        symmetric=fields_.get_list("symmetric", bool, defaults.symmetric),
        scale_dtype=fields_.get_list("scale_dtype", str, defaults.scale_dtype),
        options=[dict(o) for o in fields_.get_list("options", dict, defaults.options)],
        calibration=fields_.get_list("calibration", (str, type(None)), defaults.calibration),
        center=fields_.get_list("center", str, defaults.center),
    )
    _check_members(fields_, "quantizer", grid.quantizer, QUANTIZERS.names())
    _check_members(fields_, "granularity", grid.granularity, GRANULARITIES)
    _check_members(fields_, "scale_dtype", grid.scale_dtype, list(SCALE_DTYPES))
    _check_members(fields_, "center", grid.center, CENTERS)
    for quantizer, options in itertools.product(grid.quantizer, grid.options):
        try:
            check_options(QuantSpec(quantizer, options=options))
        except KvqError as exc:
            fields_.fail("options", str(exc))
    for bits in grid.bits:
        if not 2 <= bits <= 8:
            fields_.fail("bits", f"bits must be in 2..8, got {bits}")
    for size in grid.group_size:
        if size < 1:
            fields_.fail("group_size", f"must be positive, got {size}")
    return grid


# `executor` says how cells run (kvq.executors reads it), never what they measure: it enters no cell.
TOP_FIELDS = ("name", "models", "data", "mode", "grid", "seeds", "metrics", "lmeval", "protocol", "policy",
              "executor")
PROTOCOL_FIELDS = tuple(f.name for f in fields(Protocol))
LMEVAL_FIELDS = ("limit", "lengths", "depths")
DATA_FIELDS = tuple(f.name for f in fields(DataSpec))


def load_sweep(path: str | Path) -> SweepSpec:
    path = Path(path)
    top = Fields(path, load_located(path))
    top.unknown_keys(TOP_FIELDS)
    data_fields = top.nested("data")
    data_fields.unknown_keys(DATA_FIELDS)
    default = DataSpec()
    data = DataSpec(
        corpus=data_fields.get("corpus", str, default.corpus),
        seq_len=data_fields.get("seq_len", int, default.seq_len),
        n_windows=data_fields.get("n_windows", int, default.n_windows),
        batch_size=data_fields.get("batch_size", int, default.batch_size),
    )
    for key in ("seq_len", "n_windows", "batch_size"):
        if getattr(data, key) < (2 if key == "seq_len" else 1):
            data_fields.fail(key, f"too small: {getattr(data, key)}")
    lmeval_fields = top.nested("lmeval")
    lmeval_fields.unknown_keys(LMEVAL_FIELDS)
    lmeval_default = LmevalSpec()
    lmeval = LmevalSpec(
        limit=lmeval_fields.get("limit", int, None),
        lengths=tuple(lmeval_fields.get_list("lengths", int, list(lmeval_default.lengths))),
        depths=tuple(float(d) for d in lmeval_fields.get_list("depths", (int, float), list(lmeval_default.depths))),
    )
    protocols = [_protocol(fields_) for fields_ in _mappings(top, "protocol", default_empty=True)]
    policies = [_policy(fields_) for fields_ in _mappings(top, "policy", default_empty=True)]
    grids = [_grid(fields_) for fields_ in _mappings(top, "grid")]
    spec = SweepSpec(
        name=top.get("name", str, required=True),
        models=top.get_list("models", str, required=True),
        grids=grids,
        data=data,
        mode=top.get("mode", str, "hook"),
        seeds=top.get_list("seeds", int, [0]),
        metrics=top.get_list("metrics", str, ["ppl"]),
        lmeval=lmeval,
        protocols=protocols,
        policies=policies,
        source=str(path),
    )
    if spec.mode == "hook" and protocols != [Protocol()]:
        top.fail("protocol", "window and exact_prefill apply to mode: cache")
    if spec.mode not in MODES:
        top.fail("mode", f"{spec.mode!r} is not one of {', '.join(MODES)}")
    for metric in spec.metrics:
        if metric not in METRICS and not (metric.startswith(LMEVAL_PREFIX) and len(metric) > len(LMEVAL_PREFIX)):
            top.fail("metrics", f"{metric!r} is not 'ppl', 'kld' or 'lmeval:<task>'")
    if spec.lmeval_tasks and any(center != "none" for grid in grids for center in grid.center):
        top.fail("metrics", "centered keys (center) are measured by perplexity and KL, not yet by lm-eval tasks")
    if spec.policies != [SitePolicy()] and any(q.calibration for grid in grids for q in grid.calibration if q):
        top.fail("policy", "a calibration artifact is made for one quantizer at every site; drop one of them")
    if not spec.name.replace("_", "").replace("-", "").isalnum():
        top.fail("name", "use letters, digits, '-' and '_' only (it names the runs/ folder)")
    return spec


def _mappings(top: Fields, key: str, default_empty: bool = False) -> list[Fields]:
    """A top-level field given as one mapping or a list of them (each a separate set of cells)."""
    if key not in top.mapping and not default_empty:
        top.get(key, LocatedMapping, required=True)
    raw = top.mapping.get(key, LocatedMapping({}, {}, top.mapping.line))
    items = raw if isinstance(raw, list) else [raw]
    if not items:
        top.fail(key, "must not be empty")
    for item in items:
        if not isinstance(item, LocatedMapping):
            top.fail(key, "expected a mapping or a list of mappings")
    return [Fields(top.path, item, f"{key}[{index}]." if isinstance(raw, list) else f"{key}.")
            for index, item in enumerate(items)]


def _protocol(fields_: Fields) -> Protocol:
    fields_.unknown_keys(PROTOCOL_FIELDS)
    window = fields_.get("window", int, 0)
    if window < 0:
        fields_.fail("window", f"must be >= 0, got {window}")
    return Protocol(window, fields_.get("exact_prefill", bool, False))


def _policy(fields_: Fields) -> SitePolicy:
    try:
        return parse_policy(fields_.mapping)
    except KvqError as exc:  # "policy.<field>: message", renamed to this policy's place in the file
        where, _, message = str(exc).partition(": ")
        raise KvqError(f"{fields_.path}:{fields_.mapping.line}: field "
                       f"'{fields_.prefix.rstrip('.')}{where.removeprefix('policy')}': {message}") from None


def _without_unused_fields(quant: QuantSpec) -> QuantSpec:
    """Fields a quantizer ignores go back to defaults, so they neither change ids nor duplicate cells."""
    defaults = QuantSpec()
    uses = used_fields(quant.quantizer)
    unused = {name: getattr(defaults, name) for name in SCALAR_FIELDS - uses}
    if "granularity" in uses and quant.granularity not in GROUPED:
        unused["group_size"] = defaults.group_size
    return replace(quant, **unused)


def expand(spec: SweepSpec) -> list[Cell]:
    """Protocols x policies x models x grid x seeds, in YAML order; unseeded quantizers get one cell instead of
    one per seed."""
    cells: dict[str, Cell] = {}
    kld = "kld" in spec.metrics
    for protocol, policy, model in itertools.product(spec.protocols, spec.policies, spec.models):
        for grid in spec.grids:
            combos = itertools.product(*(getattr(grid, f) for f in GRID_FIELDS))
            for quantizer, bits, granularity, group_size, symmetric, scale_dtype, options, calibration, center \
                    in combos:
                first = QuantSpec(quantizer, bits, granularity, group_size, symmetric, scale_dtype, spec.seeds[0],
                                  options, calibration, center)
                first = _without_unused_fields(first)
                for seed in spec.seeds if is_seeded(first) else spec.seeds[:1]:
                    cell = Cell(model, spec.mode, spec.data, replace(first, seed=seed), tuple(spec.lmeval_tasks),
                                spec.lmeval, protocol, policy, kld)
                    cells.setdefault(cell.id, cell)
    return list(cells.values())
