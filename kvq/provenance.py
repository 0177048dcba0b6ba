"""Where a result came from: git commit and dirty flag, library versions, device, time."""

import datetime
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch


def _git(*args: str, cwd: Path) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state(cwd: Path | None = None) -> dict:
    cwd = cwd or Path.cwd()
    commit = _git("rev-parse", "HEAD", cwd=cwd)
    status = _git("status", "--porcelain", "--untracked-files=no", cwd=cwd)
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def resolve_device(device: str) -> str:
    """'auto' picks CUDA, then MPS, then the CPU."""
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"{device} ({platform.processor() or platform.machine()})"


def provenance(device: str = "cpu") -> dict:
    return {
        "git": git_state(),
        "versions": {p: _version(p) for p in ("kvq", "torch", "transformers")},
        "device": device_name(device),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
