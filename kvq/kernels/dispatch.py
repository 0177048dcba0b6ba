"""kvq.ops' quantize, dequantize and write_rows on an accelerator: the kernel that writes or reads a layout (the
shared body's build for the device, Triton's for stats spanning tokens and float formats on CUDA), else the torch
reference, logged once with the reason. Imported on an accelerator only, so that a CPU cell's code digest leaves it
out."""

import torch

from kvq.kernels import backend_for, note_fallback
from kvq.kernels.backends import WRITE_ROLES
from kvq.kernels.plan import kernel_constants, unsupported_reason
from kvq.ops import reference_dequantize, reference_quantize
from kvq.quant.layout import PackedLayout


def kernel_quantize(rows: torch.Tensor, rotation: torch.Tensor, lam: torch.Tensor | None, layout: PackedLayout,
                    codebook: torch.Tensor | None,
                    layer_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """kvq::quantize's (n, d) rows -> codes and stats in `layout`, on the rows' accelerator."""
    reason = _body_reason(layout)
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


def kernel_write_rows(rows: list[torch.Tensor], rotations: list[torch.Tensor], lams: list[torch.Tensor | None],
                      layout: PackedLayout, codebooks: list[torch.Tensor | None], codes: list[torch.Tensor],
                      scales: list[torch.Tensor], rings: list[torch.Tensor], length: torch.Tensor) -> bool:
    """kvq::write_rows on CUDA, every role in one launch, where the shared body's build writes the layout (True);
    False where it does not, and kvq.ops.write_rows_through_quantize writes each role instead."""
    batch, heads, tokens, d = rows[0].shape
    same_shapes = all(len({tuple(t.shape) for t in role_tensors}) == 1 for role_tensors in (rows, codes, scales, rings))
    fits = (rows[0].is_cuda and _body_reason(layout) is None and len(rows) <= WRITE_ROLES and same_shapes
            and all(role.dtype == ring.dtype for role, ring in zip(rows, rings, strict=True))
            and all(t.is_contiguous() for t in (*codes, *scales, *rings))
            and batch * heads * codes[0].shape[2] < 1 << 32)  # the kernel's slot of a row is 32-bit
    if fits:
        backend_for(rows[0].device).write_rows(
            layout, [kernel_constants(*constants) for constants in zip(rotations, lams, codebooks, strict=True)],
            [role.reshape(batch * heads, tokens, d).contiguous() for role in rows],
            *([t.flatten(0, 1) for t in buffers] for buffers in (codes, scales, rings)), length)
    return fits


def _body_reason(layout: PackedLayout) -> str | None:
    """None when the shared kernel body's build writes `layout` exactly (its arithmetic is scheme kvq's, with no
    scale of the layer's), else why not."""
    if layout.scheme != "kvq":
        return f"the {layout.scheme} scheme's arithmetic has no kernel"
    if layout.layer_scaled:
        return "the shared kernel body applies no scale of the layer's"
    return unsupported_reason(layout)
