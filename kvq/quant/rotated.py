from dataclasses import dataclass

import torch

from kvq.quant.base import Packed, Quantizer
from kvq.quant.config import QuantizerConfig, register_quantizer
from kvq.quant.layout import PackedForm, PackedLayout
from kvq.quant.scalar import ScalarQuantizer
from kvq.quant.spec import Site
from kvq.rotations import ROTATIONS, Composed, MatrixRotation, Rotation, build_rotation

LAMBDA_FLOOR = 1e-6


@dataclass
class RotatedPacked(Packed):
    """The inner quantizer's packing of the rotated rows, and the input's dtype, which decode returns."""

    inner: Packed
    dtype: torch.dtype

    def storage_bits(self) -> int:
        return self.inner.storage_bits()


class RotatedQuantizer(Quantizer):
    """rotate -> optional per-coordinate lambda -> inner quantizer; decode divides by lambda
    (clamped at 1e-6, SRFT paper Sec. 5.1) and rotates back."""

    def __init__(self, rotation: Rotation, inner: Quantizer, lam: torch.Tensor | None = None):
        self.rotation = rotation
        self.inner = inner
        self.lam = lam
        self._form: PackedForm | None = None

    def _lam(self, like: torch.Tensor) -> torch.Tensor:
        return self.lam.to(device=like.device, dtype=torch.float32).clamp_min(LAMBDA_FLOOR)

    def encode(self, x: torch.Tensor) -> RotatedPacked:
        y = self.rotation.forward(x.float())
        if self.lam is not None:
            y = y * self._lam(y)
        return RotatedPacked(self.inner.encode(y), x.dtype)

    def decode(self, packed: RotatedPacked) -> torch.Tensor:
        y = self.inner.decode(packed.inner).float()
        if self.lam is not None:
            y = y / self._lam(y)
        return self.rotation.inverse(y).to(packed.dtype)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        return self.inner.bits_per_element(d, n_tokens)

    def packing_reason(self) -> str | None:
        """None when the storage is one scalar code row per token with per-token or per-group scales (and
        offsets, where asymmetric), the layout the fused cache and kernels read; else why not."""
        inner = self.inner
        if not isinstance(inner, ScalarQuantizer):
            return f"{type(inner).__name__} under a rotation declares no packed layout"
        if inner.granularity not in ("per_token", "per_group"):
            return f"granularity {inner.granularity} has no packed layout (its scales span tokens)"
        return None

    def packed_form(self) -> PackedForm | None:
        if self.packing_reason() is not None:
            return None
        if self._form is None:
            d, inner = self.rotation.d, self.inner
            group = d if inner.granularity == "per_token" else inner.group_size
            layout = PackedLayout(d, inner.bits, group, inner.scale_dtype, inner.symmetric, self.rotation.kind)
            signs = getattr(self.rotation, "signs", torch.ones(d)).float()
            lam = self.lam.float().clamp_min(LAMBDA_FLOOR) if self.lam is not None else None
            self._form = PackedForm(layout, signs, self.rotation.matrix(), lam)
        return self._form


@dataclass(frozen=True)
class RotatedScalarConfig(QuantizerConfig):
    """A fixed rotation (`rotation`, a kvq.rotations name) then the scalar quantizer; a calibration artifact's
    learned rotation and lambda compose with it (Site.learned)."""

    bits: int
    granularity: str
    group_size: int
    symmetric: bool
    scale_dtype: str
    rotation = "identity"

    def scalar(self) -> ScalarQuantizer:
        return ScalarQuantizer(self.bits, self.granularity, self.group_size, self.symmetric, self.scale_dtype)

    def build(self, site: Site, seed: int) -> Quantizer:
        learned = site.learned
        rotation = build_rotation(self.rotation, site.d, site.seed(learned.seed if learned else seed))
        if learned and learned.rotation is not None:
            rotation = Composed(rotation, MatrixRotation(learned.rotation))
        return RotatedQuantizer(rotation, self.scalar(), learned.lam if learned else None)


def _rotated_scalar(rotation_name: str) -> type[RotatedScalarConfig]:
    return dataclass(frozen=True)(type(f"{rotation_name.upper()}Config", (RotatedScalarConfig,), {
        "rotation": rotation_name, "seeded": rotation_name != "identity", "__module__": __name__,
        "__doc__": f"{rotation_name} rotation, then the scalar quantizer."}))


register_quantizer("int")(_rotated_scalar("identity"))
for _name in ROTATIONS.names():
    register_quantizer(_name)(_rotated_scalar(_name))
