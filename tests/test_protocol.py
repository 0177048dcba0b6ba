"""The cache-mode evaluation protocol (recent exact window, exact prefill), the same for every method."""

import pytest
import torch
from conftest import loaded, requires_models

from kvq.apply import KVGeometry, ProtocolWriteCache, QuantizerBank, quantized_kv
from kvq.data import DataSpec
from kvq.errors import KvqError
from kvq.experiment import eval_windows, make_bank
from kvq.ppl import perplexity
from kvq.protocol import Protocol
from kvq.quant import QuantSpec
from kvq.sweep_spec import expand, load_sweep

SPECS = [QuantSpec("int", 3), QuantSpec("qjl", 4, options={"m": 64}),
         QuantSpec("turbo", 3, options={"variant": "prod"})]


def test_near_mask_follows_the_window_and_the_prefill():
    cache = ProtocolWriteCache(bank=None, protocol=Protocol(window=3))
    cache._prefill[0] = 5
    near = cache.near(0, n_queries=5, n_keys=5)
    distance = torch.arange(5)[:, None] - torch.arange(5)[None, :]
    assert torch.equal(near, distance < 3)
    assert torch.equal(cache.near(0, n_queries=1, n_keys=9)[0], torch.arange(9) >= 6)  # a decode step

    prefill = ProtocolWriteCache(bank=None, protocol=Protocol(window=3, exact_prefill=True))
    prefill._prefill[0] = 5
    assert prefill.near(0, 5, 5).all()  # the prompt's own call sees everything exact
    assert torch.equal(prefill.near(0, 1, 9)[0], torch.arange(9) >= 6)  # later, the prompt ages out


def test_kivis_key_groups_fill_across_writes_and_are_metered_once():
    """Under a window protocol a write's tokens short of a 16-token group stay exact until later writes make it
    whole, then are encoded with them: after a 21-token prompt and eleven one-token writes, the copies equal
    KIVI's encode of all 32 tokens at once, and the storage metered is that of the 32 tokens, not of each write."""
    bank = QuantizerBank(QuantSpec("kivi", 4, group_size=16), KVGeometry(1, 2, 64))
    cache = ProtocolWriteCache(bank, Protocol(window=4, exact_prefill=True))
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(1, 2, 32, 64, generator=generator) for _ in range(2))
    cache.update(keys[..., :21, :], values[..., :21, :], 0)
    for position in range(21, 32):
        cache.update(keys[..., position:position + 1, :], values[..., position:position + 1, :], 0)
    whole = QuantizerBank(QuantSpec("kivi", 4, group_size=16), KVGeometry(1, 2, 64))
    for got, role, states in zip(cache.far(0), ("k", "v"), (keys, values), strict=True):
        assert torch.equal(got, whole.get(0, role)(states))
    assert bank.measured_bits_per_element() == whole.measured_bits_per_element() == 4 + 2 * 16 / 16
    cache.update(keys[..., :3, :], values[..., :3, :], 0)  # three more tokens, a group short: exact, 16 bits
    assert bank.measured_bits_per_element() == pytest.approx((32 * 6 + 3 * 16) / 35, rel=1e-12)


def test_stored_bits_count_the_window_in_fp16():
    assert Protocol(window=128).stored_bits_per_element(4.5, 512) == (128 * 16 + 384 * 4.5) / 512
    assert Protocol(window=1024).stored_bits_per_element(4.5, 512) == 16
    assert Protocol().stored_bits_per_element(4.5, 512) == 4.5


@pytest.mark.parametrize("window", [-1, True, 1.5])
def test_bad_windows_are_rejected(window):
    with pytest.raises(KvqError, match="window"):
        Protocol(window=window)


def test_sweep_protocols_are_cells_and_the_default_keeps_ids(tmp_path):
    base = "name: t\nmodels: [smollm2-135m]\nmode: cache\ngrid:\n  quantizer: [int]\n"
    path = tmp_path / "s.yaml"
    path.write_text(base)
    (default,) = expand(load_sweep(path))
    path.write_text(base + "protocol: [{}, {window: 128, exact_prefill: true}]\n")
    cells = expand(load_sweep(path))
    assert cells[0].id == default.id and "protocol" not in cells[0].config()
    assert cells[1].config()["protocol"] == {"window": 128, "exact_prefill": True} and cells[1].id != default.id
    path.write_text(base.replace("mode: cache", "mode: hook") + "protocol: {window: 8}\n")
    with pytest.raises(KvqError, match="field 'protocol': window and exact_prefill apply to mode: cache"):
        load_sweep(path)
    path.write_text(base + "protocol: {window: 8, stride: 2}\n")
    with pytest.raises(KvqError, match=r"field 'protocol\.stride': unknown field"):
        load_sweep(path)


@pytest.fixture(scope="module")
def smollm2():
    lm = loaded("smollm2-135m")
    return lm, eval_windows(lm, DataSpec(seq_len=96, n_windows=2, batch_size=2))


def ppl(lm, windows, spec, protocol=Protocol()):
    bank = make_bank("smollm2-135m", lm.model.config, spec) if spec else None
    return perplexity(lm.model, windows, bank, "cache", 2, None, protocol).ppl


@requires_models
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.quantizer)
def test_window_zero_is_todays_cache_mode_and_a_full_window_is_fp(smollm2, spec):
    lm, windows = smollm2
    everything_quantized = ppl(lm, windows, spec)
    assert ppl(lm, windows, spec, Protocol(window=0)) == pytest.approx(everything_quantized, rel=1e-6)
    fp = ppl(lm, windows, None)
    assert ppl(lm, windows, spec, Protocol(window=96)) == pytest.approx(fp, rel=1e-5)
    assert ppl(lm, windows, spec, Protocol(window=0, exact_prefill=True)) == pytest.approx(fp, rel=1e-5)
    between = ppl(lm, windows, spec, Protocol(window=32))
    assert between != pytest.approx(everything_quantized, rel=1e-4) and between != pytest.approx(fp, rel=1e-4)


@requires_models
def test_exact_prefill_generates_what_fp_does_first_then_quantizes(smollm2):
    lm, windows = smollm2
    prompt = windows[:1, :64]
    bank = make_bank("smollm2-135m", lm.model.config, QuantSpec("int", 2))

    def generate(bank, protocol):
        with quantized_kv(lm.model, bank, "cache", protocol) as forward_kwargs:
            extra = forward_kwargs()
            extra.pop("use_cache")
            return lm.model.generate(prompt, max_new_tokens=24, do_sample=False, **extra)[0, 64:]

    fp = generate(None, Protocol())
    everything = generate(bank, Protocol(window=200))  # the window covers prompt and generation
    assert torch.equal(everything, fp)
    prefill = generate(bank, Protocol(window=0, exact_prefill=True))
    quantized = generate(bank, Protocol())
    assert prefill[0] == fp[0]  # the first token comes from the exact prefill
    assert not torch.equal(prefill, fp) and not torch.equal(prefill, quantized)
