import math

import pytest
import torch

from kvq.errors import KvqError
from kvq.rotations import SRFT, SRHT, build_rotation


def reference_srft_matrix(d: int, signs: torch.Tensor) -> torch.Tensor:
    """Eq. 1-2 of the SRFT paper written out with an explicit unitary DFT, independent of torch.fft."""
    n = torch.arange(d, dtype=torch.float64)
    dft = torch.exp(-2j * math.pi * torch.outer(n, n) / d) / math.sqrt(d)
    y = dft @ torch.diag(signs.double()).to(torch.complex128)  # rows: frequency bins, columns: inputs
    rows = [y[0].real, *(math.sqrt(2) * y[k].real for k in range(1, d // 2)), y[d // 2].real,
            *(math.sqrt(2) * y[k].imag for k in range(1, d // 2))]
    return torch.stack(rows)


@pytest.mark.parametrize("name", ["srft", "srht", "identity", "haar"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_orthonormal(name, d):
    rotation = build_rotation(name, d, seed=3)
    r = rotation.matrix().double()
    assert torch.allclose(r.T @ r, torch.eye(d, dtype=torch.float64), atol=1e-5)
    x, y = torch.randn(2, 500, d)
    fx, fy = rotation.forward(x), rotation.forward(y)
    assert torch.allclose(fx.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert torch.allclose((fx * fy).sum(-1), (x * y).sum(-1), atol=1e-4)
    assert torch.allclose(rotation.inverse(fx), x, atol=1e-5)


@pytest.mark.parametrize("d", [8, 64, 96])
def test_srft_matches_equation_2(d):
    rotation = SRFT(d, seed=1)
    expected = reference_srft_matrix(d, rotation.signs)
    assert torch.allclose(rotation.matrix().double(), expected, atol=1e-6)


def test_srft_non_power_of_two_even_is_orthonormal():
    rotation = SRFT(96, seed=0)
    r = rotation.matrix().double()
    assert torch.allclose(r @ r.T, torch.eye(96, dtype=torch.float64), atol=1e-5)


def test_srht_rejects_non_power_of_two():
    with pytest.raises(KvqError, match="power of two"):
        SRHT(96)


def test_srft_rejects_odd():
    with pytest.raises(KvqError, match="even"):
        SRFT(63)


def test_signs_are_seeded():
    assert torch.equal(SRFT(64, seed=5).signs, SRFT(64, seed=5).signs)
    assert not torch.equal(SRFT(64, seed=5).signs, SRFT(64, seed=6).signs)


def test_any_leading_shape():
    rotation = SRHT(64, seed=0)
    x = torch.randn(2, 3, 5, 64)
    assert torch.allclose(rotation.inverse(rotation.forward(x)), x, atol=1e-5)


def test_haar_rotation_is_uniform():
    """Uniform over O(d): each entry has mean 0 and second moment 1/d. QR without the sign fold gives a
    positive diagonal bias (E[R_11] > 0), which this catches."""
    d, seeds = 16, 4000
    corner = torch.tensor([build_rotation("haar", d, seed).matrix()[0, 0] for seed in range(seeds)],
                          dtype=torch.float64)
    assert abs(float(corner.mean())) < 4 * float(corner.std()) / seeds**0.5
    assert float((corner**2).mean()) == pytest.approx(1 / d, rel=0.08)
