import itertools

import pytest
import torch

from kvq.errors import KvqError
from kvq.quant import QuantSpec, Site, build_quantizer
from kvq.quant.scalar import GRANULARITIES, ScalarQuantizer

CASES = list(itertools.product(range(2, 9), GRANULARITIES, [True, False]))


def heavy_tailed(*shape):
    x = torch.randn(*shape)
    x[..., 3] *= 30  # an outlier channel, as Qwen's K
    return x


@pytest.mark.parametrize("bits,granularity,symmetric", CASES)
def test_error_within_half_lsb(bits, granularity, symmetric):
    q = ScalarQuantizer(bits, granularity, group_size=16, symmetric=symmetric)
    x = heavy_tailed(2, 3, 10, 64)
    packed = q.encode(x)
    err = (q.decode(packed) - x).abs()
    groups, width = q.grouping(64)
    lsb = packed.scale.float().expand(2, 3, 10, groups, width).reshape(x.shape)
    if packed.channel_scale is not None:
        lsb = lsb * packed.channel_scale.float()
    assert (err <= lsb / 2 * (1 + 1e-5) + 1e-7).all()


@pytest.mark.parametrize("bits,granularity,symmetric", CASES)
def test_bits_per_element_equals_storage(bits, granularity, symmetric):
    q = ScalarQuantizer(bits, granularity, group_size=32, symmetric=symmetric, scale_dtype="float16")
    x = torch.randn(2, 4, 20, 128)
    expected = q.bits_per_element(128, n_tokens=20)
    assert q.encode(x).storage_bits() / x.numel() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "bits,granularity,symmetric,scale_dtype,tokens,expected",
    [
        (4, "per_token", True, "float32", 16, 4 + 32 / 128),
        (4, "per_token", False, "float16", 16, 4 + 2 * 16 / 128),
        (8, "per_group", True, "float32", 16, 8 + 32 / 32),
        (4, "per_channel", True, "float32", 256, 4 + 32 / 256),
        (4, "per_channel_group", True, "float32", 256, 4 + 32 / 32 + 32 / 256),
        (3, "per_token", True, "float32", 16, 3 + 32 / 128),
    ],
)
def test_bits_per_element_hand_computed(bits, granularity, symmetric, scale_dtype, tokens, expected):
    q = ScalarQuantizer(bits, granularity, 32, symmetric, scale_dtype)
    assert q.bits_per_element(128, tokens) == expected


@pytest.mark.parametrize("name", ["int", "srft", "srht"])
def test_mse_decreases_with_bits(name):
    x = heavy_tailed(4, 32, 64)
    mse = [((build_quantizer(QuantSpec(name, b), Site(0, "k", 64))(x) - x) ** 2).mean() for b in (2, 3, 4, 6, 8)]
    assert all(a > b for a, b in itertools.pairwise(mse))


def test_rotation_lowers_error_on_outlier_channel_per_token():
    x = heavy_tailed(8, 64, 64)
    err = {n: ((build_quantizer(QuantSpec(n, 4), Site(0, "k", 64))(x) - x) ** 2).mean() for n in ("int", "srft")}
    assert err["srft"] < err["int"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"bits": 1}, "bits"),
        ({"bits": 9}, "bits"),
        ({"bits": 4, "granularity": "per_row"}, "granularity"),
        ({"bits": 4, "scale_dtype": "float64"}, "scale_dtype"),
    ],
)
def test_bad_settings_raise(kwargs, match):
    with pytest.raises(KvqError, match=match):
        ScalarQuantizer(**kwargs)


def test_group_must_divide_head_dim():
    with pytest.raises(KvqError, match="does not divide"):
        ScalarQuantizer(4, "per_group", 48).bits_per_element(64, 1)


def test_unknown_quantizer():
    with pytest.raises(KvqError, match="unknown quantizer"):
        build_quantizer(QuantSpec("nope"), Site(0, "k", 64))
