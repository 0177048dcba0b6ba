"""End-to-end perplexity on real built-in models and real text."""

import pytest
import torch
from conftest import loaded, requires_models

from kvq import ops
from kvq.apply import QuantizerBank, kv_geometry, quantized_kv
from kvq.data import token_windows
from kvq.ppl import perplexity
from kvq.quant import QuantSpec

pytestmark = [requires_models, pytest.mark.model]


def dppl(name, spec, mode="hook", seq_len=256, n_windows=4, relative=False):
    """PPL under spec minus the unquantized PPL (over the unquantized PPL when relative)."""
    lm = loaded(name)
    windows = token_windows(lm.tokenizer, "shakespeare", seq_len, n_windows)
    bank = QuantizerBank(spec, kv_geometry(lm.model.config))
    base = perplexity(lm.model, windows, None, mode).ppl
    delta = perplexity(lm.model, windows, bank, mode).ppl - base
    return delta / base if relative else delta


def test_smollm2_8bit_per_token_is_lossless():
    # Within a quarter percent (4-bit per-token costs ~7%); an absolute bound moved with transformers'
    # GGUF conversion (base PPL 40.3, 8-bit +0.062 with transformers 5.23).
    assert abs(dppl("smollm2-135m", QuantSpec("srft", 8, "per_token"), relative=True)) < 2.5e-3


def test_smollm2_3bit_per_token_degrades():
    assert dppl("smollm2-135m", QuantSpec("srft", 3, "per_token")) > 0.5


def test_smollm2_ppl_orders_by_bits():
    values = [dppl("smollm2-135m", QuantSpec("int", b, "per_token"), n_windows=2) for b in (3, 4, 8)]
    assert values[0] > values[1] > values[2]


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"])
def test_cache_mode_quantizes_every_layer(name, monkeypatch):
    """Cache mode must touch every layer, sliding-window ones included (Gemma-3)."""
    lm = loaded(name)
    geometry = kv_geometry(lm.model.config)
    bank = QuantizerBank(QuantSpec("srft", 4, "per_token"), geometry)
    sites = {id(bank.get(layer, role)): (layer, role) for layer in range(geometry.n_layers) for role in ("k", "v")}
    seen = set()

    def spy(quantizer, x, roundtrip=ops.roundtrip):
        assert x.shape[-1] == geometry.head_dim and x.shape[1] == geometry.n_kv_heads
        seen.add(sites[id(quantizer)])
        return roundtrip(quantizer, x)

    monkeypatch.setattr(ops, "roundtrip", spy)
    ids = token_windows(lm.tokenizer, "shakespeare", 64, 1)
    with torch.no_grad(), quantized_kv(lm.model, bank, "cache") as kwargs:
        quantized = lm.model(input_ids=ids, **kwargs()).logits
    with torch.no_grad(), quantized_kv(lm.model, None, "cache") as kwargs:
        fp = lm.model(input_ids=ids, **kwargs()).logits
    assert seen == {(layer, role) for layer in range(geometry.n_layers) for role in ("k", "v")}
    assert torch.isfinite(quantized).all()
    assert not torch.allclose(quantized, fp)


def test_hook_mode_hooks_are_removed():
    lm = loaded("smollm2-135m")
    bank = QuantizerBank(QuantSpec("int", 2), kv_geometry(lm.model.config))
    ids = token_windows(lm.tokenizer, "shakespeare", 32, 1)
    with torch.no_grad():
        before = lm.model(input_ids=ids).logits
        with quantized_kv(lm.model, bank, "hook") as kwargs:
            during = lm.model(input_ids=ids, **kwargs()).logits
        after = lm.model(input_ids=ids).logits
    assert not torch.allclose(before, during)
    assert torch.equal(before, after)


def test_kvquant_on_smollm2_orders_by_bits_and_its_outliers_help():
    """KVQuant at its k_proj / v_proj point (hook mode), the official simulation's online configuration."""
    def kvquant(bits, outliers):
        return dppl("smollm2-135m", QuantSpec("kvquant", bits, options={"outliers": outliers}))

    assert kvquant(4, 0.01) < kvquant(3, 0.01) < kvquant(3, 0.0)


def test_centering_qwen_keys_rescues_its_4bit_per_token_codes():
    """Qwen2.5's k_proj biases are what collapse its per-token key codes: the same SRFT-4 codes on keys less the
    bias (moved to each position) or less their calibration mean lose a fraction of what they lose uncentered."""
    from dataclasses import replace

    from kvq.data import DataSpec
    from kvq.experiment import eval_windows, make_bank, measure

    lm = loaded("qwen2.5-coder-0.5b")
    data = DataSpec("shakespeare", seq_len=256, n_windows=2, batch_size=2)
    windows = eval_windows(lm, data)
    base = measure(lm, windows, None, "cache", data).ppl
    spec = QuantSpec("srft", 4, "per_token")
    loss = {center: measure(lm, windows, make_bank(lm.name, lm.model.config, replace(spec, center=center)), "cache",
                            data).ppl - base for center in ("none", "bias", "mean")}
    assert loss["bias"] < 0.1 * loss["none"] and loss["mean"] < 0.1 * loss["none"]
