"""Running a sweep: each cell writes one sealed JSON record; current cells are skipped on rerun.

Concurrency: a cell or an fp baseline is computed only while its claim (an exclusive lock in the
sweep folder) is held. A second run of the same spec passes over the cells another run holds, works
on the rest, then waits for the held ones and takes over any whose holder died before finishing, so
no cell is computed twice and none is lost.
"""

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kvq import models
from kvq.calibrate import calibration_summary
from kvq.experiment import eval_windows, make_bank, measure
from kvq.fingerprint import sealed
from kvq.locks import exclusive
from kvq.ppl import PplResult, Progress
from kvq.provenance import provenance
from kvq.records import (
    CELL_FORMAT,
    LMEVAL_BASELINE,
    NOT_RUN,
    PPL_BASELINE,
    Baseline,
    RecordBook,
    baseline_fingerprint,
    read_baseline,
    write_baseline,
)
from kvq.store import remove_dead_temporaries, write_json_atomic
from kvq.sweep_spec import Cell, SweepSpec, expand

WindowProgress = Callable[[str], Progress]


@dataclass
class SweepOutcome:
    directory: Path
    cells: list[Cell]
    paths: list[Path]  # the cells' records: a finding reads these and nothing else
    ran: list[str]
    skipped: list[str]  # already current when this run reached them
    by_others: list[str]  # finished by a concurrent run of the same spec while this one waited
    removed_temporaries: list[Path]  # staging files of killed writers, cleaned up


def sweep_dir(runs_dir: Path, spec: SweepSpec) -> Path:
    return Path(runs_dir) / spec.name


def validate_cells(cells: list[Cell]) -> None:
    """Every cell's quantizer must build at its model's head_dim (e.g. group_size | head_dim)."""
    configs = {}
    for cell in cells:
        if cell.model not in configs:
            configs[cell.model] = models.load_config(cell.model)
        make_bank(cell.model, configs[cell.model], cell.quant, cell.policy, cell.mode)


class CellRunner:
    """Measures cells one model at a time, pairing each with its fp baselines: read from the book's
    folder, else measured and written there. Executors (kvq.executors) run one in each worker process,
    on a folder of the worker's own, and ship the records back."""

    def __init__(self, spec: SweepSpec, book: RecordBook, window_progress: WindowProgress | None = None):
        self.spec, self.book = spec, book
        self.progress = window_progress or (lambda _label: None)
        self.loaded: tuple[str, models.LoadedModel, object] | None = None
        self.references: dict[str, list] = {}  # mode -> the loaded model's fp log-probs, for KL metrics
        self.recomputed: set[Path] = set()  # baselines this runner measured itself (--force does each once)

    def model(self, cell: Cell) -> tuple[models.LoadedModel, object]:
        if self.loaded is None or self.loaded[0] != cell.model:
            self.loaded, self.references = None, {}  # one model in memory at a time
            lm = models.load(cell.model, device=self.book.device)
            self.loaded = (cell.model, lm, eval_windows(lm, cell.data))
        return self.loaded[1], self.loaded[2]

    def fp_pass(self, cell: Cell, label: str) -> PplResult:
        """The fp model on the cell's windows; its next-token log-probs become the KL reference of the
        loaded model and mode when cells ask for KL and none is kept yet."""
        lm, windows = self.model(cell)
        kept = [] if cell.kld and cell.mode not in self.references else None
        result = measure(lm, windows, None, cell.mode, cell.data, self.progress(label), keep_log_probs=kept)
        if kept is not None:
            self.references[cell.mode] = kept
        return result

    def reference(self, cell: Cell) -> list | None:
        """The fp log-probs KL metrics compare with (None when the cell asks for none): kept from the fp
        baseline when this runner measured it, else from a pass of their own."""
        if cell.kld and cell.mode not in self.references:
            self.fp_pass(cell, "fp reference")
        return self.references.get(cell.mode) if cell.kld else None

    def baseline(self, baseline: Baseline, measure_fp: Callable[[], dict], force: bool) -> dict:
        with exclusive(self.book.claim_path(baseline.path.stem)):
            record = read_baseline(baseline)
            if record is None or (force and baseline.path not in self.recomputed):
                record = write_baseline(baseline, measure_fp(), self.book.device)
                self.recomputed.add(baseline.path)
        return record

    def run(self, cell: Cell, force: bool) -> bool:
        """Measures and writes the cell unless it is current and not forced; True when it ran."""
        record = self.measure(cell, force)
        if record is not None:
            write_json_atomic(self.book.cell_path(cell), record)
        return record is not None

    def measure(self, cell: Cell, force: bool) -> dict | None:
        """The cell's sealed record, or None when its record is current and it is not forced (`force` also
        measures its fp baselines again, once per runner)."""
        if not force and self.book.staleness(cell) is None:
            return None
        lm, windows = self.model(cell)
        baselines = self.book.baselines(cell)
        fp = self.baseline(baselines[PPL_BASELINE], lambda: self.fp_pass(cell, "fp baseline").to_dict(), force)
        fp_tasks = {task: self.baseline(baselines[LMEVAL_BASELINE + task],
                                        lambda t=task: self.lmeval(lm, cell, None, t), force)
                    for task in cell.lmeval_tasks}
        if not force and self.book.staleness(cell) is None:  # a recomputed baseline matched the record's
            return None
        started = time.time()
        bank = make_bank(cell.model, lm.model.config, cell.quant, cell.policy)
        quantized = measure(lm, windows, bank, cell.mode, cell.data, self.progress(cell.label()), cell.protocol,
                            self.reference(cell))
        quantized_bits = bank.measured_bits_per_element()
        fp_ppl = fp["measurement"]["ppl"]
        record = {
            "format": CELL_FORMAT,
            "sweep": self.spec.name,
            "cell_id": cell.id,
            "config": cell.config(),
            "metrics": {
                "fp_ppl": fp_ppl,
                "fp_window_ppl": fp["measurement"]["window_ppl"],
                "ppl": quantized.ppl,
                "window_ppl": quantized.window_ppl,
                "dppl": quantized.ppl - fp_ppl,
                "tokens": quantized.tokens,
                **({"divergence": asdict(quantized.divergence)} if quantized.divergence else {}),
            },
            # the cache's cost at the end of a window: the protocol's exact tokens in fp16, the rest as encoded
            "bits_per_element": cell.protocol.stored_bits_per_element(quantized_bits, cell.data.seq_len),
            "quantized_bits_per_element": quantized_bits,
            "stated_bits_per_element": bank.bits_per_element(cell.data.seq_len),
            "calibration": calibration_summary(cell.quant.calibration) if cell.quant.calibration else None,
            "measured_with": self.book.context(cell),
            "baselines": {PPL_BASELINE: baseline_fingerprint(fp),
                          **{LMEVAL_BASELINE + t: baseline_fingerprint(b) for t, b in fp_tasks.items()}},
            "wall_time_s": round(time.time() - started, 3),
            **provenance(self.book.device),
        }
        if cell.lmeval_tasks:
            task_bank = make_bank(cell.model, lm.model.config, cell.quant, cell.policy)
            record["metrics"]["lmeval"] = {}
            for task, fp_task in fp_tasks.items():
                measured = fp_task["measurement"]
                record["metrics"]["lmeval"][task] = {**self.lmeval(lm, cell, task_bank, task),
                                                     "fp_metrics": measured["metrics"],
                                                     "fp_samples": measured["samples"]}
        return sealed(record)

    def lmeval(self, lm: models.LoadedModel, cell: Cell, bank, task: str) -> dict:
        """One lm-eval task under the bank (None: fp): its metrics and per-sample responses."""
        from kvq.lmeval import run_task
        from kvq.longctx import RetrievalSpec, write_tasks

        settings = cell.lmeval
        retrieval = RetrievalSpec(settings.lengths, settings.depths)
        folder = write_tasks(lm.tokenizer, retrieval, models.cache_dir() / "tasks")
        return run_task(lm, bank, cell.mode, task, settings.limit, folder, self.book.device, cell.protocol)


def pending(spec: SweepSpec, book: RecordBook, force: bool) -> tuple[list[Cell], list[Cell]]:
    """The spec's cells split into (to run, current), those to run in model order (one model load per
    model)."""
    cells = expand(spec)
    todo = sorted((c for c in cells if force or book.staleness(c) is not None),
                  key=lambda c: spec.models.index(c.model))
    return todo, [c for c in cells if c not in todo]


def run_sweep(spec: SweepSpec, runs_dir: Path, force: bool = False, device: str = "cpu",
              cell_progress: Callable[[list], list] | None = None,
              window_progress: WindowProgress | None = None) -> SweepOutcome:
    """Every cell in this process (the local executor)."""
    cells = expand(spec)
    validate_cells(cells)
    directory = sweep_dir(runs_dir, spec)
    removed = remove_dead_temporaries(directory) if directory.is_dir() else []
    book = RecordBook(directory, device)
    todo, current = pending(spec, book, force)
    skipped = [c.id for c in current]
    runner = CellRunner(spec, book, window_progress)
    ran: list[str] = []
    held_elsewhere: list[Cell] = []
    for cell in (cell_progress or list)(todo):
        with exclusive(book.claim_path(cell.id), wait=False) as claimed:
            if not claimed:
                held_elsewhere.append(cell)
            elif runner.run(cell, force):
                ran.append(cell.id)
            else:
                skipped.append(cell.id)
    by_others: list[str] = []
    for cell in held_elsewhere:
        with exclusive(book.claim_path(cell.id)):  # waits for the holder; its death frees the claim too
            (ran if runner.run(cell, force=False) else by_others).append(cell.id)
    return SweepOutcome(directory, cells, [book.cell_path(c) for c in cells], ran, skipped, by_others, removed)


@dataclass(frozen=True)
class CellState:
    cell_id: str
    state: str  # "current", "todo" or "stale"
    detail: str
    cell: Cell | None  # None for a record on disk that the spec no longer expands to


def sweep_status(spec: SweepSpec, runs_dir: Path, device: str = "cpu", threads: int | None = None) -> list[CellState]:
    """Every cell of the spec as current / todo / stale (with why), judged as cells measured on `device` with
    `threads` intra-op threads (None: this process's) would be, then every other cell record in the sweep folder
    (stale: not in the spec, so never in its findings). Loads no model."""
    cells = expand(spec)
    book = RecordBook(sweep_dir(runs_dir, spec), device, threads)
    states = []
    for cell in cells:
        why = book.staleness(cell)
        state = "current" if why is None else "todo" if why == NOT_RUN else "stale"
        states.append(CellState(cell.id, state, why or "", cell))
    known = {c.id for c in cells}
    for path in sorted(book.directory.glob("*.json")):
        if path.stem not in known:
            states.append(CellState(path.stem, "stale", "not in the spec (kept on disk, never in a finding)", None))
    return states
