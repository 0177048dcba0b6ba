"""Provenance comes from the tree kvq's code runs from, whatever the working directory, and quietly."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = "import json; from kvq.provenance import provenance; print(json.dumps(provenance()))"


def git(*args: str, cwd: Path) -> str:
    command = ["git", "-c", "user.name=kvq", "-c", "user.email=kvq@example.invalid", *args]
    return subprocess.run(command, cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def copy_package(into: Path) -> Path:
    shutil.copytree(ROOT / "kvq", into / "kvq", ignore=shutil.ignore_patterns("__pycache__"))
    return into


def provenance_of(package_root: Path, cwd: Path) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout), done.stderr


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    """A working directory inside another repository, with a commit of its own."""
    other = tmp_path / "other-project"
    other.mkdir()
    git("init", "-q", cwd=other)
    git("commit", "-q", "--allow-empty", "-m", "other", cwd=other)
    return other


def test_commit_is_kvqs_checkout_not_the_working_directory(tmp_path, elsewhere):
    checkout = copy_package(tmp_path / "checkout")
    git("init", "-q", cwd=checkout)
    git("add", "kvq", cwd=checkout)
    git("commit", "-q", "-m", "kvq", cwd=checkout)
    record, stderr = provenance_of(checkout, elsewhere)
    assert record["git"] == {"commit": git("rev-parse", "HEAD", cwd=checkout), "dirty": False, "installed": None}
    assert record["git"]["commit"] != git("rev-parse", "HEAD", cwd=elsewhere)
    assert stderr == ""

    (checkout / "kvq" / "new_method.py").write_text("X = 1\n")  # untracked, under the package
    record, _ = provenance_of(checkout, elsewhere)
    assert record["git"]["dirty"] is True


def test_outside_a_checkout_the_installed_version_stands_in(tmp_path, elsewhere):
    from importlib import metadata

    for where in (copy_package(tmp_path / "plain"), copy_package(elsewhere / "vendored")):
        record, stderr = provenance_of(where, elsewhere)
        assert record["git"] == {"commit": None, "dirty": None, "installed": metadata.version("kvq-harness")}
        assert stderr == ""


def test_versions_cover_what_moves_a_number():
    from kvq.provenance import versions

    found = versions()
    for package in ("torch", "transformers", "lm_eval", "datasets", "numpy"):
        assert found[package], package
