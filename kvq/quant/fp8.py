"""FP8 KV cache, as vLLM, SGLang and TensorRT-LLM ship it (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`).

Each element is stored as the float8 code of x / scale, rounded to nearest-even and saturated at the format's
largest finite value (vLLM's `scaled_fp8_conversion` clamps before the cast). The scale is one of:
- `unit`: 1.0, vLLM's default when a checkpoint carries no k/v scales;
- `tensor` / `head`: one scale per layer (per KV head), max|x| / fp8 max, fixed by the first K/V the site sees
  and kept after, as a calibrated checkpoint scale (llm-compressor, ModelOpt) is;
- `token`: one fp32 scale per token and head, max|x| / fp8 max, computed at every write (dynamic).

Method card. Follows vLLM 0.11's fp8 KV cache. A calibrated scale is a layer constant, like a rotation, and
is not counted in the bits; a per-token scale is stored and counted (8 + 32/d bits). kvq calibrates on the
first K/V a site sees: in hook-mode perplexity that call covers the whole scored sequence, so `tensor` and
`head` are calibrated on the text they score (the most favourable calibration there is); in cache mode it is
the prompt's prefill.

The codes are a kvq packed layout (`packed_form`, scheme "fp8_e4m3" / "fp8_e5m2"): indices into the format's 256
values, with the fp32 scale per token as the layout's stats, or, under a `unit` or `tensor` scale, no stats at all and
the one scale as the layout's layer scale (what vLLM stores: the codes alone), so the static cache holds them and the
decode kernels read them. A `head` scale, one per KV head, has no packed layout: the kernels fold a layer scale into
the query and output maps, which all heads share.
"""

from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from kvq.quant.base import Packed, Quantizer
from kvq.quant.config import QuantizerConfig, register_quantizer
from kvq.quant.layout import FP8_SCHEMES, PackedForm, PackedLayout
from kvq.quant.minifloat import FORMATS, MiniFloat
from kvq.quant.spec import Site

SCALE_BITS = 32
HEAD_DIM = -3  # K/V arrive as (batch, kv heads, tokens, head_dim)


@dataclass
class FP8Packed(Packed):
    codes: torch.Tensor  # uint8: the float8 bit pattern of each element
    token_scales: torch.Tensor | None  # float32 (..., T, 1) under per-token scaling, else None
    dtype: torch.dtype


def scaled_codes(x: torch.Tensor, scale: torch.Tensor, element: MiniFloat) -> torch.Tensor:
    """float8 codes of float32 x / scale (zeros where the scale is)."""
    return element.encode(torch.where(scale > 0, x / scale, torch.zeros_like(x)))


def token_scales(x: torch.Tensor, element: MiniFloat) -> torch.Tensor:
    """vLLM's dynamic per-token scale of float32 rows: max|x| / the format's largest value."""
    return x.abs().amax(-1, keepdim=True) / element.max_value


class FP8(Quantizer):
    def __init__(self, element: MiniFloat, scale: str, d: int):
        self.element = element
        self.scale = scale
        self.d = d
        self.calibrated: torch.Tensor | None = None
        self._form: PackedForm | None = None

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        """The scale x is divided by (float32 x); a tensor or head scale is calibrated on the first x."""
        if self.scale == "unit":
            return torch.ones((), device=x.device)
        if self.scale == "token":
            return token_scales(x, self.element)
        if self.calibrated is None:
            if self.scale == "head":
                dims = tuple(i for i in range(x.dim()) if i != x.dim() + HEAD_DIM)
                amax = x.abs().amax(dim=dims, keepdim=True)
            else:
                amax = x.abs().amax()
            self.calibrated = amax / self.element.max_value
        return self.calibrated

    def encode(self, x: torch.Tensor) -> FP8Packed:
        xf = x.float()
        scale = self._scale(xf)
        return FP8Packed(scaled_codes(xf, scale, self.element), scale if self.scale == "token" else None, x.dtype)

    def decode(self, packed: FP8Packed) -> torch.Tensor:
        if packed.token_scales is not None:
            scale = packed.token_scales
        else:
            scale = self.calibrated if self.calibrated is not None else 1.0
        return (self.element.decode(packed.codes) * scale).to(packed.dtype)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        return self.element.bits + (SCALE_BITS / d if self.scale == "token" else 0.0)

    def packing_reason(self) -> str | None:
        if self.scale == "head":
            return ("fp8 with a scale per head runs through the reference cache: the kernels take one scale per layer "
                    "(scale: tensor or unit) or one per token (scale: token)")
        return None

    def packed_form(self) -> PackedForm | None:
        """The format's values indexed by code, with one fp32 scale per token, or no stats and the layer's one
        scale (None until calibrated)."""
        if self.packing_reason() is not None:
            return None
        if self._form is None:
            per_token = self.scale == "token"
            layout = PackedLayout(self.d, self.element.bits, self.d, torch.float32 if per_token else None,
                                  codebook=True, scheme=f"fp8_{self.element.name}", layer_scaled=not per_token)
            self._form = PackedForm.unrotated(layout, self.element.levels())
        if self._form.layout.layer_scaled and self._form.layer_scale is None:
            if self.scale == "unit":
                self._form = self._form.scaled_by(torch.ones(()))
            elif self.calibrated is not None:
                self._form = self._form.scaled_by(self.calibrated)
        return self._form

    def calibrated_form(self, x: torch.Tensor) -> PackedForm | None:
        if self.scale == "tensor":
            self._scale(x.float())
        return self.packed_form()


def _layout_codes(element: MiniFloat, y: torch.Tensor, layout: PackedLayout,
                  layer_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 rows (n, d) -> codes (n, d) and fp32 scales (n, 1): FP8.encode's arithmetic under per-token scales;
    under the layer's scale, the codes and no stats (n, 0)."""
    if layout.layer_scaled:
        return scaled_codes(y, layer_scale, element), y.new_empty(y.shape[0], 0)
    scale = token_scales(y, element)
    return scaled_codes(y, scale, element), scale


LAYOUT_CODES = {scheme: partial(_layout_codes, FORMATS[scheme.removeprefix("fp8_")]) for scheme in FP8_SCHEMES}


@register_quantizer("fp8")
@dataclass(frozen=True)
class FP8Config(QuantizerConfig):
    """float8 codes of x / scale; scale: unit (1.0), tensor or head (calibrated once), token (dynamic)."""

    format: Literal["e4m3", "e5m2"] = "e4m3"
    scale: Literal["unit", "tensor", "head", "token"] = "tensor"
    seeded = False

    def build(self, site: Site, seed: int) -> Quantizer:
        return FP8(FORMATS[self.format], self.scale, site.d)
