"""QJL (Zandieh et al. 2024): 1-bit Johnson-Lindenstrauss sketches of keys.

A key k is stored as sign(S k) for a seeded Gaussian S (m x d) plus |k| in fp16. The asymmetric
estimator <q, k> ~ sqrt(pi/2) / m * |k| * <S q, sign(S k)> is unbiased and linear in q, so it equals
<q, k_hat> with k_hat = sqrt(pi/2) / m * |k| * S^T sign(S k): decode returns k_hat, and any attention
that takes q . k_hat computes exactly the QJL scores. Values use a scalar quantizer.
"""

import math
from dataclasses import dataclass

import torch

from kvq.errors import KvqError
from kvq.quant.base import Packed, Quantizer
from kvq.quant.packing import pack, packed_row_bytes, unpack
from kvq.quant.turbo import gaussian_sketch


@dataclass
class QJLPacked(Packed):
    signs: torch.Tensor
    norm: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype


class QJLKeys(Quantizer):
    def __init__(self, d: int, sketch_rows: int, seed: int = 0):
        if sketch_rows < 1:
            raise KvqError(f"qjl sketch rows m must be positive, got {sketch_rows}")
        self.m = sketch_rows
        self.sketch = gaussian_sketch(sketch_rows, d, seed)

    def encode(self, x: torch.Tensor) -> QJLPacked:
        xf = x.float()
        projected = xf @ self.sketch.to(x.device).T
        return QJLPacked(pack((projected >= 0).to(torch.int16), 1),
                         xf.norm(dim=-1, keepdim=True).to(torch.float16), tuple(x.shape), x.dtype)

    def score_keys(self, packed: QJLPacked) -> torch.Tensor:
        """(..., T, m) sketched keys sqrt(pi/2)/m |k| sign(S k): q S^T against these is the estimator."""
        signs = unpack(packed.signs, 1, self.m, signed=False).float() * 2 - 1
        return math.sqrt(math.pi / 2) / self.m * packed.norm.float() * signs

    def decode(self, packed: QJLPacked) -> torch.Tensor:
        keys = self.score_keys(packed)
        return (keys @ self.sketch.to(keys.device)).to(packed.dtype)

    def attention_keys(self, x: torch.Tensor) -> torch.Tensor:
        """What the cache hands attention in place of keys (see kvq.attention)."""
        return self.score_keys(self.metered_encode(x)).to(x.dtype)

    def attention_queries(self, q: torch.Tensor) -> torch.Tensor:
        return (q.float() @ self.sketch.to(q.device).T).to(q.dtype)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        return (packed_row_bytes(self.m, 1) * 8 + 16) / d
