"""QJL (Zandieh et al. 2024): 1-bit Johnson-Lindenstrauss sketches of keys.

A key k is stored as sign(S k) for a seeded m x d sketch S plus |k| in fp16 (kvq.quant.sketch). The
asymmetric estimator <q, k> ~ sqrt(pi/2) / m * |k| * <S q, sign(S k)> is unbiased and linear in q, so
it equals <q, k_hat> with k_hat = sqrt(pi/2) / m * |k| * S^T sign(S k): decode returns k_hat, and any
attention that takes q . k_hat computes exactly the QJL scores. Values use a scalar quantizer.

Method card. Paper: QJL, Sec. 3 (estimator); official code (`QJLSketch`, `QJLKeyQuantizer`), which
kvq follows in two ways beyond the paper's plain estimator:
- S is orthogonalised in blocks of d rows (`orthogonal`, default on; off is the paper's i.i.d. S).
- Outlier channels (`outliers`, default 0): per group of `group` tokens the channels with the largest
  norm over the group are sketched apart, by the first m/2 rows of S with their own norm, and the rest
  (outliers zeroed) by all m rows, and the group's channel indices (a byte each) are stored. Each
  part's estimate is read back on its own channels only, which keeps it unbiased (the part lives
  there) and takes the outliers' large norm out of the other channels' error. A query then meets
  per-group channel sets, so these keys are decoded rather than scored in sketch space. The official
  code keeps the tokens short of a whole group exact; here they form a shorter group of their own,
  and recency is the shared protocol's window (kvq.protocol).
- A larger sketch in the first layers (`initial_layers`, `initial_m`; the official code's
  `initial_layers_count` and `key_quantization_bits_initial_layers`, 15 layers at m = 4d for Llama).
Values: the official code quantizes values per token in groups of channels; kvq's qjl takes the
spec's scalar settings for values (granularity per_group, group_size 32 is that scheme).
"""

import math
from dataclasses import dataclass

import torch

from kvq.errors import KvqError
from kvq.quant.base import Packed, Quantizer
from kvq.quant.config import QuantizerConfig, register_quantizer
from kvq.quant.scalar import ScalarQuantizer
from kvq.quant.sketch import SignSketch, SketchPacked
from kvq.quant.spec import Site
from kvq.quant.split import channel_mask, group_outlier_channels


@dataclass
class QJLPacked(Packed):
    inliers: SketchPacked
    outliers: SketchPacked | None
    indices: torch.Tensor | None  # (..., groups, count) uint8: each token group's outlier channels
    shape: tuple[int, ...]
    dtype: torch.dtype

    def storage_bits(self) -> int:
        bits = self.inliers.storage_bits()
        if self.outliers is not None:
            bits += self.outliers.storage_bits() + self.indices.numel() * 8
        return bits


class QJLKeys(Quantizer):
    def __init__(self, d: int, sketch_rows: int, seed: int = 0, orthogonal: bool = True, outliers: int = 0,
                 group: int = 32):
        if sketch_rows < 2:
            raise KvqError(f"qjl sketch rows m must be at least 2, got {sketch_rows}")
        if not 0 <= outliers < d or group < 1:
            raise KvqError(f"qjl outliers must be in 0..{d - 1} and group >= 1, got {outliers} and {group}")
        self.m, self.d, self.outliers, self.group = sketch_rows, d, outliers, group
        self.sketch = SignSketch(sketch_rows, d, seed, orthogonal)
        self.outlier_sketch = self.sketch.first_rows(sketch_rows // 2) if outliers else None
        self.score_path = not outliers  # kvq.attention scores q S^T against the stored signs

    def _mask(self, indices: torch.Tensor, tokens: int) -> torch.Tensor:
        """(..., groups, count) channel indices -> (..., tokens, d) bool, each token's group's outliers."""
        return channel_mask(indices, self.d).repeat_interleave(self.group, dim=-2)[..., :tokens, :]

    def encode(self, x: torch.Tensor) -> QJLPacked:
        if not self.outliers:
            return QJLPacked(self.sketch.encode(x), None, None, tuple(x.shape), x.dtype)
        xf = x.float()
        indices = group_outlier_channels(xf, self.outliers, self.group)
        mask = self._mask(indices, x.shape[-2])
        return QJLPacked(self.sketch.encode(xf * ~mask), self.outlier_sketch.encode(xf * mask), indices,
                         tuple(x.shape), x.dtype)

    def score_keys(self, packed: QJLPacked) -> torch.Tensor:
        """(..., T, m) sketched keys sqrt(pi/2)/m |k| sign(S k): q S^T against these is the estimator
        (without outlier channels, whose keys are decoded instead)."""
        return self.sketch.scaled_signs(packed.inliers)

    def decode(self, packed: QJLPacked) -> torch.Tensor:
        keys = self.sketch.estimate(packed.inliers)
        if packed.outliers is not None:
            mask = self._mask(packed.indices, packed.shape[-2])
            keys = torch.where(mask, self.outlier_sketch.estimate(packed.outliers), keys)
        return keys.to(packed.dtype)

    def attention_keys(self, x: torch.Tensor) -> torch.Tensor:
        """What the cache hands attention in place of keys (see kvq.attention)."""
        return self.score_keys(self.metered_encode(x)).to(x.dtype)

    def attention_queries(self, q: torch.Tensor) -> torch.Tensor:
        return self.sketch.project(q).to(q.dtype)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        bits = self.sketch.bits_per_vector() * n_tokens
        if self.outliers:
            index_bits = math.ceil(n_tokens / self.group) * self.outliers * 8
            bits += self.outlier_sketch.bits_per_vector() * n_tokens + index_bits
        return bits / (d * n_tokens)


@register_quantizer("qjl")
@dataclass(frozen=True)
class QJLConfig(QuantizerConfig):
    """Keys: a QJL sketch of m rows (default 2 d), or initial_m rows in the first initial_layers layers;
    values: the spec's scalar quantizer."""

    bits: int
    granularity: str
    group_size: int
    symmetric: bool
    scale_dtype: str
    m: int | None = None
    initial_layers: int = 0
    initial_m: int | None = None
    orthogonal: bool = True
    outliers: int = 0
    outlier_group: int = 32

    def build(self, site: Site, seed: int) -> Quantizer:
        if site.role == "v":
            return ScalarQuantizer(self.bits, self.granularity, self.group_size, self.symmetric, self.scale_dtype)
        rows = self.m if self.m is not None else 2 * site.d
        if site.layer < self.initial_layers and self.initial_m is not None:
            rows = self.initial_m
        return QJLKeys(site.d, rows, site.seed(seed), self.orthogonal, self.outliers, self.outlier_group)
