"""Lloyd-Max scalar codebooks for known densities, computed once per process and cached."""

import math
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvq.rotations import Rotation

GRID_POINTS = 200_001
NORM_FLOOR = 1e-12  # a vector's norm is clamped here before it divides the vector


def midpoints(levels: torch.Tensor) -> torch.Tensor:
    """The boundaries between ascending levels, in their dtype."""
    return (levels[1:] + levels[:-1]) / 2


def nearest_level(values: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Each value's nearest of the ascending levels, as an index: the count of midpoints below it (torch.bucketize's;
    a value on a midpoint takes the lower level)."""
    return torch.bucketize(values, midpoints(levels))


def lloyd_max(grid: torch.Tensor, density: torch.Tensor, count: int, iterations: int = 300) -> torch.Tensor:
    """The `count` reconstruction levels (ascending) minimising E[(x - Q(x))^2] for x with the given
    density sampled on `grid`: alternately cells at the midpoints, levels at the cells' centroids
    (Lloyd 1982; Max 1960), started from the density's quantiles."""
    cdf = torch.cumsum(density, 0)
    cdf = cdf / cdf[-1]
    quantiles = (torch.arange(count, dtype=grid.dtype) + 0.5) / count
    levels = grid[torch.searchsorted(cdf, quantiles).clamp_max(len(grid) - 1)]
    for _ in range(iterations):
        cell = nearest_level(grid, levels)
        mass = torch.zeros_like(levels).index_add_(0, cell, density)
        moment = torch.zeros_like(levels).index_add_(0, cell, density * grid)
        levels = torch.where(mass > 0, moment / mass.clamp_min(1e-300), levels)
    return levels


@lru_cache(maxsize=16)
def lloyd_max_gaussian(bits: int) -> torch.Tensor:
    """The 2^bits Lloyd-Max reconstruction levels for a standard Gaussian (ascending)."""
    grid = torch.linspace(-8, 8, GRID_POINTS, dtype=torch.float64)
    return lloyd_max(grid, torch.exp(-grid**2 / 2), 1 << bits).float()


def angle_range(level: int) -> float:
    """Polar angles lie in [0, 2 pi) at level 0 (a pair of coordinates) and in [0, pi/2] above
    (a pair of radii)."""
    return 2 * math.pi if level == 0 else math.pi / 2


def angle_density(level: int, grid: torch.Tensor) -> torch.Tensor:
    """The density of a level's polar angle when the input coordinates are i.i.d. Gaussian, as after
    random preconditioning (PolarQuant, Han et al. 2025, Sec. 3): uniform at level 0; above it the
    angle atan2(|b|, |a|) of two 2^level-dimensional Gaussian blocks a, b has density proportional to
    (sin psi cos psi)^(2^level - 1) on [0, pi/2]."""
    if level == 0:
        return torch.ones_like(grid)
    return (torch.sin(grid) * torch.cos(grid)).clamp_min(0) ** ((1 << level) - 1)


@lru_cache(maxsize=64)
def polar_angle_codebook(level: int, bits: int) -> torch.Tensor:
    """Lloyd-Max angles for one level at `bits` bits (at level 0 these are the uniform grid's cell
    centres, since the density there is flat)."""
    grid = torch.linspace(0, angle_range(level), GRID_POINTS, dtype=torch.float64)
    return lloyd_max(grid, angle_density(level, grid), 1 << bits).float()


def encode_unit_vector(x: torch.Tensor, rotation: "Rotation",
                       levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TurboQuant_mse's encode (Alg. 1) of float32 rows x: |x| in fp16, and for each coordinate of R x / |x| the
    index of the nearest of the ascending `levels`."""
    norm = x.norm(dim=-1, keepdim=True).to(torch.float16)
    unit = rotation.forward(x / norm.float().clamp_min(NORM_FLOOR))
    return nearest_level(unit, levels), norm


def decode_unit_vector(codes: torch.Tensor, norm: torch.Tensor, rotation: "Rotation",
                       levels: torch.Tensor) -> torch.Tensor:
    """encode_unit_vector's inverse in float32: the levels rotated back, times the norm; norm (..., groups) scales
    each of `groups` equal runs of coordinates by its own entry (one group: the vector's norm)."""
    rotated = rotation.inverse(levels[codes.long()])
    return (rotated.unflatten(-1, (norm.shape[-1], -1)) * norm.float().unsqueeze(-1)).flatten(-2)
