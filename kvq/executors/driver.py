"""The driver of a distributed sweep: it alone reads and writes the sweep folder.

Cells are grouped by the fp baselines they pair with (model, data, mode, and lm-eval tasks). A group whose
baselines are not on disk first sends one cell (its leader), whose worker measures them; the rest of the group
go out once the leader's baselines are written, carrying them, so each baseline is measured once. A batch
whose worker or node dies runs again, at most `retries` times; Ctrl-C cancels what is outstanding and keeps
every cell already written.
"""

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Protocol

from kvq.errors import KvqError
from kvq.executors.worker import Batch, BatchResult
from kvq.locks import exclusive
from kvq.records import RecordBook, read_baseline
from kvq.store import read_json, remove_dead_temporaries, write_json_atomic
from kvq.sweep import SweepOutcome, pending, sweep_dir
from kvq.sweep_spec import Cell, SweepSpec, expand


class SweepIncomplete(RuntimeError):
    """Cells whose batches failed more often than the retries allow; every other cell is written."""


class Backend(Protocol):
    retries: int
    cells_per_batch: int
    threads: int  # intra-op threads each worker measures with

    def submit(self, batches: list[Batch]) -> list[Any]: ...
    def wait(self, handles: list[Any]) -> list[Any]: ...  # some that finished, at least one
    def result(self, handle: Any) -> BatchResult: ...  # raises when the worker failed
    def cancel(self, handles: list[Any]) -> None: ...


@dataclass
class _Group:
    cells: list[Cell]
    baselines: list[str]  # paths in the sweep folder
    measured: bool = False  # the baselines are on disk as this run will pair them


class _Schedule:
    """Submits batches as their baselines become known and writes what comes back, cell by cell."""

    def __init__(self, spec: SweepSpec, book: RecordBook, backend: Backend, force: bool):
        self.spec, self.book, self.backend, self.force = spec, book, backend, force
        self.outstanding: dict[Any, tuple[Batch, _Group, int]] = {}  # handle -> batch, group, attempt
        self.failed: list[tuple[Batch, str]] = []

    def groups(self, cells: list[Cell]) -> list[_Group]:
        groups: dict[tuple[str, ...], _Group] = {}
        for cell in cells:
            baselines = self.book.baselines(cell).values()
            paths = tuple(sorted(self._relative(b.path) for b in baselines))
            if paths not in groups:
                measured = not self.force and all(read_baseline(b) is not None for b in baselines)
                groups[paths] = _Group([], list(paths), measured)
            groups[paths].cells.append(cell)
        return list(groups.values())

    def _relative(self, path) -> str:
        return path.relative_to(self.book.directory).as_posix()

    def _known(self, group: _Group) -> dict[str, dict]:
        return {path: read_json(self.book.directory / path) for path in group.baselines}

    def _submit(self, batches: list[tuple[Batch, _Group, int]]) -> None:
        if batches:
            handles = self.backend.submit([batch for batch, _group, _attempt in batches])
            self.outstanding.update(zip(handles, batches, strict=True))

    def _followers(self, group: _Group, cells: list[Cell]) -> list[tuple[Batch, _Group, int]]:
        size = self.backend.cells_per_batch
        known = self._known(group)
        return [(Batch(tuple(cells[i:i + size]), known), group, 0) for i in range(0, len(cells), size)]

    def run(self, cells: list[Cell]) -> Iterator[Cell]:
        """Yields each cell as its record is written."""
        first = []
        for group in self.groups(cells):
            if group.measured:
                first += self._followers(group, group.cells)
            else:  # the leader measures the group's baselines; the others wait for them
                first.append((Batch((group.cells[0],), force=self.force), group, 0))
        self._submit(first)
        try:
            while self.outstanding:
                for handle in self.backend.wait(list(self.outstanding)):
                    yield from self._collect(handle)
        except BaseException:
            self.backend.cancel(list(self.outstanding))
            raise
        if self.failed:
            batch, error = self.failed[0]
            lost = sum(len(b.cells) for b, _ in self.failed)
            raise SweepIncomplete(f"{lost} cells were not measured: their batch failed {self.backend.retries + 1} "
                                  f"times (first: cell {batch.cells[0].id}: {error}); every other cell is saved, "
                                  "rerun the same command to resume")

    def _collect(self, handle) -> Iterator[Cell]:
        batch, group, attempt = self.outstanding.pop(handle)
        try:
            result = self.backend.result(handle)
        except Exception as exc:  # the worker died, or its node, or the job was lost
            error = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            if attempt < self.backend.retries:
                self._submit([(batch, group, attempt + 1)])
            else:
                rest = () if group.measured else tuple(c for c in group.cells if c not in batch.cells)
                self.failed.append((Batch(batch.cells + rest), error))  # a lost leader's group waits in vain
            return
        if result.error is not None:
            raise KvqError(result.error)
        for cell in batch.cells:
            measured_with = result.records[cell.id]["measured_with"]
            differs = sorted(k for k, v in self.book.context(cell).items() if measured_with.get(k) != v)
            if differs:
                raise KvqError(f"a worker measured cell {cell.id} with another {', '.join(differs)} than this "
                               "driver's; the driver and every worker need the same kvq code, torch, "
                               "transformers and device, and on a CPU the threads the workers were given")
        for path in group.baselines:
            if read_json(self.book.directory / path) != result.baselines[path]:  # new, or measured again
                write_json_atomic(self.book.directory / path, result.baselines[path])
        for cell in batch.cells:
            write_json_atomic(self.book.cell_path(cell), result.records[cell.id])
            why = self.book.staleness(cell)
            if why is not None:  # e.g. a concurrent --force run changed the baseline it was paired with
                raise KvqError(f"cell {cell.id} came back {why}")
            yield cell
        if not group.measured:
            group.measured = True
            self._submit(self._followers(group, [c for c in group.cells if c not in batch.cells]))


class _Finished:
    """The cells as they are written, sized for a progress bar."""

    def __init__(self, schedule: _Schedule, cells: list[Cell]):
        self.schedule, self.cells = schedule, cells

    def __len__(self) -> int:
        return len(self.cells)

    def __iter__(self) -> Iterator[Cell]:
        return self.schedule.run(self.cells)


def distribute(spec: SweepSpec, backend: Backend, runs_dir, force: bool, device: str,
               cell_progress: Callable[[Any], Any] | None = None) -> SweepOutcome:
    """The sweep's stale or missing cells (validated already) through `backend`; cells another run of the
    same spec holds are waited for and taken over if their holder died, as the local executor does."""
    cells = expand(spec)
    directory = sweep_dir(runs_dir, spec)
    removed = remove_dead_temporaries(directory) if directory.is_dir() else []
    book = RecordBook(directory, device, backend.threads)
    todo, current = pending(spec, book, force)
    ran: list[str] = []
    with ExitStack() as claims:
        mine = [c for c in todo if claims.enter_context(exclusive(book.claim_path(c.id), wait=False))]
        held = [c for c in todo if c not in mine]
        for cell in (cell_progress or list)(_Finished(_Schedule(spec, book, backend, force), mine)):
            ran.append(cell.id)
    by_others, left = [], []
    for cell in held:
        with exclusive(book.claim_path(cell.id)):  # waits for the holder; its death frees the claim too
            (left if book.staleness(cell) is not None else by_others).append(cell)
    if left:
        with ExitStack() as claims:
            for cell in left:
                claims.enter_context(exclusive(book.claim_path(cell.id)))
            ran += [cell.id for cell in _Schedule(spec, book, backend, False).run(left)]
    skipped = [c.id for c in current]
    return SweepOutcome(directory, cells, [book.cell_path(c) for c in cells], ran, skipped,
                        [c.id for c in by_others], removed)
