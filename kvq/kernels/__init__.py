"""Kernel builds, launches and sources behind kvq.ops, the one door to them: CUDA through NVRTC (and Triton
for decode attention), MPS through Metal, CPU through the torch reference."""

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvq.kernels.backends import KernelBackend

logger = logging.getLogger("kvq.kernels")
_noted: set[tuple[str, str]] = set()


def backend_for(device: torch.device) -> "KernelBackend | None":
    """The kernel build for a device, None on a CPU: there the torch reference serves, and the builds' modules are
    never imported (kvq.fingerprint leaves them out of a CPU cell's code digest on that ground)."""
    kind = torch.device(device).type
    if kind == "cpu":
        return None
    from kvq.kernels.backends import BACKENDS

    return BACKENDS.get(kind)


def note_fallback(operation: str, subject: object, reason: str) -> None:
    """Logs, once per (operation, subject), that the reference serves `subject` (a layout, a step's shape) where
    a kernel was asked for, and why."""
    key = (operation, str(subject))
    if key not in _noted:
        _noted.add(key)
        logger.info("%s runs the torch reference for %s: %s", operation, subject, reason)


def _probe(device_type: str) -> str:
    """'ok' when the backend compiles and runs a tiny SRFT int4 round trip here, else why not."""
    from kvq import ops
    from kvq.quant.rotated import RotatedQuantizer
    from kvq.quant.scalar import ScalarQuantizer
    from kvq.rotations import SRFT

    if device_type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    if device_type == "mps" and not torch.backends.mps.is_available():
        return "no MPS device"
    try:
        quantizer = RotatedQuantizer(SRFT(64, 0), ScalarQuantizer(4))
        x = torch.randn(4, 64, device=device_type)
        ops.decode(quantizer, ops.encode(quantizer, x))
    except Exception as error:  # a failed build is reported, not raised: the reference still serves
        return f"build failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return "ok"


def available() -> dict[str, str]:
    """Per backend: 'ok' or the reason it is not used. CPU always runs the torch reference."""
    from kvq.kernels import decode_attention

    report = {"cpu": "torch reference", "cuda": _probe("cuda"), "metal": _probe("mps")}
    if decode_attention.triton_decode is None:
        report["triton"] = "triton not installed"
    else:
        report["triton"] = "ok" if torch.cuda.is_available() else "no CUDA device"
    return report


__all__ = ["available", "backend_for", "note_fallback"]
