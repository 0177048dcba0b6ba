"""A static quantized cache: preallocated packed K/V, written in place, for torch.compile and CUDA graphs.

Every full-attention layer holds its K and V as codes and scales in its quantizers' PackedLayout for
`max_cache_len` tokens, and the newest `window` tokens also exact, in a ring of `window` rows. Each token is
quantized as it is written (kvq.ops.write_rows, no fp16 copy of the prompt kept), so a step has no flush to
branch on: attention reads the codes of positions before n - window and the ring's exact rows of the last
window positions, n being the tokens written, and a prompt attends to itself exactly: kvq.protocol's
Protocol(window, exact_prefill=True), the papers' generation protocol. Under `fused_decoding` a one-token step
attends straight from the codes (kvq.ops.decode_attention, the token counts read from a device tensor), and its
`update` returns the step's own rows, which nothing reads. Every other call's `update` returns the whole buffer
dequantized with the exact rows in place, which any attention implementation reads under the usual static-cache
mask; inside `reading_written` an eager call's mask and update cover the positions written alone (kvq.generate's
prefill reads the prompt so far, not the capacity).

KIVI's keys share a scale and an offset per channel over a group of tokens: a write quantizes the whole groups
it touches, the last one from its tokens written so far (rows past them repeat the newest, which moves no min or
max), and writes again when later tokens fill it. With the window at least a group long, the tokens of a group
not yet whole are in the window, so attention reads only whole groups' codes: the streaming KIVI cache, as the
eager protocol cache holds it (kvq.apply).

A per-site policy (kvq.policy) gives layers their own layouts, K and V codes of a width each (K8/V4), and the
layers it keeps exact (`use: fp`) hold plain fp K/V that a decode step reads with SDPA over each K/V head once
(`StaticExactLayer`). Sliding-window layers stay transformers' static sliding layers.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import StaticCache
from transformers.cache_utils import CacheLayerMixin

from kvq import ops
from kvq.apply import QuantizerBank, kv_geometry
from kvq.cache import DomainMaps, held_bytes
from kvq.center import check_fitted
from kvq.errors import KvqError
from kvq.quant.exact import Exact
from kvq.quant.layout import PackedForm

ROLES = ("k", "v")


class StaticKVLayer(CacheLayerMixin):
    """What both kinds of static layer share: `max_cache_len` token slots, the tokens written as a device tensor
    (so a compiled step reads it without a host sync), fixed addresses for CUDA graphs, and the decode routing
    (`begin_decoding`, `attend`) that kvq.attention's fused attention calls."""

    is_compileable = True
    is_sliding = False
    is_croppable = False

    def __init__(self, max_cache_len: int):
        super().__init__()
        self.max_cache_len = max_cache_len
        # Set by the attention function at prefill: whether every query row sees every written position (no
        # padding), the condition for `attend`, which takes no mask
        self.unpadded = False
        self.written_only = False  # set inside `reading_written`
        self.rerouted = False  # set while kvq.cache.fused_decoding routes the model's attention to `attend`

    def _start(self, key_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.length = torch.zeros((), dtype=torch.int64, device=self.device)  # tokens written
        self.positions = torch.arange(self.max_cache_len, device=self.device)

    def _mark_static(self) -> None:
        if not torch.compiler.is_compiling():  # fixed addresses: CUDA graphs replay over them, copying none
            for tensor in self._tensors():
                torch._dynamo.mark_static_address(tensor)
        self.is_initialized = True

    def _tensors(self) -> list[torch.Tensor]:
        return [self.length, self.positions, *self._held()]

    def _held(self) -> list[torch.Tensor]:
        """The buffers holding the layer's tokens."""
        raise NotImplementedError

    def _written(self, key_states: torch.Tensor, value_states: torch.Tensor) -> torch.Tensor:
        """The positions the new tokens go to (allocating the buffers at the first write)."""
        if not self.is_initialized:
            if torch.compiler.is_compiling():  # its buffers would belong to one CUDA graph's output pool
                raise KvqError("a static quantized cache first written inside a compiled call (a compiled chunked "
                               "prefill) must be allocated before it: call cache.allocate(model, batch_size)")
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if not torch.compiler.is_compiling() and int(self.length) + new > self.max_cache_len:
            raise KvqError(f"static quantized cache holds {self.max_cache_len} tokens; writing {new} more after "
                           f"{int(self.length)} exceeds it (build it with a larger max_cache_len)")
        return self.length + torch.arange(new, device=self.device)

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query (B, Hq, 1, d) -> attention output (B, 1, Hq, d) over the tokens written."""
        raise NotImplementedError

    @torch.compiler.disable  # runs between graphs, so nothing it keeps lands in a CUDA graph's memory pool
    def begin_decoding(self, query: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """At a prefill call (or chunk): whether every query row sees every written position (no padding), the
        condition for later decode steps to `attend`, which takes no mask; if so, one decode attention runs
        now, so that its kernels are built and its kept buffers made before a compiled step runs (a compiled
        step's graph pool must own every tensor allocated in it)."""
        self.unpadded = attention_mask is None or bool(attention_mask[:, :, -1, :int(self.length)].all())
        if self.unpadded and query.is_cuda:
            self.attend(query[..., -1:, :], 1.0)

    def get_mask_sizes(self, query, *args, **kwargs) -> tuple[int, int]:
        """The whole buffer, or under `reading_written` the positions written by the call's end, as `update`
        returns them. `query`: the call's query length, or its cache positions (transformers before 5.2x)."""
        if not self._reads_written():
            return self.max_cache_len, 0
        written = int(self.length) if self.is_initialized else 0
        return written + (query if isinstance(query, int) else query.shape[-1]), 0

    def _reads_written(self) -> bool:
        return self.written_only and not torch.compiler.is_compiling()

    def _visible(self) -> int:
        """The leading positions `update` returns."""
        return int(self.length) if self._reads_written() else self.max_cache_len

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if self.is_initialized:
            self.length.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        raise KvqError("the static quantized cache cannot crop its tokens (assisted decoding is not supported)")

    def persistent_bytes(self) -> int:
        """What the layer holds for its tokens."""
        return sum(t.numel() * t.element_size() for t in self._held()) if self.is_initialized else 0


class StaticExactLayer(StaticKVLayer):
    """A layer a policy keeps exact: fp K/V buffers of `max_cache_len` tokens. A decode step attends over the
    written tokens with SDPA reading each K/V head once (enable_gqa), as the fair fp16 baseline does."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._start(key_states)
        batch, heads = key_states.shape[:2]
        self.keys, self.values = (states.new_zeros(batch, heads, self.max_cache_len, states.shape[-1])
                                  for states in (key_states, value_states))
        self._mark_static()

    def _held(self) -> list[torch.Tensor]:
        return [self.keys, self.values]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        written = self._written(key_states, value_states)
        self.keys.index_copy_(2, written, key_states)
        self.values.index_copy_(2, written, value_states)
        self.length.add_(key_states.shape[-2])
        visible = self._visible()
        return self.keys[..., :visible, :], self.values[..., :visible, :]

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        written = (self.positions < self.length).view(1, 1, 1, -1)
        out = F.scaled_dot_product_attention(query, self.keys, self.values, attn_mask=written, scale=scaling,
                                             enable_gqa=query.shape[1] != self.keys.shape[1])
        return out.transpose(1, 2)


class StaticQuantizedLayer(StaticKVLayer):
    def __init__(self, bank: QuantizerBank, layer: int, max_cache_len: int, window: int):
        super().__init__(max_cache_len)
        if window < 1 or window > max_cache_len:
            raise KvqError(f"window must hold 1..max_cache_len ({max_cache_len}) tokens, got {window}")
        self.quantizers = {role: bank.get(layer, role) for role in ROLES}
        # post_rope_mean's constant: the keys are stored less it, which moves each query's scores by one amount
        # that softmax ignores, so attention reads them as they are (kvq.center)
        check_fitted(bank, layer)
        self.head_offsets = bank.center.offsets[layer] if layer in bank.key_centers else None  # (heads, d)
        self.key_offset = None  # the offsets on the device, broadcast over batch and tokens
        self.forms: dict[str, PackedForm] = {role: q.packed_form() for role, q in self.quantizers.items()}
        # the roles each kvq::write_rows call writes: K and V together where they share a layout (one launch on
        # CUDA), decided here, once, as it does not change; roles whose stats span tokens go through _write_groups
        per_token = [role for role, form in self.forms.items() if form.layout.token_group == 1]
        shared = len({self.forms[role].layout for role in per_token}) == 1
        self.row_writes = [per_token] if shared else [[role] for role in per_token]
        self.writes_per_token = len(per_token) == len(ROLES)  # a decode step's write can wait for its attention
        self.pending: dict[str, torch.Tensor] | None = None  # that write's rows, from update to attend
        self.kv_heads = bank.geometry.n_kv_heads
        group = max(form.layout.token_group for form in self.forms.values())
        if window < min(group, max_cache_len):  # a window of the whole cache never reads a code
            raise KvqError(f"layer {layer}: codes whose stats span {group} tokens (KIVI's keys) need a "
                           f"window of at least {group} tokens, got {window}")
        self.window = window
        # whole token groups, and room for a write's last group to run past max_cache_len (_write_groups); else whole
        # rows of 8 tokens, so that each head's rows of per-token stats start 16-byte aligned (the CUDA decode partial
        # copies TurboQuant_mse's norms 8 tokens at a time)
        self.capacity = -(-max_cache_len // 8) * 8 if group == 1 else -(-(max_cache_len + 2 * group) // group) * group
        self.packed: dict[str, ops.PackedKV] = {}
        self.ring: dict[str, torch.Tensor] = {}

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._start(key_states)
        lead = key_states.shape[:2]
        self.forms = {role: form.on(self.device) for role, form in self.forms.items()}
        if self.head_offsets is not None:
            self.key_offset = self.head_offsets.to(self.device, self.dtype)[None, :, None, :]
        for role, form in self.forms.items():
            layout = form.layout
            self.packed[role] = ops.PackedKV.holding(
                torch.zeros(*lead, self.capacity, layout.code_bytes, dtype=torch.uint8, device=self.device),
                torch.zeros(*lead, self.capacity // layout.token_group, layout.stats, dtype=layout.stats_dtype,
                            device=self.device), form)
            self.ring[role] = key_states.new_zeros(*lead, self.window, layout.head_dim)
        for form in self.forms.values():  # builds the kernels and the constants they keep, outside any graph
            rows = key_states.new_zeros(form.layout.token_group, form.layout.head_dim)
            if form.layout.layer_scaled and form.layer_scale is None:  # any scale builds the same kernels
                form = form.scaled_by(torch.ones((), device=self.device))
            ops.dequantize(*ops.quantize(rows, form), form, self.dtype)
        self.maps = DomainMaps(self.forms["k"], self.forms["v"], self.device)
        # (packed << 32 | window) rows the kernels attend over: kvq.kernels.step.device_lengths
        self.counts = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._mark_static()

    def _held(self) -> list[torch.Tensor]:
        return [*(t for p in self.packed.values() for t in (p.codes, p.scales)), *self.ring.values()]

    def _tensors(self) -> list[torch.Tensor]:
        constants = [t for form in self.forms.values()
                     for t in (form.signs, form.matrix, form.lam, form.codebook, form.block, form.layer_scale)
                     if t is not None]
        offset = [] if self.key_offset is None else [self.key_offset]
        return [*super()._tensors(), self.counts, self.maps.query, self.maps.output, *constants, *offset]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        written = self._written(key_states, value_states)
        if self.key_offset is not None:
            key_states = key_states - self.key_offset
        new = key_states.shape[-2]
        recent = min(new, self.window)
        rows = dict(zip(ROLES, (key_states, value_states), strict=True))
        for role in ROLES:
            if self.forms[role].layout.layer_scaled and self.forms[role].layer_scale is None:
                self._calibrate(role, rows[role])
        attended = new == 1 and self.rerouted and self.unpadded  # attend() reads the codes; update's return goes unread
        if attended and self.writes_per_token:
            self.pending = rows  # attend() writes them
        else:
            self._write_rows(rows, self.length)
            for role in ROLES:
                if self.forms[role].layout.token_group > 1:
                    self._write_groups(role, rows[role])
                    self.ring[role].index_copy_(2, written[new - recent:] % self.window,
                                                rows[role][..., new - recent:, :])
        self.length.add_(new)
        window = self.length.clamp(max=self.window)
        self.counts.copy_(((self.length - window) << 32 | window).reshape(1))
        if attended:
            return key_states, value_states
        visible = self._visible()
        return tuple(self.attention_ready(role, visible).index_copy(2, written, states)
                     for role, states in zip(ROLES, (key_states, value_states), strict=True))

    def _calibrate(self, role: str, states: torch.Tensor) -> None:
        """A layer_scaled layout's layer scale, from its quantizer, which calibrates it on the layer's first K/V (as
        its own first encode would) unless it has already; the maps take it in."""
        if torch.compiler.is_compiling():
            raise KvqError(f"{role.upper()}'s layer scale is calibrated on the layer's first write, which must run "
                           "eagerly (prefill before compiling a step)")
        self.forms[role] = self.quantizers[role].calibrated_form(states).on(self.device)
        torch._dynamo.mark_static_address(self.forms[role].layer_scale)
        self.maps.rescale(self.forms["k"], self.forms["v"])

    def _write_rows(self, rows: dict[str, torch.Tensor], start: torch.Tensor,
                    after: torch.Tensor | None = None) -> None:
        """The roles whose stats are per token, from position `start`, with kvq::write_rows (following `after`)."""
        for roles in self.row_writes:
            ops.write_rows([rows[role] for role in roles], [self.forms[role] for role in roles],
                           [self.packed[role].codes for role in roles], [self.packed[role].scales for role in roles],
                           [self.ring[role] for role in roles], start, after)

    def _write_groups(self, role: str, states: torch.Tensor) -> None:
        """Codes and stats of every token group the new tokens touch, from the group's first position: its tokens
        written before from the ring (the window holds a group), then the new ones, then the newest repeated up
        to whole groups (it shares the last group, so no min or max moves). Shapes depend on the number of new
        tokens alone, so a compiled step quantizes without a branch; rows past the written tokens land in the
        buffers' spare positions, which nothing reads before a later write replaces them."""
        group, new = self.forms[role].layout.token_group, states.shape[-2]
        span = -(-(group - 1 + new) // group) * group
        start = self.length // group * group
        positions = start + torch.arange(span, device=self.device)
        fresh = states.index_select(2, (positions - self.length).clamp(0, new - 1))
        earlier = self.ring[role].index_select(2, positions % self.window)
        rows = torch.where((positions < self.length).view(-1, 1), earlier, fresh)
        codes, scales = ops.quantize(rows, self.forms[role])
        self.packed[role].codes.index_copy_(2, positions, codes)
        groups = start // group + torch.arange(span // group, device=self.device)
        ops.copy_rows(self.packed[role].scales, groups, scales)

    def attention_ready(self, role: str, visible: int) -> torch.Tensor:
        """(B, H, visible, d): the leading positions' codes dequantized, the window's positions exact from the
        ring. update also puts its own tokens in exact: a prompt (or a prefill chunk) attends to itself exactly
        (kvq.protocol's exact_prefill), and decode steps see the window exact and the rest quantized."""
        packed, group = self.packed[role], self.forms[role].layout.token_group
        rows = -(-visible // group) * group
        dequantized = ops.dequantize(packed.codes[..., :rows, :], packed.scales[..., :rows // group, :],
                                     self.forms[role], self.dtype)[..., :visible, :]
        # The window's positions n - window .. n - 1. While fewer than `window` tokens are written, the leading
        # ones wrap to the tail: past the visible positions (dropped) or, in the whole buffer, unwritten ones
        # the causal mask hides.
        in_window = (self.length - self.window + self.positions[:self.window]) % self.max_cache_len
        ring = self.ring[role].index_select(2, in_window % self.window)
        if visible < self.max_cache_len:
            shown = in_window < visible
            in_window, ring = in_window[shown], ring[..., shown, :]
        return dequantized.index_copy(2, in_window, ring)

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """From the codes and the ring, after the decode step's own write, which update left to this call: a compiled
        step then launches the write just before the attention, whose CUDA kernel streams the packed rows beside it
        (csrc/decode_attention.cu; kvq_write_rows lets it launch at once)."""
        if self.pending is not None:
            rows, self.pending = self.pending, None
            self._write_rows(rows, self.length - 1, after=query)
        step = self.maps.step(self.packed["k"], self.packed["v"], (self.ring["k"], self.ring["v"]))
        return ops.decode_attention(query.squeeze(-2), step, scaling, self.counts).unsqueeze(1)

    def reset(self) -> None:
        super().reset()
        self.pending = None
        if self.is_initialized:
            self.counts.zero_()


@contextmanager
def reading_written(cache) -> Iterator[None]:
    """Inside the block, the eager calls into kvq's static layers of `cache` see only the positions written by their
    end: `get_mask_sizes` sizes the mask so and `update` returns those rows, so a prefill chunk attends over (and
    dequantizes) the prompt so far, not the whole capacity. For callers whose forward makes its mask itself, in the
    same eager call as the updates (kvq.generate's prefill): transformers' generate makes a compiled forward's mask
    outside it, where the two would disagree. Other layers, and compiled calls, keep the whole buffer."""
    layers = [layer for layer in getattr(cache, "layers", ()) if isinstance(layer, StaticKVLayer)]
    for layer in layers:
        layer.written_only = True
    try:
        yield
    finally:
        for layer in layers:
            layer.written_only = False


def unheld_reason(bank: QuantizerBank, layer: int) -> str | None:
    """None where the static cache holds a full-attention layer's sites: exact (a policy's `use: fp` keeps a layer's
    K and V exact together), or packed layouts (K and V codes of a width each); else why it does not."""
    center = bank.key_centers.get(layer)
    if center and center != "post_rope_mean":
        return (f"layer {layer} K: the static quantized cache centers keys by one constant offset (center: "
                f"post_rope_mean), not by center: {center}'s, which moves with each position")
    if isinstance(bank.get(layer, "k"), Exact):
        return None
    for role in ROLES:
        reason = bank.get(layer, role).packing_reason()
        if reason is not None:
            return f"layer {layer} {role.upper()}: the static quantized cache stores packed layouts only: {reason}"
    return None


def static_layer(bank: QuantizerBank, layer: int, max_cache_len: int, window: int) -> StaticKVLayer:
    """The static layer for a full-attention layer's sites: a plain fp layer where the policy keeps it exact, packed
    otherwise (`unheld_reason` says which layers it refuses)."""
    reason = unheld_reason(bank, layer)
    if reason is not None:
        raise KvqError(reason)
    if isinstance(bank.get(layer, "k"), Exact):
        return StaticExactLayer(max_cache_len)
    return StaticQuantizedLayer(bank, layer, max_cache_len, window)


class StaticQuantizedCache(StaticCache):
    """transformers' StaticCache with every full-attention layer a static kvq layer (`static_layer`)."""

    def __init__(self, bank: QuantizerBank, config, max_cache_len: int, window: int = 16):
        if "post_rope_mean" in bank.key_centers.values() and getattr(config, "attn_logit_softcapping", None):
            raise KvqError("center: the static cache stores keys less a constant, which moves every score of a "
                           "query alike; the model's softcapped scores (attn_logit_softcapping) do not ignore that")
        super().__init__(config=config, max_cache_len=max_cache_len)
        self.layers = [layer if layer.is_sliding else static_layer(bank, index, max_cache_len, window)
                       for index, layer in enumerate(self.layers)]

    def allocate(self, model: torch.nn.Module, batch_size: int) -> "StaticQuantizedCache":
        """Allocates every layer's buffers now, for `model`'s K/V geometry, dtype and device, instead of at the
        first write: needed where that write is compiled (generate compiles a chunked prefill on CUDA)."""
        geometry = kv_geometry(model.config)
        self.early_initialization(batch_size, geometry.n_kv_heads, geometry.head_dim, model.dtype, model.device)
        return self

    def decode_kernel_reason(self, query_heads: int) -> str | None:
        """None where a CUDA decode step of every quantized layer runs the fused kernels (with `query_heads` query
        heads); else, for the first layer that would attend through the reference, why."""
        for index, layer in enumerate(self.layers):
            if isinstance(layer, StaticQuantizedLayer):
                keys, values = (layer.forms[role].layout for role in ROLES)
                reason = ops.decode_layout_reason(keys, values, query_heads // layer.kv_heads)
                if reason is not None:
                    return f"layer {index}: {reason}"
        return None

    def memory_bytes(self) -> int:
        """Bytes this cache holds for its tokens (packed buffers, rings, sliding layers' static buffers)."""
        return sum(layer.persistent_bytes() if isinstance(layer, StaticKVLayer) else held_bytes(
            (layer.keys, layer.values)) for layer in self.layers if layer.is_initialized)
