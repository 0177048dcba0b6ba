"""SDPA with grouped-query K/V left unexpanded under a mask: the fair fp16 attention for decode benchmarks.

transformers' `sdpa` attention repeats each K/V head once per query head of its group (`repeat_kv`) whenever a
mask is passed, and a static cache always passes one (its unwritten tail is masked). A decode step then reads
the K/V `num_key_value_groups` times over (4x at Llama-3 shapes), so an fp16 static-cache row measures that
expansion rather than the bytes its cache holds. This attention hands a decode step's query to SDPA with the
K/V as stored and `enable_gqa=True`, mask or no mask; a prefill goes through transformers' `sdpa` unchanged.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvq.attention import switch_attention

GQA_SDPA_ATTENTION = "sdpa_enable_gqa"


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       **kwargs) -> tuple[torch.Tensor, None]:
    if query.shape[2] > 1:
        # A prefill under a mask: SDPA's GQA path would take its math kernel and materialise every score, where
        # transformers' expanded K/V take a fused kernel.
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                            scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
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
