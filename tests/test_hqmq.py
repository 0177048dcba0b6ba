import itertools
import math

import pytest
import torch

from kvq.errors import KvqError
from kvq.quant import QuantSpec, Site, build_quantizer
from kvq.quant.hqmq import HQMQ
from kvq.quant.quaternion import binary_tetrahedral, hamilton


def test_2t_is_24_unit_quaternions_closed_with_60_degree_separation():
    group = binary_tetrahedral()
    assert group.shape == (24, 4)
    assert torch.allclose(group.norm(dim=-1), torch.ones(24))
    products = hamilton(group[:, None], group[None, :]).reshape(-1, 4)
    distance_to_group = torch.cdist(products, group).min(dim=-1).values
    assert distance_to_group.max() < 1e-6
    cosines = group @ group.T - 2 * torch.eye(24)
    assert math.degrees(math.acos(float(cosines.max()))) == pytest.approx(60.0, abs=1e-4)


def test_hamilton_matches_known_units():
    one, i, j, k = torch.eye(4)
    assert torch.equal(hamilton(i, j), k) and torch.equal(hamilton(j, i), -k)
    assert torch.equal(hamilton(i, i), -one)


def brute_force_codeword(chunk: torch.Tensor, primary: torch.Tensor, secondary_joint: torch.Tensor) -> torch.Tensor:
    best, best_score = None, -math.inf
    for codeword in secondary_joint:
        score = float(chunk @ codeword)
        if score > best_score:
            best, best_score = codeword, score
    return best


def test_decode_picks_the_argmax_codeword():
    q = HQMQ(secondary=3, radius_bits=6, seed=2)
    x = torch.randn(1, 2, 5, 8)
    decoded = q.decode(q.encode(x)).reshape(1, 2, 5, 2, 4)
    chunks = x.reshape(1, 2, 5, 2, 4)
    for head, token, c in itertools.product(range(2), range(5), range(2)):
        direction = decoded[0, head, token, c]
        if direction.norm() == 0:
            continue
        expected = brute_force_codeword(chunks[0, head, token, c], q.primary, q.joint_codebook(head))
        assert torch.allclose(direction / direction.norm(), expected, atol=1e-5)


def test_joint_codebook_is_primary_times_secondary():
    q = HQMQ(secondary=5, seed=1)
    joint = q.joint_codebook(0)
    assert joint.shape == (24 * 5, 4)
    assert torch.allclose(joint.norm(dim=-1), torch.ones(120), atol=1e-6)
    assert not torch.allclose(q.joint_codebook(0), q.joint_codebook(1))


def test_med3x_extracts_exactly_chunks_above_threshold():
    x = torch.randn(2, 3, 40, 16)
    x[0, 1, 5, :4] = 50.0
    x[1, 2, 7, 8:12] = -30.0
    q = HQMQ(secondary=24, radius_bits=4, outlier_c=3)
    packed = q.encode(x)
    norms = x.reshape(2, 3, 40, 4, 4).norm(dim=-1)
    assert torch.equal(packed.outlier, norms > 3 * norms.median())
    decoded = q.decode(packed).reshape(2, 3, 40, 4, 4)
    kept = x.reshape(2, 3, 40, 4, 4)[packed.outlier]
    assert torch.equal(decoded[packed.outlier], kept.half().float())


@pytest.mark.parametrize(
    "secondary,radius_bits,expected",
    [(24, 3, 3.17), (24, 4, 3.42), (48, 4, 3.67), (96, 4, 3.92), (192, 4, 4.17), (192, 6, 4.67)],
)
def test_bits_match_table_21(secondary, radius_bits, expected):
    q = HQMQ(secondary, radius_bits)
    assert round(q.bits_per_element(128, 1), 2) == expected
    x = torch.randn(1, 2, 16, 128)
    assert q.encode(x).storage_bits() / x.numel() == pytest.approx(q.bits_per_element(128, 16))


def test_med3x_bits_follow_equation_2():
    x = torch.randn(1, 2, 64, 128)
    x[..., :8] *= 40
    q = HQMQ(96, 4, outlier_c=3)
    packed = q.encode(x)
    p = float(packed.outlier.float().mean())
    chunk_bits = (math.log2(24 * 96) + 4) / 4
    expected = (1 - p) * chunk_bits + p * 16 + 1 / 4 + 16 / 128
    assert packed.storage_bits() / x.numel() == pytest.approx(expected, rel=1e-9)


def test_mse_decreases_with_radius_bits_and_codebook():
    x = torch.randn(2, 2, 64, 64)
    def mse(s, r):
        q = build_quantizer(QuantSpec("hqmq", options={"S": s, "r": r}), Site(0, "k", 64))
        return float(((q(x) - x) ** 2).mean())
    assert mse(24, 2) > mse(24, 4) > mse(24, 6)
    assert mse(24, 6) > mse(192, 6)


@pytest.mark.parametrize(
    "options,match",
    [({"S": 24, "r": 9}, "radius_bits"), ({"s": 24}, "no option 's'"), ({"S": "big"}, "must be int")],
)
def test_bad_options(options, match):
    with pytest.raises(KvqError, match=match):
        build_quantizer(QuantSpec("hqmq", options=options), Site(0, "k", 64))
