"""What a Ray task or a SLURM job runs: kvq.sweep's CellRunner on a folder of the worker's own.

The driver ships the fp baselines it already has; the worker writes them into its folder, measures its
cells there exactly as the local executor does, and returns the sealed records and every baseline they
were paired with. It writes nothing the driver reads, so no shared filesystem is needed.
"""

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvq.errors import KvqError
from kvq.provenance import resolve_device
from kvq.records import RecordBook, read_baseline
from kvq.store import write_json_atomic
from kvq.sweep import CellRunner
from kvq.sweep_spec import Cell, SweepSpec

# Test-only fault switch: the first worker to read a batch of windows while this names a file that does not
# exist yet creates it and dies on the spot, as a worker whose node went down would.
KILL_ONCE = "KVQ_TEST_KILL_WORKER_ONCE"


@dataclass(frozen=True)
class Batch:
    """Cells one task or job measures in turn, with the fp baselines the driver holds for them."""

    cells: tuple[Cell, ...]
    baselines: dict[str, dict] = field(default_factory=dict)  # path in the sweep folder -> record
    force: bool = False  # measure the cells' fp baselines again


@dataclass
class BatchResult:
    records: dict[str, dict]  # cell id -> sealed record
    baselines: dict[str, dict]  # path in the sweep folder -> every baseline the records are paired with
    error: str | None = None  # a KvqError raised on the worker (a bad model name there, say)


# One runner per worker process and sweep, so a worker that runs many cells loads each model once.
_runners: dict[tuple[str, str], tuple[CellRunner, tempfile.TemporaryDirectory]] = {}


def _runner(spec: SweepSpec, device: str) -> CellRunner:
    key = (spec.name, device)
    if key not in _runners:
        folder = tempfile.TemporaryDirectory(prefix="kvq-worker-")
        book = RecordBook(Path(folder.name), device)
        _runners[key] = (CellRunner(spec, book, _kill_once_progress(os.environ.get(KILL_ONCE))), folder)
    return _runners[key][0]


def _kill_once_progress(marker: str | None):
    if not marker:
        return None

    def progress(_label: str):
        def batches(items):
            for item in items:
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    pass
                else:
                    os._exit(17)
                yield item
        return batches
    return progress


def measure_batch(spec: SweepSpec, batch: Batch, device: str, threads: int) -> BatchResult:
    """The batch's cells, measured with `threads` intra-op threads: on the CPU another thread count sums
    floats in another order, which can flip a rounding and so move a quantized PPL."""
    torch.set_num_threads(threads)
    try:
        runner = _runner(spec, resolve_device(device))
        for relative, record in batch.baselines.items():
            write_json_atomic(runner.book.directory / relative, record)
        records = {cell.id: runner.measure(cell, force=batch.force) for cell in batch.cells}
        # each baseline once, as the batch left it: the cells of a batch share their group's baselines
        paired = {baseline.path: baseline for cell in batch.cells for baseline in runner.book.baselines(cell).values()}
        baselines = {path.relative_to(runner.book.directory).as_posix(): read_baseline(baseline)
                     for path, baseline in paired.items()}
        return BatchResult(records, baselines)
    except KvqError as exc:
        return BatchResult({}, {}, str(exc))
