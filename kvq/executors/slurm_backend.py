"""Cells as SLURM array jobs through submitit, `cells_per_job` cells per job.

submitit passes the jobs and their results through a folder every node reads (the cluster's shared
filesystem); the sweep folder itself is still written by the driver alone.
"""

import shutil
import time
from pathlib import Path
from typing import Any

from kvq.errors import KvqError
from kvq.executors.ray_backend import optional_import
from kvq.executors.settings import ExecutorSettings
from kvq.executors.worker import Batch, BatchResult, measure_batch
from kvq.sweep_spec import SweepSpec

POLL_S = 2.0


class SlurmBackend:
    def __init__(self, settings: ExecutorSettings, spec: SweepSpec, device: str, folder: Path):
        submitit = optional_import("submitit", "slurm")
        if settings.cluster == "slurm" and shutil.which("sbatch") is None:
            raise KvqError("executor slurm: sbatch is not on PATH here; run the sweep from a SLURM login node, or "
                           "set cluster: local to run its jobs as processes on this machine")
        self.retries, self.cells_per_batch = settings.retries, settings.cells_per_job
        self.spec, self.device, self.threads = spec, device, settings.threads
        self.executor = submitit.AutoExecutor(folder=folder, cluster=settings.cluster)
        parameters = {"timeout_min": settings.time, "cpus_per_task": int(settings.cpus),
                      "gpus_per_node": int(settings.gpus), "name": f"kvq-{spec.name}"}
        if settings.partition:
            parameters["slurm_partition"] = settings.partition
        self.executor.update_parameters(**parameters)

    def submit(self, batches: list[Batch]) -> list[Any]:
        with self.executor.batch():  # one array job
            jobs = [self.executor.submit(measure_batch, self.spec, batch, self.device, self.threads)
                    for batch in batches]
        return jobs

    def wait(self, handles: list[Any]) -> list[Any]:
        while True:
            done = [job for job in handles if job.done()]
            if done:
                return done
            time.sleep(POLL_S)

    def result(self, handle: Any) -> BatchResult:
        return handle.result()

    def cancel(self, handles: list[Any]) -> None:
        for job in handles:
            job.cancel(check=False)

    def close(self) -> None:
        pass
