import pytest
import torch
from conftest import loaded, requires_models
from transformers import DynamicCache, LlamaConfig

from kvq.apply import KVGeometry, QuantizerBank, kv_geometry
from kvq.cache import QuantizedKVCache, QuantizedLayer, dynamic_cache_bytes
from kvq.quant import QuantSpec


def small_config(head_dim=128, layers=2):
    return LlamaConfig(num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                       hidden_size=8 * head_dim, head_dim=head_dim)


def test_window_flushes_and_returns_decoded_prefix_plus_exact_window():
    bank = QuantizerBank(QuantSpec("srft", 4, "per_group", 32), KVGeometry(2, 2, 128))
    cache = QuantizedKVCache(bank, small_config(), residual=16)
    keys, values = torch.randn(1, 2, 40, 128), torch.randn(1, 2, 40, 128)
    out_k, out_v = cache.update(keys, values, 0)
    assert torch.equal(out_v[..., 32:, :], values[..., 32:, :])
    layer = cache.layers[0]
    assert isinstance(layer, QuantizedLayer) and layer.quantized_tokens == 32 and cache.get_seq_length(0) == 40
    assert torch.equal(out_k[..., 32:, :], keys[..., 32:, :])  # the window is exact
    decoded = bank.get(0, "k").decode(layer.packed["k"][0])
    assert torch.equal(out_k[..., :32, :], decoded)
    out_k, _ = cache.update(torch.randn(1, 2, 1, 128), torch.randn(1, 2, 1, 128), 0)
    assert out_k.shape[-2] == 41 and layer.quantized_tokens == 32


def test_prefix_cache_changes_work_not_results():
    bank = QuantizerBank(QuantSpec("srht", 4, "per_group", 32), KVGeometry(2, 2, 128))
    kept, recomputed = (QuantizedKVCache(bank, small_config(), 8, keep) for keep in (True, False))
    for step in range(5):
        k, v = torch.randn(1, 2, 7 if step == 0 else 1, 128), torch.randn(1, 2, 7 if step == 0 else 1, 128)
        a, b = kept.update(k, v, 1), recomputed.update(k, v, 1)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_int4_g32_memory_ratio_beyond_window():
    bank = QuantizerBank(QuantSpec("srft", 4, "per_group", 32), KVGeometry(2, 2, 128))
    config = small_config()
    quantized, reference = QuantizedKVCache(bank, config, residual=16), DynamicCache(config=config)
    for layer in range(2):
        k, v = torch.randn(1, 2, 1030, 128).half(), torch.randn(1, 2, 1030, 128).half()
        quantized.update(k, v, layer)
        reference.update(k, v, layer)
    ratio = dynamic_cache_bytes(reference) / quantized.memory_bytes()
    assert ratio >= 3.0
    # int4 codes + one fp32 scale per 32 elements: (64 + 16) bytes per 128-d token; the window keeps the
    # 1030 % 16 = 6 newest tokens in fp16; x 2 layers x (K, V) x 2 heads
    expected = 2 * 2 * 2 * (1024 * (64 + 16) + 6 * 256)
    assert quantized.memory_bytes() == expected


@requires_models
@pytest.mark.model
def test_smollm2_greedy_at_8_bits_equals_fp():
    lm = loaded("smollm2-135m")
    prompt = lm.tokenizer("To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer",
                          return_tensors="pt")
    bank = QuantizerBank(QuantSpec("srft", 8), kv_geometry(lm.model.config))
    with torch.no_grad():
        reference = lm.model.generate(**prompt, max_new_tokens=32, do_sample=False)
        cache = QuantizedKVCache(bank, lm.model.config)
        quantized = lm.model.generate(**prompt, max_new_tokens=32, do_sample=False, past_key_values=cache)
    assert torch.equal(quantized, reference)
    assert all(isinstance(layer, QuantizedLayer) for layer in cache.layers)
    tokens = cache.get_seq_length()
    packed, window = tokens - tokens % 16, tokens % 16
    # per layer, role and KV head: int8 codes + one fp32 scale per 64-d token; the window in fp32
    geometry = kv_geometry(lm.model.config)
    per_head = packed * (64 + 4) + window * 64 * 4
    assert cache.memory_bytes() == geometry.n_layers * 2 * geometry.n_kv_heads * per_head


@requires_models
@pytest.mark.model
def test_gemma3_sliding_layers_stay_dynamic_and_generate_runs():
    lm = loaded("gemma3-270m")
    bank = QuantizerBank(QuantSpec("srft", 8), kv_geometry(lm.model.config))
    cache = QuantizedKVCache(bank, lm.model.config)
    prompt = lm.tokenizer("Shall I compare thee to a summer's day?", return_tensors="pt")
    with torch.no_grad():
        out = lm.model.generate(**prompt, max_new_tokens=8, do_sample=False, past_key_values=cache)
    kinds = [layer.is_sliding for layer in cache.layers]
    assert any(kinds) and not all(kinds)
    assert all(isinstance(layer, QuantizedLayer) != layer.is_sliding for layer in cache.layers)
    assert out.shape[-1] == prompt["input_ids"].shape[-1] + 8
