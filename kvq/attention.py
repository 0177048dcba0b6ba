"""transformers attention functions that kvq registers.

kvq_score: a key quantizer whose `score_path` is set (QJL without outlier channels) has the cache store
its sketched keys (`attention_keys`); this function maps queries the same way (`attention_queries`)
and runs SDPA, so softmax(q' . k') uses the quantizer's score estimator directly.

kvq_window: cache mode under a kvq.protocol.Protocol: each query takes the exact keys and values of the
positions inside its window and the quantizer's copies (or sketched keys) of the rest, from the
ProtocolWriteCache the context manager attached to the module.

kvq_fused: decode steps of a fused QuantizedKVCache layer (kvq.cache.FusedLayer) or of a static quantized
cache layer (kvq.static_cache) attend straight from the packed codes; every other call (prefill, sliding
layers, masked or padded batches) is plain SDPA. Masks are SDPA's for both.
"""

from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SCORE_ATTENTION = "kvq_score"
FUSED_ATTENTION = "kvq_fused"
WINDOW_ATTENTION = "kvq_window"


def uses_score_path(quantizer) -> bool:
    return getattr(quantizer, "score_path", False)


def score_attention(module, query, key, value, attention_mask, **kwargs):
    queries = module.kvq_key_scorer.attention_queries(query)
    return sdpa_attention_forward(module, queries, key, value, attention_mask, **kwargs)


def window_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention mixing exact (near) and quantized (far) positions per (query, key) pair. Where every query
    sees the same positions near (one query, a decode step; or all positions near, an exact prefill) the
    mixed K/V are plain tensors and SDPA serves; otherwise, or where far keys are scored in a sketch space
    (QJL), the scores are mixed pair by pair."""
    cache = module.kvq_protocol_cache
    layer = module.layer_idx
    far_keys, far_values = cache.far(layer)
    near = cache.near(layer, query.shape[-2], key.shape[-2])
    scorer = cache.bank.get(layer, "k")
    if not uses_score_path(scorer) and (query.shape[-2] == 1 or bool(near.all())):
        positions = near[-1].to(query.device)[:, None]  # the last query's: every query's here
        key, value = torch.where(positions, key, far_keys), torch.where(positions, value, far_values)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    near = near.to(query.device)
    groups = query.shape[1] // key.shape[1]
    key, value, far_keys, far_values = (repeat_kv(t, groups) for t in (key, value, far_keys, far_values))
    far_query = scorer.attention_queries(query) if uses_score_path(scorer) else query
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.where(near, query.float() @ key.float().transpose(-1, -2),
                         far_query.float() @ far_keys.float().transpose(-1, -2)) * scale
    if attention_mask is None:  # SDPA's mask is left out when plain causal masking is all it holds
        attention_mask = near.new_ones(near.shape).tril(key.shape[-2] - query.shape[-2])
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    else:
        scores = scores + attention_mask
    probs = scores.softmax(-1)
    output = (probs * near) @ value.float() + (probs * ~near) @ far_values.float()
    return output.transpose(1, 2).contiguous().to(query.dtype), None


def fused_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    layer = getattr(module, "kvq_fused_layer", None)
    if layer is not None and layer.is_compileable:  # kvq.static_cache.StaticQuantizedLayer
        if query.shape[-2] > 1:
            layer.begin_decoding(query, attention_mask)
        elif layer.unpadded:
            return layer.attend(query, scaling if scaling is not None else query.shape[-1] ** -0.5), None
    elif layer is not None and layer.deferred:
        # A decode step whose update kept K/V packed: attend from the codes unless a mask forbids.
        if query.shape[-2] == 1 and attention_mask is None:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return layer.attend(query, scale), None
        key, value = layer.materialize()
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def switch_attention(model: torch.nn.Module, name: str) -> Callable[[], None]:
    """Sets the model's attention implementation; returns the undo."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    return lambda: model.set_attn_implementation(previous)


for _name, _function in ((SCORE_ATTENTION, score_attention), (FUSED_ATTENTION, fused_attention),
                         (WINDOW_ATTENTION, window_attention)):
    AttentionInterface.register(_name, _function)
    AttentionMaskInterface.register(_name, sdpa_mask)
