"""Cells as Ray tasks, one cell each, with the resources the settings ask for."""

import importlib
import socket
from typing import Any

from kvq.errors import KvqError
from kvq.executors.settings import ExecutorSettings
from kvq.executors.worker import Batch, BatchResult, measure_batch
from kvq.sweep_spec import SweepSpec

CONNECT_TIMEOUT_S = 5


def optional_import(module: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise KvqError(f"executor {extra}: {module} is not installed; pip install -e '.[{extra}]'") from None


def _check_reachable(address: str) -> None:
    """Ray waits minutes for a GCS that is not there; a plain connect says so at once."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as exc:
        raise KvqError(f"--ray-address {address}: no Ray cluster answers there ({exc})") from None


class RayBackend:
    """Joins (or starts) a Ray cluster; `close` leaves a joined cluster running and stops a started one."""

    cells_per_batch = 1

    def __init__(self, settings: ExecutorSettings, spec: SweepSpec, device: str):
        self.ray = optional_import("ray", "ray")
        self.retries = settings.retries
        if settings.address not in (None, "auto"):
            _check_reachable(settings.address)
        try:
            self.ray.init(address=settings.address, include_dashboard=False, log_to_driver=False,
                          configure_logging=False)
        except ConnectionError as exc:
            raise KvqError(f"--ray-address {settings.address}: {str(exc).splitlines()[0]}") from None
        try:
            self._check_resources(settings)
        except KvqError:
            self.ray.shutdown()
            raise
        self.task = self.ray.remote(measure_batch).options(num_cpus=settings.cpus, num_gpus=settings.gpus,
                                                           max_retries=0)
        self.spec, self.device, self.threads = self.ray.put(spec), device, settings.threads

    def _check_resources(self, settings: ExecutorSettings) -> None:
        available = self.ray.cluster_resources()
        for key, resource in (("gpus", "GPU"), ("cpus", "CPU")):
            asked, has = getattr(settings, key), available.get(resource, 0)
            if asked > has:
                raise KvqError(f"--{key} / executor.{key}: each cell asks for {asked:g} {resource}s; the Ray "
                               f"cluster has {has:g}")

    def submit(self, batches: list[Batch]) -> list[Any]:
        return [self.task.remote(self.spec, batch, self.device, self.threads) for batch in batches]

    def wait(self, handles: list[Any]) -> list[Any]:
        done, _pending = self.ray.wait(handles, num_returns=1)
        return done

    def result(self, handle: Any) -> BatchResult:
        return self.ray.get(handle)

    def cancel(self, handles: list[Any]) -> None:
        for handle in handles:
            self.ray.cancel(handle, force=True)

    def close(self) -> None:
        self.ray.shutdown()
