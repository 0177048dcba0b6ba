"""The kernels' stats rows beside the reference quantizers' packed dataclasses: what kvq.ops' reference path and the
decode step read and write on every device (the kernels' builds and launches, kvq.kernels.plan, only on an
accelerator)."""

import torch

from kvq.quant.rotated import RotatedPacked
from kvq.quant.scalar import ScalarPacked


def packed_stats(packed: ScalarPacked, groups: int) -> torch.Tensor:
    """A ScalarPacked's scales, then any offsets, as the kernels' stats rows (rows, groups or 2 groups), one row per
    token, or per token group where its stats span tokens."""
    stats = [packed.scale] if packed.offset is None else [packed.scale, packed.offset]
    return torch.cat([s.reshape(-1, groups) for s in stats], dim=-1)


def per_token_stats(stats: torch.Tensor, token_group: int, tokens: int) -> torch.Tensor:
    """Stats rows (..., rows, .) of `token_group` tokens each -> the row each of `tokens` tokens reads."""
    if token_group == 1:
        return stats
    return stats.repeat_interleave(token_group, dim=-2)[..., :tokens, :]


def packed_codes(codes: torch.Tensor, scales: torch.Tensor, shape: tuple, dtype: torch.dtype,
                 symmetric: bool = True) -> RotatedPacked:
    """Kernel-layout codes (..., bytes) and scales (..., groups), followed by as many offsets where not
    `symmetric`, of rows of `dtype` as the reference quantizers' packed dataclass, so the reference can check and
    decode them."""
    scale, offset = (scales, None) if symmetric else scales.chunk(2, dim=-1)
    return RotatedPacked(ScalarPacked(codes, scale.unsqueeze(-1), None if offset is None else offset.unsqueeze(-1),
                                      None, tuple(shape), torch.float32), dtype)
