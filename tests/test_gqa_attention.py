"""The fair fp16 attention of `kvq bench decode`: transformers' sdpa function, less the K/V expansion."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from kvq import gqa_attention
from kvq.gqa_attention import gqa_sdpa


def _gqa_model():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=16, vocab_size=101, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def _decode_logits(model, cache, prompt: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The prompt's logits, then one step's per greedy token, through `cache`."""
    with torch.no_grad():
        logits = [model(input_ids=prompt, past_key_values=cache, use_cache=True).logits]
        for _ in range(steps):
            token = logits[-1][:, -1:].argmax(-1)
            logits.append(model(input_ids=token, past_key_values=cache, use_cache=True).logits)
    return logits


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
def test_gqa_sdpa_gives_transformers_sdpa_logits_with_kv_heads_left_unexpanded(cache_kind, monkeypatch):
    """Prefill and decode through a static cache (masked: its tail is unwritten) and a dynamic one (unmasked):
    the same logits as transformers' sdpa attention, which repeats K/V per query head under a mask, while every
    decode step hands SDPA the K/V with the model's 2 KV heads."""
    model = _gqa_model()
    prompt = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(1))

    def cache():
        return (StaticCache(config=model.config, max_cache_len=24) if cache_kind == "static"
                else DynamicCache(config=model.config))

    want = _decode_logits(model, cache(), prompt, 6)
    sdpa, kv_heads = torch.nn.functional.scaled_dot_product_attention, []

    def spy(query, key, value, **kwargs):
        if query.shape[2] == 1:
            kv_heads.append(key.shape[1])
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(gqa_attention.F, "scaled_dot_product_attention", spy)
    with gqa_sdpa(model):
        got = _decode_logits(model, cache(), prompt, 6)
    assert model.config._attn_implementation == "sdpa"  # restored
    assert len(kv_heads) == 6 * model.config.num_hidden_layers and set(kv_heads) == {2}
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

