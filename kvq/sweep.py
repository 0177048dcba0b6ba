"""Running a sweep: each cell writes one git-tagged JSON; finished cells are skipped on rerun."""

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvq import models
from kvq.calibrate import calibration_summary
from kvq.experiment import eval_windows, make_bank, measure
from kvq.ppl import Progress
from kvq.provenance import provenance
from kvq.store import read_json, write_json_atomic
from kvq.sweep_spec import Cell, SweepSpec, expand

CELL_FORMAT = "kvq-cell/1"


@dataclass
class SweepOutcome:
    directory: Path
    cells: list[Cell]
    ran: list[str]
    skipped: list[str]


def sweep_dir(runs_dir: Path, spec: SweepSpec) -> Path:
    return Path(runs_dir) / spec.name


def cell_path(directory: Path, cell: Cell) -> Path:
    return directory / f"{cell.id}.json"


def is_finished(path: Path) -> bool:
    record = read_json(path)
    return record is not None and record.get("format") == CELL_FORMAT


def validate_cells(cells: list[Cell]) -> None:
    """Every cell's quantizer must build at its model's head_dim (e.g. group_size | head_dim)."""
    configs = {}
    for cell in cells:
        if cell.model not in configs:
            configs[cell.model] = models.load_config(cell.model)
        make_bank(cell.model, configs[cell.model], cell.quant)


def _baseline(directory: Path, lm, windows, cell: Cell, progress: Progress | None) -> dict:
    """fp PPL per (model, data, mode): computed once and stored beside the cells."""
    key = json.dumps({"model": cell.model, "mode": cell.mode, "data": cell.data.to_dict()}, sort_keys=True)
    path = directory / "baselines" / f"{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"
    record = read_json(path)
    if record is None:
        record = measure(lm, windows, None, cell.mode, cell.data, progress).to_dict()
        write_json_atomic(path, record)
    return record


def _lmeval_metrics(directory: Path, lm, cell: Cell, bank, device: str) -> dict:
    """Each lm-eval task of the cell: quantized accuracy and per-sample responses beside the fp run's,
    the fp run computed once per (model, mode, task settings) and stored with the baselines."""
    from kvq.lmeval import run_task
    from kvq.longctx import RetrievalSpec, write_tasks

    settings = cell.lmeval
    folder = write_tasks(lm.tokenizer, RetrievalSpec(settings.lengths, settings.depths), models.cache_dir() / "tasks")
    out = {}
    for task in cell.lmeval_tasks:
        key = json.dumps({"model": cell.model, "mode": cell.mode, "task": task, **settings.to_dict()}, sort_keys=True)
        path = directory / "baselines" / f"lmeval-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"
        fp = read_json(path)
        if fp is None:
            fp = run_task(lm, None, cell.mode, task, settings.limit, folder, device)
            write_json_atomic(path, fp)
        quantized = run_task(lm, bank, cell.mode, task, settings.limit, folder, device)
        out[task] = {**quantized, "fp_metrics": fp["metrics"], "fp_samples": fp["samples"]}
    return out


def run_sweep(spec: SweepSpec, runs_dir: Path, force: bool = False, device: str = "cpu",
              cell_progress: Callable[[list], list] | None = None,
              window_progress: Callable[[str], Progress] | None = None) -> SweepOutcome:
    cells = expand(spec)
    validate_cells(cells)
    directory = sweep_dir(runs_dir, spec)
    todo = [c for c in cells if force or not is_finished(cell_path(directory, c))]
    skipped = [c.id for c in cells if c not in todo]
    ran: list[str] = []
    loaded: dict[str, tuple] = {}
    for cell in (cell_progress or list)(todo):
        if cell.model not in loaded:
            loaded.clear()  # one model in memory at a time
            lm = models.load(cell.model, device=device)
            loaded[cell.model] = (lm, eval_windows(lm, cell.data))
        lm, windows = loaded[cell.model]
        started = time.time()
        fp = _baseline(directory, lm, windows, cell, window_progress and window_progress("fp baseline"))
        bank = make_bank(cell.model, lm.model.config, cell.quant)
        quantized = measure(lm, windows, bank, cell.mode, cell.data,
                            window_progress and window_progress(cell.quant.label()))
        record = {
            "format": CELL_FORMAT,
            "sweep": spec.name,
            "cell_id": cell.id,
            "config": cell.config(),
            "metrics": {
                "fp_ppl": fp["ppl"],
                "fp_window_ppl": fp["window_ppl"],
                "ppl": quantized.ppl,
                "window_ppl": quantized.window_ppl,
                "dppl": quantized.ppl - fp["ppl"],
                "tokens": quantized.tokens,
            },
            "bits_per_element": bank.measured_bits_per_element(),
            "stated_bits_per_element": bank.bits_per_element(cell.data.seq_len),
            "calibration": calibration_summary(cell.quant.calibration) if cell.quant.calibration else None,
            "wall_time_s": round(time.time() - started, 3),
            **provenance(device),
        }
        if cell.lmeval_tasks:
            record["metrics"]["lmeval"] = _lmeval_metrics(directory, lm, cell, make_bank(cell.model, lm.model.config,
                                                                                     cell.quant), device)
        write_json_atomic(cell_path(directory, cell), record)
        ran.append(cell.id)
    return SweepOutcome(directory, cells, ran, skipped)
