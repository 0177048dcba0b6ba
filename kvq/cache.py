"""A transformers cache that physically stores K/V packed (SRFT paper Sec. 7.2).

Full-attention layers keep K/V as the quantizer's packed tensors (int4/int8 codes plus scales), except
an unquantized residual window of the most recent tokens; when the window holds `residual` tokens it
is quantized as one chunk. Sliding-window layers (Gemma-3) stay DynamicCache layers. With
`keep_dequantized_prefix` the dequantized prefix is kept and only a flushed chunk is decoded, so an
update costs O(chunk) decode work rather than O(prefix); without it nothing but packed data and the
window is held and every step decodes the whole prefix.

`fused=True` swaps full-attention layers for FusedLayer: packed K/V live in growable buffers in the
quantizers' declared PackedLayout, written by kvq.ops.quantize, no dequantized prefix is kept, and decode
steps (one new token) attend straight from the packed codes through the fused decode attention once
`fused_decoding(model, cache)` routes the model's attention there. Prefill and any step the fused path
cannot serve see the dequantized prefix plus the exact window, as QuantizedLayer returns.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvq import ops
from kvq.apply import QuantizerBank
from kvq.attention import FUSED_ATTENTION, switch_attention
from kvq.errors import KvqError
from kvq.projections import attention_modules
from kvq.quant.base import Packed
from kvq.quant.layout import PackedForm


def tensor_bytes(packed: Packed) -> int:
    return packed.storage_bits() // 8


def held_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class WindowedLayer(DynamicLayer):
    """A full-attention layer whose K/V are packed by its (layer, K|V) quantizers behind an exact window
    of the newest `residual` tokens. Its buffers change shape as it grows: not compileable."""

    is_croppable = False
    is_compileable = False

    def __init__(self, bank: QuantizerBank, layer: int, residual: int):
        super().__init__()
        if residual < 1:
            raise KvqError(f"residual window must hold at least one token, got {residual}")
        self.quantizers = {role: bank.get(layer, role) for role in ("k", "v")}
        self.window = residual

    def crop(self, tokens_to_remove: int) -> None:
        raise KvqError("QuantizedKVCache cannot crop packed tokens (assisted decoding is not supported)")


class QuantizedLayer(WindowedLayer):
    def __init__(self, bank: QuantizerBank, layer: int, residual: int, keep_dequantized_prefix: bool):
        super().__init__(bank, layer, residual)
        self.keep_prefix = keep_dequantized_prefix
        self.packed: dict[str, list[Packed]] = {"k": [], "v": []}
        self.prefix: dict[str, torch.Tensor | None] = {"k": None, "v": None}
        self.recent: dict[str, torch.Tensor | None] = {"k": None, "v": None}
        self.quantized_tokens = 0

    def _flush(self, role: str, count: int) -> None:
        chunk, self.recent[role] = self.recent[role][..., :count, :], self.recent[role][..., count:, :]
        packed = self.quantizers[role].metered_encode(chunk)
        self.packed[role].append(packed)
        if self.keep_prefix:
            decoded = self.quantizers[role].decode(packed).to(chunk.dtype)
            previous = self.prefix[role]
            self.prefix[role] = decoded if previous is None else torch.cat([previous, decoded], dim=-2)

    def _full(self, role: str) -> torch.Tensor:
        if self.keep_prefix:
            prefix = self.prefix[role]
        else:
            decoded = [self.quantizers[role].decode(p) for p in self.packed[role]]
            prefix = torch.cat(decoded, dim=-2).to(self.recent[role].dtype) if decoded else None
        return self.recent[role] if prefix is None else torch.cat([prefix, self.recent[role]], dim=-2)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        for role, states in (("k", key_states), ("v", value_states)):
            previous = self.recent[role]
            self.recent[role] = states if previous is None else torch.cat([previous, states], dim=-2)
        pending = self.recent["k"].shape[-2]
        flush = pending - pending % self.window
        if flush:
            for role in ("k", "v"):
                self._flush(role, flush)
            self.quantized_tokens += flush
        self.keys, self.values = self._full("k"), self._full("v")
        return self.keys, self.values

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.quantized_tokens + self.recent["k"].shape[-2]

    def persistent_bytes(self) -> int:
        """Packed tensors plus the window: what the layer must keep between steps."""
        packed = sum(tensor_bytes(p) for role in ("k", "v") for p in self.packed[role])
        return packed + held_bytes(self.recent.values())


class PackedStore:
    """One role's codes (B, H, capacity, bytes) and stats (B, H, capacity, layout.stats) in a PackedLayout.

    Capacity grows geometrically, so appends cost amortized O(new tokens), but by only 1/16 so held
    memory stays within 6.25% of what the codes need (int4 g32 keeps its ~3.2x over fp16). The first
    allocation (the prefill) keeps MIN_GROWTH tokens spare: otherwise the first flush of decoding
    would reallocate at once, and a reallocation costs a copy of the prefix and a new decode graph
    for every layer."""

    GROWTH = 1.0625
    MIN_GROWTH = 64  # tokens: short caches do not reallocate at every flush

    def __init__(self, form: PackedForm, lead_shape: tuple[int, ...], device: torch.device):
        """lead_shape: (batch, heads). The buffers start empty, so a prompt shorter than the window
        decodes from the window alone."""
        layout = form.layout
        self.form = form
        # whole capacity (decode graphs take it); the first `length` rows are filled
        self.buffers = ops.PackedKV(
            torch.empty(*lead_shape, 0, layout.code_bytes, dtype=torch.uint8, device=device),
            torch.empty(*lead_shape, 0, layout.stats, dtype=layout.scale_dtype, device=device),
            layout.bits, layout.head_dim, layout.symmetric)
        self.length = 0

    @staticmethod
    def _grown(buffer: torch.Tensor, capacity: int, length: int) -> torch.Tensor:
        grown = buffer.new_empty(*buffer.shape[:-2], capacity, buffer.shape[-1])
        grown[..., :length, :] = buffer[..., :length, :]
        return grown

    def append(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        end = self.length + codes.shape[-2]
        held = self.buffers.codes.shape[-2]
        if end > held:
            capacity = end + self.MIN_GROWTH if not held else max(end, int(self.GROWTH * held), held + self.MIN_GROWTH)
            self.buffers = ops.PackedKV(self._grown(self.buffers.codes, capacity, self.length),
                                        self._grown(self.buffers.scales, capacity, self.length), self.buffers.bits,
                                        self.buffers.head_dim, self.buffers.symmetric)
        self.buffers.codes.narrow(-2, self.length, end - self.length).copy_(codes)
        self.buffers.scales.narrow(-2, self.length, end - self.length).copy_(scales)
        self.length = end

    def view(self) -> ops.PackedKV:
        return self.buffers.rows(self.length)

    def held_bytes(self) -> int:
        return held_bytes((self.buffers.codes, self.buffers.scales))


class DomainMaps:
    """Matrices between a layer's model domain and its quantizers' rotated, lambda-scaled domains.

    With y = lam * (R x) the quantized coordinates: q . k = (q R^T / lam) . y_k, and
    sum_i p_i v_i = (sum_i p_i y_v,i / lam) R (the fused decode attention applies both). A layer_scaled layout's
    values are s y: the maps carry s too (q . k = (s_k q R^T / lam) . y_k), so the kernels read the codes' stats
    alone.
    """

    def __init__(self, key_form: PackedForm, value_form: PackedForm, device: torch.device):
        self.query = self._query(key_form, device)
        self.output = self._output(value_form, device)

    @staticmethod
    def _parts(form: PackedForm, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | float]:
        """R, lam and s."""
        rotation = form.matrix.to(device)
        lam = form.lam.to(device) if form.lam is not None else torch.ones(rotation.shape[0], device=device)
        return rotation, lam, 1.0 if form.layer_scale is None else form.layer_scale.to(device)

    def _query(self, form: PackedForm, device: torch.device) -> torch.Tensor:
        rotation, lam, scale = self._parts(form, device)
        return (rotation.T / lam * scale).contiguous()

    def _output(self, form: PackedForm, device: torch.device) -> torch.Tensor:
        rotation, lam, scale = self._parts(form, device)
        return (rotation / lam[:, None] * scale).contiguous()

    def rescale(self, key_form: PackedForm, value_form: PackedForm) -> None:
        """Takes the forms' layer scales into the maps, in place (their addresses stay fixed for CUDA graphs)."""
        self.query.copy_(self._query(key_form, self.query.device))
        self.output.copy_(self._output(value_form, self.output.device))

    def step(self, keys: ops.PackedKV, values: ops.PackedKV,
             window: tuple[torch.Tensor, torch.Tensor]) -> ops.DecodeStep:
        """What a decode attention step reads: packed K and V, the exact window's K and V, and these maps."""
        return ops.DecodeStep(keys, values, window, self.query, self.output)


class FusedLayer(WindowedLayer):
    def __init__(self, bank: QuantizerBank, layer: int, residual: int):
        super().__init__(bank, layer, residual)
        self.forms = {role: quantizer.packed_form() for role, quantizer in self.quantizers.items()}
        for role, quantizer in self.quantizers.items():
            if self.forms[role] is None:
                raise KvqError(f"the fused cache stores packed layouts only: {quantizer.packing_reason()}")
            layout = self.forms[role].layout
            if layout.token_group > 1 or layout.codebook:
                what = "stats span tokens" if layout.token_group > 1 else "codes index a codebook"
                raise KvqError(f"the fused cache stores scalar codes with stats per token; "
                               f"{type(quantizer).__name__}'s {what} (the static quantized cache holds them)")
        self.stores: dict[str, PackedStore] = {}
        self.raw: dict[str, torch.Tensor] = {}
        self.slots: list[list[torch.Tensor]] = []  # per window row: its (K, V) views
        self.count = 0
        self.maps: DomainMaps | None = None
        self.decode_graph = ops.decode_graph()
        # True while fused_decoding routes the model's attention to attend(): only then may a decode step
        # leave K/V packed and return the new row alone
        self.rerouted = False
        self.deferred = False
        self.fused_steps = 0
        # (window rows, newest K and V) not yet written: a decode step's write rides in attend's dispatch
        self.unwritten: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def lazy_initialization(self, key_states, value_states=None):
        super().lazy_initialization(key_states, value_states)
        self.maps = DomainMaps(self.forms["k"], self.forms["v"], key_states.device)
        lead, d = key_states.shape[:-2], key_states.shape[-1]
        for role, form in self.forms.items():
            self.stores[role] = PackedStore(form, lead, key_states.device)
            self.raw[role] = key_states.new_empty(*lead, self.window, d)
        self.slots = [[self.raw[role].narrow(-2, row, 1) for role in ("k", "v")] for row in range(self.window)]

    def _write_window(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Window rows [start, start + n) of K and V in one dispatch, through views made once for the
        one-token writes of decode steps: this is host time per layer per token."""
        n = keys.shape[-2]
        targets = self.slots[start] if n == 1 else [self.raw[role].narrow(-2, start, n) for role in ("k", "v")]
        torch._foreach_copy_(targets, [keys, values])

    def _write_unwritten(self) -> None:
        if self.unwritten is not None:
            torch._foreach_copy_(*self.unwritten)
            self.unwritten = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._write_unwritten()
        new = key_states.shape[-2]
        total = self.count + new
        if total <= self.window:
            if new == 1 and total < self.window:
                # the common decode step: attend (or materialize) writes its row in one dispatch with the decode
                # graph's query, a launch fewer per layer per token in a host-bound generate loop
                self.unwritten = (self.slots[self.count], [key_states, value_states])
            else:
                self._write_window(self.count, key_states, value_states)
            pending = self.raw  # what a flush quantizes: the full window
        else:
            pending = {role: torch.cat([self.raw[role][..., :self.count, :], states], dim=-2)
                       for role, states in (("k", key_states), ("v", value_states))}
        flush = total - total % self.window
        if flush:
            for role in ("k", "v"):
                chunk = pending[role][..., :flush, :]
                codes, scales = ops.quantize(chunk, self.forms[role])
                self.stores[role].append(codes, scales)
                self.quantizers[role].meter(ops.packed_codes(codes, scales, chunk.shape, chunk.dtype,
                                                             self.forms[role].layout.symmetric), chunk.numel())
            if total > flush:
                self._write_window(0, pending["k"][..., flush:, :], pending["v"][..., flush:, :])
        self.count = total - flush
        self.deferred = new == 1 and self.rerouted
        if self.deferred:  # attend() reads the packed codes; what update returns goes unread
            return key_states, value_states
        self.keys, self.values = self.materialize()
        return self.keys, self.values

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized prefix plus the exact window, for prefill and the steps fused attention skips."""
        self._write_unwritten()
        out = []
        for role, store in self.stores.items():
            window = self.raw[role][..., :self.count, :]
            if store.length:
                packed = store.view()
                prefix = ops.dequantize(packed.codes, packed.scales, self.forms[role], window.dtype)
                window = torch.cat([prefix, window], dim=-2)
            out.append(window)
        return out[0], out[1]

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query (B, Hq, 1, d) -> attention output (B, 1, Hq, d) straight from the packed codes."""
        keys, values = self.stores["k"], self.stores["v"]
        writes, self.unwritten = self.unwritten or ([], []), None
        step = self.maps.step(keys.buffers, values.buffers, (self.raw["k"], self.raw["v"]))
        out = self.decode_graph(query.squeeze(-2), step, scaling, (keys.length, self.count), writes)
        self.fused_steps += 1
        return out.unsqueeze(1)

    def get_seq_length(self) -> int:
        return self.stores["k"].length + self.count if self.is_initialized else 0

    def persistent_bytes(self) -> int:
        """Allocated packed buffers (capacity, not just length) plus the window buffers."""
        return sum(store.held_bytes() for store in self.stores.values()) + held_bytes(self.raw.values())


class QuantizedKVCache(DynamicCache):
    def __init__(self, bank: QuantizerBank, config, residual: int = 16, keep_dequantized_prefix: bool = True,
                 fused: bool = False):
        super().__init__(config=config)
        if not self.layers:
            raise KvqError("QuantizedKVCache needs a model config with its layer types")

        def quantized_layer(index: int) -> WindowedLayer:
            if fused:
                return FusedLayer(bank, index, residual)
            return QuantizedLayer(bank, index, residual, keep_dequantized_prefix)

        self.layers = [layer if layer.is_sliding else quantized_layer(index) for index, layer in enumerate(self.layers)]

    def memory_bytes(self) -> int:
        """Bytes this cache must hold between steps (packed data, windows, sliding layers)."""
        return sum(layer.persistent_bytes() if isinstance(layer, WindowedLayer) else _dynamic_layer_bytes(layer)
                   for layer in self.layers)


def _dynamic_layer_bytes(layer) -> int:
    return held_bytes((layer.keys, layer.values)) if layer.is_initialized else 0


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    return sum(_dynamic_layer_bytes(layer) for layer in cache.layers)


@contextmanager
def fused_decoding(model: torch.nn.Module, cache) -> Iterator[None]:
    """Routes the model's attention through kvq's fused decode attention for this cache's layers: a
    QuantizedKVCache built with fused=True, or a kvq.static_cache.StaticQuantizedCache."""
    fused = {index: layer for index, layer in enumerate(cache.layers) if hasattr(layer, "attend")}
    if not fused:
        raise KvqError("fused_decoding needs a QuantizedKVCache built with fused=True or a StaticQuantizedCache")
    modules = [m for m in attention_modules(model) if m.layer_idx in fused]
    for module in modules:
        module.kvq_fused_layer = fused[module.layer_idx]
    for layer in fused.values():
        layer.rerouted = True
    restore = switch_attention(model, FUSED_ATTENTION)
    try:
        yield
    finally:
        restore()
        for module in modules:
            del module.kvq_fused_layer
        for layer in fused.values():
            layer.rerouted = False
