"""Bit packing of integer codes into bytes.

Layout: the codes of one row form a little-endian bit stream; code i occupies bits
[i*b, (i+1)*b). For b=4 this is the usual nibble order, byte = (q[2i+1] << 4) | (q[2i] & 0xF),
i.e. the even element sits in the low nibble (as the SRFT paper's kernel, Sec. 3.2). For b=8 it is
one byte per code. Signed codes are stored as b-bit two's complement.
"""

import torch

from kvq.errors import KvqError


def packed_row_bytes(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise KvqError(f"bits must be in 1..8 for byte packing, got {bits}")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes (..., n) with values representable in `bits` bits to uint8 (..., ceil(n*b/8))."""
    _check_bits(bits)
    n = codes.shape[-1]
    unsigned = (codes.to(torch.int32) & ((1 << bits) - 1)).to(torch.uint8)
    if bits == 8:
        return unsigned.contiguous()
    if 8 % bits == 0 and n % (8 // bits) == 0:
        per_byte = 8 // bits
        shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
        grouped = unsigned.view(*codes.shape[:-1], n // per_byte, per_byte)
        return (grouped << shifts).sum(-1, dtype=torch.int32).to(torch.uint8)
    bit_index = torch.arange(bits, device=codes.device, dtype=torch.uint8)
    stream = ((unsigned.unsqueeze(-1) >> bit_index) & 1).flatten(-2)
    pad = packed_row_bytes(n, bits) * 8 - n * bits
    stream = torch.nn.functional.pad(stream, (0, pad))
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32)).to(torch.int32)
    return (stream.view(*stream.shape[:-1], -1, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int, signed: bool) -> torch.Tensor:
    """Inverse of `pack`: uint8 (..., bytes) -> int16 codes (..., n), sign-extended when `signed`."""
    _check_bits(bits)
    if bits == 8:
        codes = packed.to(torch.int16)
    elif 8 % bits == 0 and n % (8 // bits) == 0:
        shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
        codes = ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2).to(torch.int16)
    else:
        bit_index = torch.arange(8, device=packed.device, dtype=torch.uint8)
        stream = ((packed.unsqueeze(-1) >> bit_index) & 1).flatten(-2)[..., : n * bits]
        weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int16)).to(torch.int16)
        codes = (stream.view(*stream.shape[:-1], n, bits).to(torch.int16) * weights).sum(-1, dtype=torch.int16)
    if signed:
        codes = torch.where(codes >= (1 << (bits - 1)), codes - (1 << bits), codes)
    return codes
