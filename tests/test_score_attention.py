"""QJL in cache mode runs through kvq's score attention: sketched keys in the cache, sketched queries."""

import pytest
import torch
from conftest import loaded, requires_models

from kvq.apply import QuantizerBank, kv_geometry, quantized_kv
from kvq.data import token_windows
from kvq.quant import QuantSpec
from kvq.quant.base import Quantizer

pytestmark = [requires_models, pytest.mark.model]


class DecodeOnly(Quantizer):
    """The same QJL quantizer without the score path: keys reconstructed as k_hat = c |k| S^T sign(S k)."""

    def __init__(self, quantizer):
        self.quantizer = quantizer

    def encode(self, x):
        return self.quantizer.encode(x)

    def decode(self, packed):
        return self.quantizer.decode(packed)

    def bits_per_element(self, d, n_tokens):
        return self.quantizer.bits_per_element(d, n_tokens)


def attention_outputs(lm, bank, ids, layers):
    outputs = {}
    hooks = [
        lm.model.model.layers[i].self_attn.register_forward_hook(
            lambda _m, _i, out, i=i: outputs.__setitem__(i, out[0].detach().clone())
        )
        for i in layers
    ]
    try:
        with torch.no_grad(), quantized_kv(lm.model, bank, "cache") as kwargs:
            cache = kwargs()["past_key_values"]
            lm.model(input_ids=ids, past_key_values=cache, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    return outputs, cache


def test_score_path_equals_estimator_and_stores_sketches():
    lm = loaded("smollm2-135m")
    geometry = kv_geometry(lm.model.config)
    ids = token_windows(lm.tokenizer, "shakespeare", 48, 1)
    spec = QuantSpec("qjl", 8, options={"m": 96})
    score_bank = QuantizerBank(spec, geometry)
    decode_bank = QuantizerBank(spec, geometry)
    for layer in range(geometry.n_layers):
        decode_bank._built[(layer, "k")] = DecodeOnly(decode_bank.get(layer, "k"))
    layers = [0, 1, 2]
    scored, cache = attention_outputs(lm, score_bank, ids, layers)
    decoded, _ = attention_outputs(lm, decode_bank, ids, layers)
    assert cache.layers[0].keys.shape[-1] == 96  # the cache holds sketches, not head_dim keys
    for i in layers:
        assert torch.allclose(scored[i], decoded[i], atol=1e-4)
    assert lm.model.config._attn_implementation == "sdpa"  # restored after the run
