"""Key pre-conditioning (kvq.center): the offsets it subtracts are exactly what a bias adds to a cached key, the
un-rotation gives back k_proj's output, the stored mean is counted, and it refuses what it cannot center."""

import pytest
import torch
from transformers import DynamicCache, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvq.apply import QuantizerBank, kv_geometry, quantized_kv
from kvq.center import MEAN_BITS, KeyCenter, bias_offsets, mean_offsets
from kvq.data import DataSpec
from kvq.errors import KvqError
from kvq.experiment import fit_center, make_bank
from kvq.models import LoadedModel
from kvq.policy import parse_policy
from kvq.protocol import Protocol
from kvq.quant import QuantSpec

SMALL = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=128, head_dim=32,
             intermediate_size=64, vocab_size=101, max_position_embeddings=256)
HEAD_DIM = SMALL["head_dim"]


def tiny(kind: str, biases: bool = True):
    torch.manual_seed(0)
    model = (Qwen2ForCausalLM(Qwen2Config(**SMALL)) if kind == "qwen2" else
             LlamaForCausalLM(LlamaConfig(**SMALL))).eval()
    if kind == "qwen2":
        for layer in model.model.layers:  # transformers initializes biases to zero; Qwen2.5's are large
            with torch.no_grad():
                layer.self_attn.k_proj.bias.copy_(torch.randn_like(layer.self_attn.k_proj.bias) * 3 if biases else 0)
    return model


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (2, n), generator=torch.Generator().manual_seed(seed))


class Recording(DynamicCache):
    """Keeps every key write, and the center's rotated offset for it."""

    def __init__(self, center: KeyCenter, config):
        super().__init__(config=config)
        self.center, self.keys, self.offsets = center, [], []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 1:
            self.keys.append(key_states.clone())
            self.offsets.append(self.center.offset(layer_idx, key_states, rotated=True))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def written_keys(model, center: KeyCenter) -> Recording:
    """A 9-token prefill, then two one-token steps: the positions of each write move."""
    tokens = prompt(11)
    cache = Recording(center, model.config)
    undo = center.track_positions(model)
    with torch.no_grad():
        model(tokens[:, :9], past_key_values=cache, use_cache=True)
        for i in (9, 10):
            model(tokens[:, i:i + 1], past_key_values=cache, use_cache=True)
    undo()
    return cache


def test_a_bias_offset_is_what_the_bias_adds_to_every_cached_key_at_its_position():
    model = tiny("qwen2")
    center = KeyCenter(model, bias_offsets(model, [1], HEAD_DIM), 0)
    biased = written_keys(model, center)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.bias.zero_()
    unbiased = written_keys(model, center)
    assert [k.shape[2] for k in biased.keys] == [9, 1, 1]
    for with_bias, without, offset in zip(biased.keys, unbiased.keys, biased.offsets, strict=True):
        assert torch.broadcast_shapes(offset.shape, with_bias.shape) == with_bias.shape
        torch.testing.assert_close(with_bias - without, offset.expand_as(with_bias), atol=2e-5, rtol=0)
    assert not torch.allclose(biased.offsets[1], biased.offsets[2])  # each position its own rotation


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_unrotated_cached_keys_are_k_projs_output(kind):
    """Without a key norm, the pre-RoPE keys are k_proj's output: the cache-mode means (cached keys un-rotated)
    equal the hook-mode means (k_proj's output)."""
    model = tiny(kind)
    windows = prompt(40, seed=2)
    cached = mean_offsets(model, [0, 1], HEAD_DIM, windows, "cache", batch_size=1)
    hooked = mean_offsets(model, [0, 1], HEAD_DIM, windows, "hook", batch_size=2)
    for layer in (0, 1):
        assert cached[layer].shape == (SMALL["num_key_value_heads"], HEAD_DIM)
        torch.testing.assert_close(cached[layer], hooked[layer], atol=2e-5, rtol=0)
    if kind == "qwen2":  # the means carry the biases
        bias = model.model.layers[1].self_attn.k_proj.bias.view(-1, HEAD_DIM)
        assert (cached[1] - bias).abs().mean() < 0.5 * bias.abs().mean()


def logits_under(model, bank, protocol=Protocol()) -> torch.Tensor:
    with quantized_kv(model, bank, "cache", protocol) as fresh, torch.no_grad():
        return model(prompt(24), **fresh()).logits


def centered_bank(model, center: str, spec: QuantSpec = QuantSpec("int", 4)) -> QuantizerBank:
    from dataclasses import replace

    bank = QuantizerBank(replace(spec, center=center), kv_geometry(model.config))
    if center != "none":
        bank.center = KeyCenter(model, bias_offsets(model, list(range(SMALL["num_hidden_layers"])), HEAD_DIM), 0)
    return bank


def test_centering_on_zero_biases_changes_nothing_and_a_window_over_everything_is_fp():
    model = tiny("qwen2", biases=False)
    assert torch.equal(logits_under(model, centered_bank(model, "bias")),
                       logits_under(model, centered_bank(model, "none")))
    model = tiny("qwen2")
    with torch.no_grad():
        fp = model(prompt(24)).logits
    assert torch.equal(logits_under(model, centered_bank(model, "bias"), Protocol(window=24)), fp)
    # and with real biases centering changes what the quantized keys are
    assert not torch.equal(logits_under(model, centered_bank(model, "bias")),
                           logits_under(model, centered_bank(model, "none")))


def test_a_stored_mean_is_counted_once_per_layer_and_stated_per_call():
    model = tiny("qwen2")
    bank = QuantizerBank(QuantSpec("int", 4, center="mean"), kv_geometry(model.config))
    stored = MEAN_BITS * 2 * SMALL["num_key_value_heads"] * HEAD_DIM
    bank.center = KeyCenter(model, mean_offsets(model, [0, 1], HEAD_DIM, prompt(16), "cache", 2), stored)
    logits_under(model, bank)
    plain = QuantizerBank(QuantSpec("int", 4), kv_geometry(model.config))
    logits_under(model, plain)
    elements = sum(q.stored_elements for q in bank._built.values())
    expected = (sum(q.stored_bits for q in plain._built.values()) + bank.center.stored_bits) / elements
    assert bank.measured_bits_per_element() == pytest.approx(expected, rel=1e-12)
    assert bank.measured_bits_per_element() > plain.measured_bits_per_element()
    # stated for one call of n tokens: half the sites (the keys) add 16 bits per head channel over n tokens
    assert bank.bits_per_element(64) == pytest.approx(plain.bits_per_element(64) + MEAN_BITS / 64 / 2)


def test_a_post_rope_mean_is_the_mean_of_the_keys_as_cached_and_the_same_at_every_position():
    """post_rope_mean's offsets are the cached (post-RoPE) keys' per-head-channel mean over the windows, not the
    pre-RoPE mean; a KeyCenter holding them as fixed gives that one offset to every write, where a moved one
    differs by position."""
    model = tiny("qwen2")
    windows = prompt(40, seed=2)
    fitted = mean_offsets(model, [0, 1], HEAD_DIM, windows, "cache", batch_size=1, after_rope=True)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(windows, past_key_values=cache, use_cache=True)
    for layer in (0, 1):
        torch.testing.assert_close(fitted[layer], cache.layers[layer].keys.float().mean(dim=(0, 2)), atol=2e-5,
                                   rtol=0)
    pre_rope = mean_offsets(model, [1], HEAD_DIM, windows, "cache", batch_size=1)
    assert not torch.allclose(fitted[1], pre_rope[1], atol=1e-3)
    fixed = written_keys(model, KeyCenter(model, fitted, 0, fixed=frozenset([0, 1])))
    moved = written_keys(model, KeyCenter(model, fitted, 0))
    for offset in fixed.offsets:
        assert torch.equal(offset, fitted[1][None, :, None, :])
    assert not torch.allclose(moved.offsets[1], moved.offsets[2])


@pytest.mark.parametrize("center", ["mean", "post_rope_mean"])
def test_fit_center_stores_the_means_it_fits_and_counts_them(monkeypatch, center):
    """mean: the pre-RoPE keys' mean, moved with position; post_rope_mean: the cached keys' mean, held fixed."""
    model = tiny("qwen2")
    windows = prompt(32, seed=3)
    monkeypatch.setattr("kvq.experiment.token_windows", lambda *args, **kwargs: windows)
    bank = QuantizerBank(QuantSpec("int", 4, center=center), kv_geometry(model.config))
    fit_center(bank, LoadedModel("tiny", model, None, ""), DataSpec(batch_size=2), "cache")
    after_rope = center == "post_rope_mean"
    expected = mean_offsets(model, [0, 1], HEAD_DIM, windows, "cache", 2, after_rope=after_rope)
    for layer in (0, 1):
        torch.testing.assert_close(bank.center.offsets[layer], expected[layer], atol=0, rtol=0)
    assert bank.center.fixed == ({0, 1} if after_rope else set())
    assert bank.center.stored_bits == MEAN_BITS * 2 * SMALL["num_key_value_heads"] * HEAD_DIM
    plain = QuantizerBank(QuantSpec("int", 4), kv_geometry(model.config))
    for layer, role in [(layer, role) for layer in (0, 1) for role in ("k", "v")]:
        bank.get(layer, role), plain.get(layer, role)
    # stated for one call of n tokens: half the sites (the keys) add 16 bits per head channel over n tokens
    assert bank.bits_per_element(64) == pytest.approx(plain.bits_per_element(64) + MEAN_BITS / 64 / 2)


def test_a_post_rope_mean_is_refused_in_hook_mode_and_for_keys_encoded_before_rope():
    with pytest.raises(KvqError, match="hook mode quantizes k_proj's output before RoPE"):
        make_bank("tiny", Qwen2Config(**SMALL), QuantSpec("int", 4, center="post_rope_mean"), mode="hook")
    make_bank("tiny", Qwen2Config(**SMALL), QuantSpec("int", 4, center="post_rope_mean"), mode="cache")
    with pytest.raises(KvqError, match="kvquant encodes keys before RoPE"):
        make_bank("tiny", Qwen2Config(**SMALL), QuantSpec("kvquant", 4, center="post_rope_mean"))


@pytest.mark.parametrize("config, spec, policy, fragment", [
    (LlamaConfig(**SMALL), QuantSpec("int", 4, center="bias"), None, "center: bias: the model's k_proj has no bias"),
    (Gemma3TextConfig(**SMALL, attention_bias=True), QuantSpec("int", 4, center="bias"), None,
     "normalizes keys after k_proj (k_norm)"),
    (Qwen2Config(**SMALL), QuantSpec("int", 4, center="median"), None,
     "center must be one of none, bias, mean, post_rope_mean"),
    (Qwen2Config(**SMALL), QuantSpec("qjl", 4, center="bias"), None, "scored from their sketch"),
    (Qwen2Config(**SMALL), QuantSpec("int", 4), {"v": {"center": "mean"}}, "center applies to keys"),
])
def test_what_cannot_be_centered_is_refused_naming_it(config, spec, policy, fragment):
    with pytest.raises(KvqError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        make_bank("tiny", config, spec, parse_policy(policy))


def test_a_policy_centers_the_keys_of_the_layers_it_names():
    bank = make_bank("tiny", Qwen2Config(**SMALL), QuantSpec("int", 4),
                     parse_policy({"layers": [{"last": 1, "k": {"center": "bias"}}]}))
    assert bank.key_centers == {1: "bias"}
    with pytest.raises(KvqError, match="not fitted"):
        with quantized_kv(tiny("qwen2"), bank, "cache"):
            pass
