"""KVQuant (Hooper et al. 2024, "KVQuant: Towards 10 Million Context Length LLM Inference with KV Cache
Quantization"), as its official simulation computes it (SqueezeAILab/KVQuant, quant/kvquant/
simquant_module_quantizer.py, `QuantLinearSim` with `dynamicquantization=True`).

- Keys per channel (paper: "Per-Channel Key Quantization"): each channel's statistics over the tokens of the call;
  values per token, over its channels.
- Per-vector dense-and-sparse ("Per-Vector Dense-and-Sparse Quantization"): in each vector (a key channel, a value
  token) the entries at or beyond its (1 - outliers/2) and outliers/2 quantiles (`get_outliers_dynamic`) are kept
  exact in fp16 with their positions; the range of the rest is taken after setting them to the vector's median.
- The datatype: NormalFloat signposts (`nf`, the official code's default `nf_nuq=True`: QLoRA's NF construction,
  normalised to [-1, 1], the vector's midpoint at 0), signposts fitted per layer and K|V on calibration data (`nuq`,
  `quant_fn_nuq_recon`, normalised as `nf`), or uniform asymmetric integers (`uniform`, `quant_fn_zp`).

Stored, and counted in the measured bits: every element's b-bit dense code (an outlier's too, as the dense matrix
keeps its slot), each vector's midpoint and half-range (NF, nuq) or scale and zero point (uniform) in fp16, and each
outlier's fp16 value and int16 position with an int16 count per vector (a CSR-like sparse part). A layer's nuq
signposts are a calibration constant, like a codebook (kvq.quant.base), not per-token storage.

Method card: where kvq differs from KVQuant. Keys are pre-RoPE in the paper ("Pre-RoPE Key Quantization") and in
its simulation, which quantizes k_proj's output: kvq's hook mode is that point, and in cache mode each written key
is un-rotated to its pre-RoPE form with the model's own RoPE, encoded, decoded and rotated back (kvq.center; the
quantizer says so with `keys_before_rope`), so the codes are the same pre-RoPE ones. The paper's nuq datatype
(per-layer signposts from k-means weighted by Fisher information on calibration data, "nuqX") is `datatype: nuq`,
its signposts fitted by `kvq calibrate --learn nuq` (kvq.quant.nuq says where that fit differs). The offline
per-channel key thresholds, which let a single decoded token be quantized on its own, are not built: this is the
official code's online (dynamic) configuration, whose per-channel key statistics need the whole call's tokens (a
one-token call keeps its keys exact, and pays fp16 side data for it: the measured bits show it). The attention
sink kept exact ("Attention Sink-Aware Quantization") is the shared protocol's business in kvq (its exact window
and prefill), not this quantizer's.
"""

import math
from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch

from kvq.errors import KvqError
from kvq.quant.base import Packed, Quantizer
from kvq.quant.config import QuantizerConfig, register_quantizer
from kvq.quant.nuq import site_signposts
from kvq.quant.packing import pack, unpack
from kvq.quant.spec import Site

KVQUANT_BITS = (2, 3, 4, 5)  # the official QuantLinearSim's
NF_OFFSETS = (0.5 * (1 / 32 + 1 / 30), 1 - 0.5 * (1 / 32 + 1 / 30))  # QLoRA's, as the official code takes them


@cache
def nf_signposts(bits: int) -> tuple[float, ...]:
    """The 2^bits NormalFloat signposts in [-1, 1] as KVQuant's QuantLinearSim builds them: standard-normal quantiles
    at 2^(b-1) evenly spaced probabilities from NF_OFFSETS[0] to 1/2 (the negative half, scaled so its ends are -1
    and 0) and 2^(b-1) + 1 from 1/2 to NF_OFFSETS[1] (the positive half, scaled to 0..1, its 0 dropped)."""
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    half = 2 ** (bits - 1)
    low = torch.linspace(NF_OFFSETS[0], 0.5, half, dtype=torch.float64)
    high = torch.linspace(0.5, NF_OFFSETS[1], half + 1, dtype=torch.float64)
    negative, positive = normal.icdf(low), normal.icdf(high)
    negative = (negative - negative[-1]) / (negative[-1] - negative[0])
    positive = (positive - positive[0]) / (positive[-1] - positive[0])
    return tuple(float(v) for v in torch.cat([negative, positive[1:]]))


@dataclass
class KVQuantPacked(Packed):
    codes: torch.Tensor  # uint8: every element's b-bit code, vectors along the last axis
    low: torch.Tensor  # fp16 (..., 1): NF midpoint, or uniform scale
    high: torch.Tensor  # fp16 (..., 1): NF half-range, or uniform zero point
    outlier_values: torch.Tensor  # fp16 (n_outliers,)
    outlier_positions: torch.Tensor  # int16 (n_outliers,): index within its vector
    outlier_counts: torch.Tensor  # int16 (..., ): outliers per vector
    shape: tuple[int, ...]
    dtype: torch.dtype


class KVQuant(Quantizer):
    """`signposts`: the nuq datatype's 2^bits sorted values in [-1, 1] for this site (kvq.quant.nuq); NF's by
    default."""

    def __init__(self, role: str, bits: int, datatype: str = "nf", outliers: float = 0.01,
                 signposts: tuple[float, ...] | None = None):
        if bits not in KVQUANT_BITS:
            raise KvqError(f"kvquant bits must be one of {', '.join(map(str, KVQUANT_BITS))}, got {bits}")
        if not 0 <= outliers < 1:
            raise KvqError(f"kvquant option 'outliers' must be a fraction in [0, 1), got {outliers}")
        self.role, self.bits, self.datatype, self.outliers = role, bits, datatype, outliers
        self.keys_before_rope = role == "k"
        self.signposts = torch.tensor(signposts or nf_signposts(bits))

    def vectors(self, x: torch.Tensor) -> torch.Tensor:
        """(..., T, d) -> float32 vectors along the last axis: key channels over tokens, value tokens over channels."""
        return (x.transpose(-1, -2) if self.role == "k" else x).float()

    def _outlier_mask(self, v: torch.Tensor) -> torch.Tensor:
        if self.outliers == 0:
            return torch.zeros_like(v, dtype=torch.bool)
        t = 1 - self.outliers / 2
        rows = v.reshape(-1, v.shape[-1])
        upper = torch.quantile(rows, t, dim=-1, keepdim=True).reshape(*v.shape[:-1], 1)
        lower = torch.quantile(rows, 1 - t, dim=-1, keepdim=True).reshape(*v.shape[:-1], 1)
        return (v <= lower) | (v >= upper)

    def normalized(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the signposts of `nf` and `nuq` quantize (quant_fn_nf): each of the `vectors` less its inliers'
        midpoint, over their half-range, so its inliers span [-1, 1], outliers set to 0; with the outlier mask, the
        midpoints and the half-ranges."""
        mask = self._outlier_mask(v)
        low, high = self._inlier_range(v, mask)
        low, high = (high + low) / 2, (high - low) / 2
        return torch.where(mask, 0.0, v - low) / high, mask, low, high

    @staticmethod
    def _inlier_range(v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each vector's least and greatest entry once its outliers are set to its median."""
        median = v.median(dim=-1, keepdim=True).values
        inliers = torch.where(mask, median, v)
        return inliers.amin(-1, keepdim=True), inliers.amax(-1, keepdim=True)

    def encode(self, x: torch.Tensor) -> KVQuantPacked:
        levels = 2 ** self.bits - 1
        v = self.vectors(x)
        if self.datatype in ("nf", "nuq"):
            scaled, mask, low, high = self.normalized(v)
            codes = (scaled.unsqueeze(-1) - self.signposts.to(v.device)).abs().argmin(-1)
        else:  # quant_fn_zp
            mask = self._outlier_mask(v)
            bottom, top = self._inlier_range(v, mask)
            low = levels / (top - bottom)
            high = torch.round(bottom * low).clamp(-levels, 0)
            codes = torch.round(low * torch.where(mask, 0.0, v) - high).clamp(0, levels)
        codes = torch.nan_to_num(codes.float()).to(torch.int16)
        return KVQuantPacked(pack(codes, self.bits), low.half(), high.half(), v[mask].half(),
                             mask.nonzero()[:, -1].to(torch.int16), mask.sum(-1).to(torch.int16), tuple(x.shape),
                             x.dtype)

    def decode(self, packed: KVQuantPacked) -> torch.Tensor:
        length = packed.shape[-2] if self.role == "k" else packed.shape[-1]
        codes = unpack(packed.codes, self.bits, length, signed=False).long()
        low, high = packed.low.float(), packed.high.float()
        if self.datatype in ("nf", "nuq"):
            v = self.signposts.to(codes.device)[codes].float() * high + low
        else:
            v = (codes.float() + high) / low
        v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
        mask = _mask_of(packed, v.shape)
        v = v.masked_scatter(mask, packed.outlier_values.float())
        return (v.transpose(-1, -2) if self.role == "k" else v).to(packed.dtype)

    def packing_reason(self) -> str | None:
        return "kvquant's codes with sparse fp16 outliers run through the reference cache; no fused kernel reads them"

    def outliers_per_vector(self, length: int) -> int:
        """Entries a vector of `length` distinct values keeps exact: those at or above torch.quantile's threshold at
        1 - outliers/2 and at or below its threshold at outliers/2 (positions interpolated in float32, as it does);
        at least one each side whenever outliers > 0, so a short vector keeps more than the nominal fraction."""
        if self.outliers == 0:
            return 0
        t = 1 - self.outliers / 2
        upper, lower = (float(torch.tensor(q, dtype=torch.float32) * (length - 1)) for q in (t, 1 - t))
        return length - math.ceil(upper) + math.floor(lower) + 1

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        """Exact for vectors of distinct values: b-bit codes, 48 bits of side data per vector (two fp16 values, an
        int16 count) and 32 per outlier (an fp16 value, an int16 position)."""
        length = n_tokens if self.role == "k" else d
        return self.bits + (48 + 32 * self.outliers_per_vector(length)) / length


def _mask_of(packed: KVQuantPacked, shape: torch.Size) -> torch.Tensor:
    """The outlier positions as a boolean mask of the vectors' shape (counts per vector, in row-major order)."""
    rows = torch.repeat_interleave(torch.arange(packed.outlier_counts.numel(), device=packed.outlier_counts.device),
                                   packed.outlier_counts.flatten().long())
    mask = torch.zeros(packed.outlier_counts.numel(), shape[-1], dtype=torch.bool, device=rows.device)
    mask[rows, packed.outlier_positions.long()] = True
    return mask.reshape(shape)


@register_quantizer("kvquant")
@dataclass(frozen=True)
class KVQuantConfig(QuantizerConfig):
    """K per channel over the call's tokens, V per token; NF, fitted (nuq) or uniform codes; `outliers` of each
    vector in fp16. `signposts`: the `kvq calibrate --learn nuq` artifact the nuq datatype reads."""

    bits: int
    datatype: Literal["nf", "nuq", "uniform"] = "nf"
    outliers: float = 0.01
    signposts: str | None = None
    seeded = False

    def build(self, site: Site, seed: int) -> Quantizer:
        if (self.datatype == "nuq") != (self.signposts is not None):
            raise KvqError("kvquant option 'signposts' names the artifact of `kvq calibrate --learn nuq`, which "
                           "datatype nuq needs and the other datatypes do not read")
        fitted = site_signposts(self.signposts, site, self.bits, self.outliers) if self.signposts else None
        return KVQuant(site.role, self.bits, self.datatype, self.outliers, fitted)
