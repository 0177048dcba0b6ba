"""Engine block formats quantize each head vector in consecutive blocks of its coordinates."""

import torch

from kvq.errors import KvqError


def require_blocks(d: int, size: int, format_name: str) -> None:
    """A format of `size`-coordinate blocks needs head_dim to be a whole number of blocks."""
    if d % size:
        raise KvqError(f"{format_name} stores blocks of {size} coordinates; head_dim {d} is not a multiple of {size}")


def split_blocks(x: torch.Tensor, size: int, format_name: str) -> torch.Tensor:
    """(..., d) -> (..., d / size, size) in float32."""
    require_blocks(x.shape[-1], size, format_name)
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // size, size)


def merge_blocks(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-2], -1)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (..., n) -> bytes (..., n/2): code j in the low nibble of byte j, code j + n/2 in its high
    nibble (ggml's block order; kvq.quant.packing packs neighbours, as OCP MX and NVFP4 do)."""
    half = codes.shape[-1] // 2
    return (codes[..., :half] | (codes[..., half:] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)
