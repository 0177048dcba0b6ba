"""A transformers attention function for quantizers that score keys without reconstructing them.

A key quantizer with `attention_keys` / `attention_queries` (QJL) has the cache store its sketched
keys; this function maps queries the same way and runs SDPA, so softmax(q' . k') uses the quantizer's
score estimator directly. Masks are SDPA's.
"""

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SCORE_ATTENTION = "kvq_score"


def uses_score_path(quantizer) -> bool:
    return hasattr(quantizer, "attention_keys") and hasattr(quantizer, "attention_queries")


def score_attention(module, query, key, value, attention_mask, **kwargs):
    queries = module.kvq_key_scorer.attention_queries(query)
    return sdpa_attention_forward(module, queries, key, value, attention_mask, **kwargs)


AttentionInterface.register(SCORE_ATTENTION, score_attention)
AttentionMaskInterface.register(SCORE_ATTENTION, sdpa_mask)
