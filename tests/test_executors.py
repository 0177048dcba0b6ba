"""Executors: Ray and submitit run the smoke sweep to the local executor's records; settings errors."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
from conftest import counting_fp_passes, requires_models, run_kvq

from kvq import executors
from kvq.errors import KvqError
from kvq.executors import ExecutorSettings, executor_settings, sweep_device
from kvq.executors.driver import SweepIncomplete, distribute
from kvq.executors.worker import measure_batch
from kvq.fingerprint import verified
from kvq.sweep_spec import expand, load_sweep

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"


def records(directory: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in directory.glob("*.json")}


def dppl(directory: Path) -> dict[str, float]:
    return {cell_id: record["metrics"]["dppl"] for cell_id, record in records(directory).items()}


@pytest.fixture(scope="module")
def local_smoke(tmp_path_factory) -> Path:
    """The smoke sweep through the local executor, one intra-op thread as each cpus: 1 worker uses."""
    runs = tmp_path_factory.mktemp("local")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outcome = executors.run(load_sweep(SMOKE), ExecutorSettings(), runs, False, "cpu")
    finally:
        torch.set_num_threads(threads)
    return outcome.directory


class InProcess:
    """A backend that measures each batch here when the driver collects it, failing the first `failures`
    attempts as a dead worker would, or interrupted (Ctrl-C) while it waits."""

    retries, cells_per_batch, threads = 1, 2, 1

    def __init__(self, spec, failures: int = 0, interrupt: bool = False):
        self.spec, self.failures, self.interrupt = spec, failures, interrupt
        self.submitted: list = []
        self.cancelled: list = []

    def submit(self, batches):
        self.submitted += batches
        return list(range(len(self.submitted) - len(batches), len(self.submitted)))

    def wait(self, handles):
        if self.interrupt:
            raise KeyboardInterrupt
        return handles[:1]

    def result(self, handle):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the worker died")
        return measure_batch(self.spec, self.submitted[handle], "cpu", self.threads)

    def cancel(self, handles):
        self.cancelled += handles


@pytest.fixture
def fresh_workers(monkeypatch):
    """No worker state from other tests, and this process's thread count back afterwards."""
    from kvq.executors import worker

    monkeypatch.setattr(worker, "_runners", {})
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@requires_models
def test_the_driver_measures_baselines_once_and_retries_a_dead_worker(tmp_path, local_smoke, fresh_workers,
                                                                     monkeypatch):
    spec = load_sweep(SMOKE)
    passes = counting_fp_passes(monkeypatch)
    backend = InProcess(spec, failures=1)
    outcome = distribute(spec, backend, tmp_path, False, "cpu")
    leader, *followers = backend.submitted
    assert len(leader.cells) == 1 and not leader.baselines  # one cell measures the group's fp baseline ...
    assert followers[0] == leader  # (sent again once: its first worker died)
    rest = followers[1:]
    assert all(len(b.cells) <= 2 and list(b.baselines) == ["baselines/" + next(
        (tmp_path / "smoke" / "baselines").iterdir()).name] for b in rest)  # ... the others carry it
    assert len(passes) == 1
    assert sorted(outcome.ran) == sorted(c.id for c in expand(spec))  # every cell once
    assert dppl(outcome.directory) == dppl(local_smoke)


@requires_models
def test_cells_past_their_retries_are_named_and_the_rest_kept(tmp_path, fresh_workers):
    spec = load_sweep(SMOKE)
    with pytest.raises(SweepIncomplete, match=r"^6 cells were not measured: their batch failed 2 times"):
        distribute(spec, InProcess(spec, failures=2), tmp_path, False, "cpu")  # the leader's group waits on it
    assert not list((tmp_path / "smoke").glob("*.json"))
    backend = InProcess(spec, failures=0)
    distribute(spec, backend, tmp_path, False, "cpu")
    assert len(list((tmp_path / "smoke").glob("*.json"))) == len(expand(spec))


def test_ctrl_c_cancels_what_is_outstanding(tmp_path, fresh_workers):
    spec = load_sweep(SMOKE)
    backend = InProcess(spec, interrupt=True)
    with pytest.raises(KeyboardInterrupt):
        distribute(spec, backend, tmp_path, False, "cpu")
    assert backend.cancelled == [0] and not list((tmp_path / "smoke").glob("*.json"))


def spec_with(tmp_path: Path, executor: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(SMOKE.read_text() + executor)
    return path


def test_settings_from_the_spec_with_flags_over_them(tmp_path):
    path = spec_with(tmp_path, "executor: {name: ray, gpus: 1, cpus: 2, retries: 3}\n")
    settings = executor_settings(path, {"name": None, "cpus": 4.0, "retries": None})
    assert settings == ExecutorSettings(name="ray", gpus=1.0, cpus=4.0, retries=3)
    assert sweep_device(settings, "auto") == "cuda"
    assert executor_settings(SMOKE, {}) == ExecutorSettings()  # no executor field: local, as before
    assert [c.id for c in expand(load_sweep(path))] == [c.id for c in expand(load_sweep(SMOKE))]  # in no cell


@pytest.mark.parametrize("executor,flags,message", [
    ("executor: {name: dask}\n", {}, "s.yaml:11: field 'executor.name': 'dask' is not one of local, ray, slurm"),
    ("executor: {name: ray, partition: gpu}\n", {}, "field 'executor.partition': applies to the slurm executor"),
    ("executor: {name: ray, gpus: many}\n", {}, "field 'executor.gpus': expected float"),
    ("executor: {name: slurm, time: 0}\n", {}, "field 'executor.time': expected a number >= 1, got 0"),
    ("executor: {name: ray, colour: red}\n", {}, "field 'executor.colour': unknown field"),
    ("", {"name": "ray", "retries": -1}, "--retries: expected a number >= 0, got -1"),
    ("", {"gpus": 1.0}, "--gpus: applies to the ray / slurm executor, not local"),
    ("executor: {name: slurm, gpus: 0.5}\n", {}, "field 'executor.gpus': SLURM takes a whole number, got 0.5"),
])
def test_bad_settings_name_the_field(tmp_path, executor, flags, message):
    with pytest.raises(KvqError, match=re.escape(message)):
        executor_settings(spec_with(tmp_path, executor), flags)


def test_cells_on_cpu_take_no_gpus():
    with pytest.raises(KvqError, match="cells on cuda need gpus > 0"):
        sweep_device(ExecutorSettings(name="ray"), "cuda")
    with pytest.raises(KvqError, match="cells on cuda need gpus > 0"):
        sweep_device(ExecutorSettings(name="ray", gpus=1), "cpu")


def test_a_missing_extra_names_it(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "ray", None)
    with pytest.raises(KvqError, match=r"pip install -e '\.\[ray\]'"):
        executors.run(load_sweep(SMOKE), ExecutorSettings(name="ray"), tmp_path, False, "cpu")
    assert not any(tmp_path.iterdir())


@requires_models
def test_ray_runs_the_local_cells_and_a_rerun_schedules_nothing(tmp_path, local_smoke, monkeypatch):
    pytest.importorskip("ray")
    from kvq.executors.ray_backend import RayBackend

    settings = ExecutorSettings(name="ray", cpus=1)
    outcome = executors.run(load_sweep(SMOKE), settings, tmp_path, False, "cpu")
    assert sorted(outcome.ran) == sorted(c.id for c in expand(load_sweep(SMOKE)))
    assert dppl(outcome.directory) == dppl(local_smoke)  # same ids, the same numbers to the last bit
    assert all(verified(record) for record in records(outcome.directory).values())
    submitted = []
    monkeypatch.setattr(RayBackend, "submit", lambda self, batches: submitted.append(batches) or [])
    again = executors.run(load_sweep(SMOKE), settings, tmp_path, False, "cpu")
    assert again.ran == [] and len(again.skipped) == len(outcome.cells) and submitted == []


@requires_models
def test_submitit_local_executor_runs_the_local_cells(tmp_path, local_smoke):
    pytest.importorskip("submitit")
    settings = ExecutorSettings(name="slurm", cluster="local", cells_per_job=2, cpus=1)
    outcome = executors.run(load_sweep(SMOKE), settings, tmp_path, False, "cpu")
    assert len(outcome.ran) == len(outcome.cells)
    assert dppl(outcome.directory) == dppl(local_smoke)


@requires_models
def test_a_ray_worker_killed_mid_cell_is_retried(tmp_path):
    pytest.importorskip("ray")
    marker = tmp_path / "killed"
    env = {**os.environ, "KVQ_TEST_KILL_WORKER_ONCE": str(marker)}
    result = run_kvq("sweep", str(SMOKE), "--executor", "ray", "--device", "cpu", "--runs-dir", str(tmp_path / "runs"),
                     "--results", str(tmp_path / "RESULTS.md"), env=env)
    assert result.returncode == 0, result.stderr
    assert marker.exists()  # a worker did die measuring a cell
    cells = expand(load_sweep(SMOKE))
    assert f"{len(cells)} cells ran, 0 already done" in result.stdout  # each cell once, none twice
    assert sorted(records(tmp_path / "runs" / "smoke")) == sorted(c.id for c in cells)
    # judged as the same executor's workers (one thread each) would measure them
    status = run_kvq("sweep", str(SMOKE), "--status", "--executor", "ray", "--device", "cpu", "--runs-dir",
                     str(tmp_path / "runs"))
    assert f"{len(cells)} current, 0 todo, 0 stale" in status.stdout
    ledger = (tmp_path / "RESULTS.md").read_text()
    assert ledger.count("\n## ") + ledger.startswith("## ") == 1


@requires_models
@pytest.mark.parametrize("flags,message", [
    (["--executor", "nope"], "--executor: 'nope' is not one of local, ray, slurm"),
    (["--executor", "ray", "--ray-address", "127.0.0.1:1"], "--ray-address 127.0.0.1:1: no Ray cluster answers"),
    (["--executor", "ray", "--gpus", "1"], "executor.gpus: each cell asks for 1 GPUs; the Ray cluster has 0"),
])
def test_bad_executor_settings_exit_2_and_write_nothing(tmp_path, flags, message):
    if "ray" in flags:
        pytest.importorskip("ray")
    result = run_kvq("sweep", str(SMOKE), *flags, "--runs-dir", str(tmp_path / "runs"),
                     "--results", str(tmp_path / "RESULTS.md"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("kvq: error: ")
    assert message in result.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "RESULTS.md").exists()
