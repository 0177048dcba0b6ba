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

from kvq import ops
from kvq.attention import SCORE_ATTENTION, WINDOW_ATTENTION, switch_attention, uses_score_path
from kvq.center import MEAN_BITS, STORED_CENTERS, KeyCenter, check_center, check_fitted
from kvq.errors import KvqError
from kvq.policy import SitePolicy
from kvq.projections import attention_modules, merge_heads, split_heads
from kvq.protocol import FP16_BITS, MODES, Protocol
from kvq.quant import Learned, Quantizer, QuantSpec, Site, build_quantizer
from kvq.quant.exact import Exact


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise KvqError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def check_protocol(mode: str, protocol: Protocol) -> Protocol:
    if mode == "hook" and not protocol.is_default:
        raise KvqError("the protocol's window and exact_prefill apply to cache mode, not hook mode")
    return protocol


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
    """One quantizer per (layer, K|V) site, built on first use, with learned pieces from a calibration; a
    SitePolicy (kvq.policy) gives sites their own settings or keeps them exact. Sites whose spec centers its keys
    (kvq.center) read their offsets from `center`, fitted to the model before a run (kvq.experiment)."""

    def __init__(self, spec: QuantSpec, geometry: KVGeometry,
                 learned: dict[tuple[int, str], Learned] | None = None, policy: SitePolicy = SitePolicy()):
        self.spec = spec
        self.geometry = geometry
        self.learned = learned or {}
        self.policy = policy
        self._built: dict[tuple[int, str], Quantizer] = {}
        self.center: KeyCenter | None = None
        # Bad bits, group sizes, centers or policies should fail here, before any model work.
        self._site_specs = None
        if not policy.is_default:
            if learned:
                raise KvqError("a calibration artifact is made for one quantizer at every site; it cannot be "
                               "combined with a per-site policy")
            self._site_specs = policy.site_specs(spec, geometry.n_layers)
            for layer, role in self._site_specs:
                try:
                    self.get(layer, role)
                except KvqError as exc:
                    raise KvqError(f"policy: the {role.upper()} quantizer of layer {layer}: {exc}") from None
        self.key_centers = self._key_centers()
        # layers whose key quantizer encodes keys before RoPE (in cache mode kvq.center undoes and redoes it)
        self.pre_rope_layers = frozenset(layer for layer in range(geometry.n_layers)
                                         if getattr(self.get(layer, "k"), "keys_before_rope", False))
        for layer in self.pre_rope_layers:
            if self.key_centers.get(layer) == "post_rope_mean":
                raise KvqError(f"center: post_rope_mean is a mean after RoPE; {self.site_spec(layer, 'k').quantizer} "
                               "encodes keys before RoPE, where center: mean centers them")
        self.bits_per_element(1)

    def site_spec(self, layer: int, role: str) -> QuantSpec | None:
        return self.spec if self._site_specs is None else self._site_specs[(layer, role)]

    def _key_centers(self) -> dict[int, str]:
        """layer -> how its keys are centered, for the layers that center them."""
        check_center(self.spec.center)
        centers = {}
        for layer in range(self.geometry.n_layers):
            values = self.site_spec(layer, "v")
            if values is not None and values.center != self.spec.center:  # a policy's V field
                raise KvqError(f"center applies to keys; layer {layer}'s V sites ask for {values.center!r}")
            keys = self.site_spec(layer, "k")
            if keys is None or check_center(keys.center) == "none":
                continue
            if uses_score_path(self.get(layer, "k")):
                raise KvqError(f"center: {keys.quantizer}'s keys are scored from their sketch, never decoded, so "
                               "they cannot be centered")
            centers[layer] = keys.center
        return centers

    def get(self, layer: int, role: str) -> Quantizer:
        key = (layer, role)
        if key not in self._built:
            spec = self.site_spec(layer, role)
            site = Site(layer, role, self.geometry.head_dim, self.learned.get(key))
            self._built[key] = Exact() if spec is None else build_quantizer(spec, site)
        return self._built[key]

    def bits_per_element(self, n_tokens: int) -> float:
        """The quantizers' stated cost for one encode call of n_tokens tokens, averaged over the sites
        built so far (every site that ran, after a run; every site of a policy; sites may differ, e.g. QJL
        keys vs values)."""
        self.get(0, "k")
        sizes = [q.bits_per_element(self.geometry.head_dim, n_tokens)
                 + (MEAN_BITS / n_tokens if role == "k" and self.key_centers.get(layer) in STORED_CENTERS else 0)
                 for (layer, role), q in self._built.items()]
        return sum(sizes) / len(sizes)

    def measured_bits_per_element(self) -> float | None:
        """Storage actually produced by every call so far, over all sites (and the stored key means, once per
        layer); None before any call."""
        bits = sum(q.stored_bits for q in self._built.values()) + (self.center.stored_bits if self.center else 0)
        elements = sum(q.stored_elements for q in self._built.values())
        return bits / elements if elements else None


def _projection_hook(bank: QuantizerBank, layer: int, role: str) -> Callable:
    quantizer, head_dim = bank.get(layer, role), bank.geometry.head_dim
    centered = role == "k" and bank.center is not None and layer in bank.center.offsets

    def hook(_module, _inputs, output):
        heads = split_heads(output, head_dim)
        if centered:  # k_proj's output is pre-RoPE: the offset as it is
            heads = bank.center.roundtrip(layer, heads, lambda x: ops.roundtrip(quantizer, x), rotated=False)
        else:
            heads = ops.roundtrip(quantizer, heads)
        return merge_heads(heads).to(output.dtype)

    return hook


def quantized_pair(bank: QuantizerBank, layer: int, keys: torch.Tensor, values: torch.Tensor):
    """What attention reads in place of one write's K/V: quantize-dequantized values, and keys
    quantize-dequantized or, for a score-path quantizer (QJL), sketched."""
    key_quantizer = bank.get(layer, "k")
    if uses_score_path(key_quantizer):
        keys = key_quantizer.attention_keys(keys)
    elif bank.center is not None and bank.center.covers(layer):  # cache writes are post-RoPE
        keys = bank.center.roundtrip(layer, keys, lambda x: ops.roundtrip(key_quantizer, x), rotated=True)
    else:
        keys = ops.roundtrip(key_quantizer, keys).to(keys.dtype)
    return keys, ops.roundtrip(bank.get(layer, "v"), values).to(values.dtype)


class QuantizedWriteCache(DynamicCache):
    """DynamicCache that quantize-dequantizes every K/V write (post-RoPE)."""

    def __init__(self, bank: QuantizerBank, config=None):
        super().__init__(config=config)
        self.bank = bank

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        key_states, value_states = quantized_pair(self.bank, layer_idx, key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class ProtocolWriteCache(DynamicCache):
    """Cache mode under a non-default Protocol: the layers hold exact K/V (what `update` returns) and
    this cache holds their quantized copies beside them, aligned position by position, for
    kvq.attention's window attention to read where a position is out of a query's window.

    Where a site's stats span a group of positions (KIVI, Quantizer.token_group), a write's tokens short of a
    whole group stay exact until a later write fills it: the next write encodes them again with its own, from
    the group's first position, and their copies (and storage) are replaced, as KIVI's streaming cache does."""

    def __init__(self, bank: QuantizerBank, protocol: Protocol, config=None):
        super().__init__(config=config)
        self.bank, self.protocol = bank, protocol
        self._far: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._prefill: dict[int, int] = {}
        self._partial: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a layer's tokens short of a group

    def _quantized(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """The quantized copies of this write, preceded by those of the layer's partial group encoded again; and
        how many earlier copies they replace."""
        sites = [self.bank.get(layer_idx, role) for role in ("k", "v")]
        partial = self._partial.pop(layer_idx, None)
        if partial is not None:
            for site, earlier in zip(sites, partial, strict=True):
                site.rewind(earlier.numel(), FP16_BITS)
            key_states, value_states = (torch.cat([earlier, new], dim=-2)
                                        for earlier, new in zip(partial, (key_states, value_states), strict=True))
        short = key_states.shape[-2] % max(site.token_group for site in sites)
        if short:
            self._partial[layer_idx] = (key_states[..., -short:, :], value_states[..., -short:, :])
        replaced = 0 if partial is None else partial[0].shape[-2]
        return quantized_pair(self.bank, layer_idx, key_states, value_states), replaced

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        far, replaced = self._quantized(layer_idx, key_states, value_states)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx in self._far:
            far = tuple(torch.cat([old[..., :old.shape[-2] - replaced, :], new], dim=-2)
                        for old, new in zip(self._far[layer_idx], far, strict=True))
        # A sliding layer returns only its newest positions: the copies keep the same suffix.
        self._far[layer_idx] = tuple(t[..., -keys.shape[-2]:, :] for t in far)
        self._prefill.setdefault(layer_idx, keys.shape[-2])
        return keys, values

    def far(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._far[layer_idx]

    def near(self, layer_idx: int, n_queries: int, n_keys: int) -> torch.Tensor:
        """(n_queries, n_keys) bool: True where the query sees that position exact. The queries are
        the newest n_queries of the n_keys positions."""
        if self.protocol.exact_prefill and n_keys == self._prefill[layer_idx]:
            return torch.ones(n_queries, n_keys, dtype=torch.bool)
        queries = torch.arange(n_keys - n_queries, n_keys)[:, None]
        return queries - torch.arange(n_keys)[None, :] < self.protocol.window


@contextmanager
def quantized_kv(model: torch.nn.Module, bank: QuantizerBank | None, mode: str,
                 protocol: Protocol = Protocol()) -> Iterator[Callable[[], dict]]:
    """Yields a function giving the forward() kwargs for one fresh forward pass under `mode`.

    With bank None the model runs unquantized (the fp baseline), on the same code path.
    """
    check_protocol(check_mode(mode), protocol)
    if bank is not None:
        check_fitted(bank)
    if bank is not None and bank.pre_rope_layers and bank.center is None:
        bank.center = KeyCenter(model, {}, 0, bank.pre_rope_layers)
    handles = []
    restore = None
    untrack = bank.center.track_positions(model) if bank is not None and bank.center and mode == "cache" else None
    try:
        if mode == "hook":
            if bank is not None:
                for attention in attention_modules(model):
                    for role, projection in (("k", attention.k_proj), ("v", attention.v_proj)):
                        hook = _projection_hook(bank, attention.layer_idx, role)
                        handles.append(projection.register_forward_hook(hook))
            yield lambda: {"use_cache": False}
        elif bank is None:
            yield lambda: {"use_cache": True, "past_key_values": DynamicCache(config=model.config)}
        elif not protocol.is_default:
            fresh_cache, restore = _use_window_attention(model, bank, protocol)
            yield fresh_cache
        else:
            if uses_score_path(bank.get(0, "k")):
                restore = _use_score_attention(model, bank)
            yield lambda: {"use_cache": True, "past_key_values": QuantizedWriteCache(bank, config=model.config)}
    finally:
        for handle in handles:
            handle.remove()
        if restore:
            restore()
        if untrack:
            untrack()


def _use_window_attention(model: torch.nn.Module, bank: QuantizerBank, protocol: Protocol):
    """Switches the model to kvq's window attention; returns a function giving the forward() kwargs
    with a fresh ProtocolWriteCache (which the attention modules read), and the undo."""
    modules = attention_modules(model)
    restore_attention = switch_attention(model, WINDOW_ATTENTION)

    def fresh_cache() -> dict:
        cache = ProtocolWriteCache(bank, protocol, config=model.config)
        for attention in modules:
            attention.kvq_protocol_cache = cache
        return {"use_cache": True, "past_key_values": cache}

    def restore() -> None:
        restore_attention()
        for attention in modules:
            attention.__dict__.pop("kvq_protocol_cache", None)

    return fresh_cache, restore


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
