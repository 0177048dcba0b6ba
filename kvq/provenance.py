"""Where a result came from: kvq's own source tree, the versions of what shapes a number, device, time.

The git state is that of the checkout kvq's code runs from, not of the working directory: a result
computed from inside another repository must not carry that repository's commit.
"""

import datetime
import platform
import subprocess
from functools import cache
from importlib import metadata
from pathlib import Path

import torch

from kvq.errors import KvqError

PACKAGE_DIR = Path(__file__).resolve().parent
DISTRIBUTION = "kvq-harness"  # kvq's name on PyPI, where "kvq" is another project
# Packages whose version can move a measured number (kernel back ends included); absent ones read None.
VERSIONED = (DISTRIBUTION, "torch", "transformers", "lm_eval", "datasets", "numpy", "triton", "gguf", "accelerate")
# What the git state covers beside the package (which holds the kernel sources): the build file (a results
# ledger or run folder written in the same checkout is output, not code).
SOURCE_SIBLINGS = ("pyproject.toml",)


def _git(*args: str, cwd: Path) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _checkout_root() -> Path | None:
    """The git work tree that tracks this very package, or None (an installed copy, or a package
    that merely sits inside some other repository, such as a virtualenv in a project folder)."""
    top = _git("rev-parse", "--show-toplevel", cwd=PACKAGE_DIR)
    if top is None:
        return None
    top = Path(top).resolve()
    if not PACKAGE_DIR.is_relative_to(top):
        return None
    init = (PACKAGE_DIR / "__init__.py").relative_to(top).as_posix()
    return top if _git("ls-files", "--error-unmatch", init, cwd=top) is not None else None


def git_state() -> dict:
    """{commit, dirty, installed}: dirty counts modified and untracked (not ignored) files under the
    package, the kernel sources and pyproject.toml; outside a checkout commit and dirty are None and
    `installed` names the installed version."""
    root = _checkout_root()
    if root is None:
        return {"commit": None, "dirty": None, "installed": _version(DISTRIBUTION)}
    commit = _git("rev-parse", "HEAD", cwd=root)
    package = PACKAGE_DIR.relative_to(root)
    paths = [package.as_posix(), *((package.parent / sibling).as_posix() for sibling in SOURCE_SIBLINGS)]
    status = _git("status", "--porcelain", "--untracked-files=all", "--", *paths, cwd=root)
    return {"commit": commit, "dirty": bool(status) if status is not None else None, "installed": None}


def describe_source(git: dict) -> str:
    """One line for a ledger item: 'commit `abc` (dirty)' or 'installed kvq-harness 0.1.0'."""
    if git.get("commit"):
        return f"commit `{git['commit']}`" + (" (dirty)" if git.get("dirty") else "")
    return f"installed {DISTRIBUTION} {git.get('installed')}"


@cache
def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {package: _version(package) for package in VERSIONED}


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def resolve_device(device: str) -> str:
    """'auto' picks CUDA, then MPS, then the CPU; a named device must exist here."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if _mps_available() else "cpu"
    kind, _, index = device.partition(":")
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": _mps_available()}
    if kind not in available or (index and not index.isdigit()):
        raise KvqError(f"--device must be auto, cpu, cuda, cuda:N or mps, got {device!r}")
    if not available[kind]:
        raise KvqError(f"--device {device}: no {kind.upper()} device is available here")
    return device


def device_name(device: str) -> str:
    """The card, or for the CPU its model and the instruction set torch's kernels take (AVX2, AVX512, ...): CPU
    numbers depend on it, as floats summed by other kernels round apart."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    if device.startswith("mps"):
        return f"{device} ({platform.processor() or platform.machine()})"
    described = (platform.machine(), _cpu_model(), torch.backends.cpu.get_cpu_capability())
    return f"{device} ({', '.join(part for part in described if part)})"


def _cpu_model() -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


def provenance(device: str = "cpu") -> dict:
    return {
        "git": git_state(),
        "versions": versions(),
        "device": device_name(device),
        "threads": torch.get_num_threads(),  # CPU numbers depend on it: sums in another order round apart
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
