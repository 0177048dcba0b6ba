"""Key pre-conditioning (`center`): a known offset of a layer's keys, subtracted before the quantizer encodes them
and added back after it decodes, so the codes spend none of their range on it. Any quantizer's keys may take it
(a QuantSpec field, so a sweep grid's or a policy site's too).

- `bias`: k_proj's bias b. Before RoPE a key is W x + b, and RoPE is linear, so at position p the key's offset is
  R_p b: the bias moved to each position by the model's own rotary embedding (its cos and sin of that forward
  call). Exact up to float rounding, and the bias is the model's, so it costs no stored bits.
- `mean`: each head channel's mean of the pre-RoPE keys over the calibration split (the corpus's held-out
  quarter, kvq.data), moved to each position the same way. The method stores it: 16 bits per head channel, once
  per layer.
- `post_rope_mean`: each head channel's mean of the keys as the cache holds them (after RoPE) over the
  calibration split: one constant offset per layer, not moved per position. Subtracting a constant from every key
  moves each query's scores by one amount, which softmax ignores, so the static cache can store the keys less it
  and attend over them as they are (kvq.static_cache). The method stores it: 16 bits per head channel, once per
  layer. Cache mode only.
- `none`: the keys as they come.

In hook mode the keys are k_proj's output (pre-RoPE), so the offset is b or the mean itself; in cache mode they
are post-RoPE and the offset of `bias` and `mean` is rotated. Keys scored from a sketch (QJL's score path) are
never decoded, so they cannot be centered; of the static cache's packed keys only `post_rope_mean`'s can be.
"""

import sys
from collections.abc import Callable

import torch
from transformers import DynamicCache

from kvq.errors import KvqError
from kvq.projections import attention_by_layer, split_heads

CENTERS = ("none", "bias", "mean", "post_rope_mean")
STORED_CENTERS = ("mean", "post_rope_mean")  # offsets the method stores, MEAN_BITS per head channel
MEAN_BITS = 16  # a stored mean is fp16


def check_center(center: str) -> str:
    if center not in CENTERS:
        raise KvqError(f"center must be one of {', '.join(CENTERS)}, got {center!r}")
    return center


def check_center_mode(centers, mode: str) -> None:
    """post_rope_mean centers the keys the cache holds, which hook mode does not quantize."""
    if mode == "hook" and "post_rope_mean" in centers:
        raise KvqError("center: post_rope_mean centers the keys as the cache holds them (after RoPE); hook mode "
                       "quantizes k_proj's output before RoPE, where center: mean is that mean")


def check_fitted(bank, layer: int | None = None) -> None:
    """That the key offsets a bank's centered sites subtract (any layer's, or `layer`'s) are fitted: `bank` is any
    object with key_centers and center, as QuantizerBank has."""
    centered = bool(bank.key_centers) if layer is None else layer in bank.key_centers
    if centered and bank.center is None:
        raise KvqError("center: the bank's key offsets are not fitted to the model (kvq.experiment.fit_center)")


def bias_reason(attention: torch.nn.Module) -> str | None:
    """Why `center: bias` cannot center this attention module's keys; None when it can."""
    if attention.k_proj.bias is None:
        return "the model's k_proj has no bias"
    if hasattr(attention, "k_norm"):
        return "the model normalizes keys after k_proj (k_norm), so the bias is no offset of them"
    return None


def _rope_of(attention: torch.nn.Module) -> Callable:
    """The model's own apply_rotary_pos_emb(q, k, cos, sin), from the module that defines its attention."""
    rope = getattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb", None)
    if rope is None:
        raise KvqError(f"center: {type(attention).__name__} has no apply_rotary_pos_emb to move offsets with")
    return rope


class KeyCenter:
    """How a layer's keys reach its quantizer beyond the quantizer itself: less a per-layer pre-RoPE offset (heads, d),
    and for `pre_rope` layers (a quantizer that encodes keys before RoPE, KVQuant's) un-rotated to their pre-RoPE
    form first and rotated back after decoding, in cache mode, where the keys written are post-RoPE.

    `track_positions` keeps each attention module's (cos, sin) of the forward call in flight, so a cache write of
    that layer moves the offset, and undoes and redoes RoPE, exactly as the model rotated its keys."""

    def __init__(self, model: torch.nn.Module, offsets: dict[int, torch.Tensor], stored_bits: int,
                 pre_rope: frozenset[int] = frozenset(), fixed: frozenset[int] = frozenset()):
        attention = attention_by_layer(model)
        self.offsets = offsets
        self.stored_bits = stored_bits
        self.pre_rope = pre_rope
        self.fixed = fixed  # layers whose offset is the same at every position (post_rope_mean)
        self._rope = {layer: _rope_of(attention[layer]) for layer in set(offsets) | pre_rope}
        self._positions: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def covers(self, layer: int) -> bool:
        return layer in self._rope

    def offset(self, layer: int, keys: torch.Tensor, rotated: bool) -> torch.Tensor:
        """The offset of `keys` (batch, heads, tokens, d), broadcastable to them, in float32."""
        base = self.offsets[layer].to(keys.device)[None, :, None, :]
        if not rotated or layer in self.fixed:
            return base
        cos, sin = self._cos_sin(layer)
        moved, _ = self._rope[layer](base, base, cos, sin)
        return moved

    def unrotated(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Post-RoPE `keys` of the write in flight back in their pre-RoPE form, in float32."""
        cos, sin = self._cos_sin(layer)
        keys = keys.float()
        # R_p^-1 k = R(cos, -sin) k / (cos^2 + sin^2): the two entries of a RoPE pair share one angle, and a
        # rope scaling factor multiplies cos and sin alike.
        back, _ = self._rope[layer](keys, keys, cos, -sin)
        return back / (cos * cos + sin * sin).unsqueeze(1)

    def _rotated(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        cos, sin = self._cos_sin(layer)
        moved, _ = self._rope[layer](keys, keys, cos, sin)
        return moved

    def _cos_sin(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self._positions:
            raise KvqError(f"center: no rotary positions seen for layer {layer}; call track_positions first")
        return tuple(t.float() for t in self._positions[layer])

    def roundtrip(self, layer: int, keys: torch.Tensor, roundtrip: Callable, rotated: bool) -> torch.Tensor:
        """What attention reads in place of `keys` (post-RoPE when `rotated`): `roundtrip` (encode, decode) of the
        keys in this layer's frame, before RoPE for a pre-RoPE layer, less its offset where it has one."""
        before_rope = rotated and layer in self.pre_rope
        frame = self.unrotated(layer, keys) if before_rope else keys.float()
        offset = self.offset(layer, frame, rotated and not before_rope) if layer in self.offsets else 0
        decoded = roundtrip(frame - offset) + offset
        return (self._rotated(layer, decoded) if before_rope else decoded).to(keys.dtype)

    def track_positions(self, model: torch.nn.Module) -> Callable[[], None]:
        """Records (cos, sin) at each covered attention module's entry; returns the undo."""
        def remember(module, args, kwargs):
            self._positions[module.layer_idx] = kwargs.get("position_embeddings") or args[1]

        handles = [module.register_forward_pre_hook(remember, with_kwargs=True)
                   for layer, module in attention_by_layer(model).items() if self.covers(layer)]

        def undo() -> None:
            for handle in handles:
                handle.remove()
            self._positions.clear()

        return undo


def bias_offsets(model: torch.nn.Module, layers: list[int], head_dim: int) -> dict[int, torch.Tensor]:
    attention = attention_by_layer(model)
    offsets = {}
    for layer in layers:
        reason = bias_reason(attention[layer])
        if reason:
            raise KvqError(f"center: bias: {reason}")
        offsets[layer] = attention[layer].k_proj.bias.detach().float().view(-1, head_dim).clone()
    return offsets


def _accumulate(sums: dict, counts: dict, layer: int, keys: torch.Tensor) -> None:
    """Adds (batch, heads, tokens, d) keys to a layer's per-head-channel sums."""
    sums[layer] = sums.get(layer, 0) + keys.sum(dim=(0, 2)).double()
    counts[layer] = counts.get(layer, 0) + keys.shape[0] * keys.shape[2]


class _WrittenKeySums(DynamicCache):
    """Sums each covered layer's keys as they are written: as they come (`after_rope`), or un-rotated to their
    pre-RoPE form."""

    def __init__(self, center: KeyCenter, sums: dict, counts: dict, config, after_rope: bool):
        super().__init__(config=config)
        self.center, self.sums, self.counts, self.after_rope = center, sums, counts, after_rope

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.center.covers(layer_idx):
            keys = key_states.float() if self.after_rope else self.center.unrotated(layer_idx, key_states)
            _accumulate(self.sums, self.counts, layer_idx, keys)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@torch.no_grad()
def mean_offsets(model: torch.nn.Module, layers: list[int], head_dim: int, windows: torch.Tensor, mode: str,
                 batch_size: int, after_rope: bool = False) -> dict[int, torch.Tensor]:
    """Each layer's per-head-channel mean of the keys before RoPE, as the quantizer sees them in `mode` (k_proj's
    output in hook mode; the cached keys un-rotated in cache mode), or with `after_rope` (cache mode) of the cached
    keys as they are, over `windows` of the calibration split."""
    check_center_mode(["post_rope_mean"] if after_rope else [], mode)
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}
    device = next(model.parameters()).device
    attention = attention_by_layer(model)
    probe = KeyCenter(model, {layer: None for layer in layers}, 0)

    def record(layer):
        def hook(_module, _inputs, output):
            _accumulate(sums, counts, layer, split_heads(output.float(), head_dim))
        return hook

    handles = ([attention[layer].k_proj.register_forward_hook(record(layer)) for layer in layers]
               if mode == "hook" else [])
    undo_positions = probe.track_positions(model) if mode != "hook" else None
    try:
        for batch in windows.split(batch_size):
            kwargs = ({"use_cache": False} if mode == "hook" else
                      {"use_cache": True, "past_key_values": _WrittenKeySums(probe, sums, counts, model.config,
                                                                         after_rope)})
            model(input_ids=batch.to(device), **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        if undo_positions:
            undo_positions()
    return {layer: (sums[layer] / counts[layer]).float() for layer in layers}
