"""FusedLayer keeps QuantizedLayer's semantics while attending from packed codes.

On CPU the kernels fall back to the torch reference, so these tests pin the layer logic (window,
flush, domain maps, split attention); on CUDA the same tests run the NVRTC and Triton kernels.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES
from transformers import LlamaConfig, LlamaForCausalLM

from kvq.apply import KVGeometry, QuantizerBank, kv_geometry
from kvq.cache import FusedLayer, PackedStore, QuantizedKVCache, QuantizedLayer, WindowedLayer, fused_decoding
from kvq.errors import KvqError
from kvq.quant import QuantSpec


def llama_config(head_dim=64, layers=2, q_heads=8, kv_heads=2):
    return LlamaConfig(num_hidden_layers=layers, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                       hidden_size=q_heads * head_dim, head_dim=head_dim, intermediate_size=128, vocab_size=97)


def reference_attention(query, keys, values, scale):
    out = F.scaled_dot_product_attention(query.float(), keys.float(), values.float(), scale=scale,
                                         enable_gqa=query.shape[1] != keys.shape[1])
    return out.transpose(1, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec, prompt", [(QuantSpec("srft", 4, "per_group", 32), 37), (QuantSpec("srht", 8), 37),
                                          (QuantSpec("int", 4, "per_token"), 37),
                                          (QuantSpec("srft", 4, "per_group", 32), 5),
                                          (QuantSpec("srft", 4, "per_group", 32, scale_dtype="float16"), 37),
                                          (QuantSpec("srft", 3, "per_group", 32), 37),
                                          (QuantSpec("srft", 4, "per_group", 32, scale_dtype="bfloat16"), 37)])
def test_fused_layer_attends_like_dequantized_reference(device, spec, prompt):
    """Twenty decode steps cross a window flush; a 5-token prompt starts with nothing packed. On CUDA the
    int4 g32 case runs csrc/decode_attention.cu's partial kernel; 3-bit codes and bfloat16 scales, which no
    quantize kernel takes, run the reference behind the same ops."""
    d, kv_heads, q_heads = 128, 2, 8
    bank = QuantizerBank(spec, KVGeometry(1, kv_heads, d))
    bank.get(0, "k").lam = torch.rand(d) + 0.5  # a calibrated lambda must round-trip through the maps
    reference, fused = QuantizedLayer(bank, 0, 16, True), FusedLayer(bank, 0, 16)
    fused.rerouted = True  # as under fused_decoding: decode steps attend from the codes
    generator = torch.Generator().manual_seed(3)

    def states(tokens):
        return [torch.randn(1, kv_heads, tokens, d, generator=generator).to(device) for _ in range(2)]

    k, v = states(prompt)
    ref_k, ref_v = reference.update(k, v)
    fused_k, fused_v = fused.update(k, v)
    assert not fused.deferred and fused.get_seq_length() == prompt == reference.get_seq_length()
    torch.testing.assert_close(fused_k, ref_k, atol=2e-5, rtol=0)
    torch.testing.assert_close(fused_v, ref_v, atol=2e-5, rtol=0)
    for step in range(20):
        k, v = states(1)
        ref_k, ref_v = reference.update(k, v)
        fused.update(k, v)
        assert fused.deferred and fused.get_seq_length() == prompt + 1 + step
        query = torch.randn(1, q_heads, 1, d, generator=generator).to(device)
        expected = reference_attention(query, ref_k, ref_v, d ** -0.5)
        torch.testing.assert_close(fused.attend(query, d ** -0.5).float(), expected, atol=2e-3, rtol=0)
    total = prompt + 20
    assert fused.stores["k"].length == total - total % 16 and fused.count == total % 16
    # flushes reuse the decode graph: only a reallocated buffer needs a new one, here the first
    # allocation after a prompt that left nothing packed (the prefill's buffers keep spare rows)
    assert fused.decode_graph.captures == ((1 + (prompt < 16)) if device == "cuda" else 0)


def test_fused_layer_keeps_decode_rows_that_no_attend_wrote():
    """A decode step's window row is written with attend's dispatch; when attend does not run (a masked step
    materializes instead, or nothing attends) materialize or the next update must write it."""
    bank = QuantizerBank(QuantSpec("srft", 8, "per_group", 32), KVGeometry(1, 2, 64))
    reference, fused = QuantizedLayer(bank, 0, 16, True), FusedLayer(bank, 0, 16)
    fused.rerouted = True
    generator = torch.Generator().manual_seed(5)
    # 16 packed, 4 window rows; of 3 decode rows, the next update writes the first two and materialize the last
    for tokens in (20, 1, 1, 1):
        k, v = (torch.randn(1, 2, tokens, 64, generator=generator) for _ in range(2))
        expected = reference.update(k, v)
        fused.update(k, v)
    for got, want in zip(fused.materialize(), expected, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_a_decode_step_outside_fused_decoding_returns_the_whole_cache():
    """Unless fused_decoding routes attention to attend(), update must return attention-ready K/V: a model
    whose attention was not rerouted would otherwise attend to the newest token alone."""
    bank = QuantizerBank(QuantSpec("srft", 4, "per_group", 32), KVGeometry(1, 2, 64))
    reference, fused = QuantizedLayer(bank, 0, 16, True), FusedLayer(bank, 0, 16)
    generator = torch.Generator().manual_seed(7)
    for tokens in (20, 1, 1):
        k, v = (torch.randn(1, 2, tokens, 64, generator=generator) for _ in range(2))
        expected, got = reference.update(k, v), fused.update(k, v)
        assert not fused.deferred and got[0].shape[-2] == fused.get_seq_length()
        for have, want in zip(got, expected, strict=True):
            torch.testing.assert_close(have, want, atol=2e-5, rtol=0)
    assert WindowedLayer.is_compileable is False


def test_generate_with_a_fused_cache_but_plain_attention_matches_the_reference_cache():
    torch.manual_seed(0)
    config = llama_config()
    model = LlamaForCausalLM(config).eval()
    bank = QuantizerBank(QuantSpec("srft", 8, "per_group", 32), kv_geometry(config))
    prompt = torch.randint(0, config.vocab_size, (1, 21))
    options = dict(max_new_tokens=12, do_sample=False)
    expected = model.generate(prompt, past_key_values=QuantizedKVCache(bank, config), **options)
    got = model.generate(prompt, past_key_values=QuantizedKVCache(bank, config, fused=True), **options)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("scale_dtype, scale_bytes", [("float32", 4), ("float16", 2)])
def test_fused_memory_counts_allocated_buffers(scale_dtype, scale_bytes):
    bank = QuantizerBank(QuantSpec("srft", 4, "per_group", 32, scale_dtype=scale_dtype), KVGeometry(1, 2, 128))
    layer = FusedLayer(bank, 0, 16)
    layer.update(torch.randn(1, 2, 1030, 128).half(), torch.randn(1, 2, 1030, 128).half())
    # codes 64 B + 4 scales per token for 1024 packed tokens and 64 spare; the window holds 16 fp16 tokens
    per_role = 2 * ((1024 + PackedStore.MIN_GROWTH) * (64 + 4 * scale_bytes) + 16 * 128 * 2)
    assert layer.persistent_bytes() == 2 * per_role


def test_fused_cache_refuses_quantizers_without_a_packed_layout():
    assert QuantizerBank(QuantSpec("srft", 4), KVGeometry(1, 1, 64)).get(0, "k").packed_form() is not None
    assert QuantizerBank(QuantSpec("int", 4, symmetric=False), KVGeometry(1, 1, 64)).get(0, "k").packed_form()
    for spec, reason in ((QuantSpec("int", 4, "per_channel"), "per_channel"), (QuantSpec("hqmq", 4), "HQMQ"),
                         (QuantSpec("kivi", 4, group_size=32), "KIVI")):
        bank = QuantizerBank(spec, KVGeometry(1, 1, 64))
        with pytest.raises(KvqError, match=reason):
            FusedLayer(bank, 0, 16)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_decoding_generate_matches_reference_cache(device):
    torch.manual_seed(0)
    config = llama_config()
    model = LlamaForCausalLM(config).to(device).eval()
    bank = QuantizerBank(QuantSpec("srft", 8, "per_group", 32), kv_geometry(config))
    prompt = torch.randint(0, config.vocab_size, (1, 21), device=device)
    options = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = model.generate(prompt, past_key_values=QuantizedKVCache(bank, config), **options)
        cache = QuantizedKVCache(bank, config, fused=True)
        with fused_decoding(model, cache):
            got = model.generate(prompt, past_key_values=cache, **options)
    assert model.config._attn_implementation != "kvq_fused"
    assert all(layer.fused_steps == 11 for layer in cache.layers)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores), atol=1e-3, rtol=0)
    assert torch.equal(got.sequences, expected.sequences)


def test_fused_decoding_needs_a_fused_cache():
    config = llama_config()
    model = LlamaForCausalLM(config)
    bank = QuantizerBank(QuantSpec("srft", 4), kv_geometry(config))
    with pytest.raises(KvqError, match="fused=True"), fused_decoding(model, QuantizedKVCache(bank, config)):
        pass
