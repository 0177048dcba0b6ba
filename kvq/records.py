"""A sweep folder's records on disk (cells and fp baselines), and whether a finished cell is current.

A cell is current when its record has this kvq's format, its digest verifies (nobody edited it), it
was measured in the current measuring context (the code its measurement runs, torch, transformers,
device kind, calibration artifact bytes), and every fp baseline it was paired with is the one a run
would pair it with now. Baselines are keyed on model, mode, data spec, corpus text digest and the
measuring context, and carry provenance and a digest of their own.
"""

from dataclasses import dataclass, field
from pathlib import Path

from kvq.fingerprint import corpus_digest, file_digest, measuring_context, record_digest, sealed, verified
from kvq.provenance import provenance, versions
from kvq.store import read_json, write_json_atomic
from kvq.sweep_spec import Cell

CELL_FORMAT = "kvq-cell/2"
BASELINE_FORMAT = "kvq-baseline/1"
PPL_BASELINE = "ppl"
LMEVAL_BASELINE = "lmeval:"  # + task name
LMEVAL_METRIC = "lmeval"
CLAIMS = ".claims"  # lock files: who is computing which cell or baseline right now
NOT_RUN = "not run yet"


@dataclass(frozen=True)
class Baseline:
    """Where one fp reference lives and the key that identifies it."""

    key: dict
    path: Path


@dataclass
class RecordBook:
    """The records of one sweep folder, judged against one device's current measuring context: on a CPU with
    `threads` intra-op threads, those its cells are measured with (None: this process's count when asked)."""

    directory: Path
    device: str
    threads: int | None = None
    _corpora: dict[str, str] = field(default_factory=dict)

    def cell_path(self, cell: Cell) -> Path:
        return self.directory / f"{cell.id}.json"

    def claim_path(self, name: str) -> Path:
        return self.directory / CLAIMS / f"{name}.lock"

    def context(self, cell: Cell) -> dict:
        context = measuring_context(self.device, quantizers_of(cell.config()), metrics_of(cell), self.threads)
        if cell.quant.calibration:
            context["calibration"] = file_digest(cell.quant.calibration)
        for option, value in sorted(cell.quant.options.items()):  # an artifact the quantizer reads (nuq signposts)
            if isinstance(value, str) and Path(value).is_file():
                context[f"options.{option}"] = file_digest(value)
        return context

    def _corpus(self, corpus: str) -> str:
        if corpus not in self._corpora:
            self._corpora[corpus] = corpus_digest(corpus)
        return self._corpora[corpus]

    def _baseline(self, prefix: str, key: dict, metrics: tuple[str, ...] = ()) -> Baseline:
        key = {**key, **measuring_context(self.device, (), metrics, self.threads)}
        return Baseline(key, self.directory / "baselines" / f"{prefix}{record_digest(key)}.json")

    def baselines(self, cell: Cell) -> dict[str, Baseline]:
        """Every fp reference the cell is measured against, by name."""
        found = {PPL_BASELINE: self._baseline("", {
            "model": cell.model, "mode": cell.mode, "data": cell.data.to_dict(),
            "corpus": self._corpus(cell.data.corpus)})}
        for task in cell.lmeval_tasks:
            found[LMEVAL_BASELINE + task] = self._baseline("lmeval-", {
                "model": cell.model, "mode": cell.mode, "task": task, **cell.lmeval.to_dict(),
                "lm_eval": versions()["lm_eval"]}, (LMEVAL_METRIC,))
        return found

    def staleness(self, cell: Cell) -> str | None:
        """Why the cell must be (re)computed: NOT_RUN, or why its record is stale; None when it is
        current."""
        raw = read_json(self.cell_path(cell))
        if raw is None:
            return NOT_RUN
        if raw.get("format") != CELL_FORMAT:
            return f"stale: recorded in format {raw.get('format')!r}, not {CELL_FORMAT}"
        if verified(raw) is None:
            return "stale: the record was edited after it was written"
        context = self.context(cell)
        differs = [k for k in sorted(set(context) | set(raw["measured_with"]))
                   if context.get(k) != raw["measured_with"].get(k)]
        if differs:
            return "stale: measured with another " + ", ".join(differs)
        for name, baseline in self.baselines(cell).items():
            current = read_baseline(baseline)
            if current is None:
                return f"stale: its {name} fp baseline is missing or was edited (a run recomputes it)"
            if raw["baselines"].get(name) != baseline_fingerprint(current):
                return f"stale: its {name} fp baseline changed"
        return None


def metrics_of(cell: Cell) -> tuple[str, ...]:
    """The metrics beyond perplexity a cell measures, as kvq.fingerprint names their modules."""
    return (LMEVAL_METRIC,) if cell.lmeval_tasks else ()


def quantizers_of(config: dict) -> set[str]:
    """The quantizers a cell's config (Cell.config(), as its record stores it) runs: its own and any its policy
    gives a site."""
    policy = config.get("policy", {})
    role_sets = [policy] + [rule for rule in policy.get("layers", [])]
    return {config["quant"]["quantizer"]} | {fields["quantizer"] for roles in role_sets
                                             for role, fields in roles.items()
                                             if isinstance(fields, dict) and "quantizer" in fields}


def baseline_fingerprint(record: dict) -> str:
    """What a cell pairs with: the baseline's key and numbers (not when or where it was computed, so
    a recomputation that measures the same numbers leaves its cells current)."""
    return record_digest({"key": record["key"], "measurement": record["measurement"]})


def read_baseline(baseline: Baseline) -> dict | None:
    """The stored baseline if its digest verifies and its key is the one asked for, else None."""
    record = verified(read_json(baseline.path))
    if record is None or record.get("format") != BASELINE_FORMAT or record.get("key") != baseline.key:
        return None
    return record


def write_baseline(baseline: Baseline, measurement: dict, device: str) -> dict:
    record = sealed({"format": BASELINE_FORMAT, "key": baseline.key, "measurement": measurement,
                     **provenance(device)})
    write_json_atomic(baseline.path, record)
    return record
