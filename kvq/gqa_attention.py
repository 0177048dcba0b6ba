"""SDPA with grouped-query K/V left unexpanded under a mask: the fair fp16 attention for decode benchmarks.

transformers' `sdpa` attention repeats each K/V head once per query head of its group (`repeat_kv`) whenever a
mask is passed, and a static cache always passes one (its unwritten tail is masked). A decode step then reads
the K/V `num_key_value_groups` times over (4x at Llama-3 shapes), so an fp16 static-cache row measures that
expansion rather than the bytes its cache holds. This attention hands SDPA the K/V as stored with
`enable_gqa=True`, mask or no mask; everything else follows transformers' `sdpa_attention_forward`.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvq.attention import switch_attention

GQA_SDPA_ATTENTION = "sdpa_enable_gqa"


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       is_causal=None, **kwargs) -> tuple[torch.Tensor, None]:
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # SDPA aligns its causal mask top-left, so an unmasked first prefill into a longer static cache never sees the
    # unwritten tail
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                            scale=scaling, is_causal=is_causal,
                                            enable_gqa=key.shape[1] != query.shape[1])
    return output.transpose(1, 2).contiguous(), None


@contextmanager
def gqa_sdpa(model: torch.nn.Module) -> Iterator[None]:
    """Runs the model's attention through `gqa_sdpa_attention` inside the block."""
    restore = switch_attention(model, GQA_SDPA_ATTENTION)
    try:
        yield
    finally:
        restore()


AttentionInterface.register(GQA_SDPA_ATTENTION, gqa_sdpa_attention)
AttentionMaskInterface.register(GQA_SDPA_ATTENTION, sdpa_mask)
