"""How the Triton decode partial (kvq.kernels.triton_decode) reads packed codes as fp16 tiles: int4 nibbles by
magic-number conversions, codes that span bytes cut from whole words, float formats' codes computed from their bits,
codebook indices of at most 4 bits looked up in registers by byte permutes, wider ones gathered from the
fp16 levels."""

import torch
import triton
import triton.language as tl


def _nibbles_to_f16(low: int, high: int, exact: bool) -> tl.constexpr:
    """Nibbles to fp16 integers: spread 4 bytes over 16-bit lanes, then place each nibble under exponent 1024
    (fp16 0x6400) by (byte & mask) ^ magic, a low nibble in mantissa bits 0-3 (reads `low` + n), a high one in
    bits 4-7 (reads `high` + 16 n). Two's-complement codes flip their sign bit on the way ((n & 0xF) ^ 8 =
    n + 8: magics 0x6408 and 0x6480, reading 1032 + n and 1152 + 16 n); unsigned codes need no flip (0x6400:
    1024 + n, 1024 + 16 n). Outputs: low nibbles, then high nibbles, of the 4 bytes. Biased (not `exact`), 8
    values per 6 instructions, serve keys, whose query takes the biases out (see _query_bias); exact ones also
    subtract them, 8 values per 10 instructions, for values, whose accumulators would otherwise carry the
    biases across a whole split, where the tensor cores' truncating float32 sums would lose their low bits."""
    low_magic, high_magic = 0x6400 + low - 1024, 0x6400 + (high - 1024) // 16 * 16

    def pair(half: int) -> str:
        return f"0x{half:04x}{half:04x}"

    body = f"""
{{
.reg .b32 lo, hi;
prmt.b32 lo, $4, 0, 0x4140;
prmt.b32 hi, $4, 0, 0x4342;
lop3.b32 $0, lo, 0x000F000F, {pair(low_magic)}, 0x6a;
lop3.b32 $1, hi, 0x000F000F, {pair(low_magic)}, 0x6a;
lop3.b32 $2, lo, 0x00F000F0, {pair(high_magic)}, 0x6a;
lop3.b32 $3, hi, 0x00F000F0, {pair(high_magic)}, 0x6a;
"""
    if exact:  # low + n - low; (high + 16 n) / 16 - high / 16
        high_bias = torch.tensor(-high / 16, dtype=torch.float16).view(torch.int16).item() & 0xFFFF
        body += f"""
.reg .b32 low_bias, high_step, high_bias;
mov.b32 low_bias, {pair(low_magic)};
mov.b32 high_step, 0x2c002c00;
mov.b32 high_bias, {pair(high_bias)};
sub.f16x2 $0, $0, low_bias;
sub.f16x2 $1, $1, low_bias;
fma.rn.f16x2 $2, $2, high_step, high_bias;
fma.rn.f16x2 $3, $3, high_step, high_bias;
"""
    return tl.constexpr(body + "}")


def _level_lookup() -> tl.constexpr:
    """4-bit codes to the fp16 levels of a 16-level codebook, in registers: 8 codes (the nibbles of 4 bytes, $4) per
    call, out as _nibbles_to_f16's are (low nibbles' levels in $0, $1, high nibbles' in $2, $3). The tables ($5 on,
    four operands each, as Triton passes a 32-bit operand once per packed element) hold the levels' low bytes (levels
    0-3, 4-7, 8-11, 12-15), then their high bytes (levels_held). Each code's low 3 bits pick its bytes from levels
    0-7 and from 8-15 by byte permutes, its bit 3 picks between them (a byte mask from prmt's sign replication), and
    two permutes interleave the low and high bytes into fp16 pairs. A gather from the levels in memory instead takes
    a load per code."""
    def nibbles(first: str, mask: str, out_even: str, out_odd: str) -> str:
        # `first`: the codes' low 3 bits at each byte's bits 0-2; `mask`'s bit 7 of each byte: their bit 3
        return f"""
and.b32 x, {first}, 0x07070707;
shr.b32 z, x, 4;
or.b32 z, z, x;
prmt.b32 sel, z, 0, 0x4420;
prmt.b32 m, {mask}, 0, 0xBA98;
prmt.b32 la, $5, $9, sel;
prmt.b32 lb, $13, $17, sel;
prmt.b32 ha, $21, $25, sel;
prmt.b32 hb, $29, $33, sel;
lop3.b32 lo, la, lb, m, 0xD8;
lop3.b32 hi, ha, hb, m, 0xD8;
prmt.b32 {out_even}, lo, hi, 0x5140;
prmt.b32 {out_odd}, lo, hi, 0x7362;"""

    return tl.constexpr("{\n.reg .b32 x, z, sel, m, la, lb, ha, hb, lo, hi, shifted;\nshl.b32 shifted, $4, 4;"
                        + nibbles("$4", "shifted", "$0", "$1") + "\nshr.b32 shifted, $4, 4;"
                        + nibbles("shifted", "$4", "$2", "$3") + "\n}")


_LEVEL_LOOKUP = _level_lookup()
_LEVEL_LOOKUP_OPERANDS = tl.constexpr("=r,=r,=r,=r,r" + ",r" * 32)
# Codes of at most 3 bits (int32 indices below 8, four per call in $2-$5) to the fp16 levels of their codebook: one
# selector of their four indices picks each one's low and high byte from the tables of levels 0-7 ($6 and $10 the
# low bytes, $14 and $18 the high ones: levels_held's words 0, 1, 4, 5, four operands each), interleaved into pairs.
_SMALL_LEVEL_LOOKUP = tl.constexpr("""{
.reg .b32 sel, shifted, lo, hi;
shl.b32 shifted, $3, 4;
or.b32 sel, $2, shifted;
shl.b32 shifted, $4, 8;
or.b32 sel, sel, shifted;
shl.b32 shifted, $5, 12;
or.b32 sel, sel, shifted;
prmt.b32 lo, $6, $10, sel;
prmt.b32 hi, $14, $18, sel;
prmt.b32 $0, lo, hi, 0x5140;
prmt.b32 $1, lo, hi, 0x7362;
}""")
_SMALL_LEVEL_LOOKUP_OPERANDS = tl.constexpr("=r,=r" + ",r" * 20)


# What a biased nibble reads: a signed code n (two's complement) 1032 + n low, 1152 + 16 n high; an unsigned
# one 1024 + n and 1024 + 16 n
SIGNED_LOW_BIAS = tl.constexpr(1032.0)
SIGNED_HIGH_BIAS = tl.constexpr(1152.0)
UNSIGNED_BIAS = tl.constexpr(1024.0)
_SIGNED_BIASED = _nibbles_to_f16(1032, 1152, exact=False)
_SIGNED_EXACT = _nibbles_to_f16(1032, 1152, exact=True)
_UNSIGNED_BIASED = _nibbles_to_f16(1024, 1024, exact=False)
_UNSIGNED_EXACT = _nibbles_to_f16(1024, 1024, exact=True)
HIGH_STEP = tl.constexpr(16.0)


@triton.jit
def load_codes(codes_ptr, tokens, valid, BITS: tl.constexpr, HALF: tl.constexpr, EXACT: tl.constexpr,
               SIGNED: tl.constexpr, table, CODEBOOK: tl.constexpr, FLOAT_MANTISSA: tl.constexpr):
    """Even and odd coordinates of a (BLOCK, d) tile of codes as fp16 (codes_ptr: this head's rows of
    HALF * BITS // 4 bytes): integers, two's complement where SIGNED, else unsigned, int4 ones biased unless EXACT
    (_nibbles_to_f16); or, where CODEBOOK, the levels that the codes index (table: what levels_held keeps of them,
    looked up in registers for codes of at most 4 bits, else gathered from the fp16 levels), computed from the codes'
    bits where they are a float format's with FLOAT_MANTISSA >= 0 mantissa bits (float_bits_to_f16).
    An exact int4 conversion (values; keys decoded in registers) is marked impure, which pins it where it is written:
    Triton otherwise moves the tile's layout change ahead of it, to shift bytes rather than halves, and as V's
    products run over tokens that gathers the bytes one at a time from shared memory. Codebook lookups are read
    exact, and pinned alike."""
    # one chain of constant conditions: Triton compiles what follows a return under one, which a table of
    # another kind than its branch's would not survive
    if CODEBOOK and FLOAT_MANTISSA < 0 and BITS == 4:
        byte = _nibble_bytes(codes_ptr, tokens, valid, HALF)
        return tl.inline_asm_elementwise(_LEVEL_LOOKUP, _LEVEL_LOOKUP_OPERANDS, [
            byte, table[0], table[1], table[2], table[3], table[4], table[5], table[6], table[7]],
            dtype=(tl.float16, tl.float16), is_pure=False, pack=4)
    elif CODEBOOK:
        even, odd = _load_indices(codes_ptr, tokens, valid, BITS, HALF)
        if FLOAT_MANTISSA >= 0:
            return float_bits_to_f16(even, BITS, FLOAT_MANTISSA), float_bits_to_f16(odd, BITS, FLOAT_MANTISSA)
        elif BITS <= 3:
            return _small_looked_up(even, table), _small_looked_up(odd, table)
        else:
            return (tl.reshape(tl.gather(table, tl.reshape(even, (even.numel,)), 0), even.shape),
                    tl.reshape(tl.gather(table, tl.reshape(odd, (odd.numel,)), 0), odd.shape))
    elif BITS == 4:
        byte = _nibble_bytes(codes_ptr, tokens, valid, HALF)
        if SIGNED:
            return _nibbles(byte, _SIGNED_EXACT if EXACT else _SIGNED_BIASED, EXACT)
        return _nibbles(byte, _UNSIGNED_EXACT if EXACT else _UNSIGNED_BIASED, EXACT)
    else:
        even, odd = _load_indices(codes_ptr, tokens, valid, BITS, HALF)
        if SIGNED:  # two's complement of BITS bits
            even = even - ((even >> (BITS - 1)) << BITS)
            odd = odd - ((odd >> (BITS - 1)) << BITS)
        return even.to(tl.float16), odd.to(tl.float16)

@triton.jit
def _nibble_bytes(codes_ptr, tokens, valid, HALF: tl.constexpr):
    """The (BLOCK, HALF) bytes of a tile of 4-bit codes, one per coordinate pair, each row read whole."""
    return tl.load(codes_ptr + tokens[:, None] * HALF + tl.arange(0, HALF)[None, :], mask=valid[:, None], other=0)

@triton.jit
def _small_looked_up(indices, table):
    return tl.inline_asm_elementwise(_SMALL_LEVEL_LOOKUP, _SMALL_LEVEL_LOOKUP_OPERANDS, [
        indices, table[0], table[1], table[4], table[5]], dtype=tl.float16, is_pure=False, pack=4)

@triton.jit
def levels_held(levels, BITS: tl.constexpr, HELD: tl.constexpr):
    """What load_codes reads of a codebook of 2^BITS levels (levels: its float32 values), made once per program where
    HELD. For codes of at most 4 bits, the register lookups' byte tables: the low bytes of the fp16 levels 0-3, 4-7,
    8-11 and 12-15, then their high bytes, level 4w + i in byte i of int32 w (zeros past the levels). For wider codes,
    the fp16 levels themselves, which tl.gather reads. Else nothing is read."""
    if HELD and BITS <= 4:
        level = tl.arange(0, 16)
        bits = tl.load(levels + level, mask=level < (1 << BITS), other=0.0)
        bits = bits.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        shift = 8 * (level % 4)
        low, high = (bits & 0xFF) << shift, ((bits >> 8) & 0xFF) << shift
        word = level // 4  # the fields of a word are disjoint: their sum is their union
        return (tl.sum(tl.where(word == 0, low, 0), 0), tl.sum(tl.where(word == 1, low, 0), 0),
                tl.sum(tl.where(word == 2, low, 0), 0), tl.sum(tl.where(word == 3, low, 0), 0),
                tl.sum(tl.where(word == 0, high, 0), 0), tl.sum(tl.where(word == 1, high, 0), 0),
                tl.sum(tl.where(word == 2, high, 0), 0), tl.sum(tl.where(word == 3, high, 0), 0))
    elif HELD:
        return tl.load(levels + tl.arange(0, 1 << BITS)).to(tl.float16)
    else:
        return 0

@triton.jit
def float_bits_to_f16(code, BITS: tl.constexpr, MANTISSA: tl.constexpr):
    """fp16 values of a float format's codes (int32: sign, BITS - 1 - MANTISSA exponent bits of bias b =
    2^(that - 1) - 1, MANTISSA mantissa bits). Its exponent and mantissa fields, placed under fp16's (mantissa
    aligned at the top), read as 2^(e - 15) (1 + m / 2^M), or 2^-14 m / 2^M for e = 0; the format's value is
    2^(e - b) (1 + m / 2^M), or 2^(1 - b) m / 2^M: both are the fp16 reading times 2^(15 - b). That product is
    exact, as every value of these formats (at most 5 exponent bits) is an fp16 value."""
    MAGNITUDE: tl.constexpr = BITS - 1
    EXPONENT_BIAS: tl.constexpr = (1 << (MAGNITUDE - MANTISSA - 1)) - 1
    fields = ((code >> MAGNITUDE) << 15) | ((code & ((1 << MAGNITUDE) - 1)) << (10 - MANTISSA))
    half = fields.to(tl.uint16).to(tl.float16, bitcast=True)
    if EXPONENT_BIAS == 15:  # fp16's own exponent field (e5m2)
        return half
    rescale: tl.constexpr = float(1 << (15 - EXPONENT_BIAS))
    return half * tl.full([1, 1], rescale, tl.float16)

@triton.jit
def _load_indices(codes_ptr, tokens, valid, BITS: tl.constexpr, HALF: tl.constexpr):
    """Even and odd coordinates' unsigned codes of a (BLOCK, d) tile as int32 (kvq.quant.packing's little-end-first
    bit stream per row): 4-bit codes one byte load per coordinate pair, int8 one 16-bit load (the low byte the even
    coordinate), other widths whole words (_spanning_codes)."""
    pairs = tl.arange(0, HALF)
    row_bytes: tl.constexpr = HALF * BITS // 4
    if BITS == 4:
        byte = _nibble_bytes(codes_ptr, tokens, valid, HALF).to(tl.int32)
        return byte & 0xF, byte >> 4
    elif BITS == 8:
        words = codes_ptr.to(tl.pointer_type(tl.int16)) + tokens[:, None] * (row_bytes // 2) + pairs[None, :]
        word = tl.load(words, mask=valid[:, None], other=0).to(tl.int32)
        return word & 0xFF, (word >> 8) & 0xFF
    else:  # one chain of constant conditions, as in load_codes
        return _spanning_codes(codes_ptr, tokens, valid, BITS, HALF)

@triton.jit
def _spanning_codes(codes_ptr, tokens, valid, BITS: tl.constexpr, HALF: tl.constexpr):
    """Even and odd codes of 2, 3, 5, 6 and 7 bits: each run of 32 coordinates is BITS whole 32-bit words of the
    row, read as BITS loads of one word per run (rows are whole words: 2 HALF >= 32 coordinates), and each code is
    cut from the one or two words it lies in by shifts known when compiling. The runs' 16 even and 16 odd codes are
    then joined in order into (BLOCK, HALF) tiles."""
    RUNS: tl.constexpr = HALF // 16
    rows = codes_ptr.to(tl.pointer_type(tl.uint32)) + tokens[:, None] * (RUNS * BITS) + BITS * tl.arange(0, RUNS)
    words = (_word(rows, 0, valid, BITS), _word(rows, 1, valid, BITS), _word(rows, 2, valid, BITS),
             _word(rows, 3, valid, BITS), _word(rows, 4, valid, BITS), _word(rows, 5, valid, BITS),
             _word(rows, 6, valid, BITS))
    even, odd = _run_codes(words, 0, BITS), _run_codes(words, 1, BITS)
    return tl.reshape(even, (tokens.shape[0], HALF)), tl.reshape(odd, (tokens.shape[0], HALF))

@triton.jit
def _word(rows, K: tl.constexpr, valid, BITS: tl.constexpr):
    """Word K of each run, (BLOCK, RUNS) uint32; zeros past the run's BITS words (never read)."""
    if K < BITS:
        return tl.load(rows + K, mask=valid[:, None], other=0)
    else:
        return tl.zeros(rows.shape, tl.uint32)

@triton.jit
def _run_codes(words, FIRST: tl.constexpr, BITS: tl.constexpr):
    """Codes FIRST, FIRST + 2, ..., FIRST + 30 of each run, joined in order (_sixteen_in_order)."""
    return _sixteen_in_order(
        _code(words, FIRST, BITS), _code(words, FIRST + 2, BITS), _code(words, FIRST + 4, BITS),
        _code(words, FIRST + 6, BITS), _code(words, FIRST + 8, BITS), _code(words, FIRST + 10, BITS),
        _code(words, FIRST + 12, BITS), _code(words, FIRST + 14, BITS), _code(words, FIRST + 16, BITS),
        _code(words, FIRST + 18, BITS), _code(words, FIRST + 20, BITS), _code(words, FIRST + 22, BITS),
        _code(words, FIRST + 24, BITS), _code(words, FIRST + 26, BITS), _code(words, FIRST + 28, BITS),
        _code(words, FIRST + 30, BITS))

@triton.jit
def _code(words, J: tl.constexpr, BITS: tl.constexpr):
    """Code J of each run (bits BITS J .. BITS J + BITS - 1 of its words, low word first) as int32."""
    WORD: tl.constexpr = BITS * J // 32
    SHIFT: tl.constexpr = BITS * J % 32
    code = words[WORD] >> SHIFT
    if SHIFT + BITS > 32:
        code = code | (words[WORD + 1] << (32 - SHIFT))
    return (code & ((1 << BITS) - 1)).to(tl.int32)

@triton.jit
def _sixteen_in_order(c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    """16 (BLOCK, RUNS) tensors joined into (BLOCK, RUNS, 2, 2, 2, 2), tensor i at index i of the last four dims
    read as one: joining the evens' order with the odds' puts the last dim's index last."""
    return tl.join(_eight_in_order(c0, c2, c4, c6, c8, c10, c12, c14),
                   _eight_in_order(c1, c3, c5, c7, c9, c11, c13, c15))

@triton.jit
def _eight_in_order(c0, c1, c2, c3, c4, c5, c6, c7):
    return tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))

@triton.jit
def _nibbles(byte, CONVERSION: tl.constexpr, PINNED: tl.constexpr):
    return tl.inline_asm_elementwise(CONVERSION, "=r,=r,=r,=r,r", [byte], dtype=(tl.float16, tl.float16),
                                     is_pure=not PINNED, pack=4)
