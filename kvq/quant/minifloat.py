"""Small floating-point element formats (FP8, FP6, FP4, and the unsigned E4M3 of NVFP4's scales): rounding to
their grid and their bit codes, in float32 arithmetic that is exact for these widths.

A format with E exponent bits, M mantissa bits and bias b holds 0, the subnormals k * 2^(1-b-M) for
k < 2^M, and the normals (1 + m / 2^M) * 2^(e-b); the largest finite value is `max_value` (for e4m3fn the
all-ones code is NaN, so the top binade stops one step short). Rounding is to the nearest grid point with
ties to even, and values beyond `max_value` saturate to it: the behaviour of torch's float8 casts after
clamping (as torchao and vLLM clamp), of the OCP MX spec's conversions (Sec. 6.3) and of NVIDIA's NVFP4.
E8M0 (the MX scales) holds the powers of two 2^(b - 127) as their biased exponent b.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MiniFloat:
    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_value: float
    signed: bool = True

    @property
    def bits(self) -> int:
        return self.exponent_bits + self.mantissa_bits + int(self.signed)

    @property
    def max_power_of_two(self) -> int:
        """emax of the OCP MX spec: the exponent of the largest normal binade."""
        return int(torch.tensor(self.max_value).log2().floor())

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """x (float32) rounded to this format's grid, ties to even, saturating; the sign of x is kept (also
        on zero), as the codes keep it."""
        magnitude = x.abs().clamp(max=self.max_value)
        _, exponent = torch.frexp(magnitude)  # magnitude = f * 2^exponent, f in [0.5, 1)
        binade = (exponent - 1).clamp(min=1 - self.bias)  # subnormals share the lowest normal binade's step
        step = torch.ldexp(torch.ones_like(magnitude), binade - self.mantissa_bits)
        rounded = (torch.round(magnitude / step) * step).clamp(max=self.max_value)
        return torch.where(torch.signbit(x), -rounded, rounded)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The bit codes (uint8: sign, exponent field, mantissa field) of round(x)."""
        value = self.round(x.float())
        magnitude = value.abs()
        _, exponent = torch.frexp(magnitude)
        normal = magnitude >= 2.0 ** (1 - self.bias)
        binade = torch.where(normal, exponent - 1, torch.full_like(exponent, 1 - self.bias))
        mantissa = torch.ldexp(magnitude, self.mantissa_bits - binade).to(torch.int32)
        mantissa = torch.where(normal, mantissa - (1 << self.mantissa_bits), mantissa)
        exponent_field = torch.where(normal, binade + self.bias, torch.zeros_like(binade))
        code = (exponent_field << self.mantissa_bits) | mantissa
        if self.signed:
            code = code | (torch.signbit(value).to(torch.int32) << (self.exponent_bits + self.mantissa_bits))
        return code.to(torch.uint8)

    def decode(self, code: torch.Tensor) -> torch.Tensor:
        """float32 values of bit codes made by encode."""
        code = code.to(torch.int32)
        mantissa = code & ((1 << self.mantissa_bits) - 1)
        exponent_field = (code >> self.mantissa_bits) & ((1 << self.exponent_bits) - 1)
        normal = exponent_field > 0
        significand = torch.where(normal, mantissa + (1 << self.mantissa_bits), mantissa).float()
        binade = torch.where(normal, exponent_field - self.bias, torch.full_like(exponent_field, 1 - self.bias))
        value = torch.ldexp(significand, binade - self.mantissa_bits)
        if self.signed:
            negative = ((code >> (self.exponent_bits + self.mantissa_bits)) & 1).bool()
            value = torch.where(negative, -value, value)
        return value

    def levels(self) -> torch.Tensor:
        """float32 value of every code, indexed by code: the table a packed layout's codes index."""
        return self.decode(torch.arange(1 << self.bits))


E8M0_BIAS = 127
F32_MANTISSA_BITS = 23


def e8m0_value(biased: torch.Tensor) -> torch.Tensor:
    """float32 2^(b - 127) of biased E8M0 exponents b (uint8), placed in float32's exponent field; b = 0 reads as 0
    (torchao's decode of a block of zeros)."""
    return (biased.to(torch.int32) << F32_MANTISSA_BITS).view(torch.float32)


E2M1 = MiniFloat("e2m1", 2, 1, 1, 6.0)
E2M3 = MiniFloat("e2m3", 2, 3, 1, 7.5)
E3M2 = MiniFloat("e3m2", 3, 2, 3, 28.0)
E4M3 = MiniFloat("e4m3", 4, 3, 7, 448.0)
E5M2 = MiniFloat("e5m2", 5, 2, 15, 57344.0)
UE4M3 = MiniFloat("ue4m3", 4, 3, 7, 448.0, signed=False)

FORMATS = {f.name: f for f in (E2M1, E2M3, E3M2, E4M3, E5M2)}
TORCH_FLOAT8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
