"""Fused kernels with device dispatch: CUDA -> NVRTC build, MPS -> Metal build, CPU -> torch reference.

`encode`/`decode` mirror Quantizer.encode/decode and return the same packed dataclasses, so kernel
output can be checked against (and decoded by) the reference quantizer.
"""

from weakref import WeakKeyDictionary

import torch

from kvq.kernels.backends import BACKENDS, KernelBackend
from kvq.kernels.plan import KernelPlan, packed_codes, packing_reason, plan_for, unsupported_reason
from kvq.quant.base import Packed, Quantizer
from kvq.quant.rotated import RotatedPacked

_device_plans: WeakKeyDictionary = WeakKeyDictionary()


def backend_for(device: torch.device) -> KernelBackend | None:
    return BACKENDS.get(torch.device(device).type)


def device_plan(quantizer: Quantizer, device: torch.device) -> KernelPlan | None:
    """The quantizer's kernel plan with its constants on `device` (built once per device)."""
    per_device = _device_plans.setdefault(quantizer, {})
    key = str(device)
    if key not in per_device:
        plan = plan_for(quantizer)
        per_device[key] = plan.on(device) if plan is not None else None
    return per_device[key]


def _kernel_route(quantizer: Quantizer, device: torch.device):
    backend = backend_for(device)
    plan = device_plan(quantizer, device) if backend is not None else None
    return (backend, plan) if plan is not None else (None, None)


def encode(quantizer: Quantizer, x: torch.Tensor) -> Packed:
    backend, plan = _kernel_route(quantizer, x.device)
    if backend is None:
        return quantizer.encode(x)
    codes, scales = backend.quantize(plan, x.reshape(-1, plan.d).contiguous())
    lead = x.shape[:-1]
    return packed_codes(codes.view(*lead, plan.code_bytes), scales.view(*lead, plan.groups), x.shape, x.dtype)


def metered_encode(quantizer: Quantizer, x: torch.Tensor) -> Packed:
    return quantizer.meter(encode(quantizer, x), x.numel())


def decode(quantizer: Quantizer, packed: Packed) -> torch.Tensor:
    if not isinstance(packed, RotatedPacked):
        return quantizer.decode(packed)
    backend, plan = _kernel_route(quantizer, packed.inner.codes.device)
    if backend is None:
        return quantizer.decode(packed)
    inner = packed.inner
    codes = inner.codes.reshape(-1, plan.code_bytes).contiguous()
    scales = inner.scale.reshape(-1, plan.groups).contiguous()
    return backend.dequantize(plan, codes, scales, inner.dtype).view(inner.shape)


def _probe(device_type: str) -> str:
    """'ok' when the backend compiles and runs a tiny SRFT int4 round trip here, else why not."""
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
        decode(quantizer, encode(quantizer, x))
    except Exception as error:  # a failed build is reported, not raised: the reference still serves
        return f"build failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return "ok"


def available() -> dict[str, str]:
    """Per backend: 'ok' or the reason it is not used. CPU always runs the torch reference."""
    from kvq.kernels import decode_attention

    report = {"cpu": "torch reference", "cuda": _probe("cuda"), "metal": _probe("mps")}
    if decode_attention.triton is None:
        report["triton"] = "triton not installed"
    else:
        report["triton"] = "ok" if torch.cuda.is_available() else "no CUDA device"
    return report


__all__ = ["KernelPlan", "available", "backend_for", "decode", "encode", "metered_encode", "packing_reason",
           "plan_for", "unsupported_reason"]
