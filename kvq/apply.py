"""Putting quantizers on a model's KV path.

hook:  quantize-dequantize the k_proj / v_proj outputs (pre-RoPE, pre-norm), as the SRFT paper's
       hook-PPL (Sec. 3.3).
cache: quantize-dequantize K/V post-RoPE when they are written to the cache, through a DynamicCache
       subclass, as the HQMQ paper's evaluation; sliding-window layers keep their own cache layers.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvq.attention import SCORE_ATTENTION, switch_attention, uses_score_path
from kvq.errors import KvqError
from kvq.quant import Learned, Quantizer, QuantSpec, Site, build_quantizer

MODES = ("hook", "cache")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise KvqError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


@dataclass(frozen=True)
class KVGeometry:
    n_layers: int
    n_kv_heads: int
    head_dim: int


def kv_geometry(model_config) -> KVGeometry:
    config = model_config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return KVGeometry(config.num_hidden_layers, n_kv, head_dim)


class QuantizerBank:
    """One quantizer per (layer, K|V) site, built on first use, with learned pieces from a calibration."""

    def __init__(self, spec: QuantSpec, geometry: KVGeometry,
                 learned: dict[tuple[int, str], Learned] | None = None):
        self.spec = spec
        self.geometry = geometry
        self.learned = learned or {}
        self._built: dict[tuple[int, str], Quantizer] = {}
        # Bad bits or group sizes should fail here, before any model work.
        self.bits_per_element(1)

    def get(self, layer: int, role: str) -> Quantizer:
        key = (layer, role)
        if key not in self._built:
            site = Site(layer, role, self.geometry.head_dim, self.learned.get(key))
            self._built[key] = build_quantizer(self.spec, site)
        return self._built[key]

    def bits_per_element(self, n_tokens: int) -> float:
        """The quantizer's stated cost for one encode call of n_tokens tokens."""
        return self.get(0, "k").bits_per_element(self.geometry.head_dim, n_tokens)

    def measured_bits_per_element(self) -> float | None:
        """Storage actually produced by every call so far, over all sites; None before any call."""
        bits = sum(q.stored_bits for q in self._built.values())
        elements = sum(q.stored_elements for q in self._built.values())
        return bits / elements if elements else None


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    found = [m for m in model.modules() if hasattr(m, "k_proj") and hasattr(m, "v_proj") and hasattr(m, "layer_idx")]
    if not found:
        raise KvqError(f"{type(model).__name__} has no attention modules with k_proj/v_proj; hook mode needs them")
    return found


def _projection_hook(quantizer: Quantizer, head_dim: int) -> Callable:
    def hook(_module, _inputs, output):
        batch, tokens, width = output.shape
        heads = output.view(batch, tokens, width // head_dim, head_dim).transpose(1, 2)
        return quantizer(heads).transpose(1, 2).reshape(batch, tokens, width).to(output.dtype)

    return hook


class QuantizedWriteCache(DynamicCache):
    """DynamicCache that quantize-dequantizes every K/V write (post-RoPE)."""

    def __init__(self, bank: QuantizerBank, config=None):
        super().__init__(config=config)
        self.bank = bank

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        key_quantizer = self.bank.get(layer_idx, "k")
        if uses_score_path(key_quantizer):
            key_states = key_quantizer.attention_keys(key_states)
        else:
            key_states = key_quantizer(key_states).to(key_states.dtype)
        value_states = self.bank.get(layer_idx, "v")(value_states).to(value_states.dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@contextmanager
def quantized_kv(model: torch.nn.Module, bank: QuantizerBank | None, mode: str) -> Iterator[Callable[[], dict]]:
    """Yields a function giving the forward() kwargs for one fresh forward pass under `mode`.

    With bank None the model runs unquantized (the fp baseline), on the same code path.
    """
    check_mode(mode)
    handles = []
    restore = None
    try:
        if mode == "hook":
            if bank is not None:
                head_dim = bank.geometry.head_dim
                for attention in attention_modules(model):
                    for role, projection in (("k", attention.k_proj), ("v", attention.v_proj)):
                        hook = _projection_hook(bank.get(attention.layer_idx, role), head_dim)
                        handles.append(projection.register_forward_hook(hook))
            yield lambda: {"use_cache": False}
        elif bank is None:
            yield lambda: {"use_cache": True, "past_key_values": DynamicCache(config=model.config)}
        else:
            if uses_score_path(bank.get(0, "k")):
                restore = _use_score_attention(model, bank)
            yield lambda: {"use_cache": True, "past_key_values": QuantizedWriteCache(bank, config=model.config)}
    finally:
        for handle in handles:
            handle.remove()
        if restore:
            restore()


def _use_score_attention(model: torch.nn.Module, bank: QuantizerBank) -> Callable[[], None]:
    """Switches the model to kvq's score attention (kvq.attention); returns the undo."""
    modules = attention_modules(model)
    for attention in modules:
        attention.kvq_key_scorer = bank.get(attention.layer_idx, "k")
    restore_attention = switch_attention(model, SCORE_ATTENTION)

    def restore() -> None:
        restore_attention()
        for attention in modules:
            del attention.kvq_key_scorer

    return restore
