"""KVQuant as its official simulation computes it (kvq.quant.kvquant): the NormalFloat signposts against QLoRA's
published NF4 table, per-vector dense-and-sparse outliers kept exact and counted as stored, and the vectors each
role takes (key channels over tokens, value tokens over channels)."""

import pytest
import torch

from kvq.errors import KvqError
from kvq.quant import QuantSpec, Site, build_quantizer
from kvq.quant.kvquant import KVQuant, nf_signposts

# QLoRA's NF4 (Dettmers et al. 2023, Appendix E; bitsandbytes' create_normal_map), which KVQuant's NF signposts
# build with the same offsets
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
       0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


def heavy_tailed(*shape, seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.distributions.StudentT(2.0).sample(shape) * (torch.rand(shape[-1], generator=generator) + 0.5)


def test_nf4_signposts_are_qloras_table():
    torch.testing.assert_close(torch.tensor(nf_signposts(4)), torch.tensor(NF4), atol=1e-6, rtol=0)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_nf_signposts_span_minus_one_to_one_with_an_exact_zero(bits):
    posts = torch.tensor(nf_signposts(bits))
    assert posts.numel() == 2 ** bits and bool((posts.diff() > 0).all())
    assert {-1.0, 0.0, 1.0} <= set(posts.tolist())
    assert int((posts > 0).sum()) == 2 ** (bits - 1)  # one more level above zero than below, as NF4 has


@pytest.mark.parametrize("datatype", ["nf", "uniform"])
@pytest.mark.parametrize("role", ["k", "v"])
def test_outliers_come_back_exact_and_every_stored_bit_is_counted(role, datatype):
    torch.manual_seed(0)
    x = heavy_tailed(2, 3, 200, 64)
    quantizer = KVQuant(role, 3, datatype, outliers=0.01)
    packed = quantizer.encode(x)
    y = quantizer.decode(packed)
    vectors = (x.transpose(-1, -2) if role == "k" else x).reshape(-1, 200 if role == "k" else 64)
    t = 1 - 0.01 / 2
    upper = torch.quantile(vectors, t, dim=-1, keepdim=True)
    lower = torch.quantile(vectors, 1 - t, dim=-1, keepdim=True)
    outliers = (vectors >= upper) | (vectors <= lower)
    exact = (y.transpose(-1, -2) if role == "k" else y).reshape(vectors.shape)[outliers]
    assert torch.equal(exact, vectors[outliers].half().float())
    # b-bit codes of every element, fp16 midpoint and half-range (or scale and zero point) and an int16 count per
    # vector, an fp16 value and an int16 position per outlier
    stored = 3 * x.numel() + vectors.shape[0] * (16 + 16 + 16) + int(outliers.sum()) * (16 + 16)
    assert packed.storage_bits() == stored
    quantizer(x)
    assert quantizer.stored_bits == stored  # what a run meters is what it stores


def test_keys_are_quantized_per_channel_and_values_per_token():
    """A channel scaled 1000x spoils only its own keys' codes and only the tokens' value ranges it shares."""
    torch.manual_seed(1)
    x = torch.randn(1, 1, 64, 16)
    loud = x.clone()
    loud[..., 3] *= 1000
    for role in ("k", "v"):
        quantizer = KVQuant(role, 4, outliers=0.0)
        error = (quantizer.decode(quantizer.encode(loud)) - loud).abs()[..., [0, 1, 2, 4, 5]]
        quiet_error = (quantizer.decode(quantizer.encode(x)) - x).abs()[..., [0, 1, 2, 4, 5]]
        if role == "k":
            torch.testing.assert_close(error, quiet_error)  # other channels' statistics are their own
        else:
            assert error.mean() > 10 * quiet_error.mean()  # a token's one range spans the loud channel


def test_more_bits_and_outliers_lower_the_error():
    x = heavy_tailed(1, 2, 256, 64, seed=2)

    def error(bits, outliers):
        quantizer = KVQuant("v", bits, outliers=outliers)
        return float(((quantizer.decode(quantizer.encode(x)) - x) ** 2).mean())

    assert error(4, 0.01) < error(3, 0.01) < error(2, 0.01)
    assert error(3, 0.01) < 0.5 * error(3, 0.0)


def test_the_registry_builds_it_with_its_options_checked():
    site = Site(0, "k", 64)
    quantizer = build_quantizer(QuantSpec("kvquant", 3, options={"datatype": "uniform", "outliers": 0.0}), site)
    assert isinstance(quantizer, KVQuant) and quantizer.datatype == "uniform" and quantizer.outliers == 0.0
    with pytest.raises(KvqError, match="datatype"):
        build_quantizer(QuantSpec("kvquant", 3, options={"datatype": "nf4"}), site)
    with pytest.raises(KvqError, match="signposts"):  # nuq's fitted signposts (tests/test_kvquant_nuq.py)
        build_quantizer(QuantSpec("kvquant", 3, options={"datatype": "nuq"}), site)
    with pytest.raises(KvqError, match="bits must be one of 2, 3, 4, 5"):
        build_quantizer(QuantSpec("kvquant", 8), site)


@pytest.mark.parametrize("length", [40, 64, 200, 1000, 4096])
def test_the_stated_outliers_per_vector_are_the_ones_stored(length):
    """At least one each side of a short vector; the nominal 1% from 200 entries on (5 + 5 of 1000)."""
    quantizer = KVQuant("v", 4, outliers=0.01)
    packed = quantizer.encode(torch.randn(3, length, generator=torch.Generator().manual_seed(length)))
    assert packed.outlier_counts.tolist() == [quantizer.outliers_per_vector(length)] * 3
    assert quantizer.outliers_per_vector(1000) == 10
