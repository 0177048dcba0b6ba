"""Each vector method against its paper's own distortion numbers, on synthetic vectors (CPU)."""

import math

import pytest
import torch

from kvq.quant import QuantSpec, Site, build_quantizer
from kvq.quant.codebooks import angle_density, angle_range, polar_angle_codebook

D = 128
# Gaussian Lloyd-Max distortion at b = 1..4 bits (Max 1960), which TurboQuant's Theorem 1 rounds to
# 0.36, 0.117, 0.03, 0.009
LLOYD_MAX_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


def unit_vectors(n: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (x / x.norm(dim=-1, keepdim=True)).float()


def turbo(bits: int, seed: int = 0, role: str = "k", **options):
    return build_quantizer(QuantSpec("turbo", bits, seed=seed, options={"rotation": "haar", **options}),
                           Site(0, role, D))


def roundtrip(quantizer, x: torch.Tensor) -> torch.Tensor:
    return quantizer(x.view(1, *x.shape)).view(x.shape)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_turbo_mse_matches_theorem_1(bits):
    x = unit_vectors(4096, seed=1001)
    mse = float(((roundtrip(turbo(bits), x) - x) ** 2).sum(-1).mean())
    assert mse == pytest.approx(LLOYD_MAX_MSE[bits], rel=0.05)


@pytest.mark.parametrize("bits,paper", [(1, 1.57), (2, 0.56), (3, 0.18), (4, 0.047)])
def test_turbo_prod_is_unbiased_and_matches_theorem_2(bits, paper):
    """d E[(<y, x> - <y, x~>)^2] for unit x, y, with x~ = (b-1)-bit mse + 1-bit QJL of the residual r.

    The QJL variance is (pi/2 |r|^2 - <r, y>^2) / d per pair, so D_prod = (pi/2 - 1/d) D_mse(b-1) with
    D_mse(0) = 1. The paper's values are this with its rounded Theorem 1 numbers (pi/2 x 0.03 = 0.047
    at b = 4); with the exact D_mse(3) = 0.0345 that holds at b = 3, b = 4 gives 0.054, which is the
    value tested there: 0.047 and 0.0345 cannot both hold."""
    exact = (math.pi / 2 - 1 / D) * (LLOYD_MAX_MSE[bits - 1] if bits > 1 else 1.0)
    if bits < 4:
        assert exact == pytest.approx(paper, rel=0.05)
    x, z = unit_vectors(10_000, seed=2002), unit_vectors(10_000, seed=3003)
    y = 0.6 * x + 0.8 * z  # <x, y> near 0.6, so relative bias is measurable
    y = y / y.norm(dim=-1, keepdim=True)
    errors, estimates, truths = [], [], []
    for seed, chunk in enumerate(zip(x.split(2500), y.split(2500), strict=True)):
        xs, ys = chunk
        estimate = (roundtrip(turbo(bits, seed, variant="prod"), xs) * ys).sum(-1)
        truth = (xs * ys).sum(-1)
        estimates.append(estimate)
        truths.append(truth)
        errors.append((estimate - truth) ** 2)
    bias = float(torch.cat(estimates).mean() / torch.cat(truths).mean() - 1)
    assert abs(bias) < 0.01
    # correlated pairs add <r, y>^2 terms the random-pair formula leaves out; check it on random pairs
    random_pairs = D * float(((roundtrip(turbo(bits, 9, variant="prod"), x) * z).sum(-1) - (x * z).sum(-1))
                             .pow(2).mean())
    assert random_pairs == pytest.approx(exact, rel=0.10)


@pytest.mark.parametrize("bits", [2, 4])
def test_turbo_prod_spends_b_bits_on_keys_and_values_take_mse(bits):
    x = torch.randn(1, 2, 16, D)
    keys, values = turbo(bits, variant="prod"), turbo(bits, role="v", variant="prod")
    assert keys.bits_per_element(D, 16) == bits + 32 / D  # (b-1)-bit codes + d sign bits + two fp16 norms
    assert keys.encode(x).storage_bits() / x.numel() == pytest.approx(keys.bits_per_element(D, 16))
    assert values.bits_per_element(D, 16) == bits + 16 / D
    assert torch.equal(values(x), turbo(bits, role="v")(x))


def test_qjl_orthogonal_blocks_are_unbiased_and_cut_score_error():
    """Official QJL code: S orthogonalised in blocks of d rows. Keys and queries with unequal channel
    scales, m = 2d."""
    generator = torch.Generator().manual_seed(44)
    scale = torch.linspace(0.2, 3, D)
    k, q = torch.randn(2, 4096, D, generator=generator) * scale
    exact = (q * k).sum(-1)
    relative_mse, estimates = {}, []
    for orthogonal in (False, True):
        errors = []
        for seed in range(4):
            spec = QuantSpec("qjl", seed=seed, options={"m": 2 * D, "orthogonal": orthogonal})
            estimate = (roundtrip(build_quantizer(spec, Site(0, "k", D)), k) * q).sum(-1)
            errors.append(float(((estimate - exact) ** 2).mean() / (exact**2).mean()))
            if orthogonal:
                estimates.append(estimate)
        relative_mse[orthogonal] = sum(errors) / len(errors)
    pooled = torch.cat(estimates)
    slope = float((pooled * exact.repeat(4)).sum() / (exact.repeat(4) ** 2).sum())
    assert slope == pytest.approx(1.0, abs=0.02)
    assert relative_mse[True] <= 0.4 * relative_mse[False]


def _expected_square_error(level: int, bits: int, levels: torch.Tensor) -> float:
    grid = torch.linspace(0, angle_range(level), 200_001, dtype=torch.float64)
    density = angle_density(level, grid)
    density = density / density.sum()
    cell = torch.bucketize(grid, (levels[1:] + levels[:-1]) / 2)
    return float((density * (grid - levels[cell]) ** 2).sum())


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_polar_angle_codebooks_beat_the_uniform_grid(level, bits):
    cells = 1 << bits
    uniform = (torch.arange(cells, dtype=torch.float64) + 0.5) / cells * angle_range(level)
    fitted = _expected_square_error(level, bits, polar_angle_codebook(level, bits).double())
    grid = _expected_square_error(level, bits, uniform)
    if level == 0:  # level-1 angles are uniform on [0, 2 pi): the uniform grid is already optimal
        assert fitted == pytest.approx(grid, rel=1e-6)
    else:
        assert fitted < 0.9 * grid


def test_polar_at_3875_bits_keeps_scores_within_paper_error():
    generator = torch.Generator().manual_seed(55)
    k, q = torch.randn(2, 4096, D, generator=generator)
    exact = (q * k).sum(-1)
    polar = build_quantizer(QuantSpec("polar", 4), Site(0, "k", D))
    assert polar.bits_per_element(D, 1) == 3.875
    estimate = (roundtrip(polar, k) * q).sum(-1)
    assert float(((estimate - exact) ** 2).mean() / (exact**2).mean()) <= 0.035
