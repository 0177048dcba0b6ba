"""Executor settings: the spec's `executor:` mapping, with command-line flags over it.

    executor: {name: ray, gpus: 1, cpus: 2, retries: 2, address: auto}
    executor: {name: slurm, partition: gpu, time: 120, gpus: 1, cpus: 4, cells_per_job: 4}

They say how cells run, never what a cell measures, so they enter no cell id: the same spec gives the same
cells under every executor.
"""

from dataclasses import dataclass, replace
from pathlib import Path

from kvq.errors import KvqError
from kvq.provenance import resolve_device
from kvq.yamlspec import Fields, load_located

EXECUTORS = ("local", "ray", "slurm")
SUBMITIT_CLUSTERS = ("slurm", "local")  # local: submitit runs each job as a process here (no SLURM needed)
# The settings each executor reads; one given to another executor is an error, not silently ignored.
USED_BY = {
    "local": (),
    "ray": ("gpus", "cpus", "retries", "address"),
    "slurm": ("gpus", "cpus", "retries", "partition", "time", "cells_per_job", "cluster"),
}
FLAGS = {"name": "--executor", "address": "--ray-address", "gpus": "--gpus", "cpus": "--cpus",
         "retries": "--retries", "partition": "--partition", "time": "--time", "cells_per_job": "--cells-per-job",
         "cluster": "--cluster"}


@dataclass(frozen=True)
class ExecutorSettings:
    name: str = "local"
    gpus: float = 0  # per cell (Ray task or SLURM job)
    cpus: float = 1  # per cell
    retries: int = 2  # how often a cell whose worker or node died runs again
    address: str | None = None  # Ray: None starts a local instance, "auto" joins the running one, or host:port
    partition: str | None = None  # SLURM partition
    time: int = 60  # SLURM job limit, minutes
    cells_per_job: int = 1  # SLURM: cells measured one after another in each array job
    cluster: str = "slurm"  # submitit's: "slurm", or "local" to run the jobs as processes on this machine

    @property
    def distributed(self) -> bool:
        return self.name != "local"

    @property
    def threads(self) -> int | None:
        """Intra-op threads a cell is measured with: a worker's whole CPUs (Ray and SLURM pin them), or None for
        this process's own count (local)."""
        return max(1, int(self.cpus)) if self.distributed else None


_KINDS = {"name": str, "gpus": float, "cpus": float, "retries": int, "address": str, "partition": str,
          "time": int, "cells_per_job": int, "cluster": str}


def executor_settings(spec_path: Path, flags: dict) -> ExecutorSettings:
    """The spec's `executor:` fields, then every flag that is not None over them; KvqError naming the bad
    field (file, line and `executor.<field>`) or flag."""
    located = Fields(Path(spec_path), load_located(Path(spec_path))).nested("executor")
    located.unknown_keys(tuple(FLAGS))
    values = {key: located.get(key, _KINDS[key]) for key in FLAGS if key in located.mapping}
    origin = dict.fromkeys(values, "spec")
    for key, value in flags.items():
        if value is not None:
            values[key], origin[key] = value, "flag"

    def fail(key: str, message: str):
        if origin[key] == "flag":
            raise KvqError(f"{FLAGS[key]}: {message}")
        located.fail(key, message)

    settings = replace(ExecutorSettings(), **values)
    if settings.name not in EXECUTORS:
        fail("name", f"{settings.name!r} is not one of {', '.join(EXECUTORS)}")
    for key in values:
        if key != "name" and key not in USED_BY[settings.name]:
            fail(key, f"applies to the {' / '.join(e for e in EXECUTORS if key in USED_BY[e])} executor, "
                      f"not {settings.name}")
    bounds = {"gpus": (0, ">= 0"), "retries": (0, ">= 0"), "cpus": (1e-9, "> 0"), "time": (1, ">= 1"),
              "cells_per_job": (1, ">= 1")}
    for key, (least, shown) in bounds.items():
        if key in values and getattr(settings, key) < least:
            fail(key, f"expected a number {shown}, got {getattr(settings, key)!r}")
    for key in ("gpus", "cpus"):  # SLURM allocates whole devices and cores; Ray may share a GPU between cells
        if settings.name == "slurm" and key in values and getattr(settings, key) != int(getattr(settings, key)):
            fail(key, f"SLURM takes a whole number, got {getattr(settings, key)!r}")
    if "cluster" in values and settings.cluster not in SUBMITIT_CLUSTERS:
        fail("cluster", f"{settings.cluster!r} is not one of {', '.join(SUBMITIT_CLUSTERS)}")
    return settings


def sweep_device(settings: ExecutorSettings, device: str) -> str:
    """The device kind cells are measured on. Local: `device` resolved on this machine. Ray and SLURM:
    cells run on workers, so this machine need not have the device; `auto` means cuda when each cell gets
    a GPU, else cpu, and the two must agree (every cell of a sweep on one kind of device)."""
    if not settings.distributed:
        return resolve_device(device)
    kind = device.split(":", 1)[0]
    if kind == "auto":
        return "cuda" if settings.gpus > 0 else "cpu"
    if kind not in ("cpu", "cuda"):
        raise KvqError(f"--device {device}: the {settings.name} executor runs cells on cpu or cuda")
    if (kind == "cuda") != (settings.gpus > 0):
        raise KvqError(f"--device {device} with executor.gpus {settings.gpus:g}: cells on cuda need gpus > 0 "
                       "each, cells on cpu none")
    return kind
