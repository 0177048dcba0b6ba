"""QJL (Zandieh et al. 2024): 1-bit Johnson-Lindenstrauss sketches of keys.

A key k is stored as sign(S k) for a seeded m x d sketch S plus |k| in fp16 (kvq.quant.sketch). The
asymmetric estimator <q, k> ~ sqrt(pi/2) / m * |k| * <S q, sign(S k)> is unbiased and linear in q, so
it equals <q, k_hat> with k_hat = sqrt(pi/2) / m * |k| * S^T sign(S k): decode returns k_hat, and any
attention that takes q . k_hat computes exactly the QJL scores. Values use a scalar quantizer.

Method card. Paper: QJL, Sec. 3 (estimator), official code (`QJLSketch`). As the official code, S is
orthogonalised in blocks of d rows by default (`orthogonal`); `orthogonal=False` is the paper's
i.i.d. Gaussian S. Not yet here: the official code's outlier channels sketched apart per 32-token
group, its exact prompt window, and per-layer m.
"""

from dataclasses import dataclass

import torch

from kvq.errors import KvqError
from kvq.quant.base import Quantizer
from kvq.quant.sketch import SignSketch, SketchPacked


@dataclass
class QJLPacked(SketchPacked):
    shape: tuple[int, ...]
    dtype: torch.dtype


class QJLKeys(Quantizer):
    def __init__(self, d: int, sketch_rows: int, seed: int = 0, orthogonal: bool = True):
        if sketch_rows < 1:
            raise KvqError(f"qjl sketch rows m must be positive, got {sketch_rows}")
        self.m = sketch_rows
        self.sketch = SignSketch(sketch_rows, d, seed, orthogonal)

    def encode(self, x: torch.Tensor) -> QJLPacked:
        packed = self.sketch.encode(x)
        return QJLPacked(packed.signs, packed.norm, tuple(x.shape), x.dtype)

    def score_keys(self, packed: QJLPacked) -> torch.Tensor:
        """(..., T, m) sketched keys sqrt(pi/2)/m |k| sign(S k): q S^T against these is the estimator."""
        return self.sketch.scaled_signs(packed)

    def decode(self, packed: QJLPacked) -> torch.Tensor:
        return self.sketch.estimate(packed).to(packed.dtype)

    def attention_keys(self, x: torch.Tensor) -> torch.Tensor:
        """What the cache hands attention in place of keys (see kvq.attention)."""
        return self.score_keys(self.metered_encode(x)).to(x.dtype)

    def attention_queries(self, q: torch.Tensor) -> torch.Tensor:
        return self.sketch.project(q).to(q.dtype)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        return self.sketch.bits_per_vector() / d
