"""kvq.ops' quantize and dequantize on an accelerator: the kernel that writes or reads a layout (the shared body's
build for the device, Triton's for stats spanning tokens and float formats on CUDA), else the torch reference,
logged once with the reason. Imported on an accelerator only, so that a CPU cell's code digest leaves it out."""

import torch

from kvq.kernels import backend_for, note_fallback
from kvq.kernels.plan import kernel_constants, unsupported_reason
from kvq.ops import reference_dequantize, reference_quantize
from kvq.quant.layout import PackedLayout


def kernel_quantize(rows: torch.Tensor, rotation: torch.Tensor, lam: torch.Tensor | None, layout: PackedLayout,
                    codebook: torch.Tensor | None,
                    layer_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """kvq::quantize's (n, d) rows -> codes and stats in `layout`, on the rows' accelerator."""
    scheme = layout.scheme
    reason = unsupported_reason(layout) if scheme == "kvq" else f"the {scheme} scheme's arithmetic has no kernel"
    if (layout.token_group > 1 or layout.element is not None) and rows.is_cuda:
        from kvq.kernels import triton_quantize  # imported on CUDA only, as decode attention's kernels are

        reason = triton_quantize.unsupported_reason(layout, lam)
        if reason is None:
            return triton_quantize.quantize(rows, layout, layer_scale)
    if reason is not None:
        note_fallback("kvq::quantize", layout, reason)
        return reference_quantize(rows, rotation, lam, layout, codebook, layer_scale)
    return backend_for(rows.device).quantize(layout, kernel_constants(rotation, lam, codebook), rows.contiguous())


def kernel_dequantize(codes: torch.Tensor, scales: torch.Tensor, rotation: torch.Tensor, lam: torch.Tensor | None,
                      layout: PackedLayout, dtype: torch.dtype, codebook: torch.Tensor | None,
                      layer_scale: torch.Tensor | None) -> torch.Tensor:
    """kvq::dequantize's codes and stats in `layout` -> rows of `dtype`, on the codes' accelerator."""
    reason = unsupported_reason(layout)
    if reason is not None:
        note_fallback("kvq::dequantize", layout, reason)
        return reference_dequantize(codes, scales, rotation, lam, layout, dtype, codebook, layer_scale)
    return backend_for(codes.device).dequantize(layout, kernel_constants(rotation, lam, codebook), codes.contiguous(),
                                                scales.contiguous(), dtype)
