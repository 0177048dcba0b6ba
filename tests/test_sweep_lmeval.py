import json
from pathlib import Path

import pytest
from conftest import requires_models, run_kvq

from kvq.sweep_spec import expand, load_sweep

ROOT = Path(__file__).resolve().parents[1]

SPEC = """name: lm
models: [smollm2-135m]
data: {seq_len: 64, n_windows: 1}
grid:
  quantizer: [int]
  bits: [2, 8]
metrics: [ppl, "lmeval:kvq_passkey"]
lmeval: {limit: 2, lengths: [192], depths: [0, 1]}
"""


def test_lmeval_metric_is_part_of_the_cell_id(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(SPEC)
    with_lmeval = expand(load_sweep(path))
    path.write_text(SPEC.replace(', "lmeval:kvq_passkey"', ""))
    without = expand(load_sweep(path))
    assert with_lmeval[0].lmeval_tasks == ("kvq_passkey",) and not without[0].lmeval_tasks
    assert with_lmeval[0].id != without[0].id


def test_bad_metric_names_field(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(SPEC.replace('"lmeval:kvq_passkey"', "bleu"))
    done = run_kvq("sweep", str(path))
    assert done.returncode == 2 and "field 'metrics'" in done.stderr


@requires_models
@pytest.mark.model
def test_sweep_runs_lmeval_metric(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(SPEC)
    done = run_kvq("sweep", str(path), "--runs-dir", str(tmp_path / "runs"), "--results", str(tmp_path / "R.md"),
                   cwd=ROOT)
    assert done.returncode == 0, done.stderr
    records = [json.loads(p.read_text()) for p in (tmp_path / "runs" / "lm").glob("*.json")]
    assert len(records) == 2
    for record in records:
        task = record["metrics"]["lmeval"]["kvq_passkey"]
        assert len(task["samples"]) == 2 and len(task["fp_samples"]) == 2
    assert "kvq_passkey acc" in (tmp_path / "R.md").read_text()
    # stderr is a pipe, as a log file is: a line per cell, and no cursor movement from lm-eval's bars under kvq's
    assert "cells: 2/2" in done.stderr and "\x1b[" not in done.stderr
