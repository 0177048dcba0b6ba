import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import counting_fp_passes, requires_models, run_kvq

from kvq.errors import KvqError
from kvq.results import load, summarize
from kvq.sweep_spec import expand, load_sweep

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"


def write(tmp_path, text):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


BASE = "name: t\nmodels: [smollm2-135m]\ngrid:\n  quantizer: [srft]\n"


@pytest.mark.parametrize(
    "text,fragment",
    [
        (BASE.replace("[srft]", "[nope]"), "s.yaml:4: field 'grid.quantizer': 'nope' is not one of"),
        (BASE + "  bits: [0]\n", "s.yaml:5: field 'grid.bits': bits must be in 2..8, got 0"),
        ("name: t\ngrid:\n  quantizer: [srft]\n", "field 'models' is required"),
        (BASE + "mode: both\n", "s.yaml:5: field 'mode'"),
        (BASE + "data: {seq_len: abc}\n", "field 'data.seq_len': expected int"),
        (BASE + "colour: red\n", "s.yaml:5: field 'colour': unknown field"),
        ("name: t\nmodels: [a\n", "invalid YAML"),
    ],
)
def test_schema_errors_name_field_and_line(tmp_path, text, fragment):
    with pytest.raises(KvqError) as info:
        load_sweep(write(tmp_path, text))
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_schema_error_from_cli_is_one_line(tmp_path):
    done = run_kvq("sweep", str(write(tmp_path, BASE + "  bits: [0]\n")))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "grid.bits" in done.stderr


def test_expansion_ids_stable_and_unseeded_collapse():
    spec = load_sweep(SMOKE)
    cells = expand(spec)
    # int is unseeded (1 cell per bits), srft seeded (2 seeds per bits)
    assert len(cells) == 2 * 1 + 2 * 2
    assert [c.id for c in cells] == [c.id for c in expand(load_sweep(SMOKE))]
    assert len({c.id for c in cells}) == len(cells)


def git_head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


@requires_models
def test_sweep_killed_and_resumed_loses_and_duplicates_nothing(tmp_path):
    runs, ledger = tmp_path / "runs", tmp_path / "RESULTS.md"
    args = [sys.executable, "-m", "kvq", "sweep", str(SMOKE), "--runs-dir", str(runs), "--results", str(ledger)]
    cell_dir = runs / "smoke"
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and len(list(cell_dir.glob("*.json"))) < 2:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = {p.name for p in cell_dir.glob("*.json")}
    expected = {f"{c.id}.json" for c in expand(load_sweep(SMOKE))}
    assert 2 <= len(partial) < len(expected), "kill should land mid-sweep"
    assert not ledger.exists()

    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert f"{len(expected) - len(partial)} cells ran, {len(partial)} already done" in done.stdout
    assert {p.name for p in cell_dir.glob("*.json")} == expected
    assert not list(cell_dir.glob(".*.tmp"))

    frame = load(cell_dir)
    assert len(frame) == len(expected) and frame.path.is_unique
    record = json.loads(next(cell_dir.glob("*.json")).read_text())
    assert record["git"]["commit"] == git_head()
    assert record["metrics"]["dppl"] == pytest.approx(record["metrics"]["ppl"] - record["metrics"]["fp_ppl"])
    assert record["bits_per_element"] == pytest.approx(record["stated_bits_per_element"], rel=1e-12)
    assert "## 1. smoke" in ledger.read_text()
    assert (cell_dir / "figures" / "dppl_vs_bits.png").stat().st_size > 0

    summary = summarize(frame)
    srft3 = summary[summary.label == "srft-3b-per_token"].iloc[0]
    int8 = summary[summary.label == "int-8b-per_token"].iloc[0]
    assert srft3.seeds == 2 and srft3.dppl_mean > int8.dppl_mean

    rerun = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert f"0 cells ran, {len(expected)} already done" in rerun.stdout
    assert "finding unchanged: " in rerun.stdout and "appended nothing" in rerun.stdout
    assert "## 2." not in ledger.read_text()


@requires_models
def test_plot_command(tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    done = run_kvq("sweep", "configs/smoke.yaml", "--runs-dir", str(runs), "--results", str(tmp_path / "R.md"),
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "figs"
    done = run_kvq("plot", str(runs / "smoke"), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert (out / "dppl_vs_bits.png").exists() and (out / "dppl_vs_bits.pdf").exists()


@requires_models
def test_kl_metrics_take_their_reference_from_the_fp_baseline_pass(tmp_path, monkeypatch):
    from kvq.sweep import run_sweep

    spec = write(tmp_path, SMOKE.read_text() + "metrics: [ppl, kld]\n")
    passes = counting_fp_passes(monkeypatch)
    outcome = run_sweep(load_sweep(spec), tmp_path / "runs")
    assert len(passes) == 1  # the baseline's pass, its log-probs kept as the reference
    assert all(load(p)["kld"].notna().all() for p in outcome.paths)
    for path in outcome.paths:
        path.unlink()
    run_sweep(load_sweep(spec), tmp_path / "runs")  # the baseline read from disk: the reference needs a pass
    assert len(passes) == 2
