"""How a sweep's cells run: in this process (local, the default), as Ray tasks, or as SLURM array jobs
through submitit. Every executor measures a cell with kvq.sweep's CellRunner, so a cell's record is the
same whichever ran it; Ray and SLURM workers ship records back and the driver alone writes the folder.
"""

from collections.abc import Callable
from pathlib import Path

from kvq.executors.settings import EXECUTORS, ExecutorSettings, executor_settings, sweep_device
from kvq.sweep import SweepOutcome, WindowProgress, run_sweep, sweep_dir, validate_cells
from kvq.sweep_spec import SweepSpec, expand

__all__ = ["EXECUTORS", "ExecutorSettings", "executor_settings", "run", "sweep_device"]


def run(spec: SweepSpec, settings: ExecutorSettings, runs_dir: Path, force: bool, device: str,
        cell_progress: Callable | None = None, window_progress: WindowProgress | None = None) -> SweepOutcome:
    """The sweep under `settings`; `device` is sweep_device's answer. Bad settings (an unreachable Ray
    address, more GPUs per cell than the cluster has) raise KvqError before anything is written."""
    if not settings.distributed:
        return run_sweep(spec, runs_dir, force, device, cell_progress, window_progress)
    from kvq.executors.driver import distribute

    validate_cells(expand(spec))  # before a cluster is joined or started
    if settings.name == "ray":
        from kvq.executors.ray_backend import RayBackend

        backend = RayBackend(settings, spec, device)
    else:
        from kvq.executors.slurm_backend import SlurmBackend

        backend = SlurmBackend(settings, spec, device, sweep_dir(runs_dir, spec) / ".submitit")
    try:
        return distribute(spec, backend, runs_dir, force, device, cell_progress)
    finally:
        backend.close()
