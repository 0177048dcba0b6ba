"""Quaternion algebra for HQMQ: Hamilton product and the binary tetrahedral group 2T."""

import itertools

import torch


def hamilton(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Hamilton product of (..., 4) quaternions (w, x, y, z), broadcasting."""
    a1, b1, c1, d1 = p.unbind(-1)
    a2, b2, c2, d2 = q.unbind(-1)
    return torch.stack(
        [
            a1 * a2 - b1 * b2 - c1 * c2 - d1 * d2,
            a1 * b2 + b1 * a2 + c1 * d2 - d1 * c2,
            a1 * c2 - b1 * d2 + c1 * a2 + d1 * b2,
            a1 * d2 + b1 * c2 - c1 * b2 + d1 * a2,
        ],
        dim=-1,
    )


def binary_tetrahedral() -> torch.Tensor:
    """The 24 unit Hurwitz quaternions: +-1, +-i, +-j, +-k and (+-1 +-i +-j +-k)/2 (HQMQ App. D)."""
    axis = [torch.eye(4)[i] * sign for i in range(4) for sign in (1.0, -1.0)]
    half = [torch.tensor(signs) / 2 for signs in itertools.product((1.0, -1.0), repeat=4)]
    return torch.stack(axis + half)


def random_unit_quaternions(count: int, seed: int) -> torch.Tensor:
    """Haar-uniform on S^3: normalized 4-d standard Gaussians."""
    q = torch.randn(count, 4, generator=torch.Generator().manual_seed(seed))
    return q / q.norm(dim=-1, keepdim=True)
