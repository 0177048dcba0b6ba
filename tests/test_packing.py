import pytest
import torch

from kvq.quant.packing import pack, unpack


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [64, 128, 13])
def test_pack_unpack_bit_exact(bits, signed, n):
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    codes = torch.randint(lo, hi + 1, (3, 7, n), dtype=torch.int16)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape[-1] == (n * bits + 7) // 8
    assert torch.equal(unpack(packed, bits, n, signed), codes)


def test_int4_nibble_order_even_element_in_low_nibble():
    packed = pack(torch.tensor([1, 2, -1, 7], dtype=torch.int16), 4)
    assert packed.tolist() == [0x21, 0x7F]


def test_int8_is_one_byte_per_code():
    codes = torch.tensor([-128, -1, 0, 127], dtype=torch.int16)
    assert pack(codes, 8).tolist() == [0x80, 0xFF, 0x00, 0x7F]
