// Device primitives of the decode attention kernels (decode_attention.cu, which follows this file in the
// translation unit kvq.kernels.cuda_decode assembles): element conversions, PTX helpers, async copies and
// programmatic dependent launch. KVQ_ELEM_*, KVQ_SCALE_HALF and KVQ_OFFSETS come from the defines ahead of both.

typedef unsigned int uint;
typedef unsigned char uchar;
typedef unsigned short ushort;


#if defined(KVQ_ELEM_FLOAT32)
typedef float kvq_elem;
__device__ __forceinline__ float kvq_to_float(float x) { return x; }
__device__ __forceinline__ float kvq_from_float(float x) { return x; }
#elif defined(KVQ_ELEM_FLOAT16)
typedef ushort kvq_elem;
__device__ __forceinline__ float kvq_to_float(ushort x) {
    float out;
    asm("cvt.f32.f16 %0, %1;" : "=f"(out) : "h"(x));
    return out;
}
__device__ __forceinline__ ushort kvq_from_float(float x) {
    ushort out;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out) : "f"(x));
    return out;
}
#else
typedef ushort kvq_elem;
__device__ __forceinline__ float kvq_to_float(ushort x) { return __uint_as_float((uint)x << 16); }
__device__ __forceinline__ ushort kvq_from_float(float x) {
    ushort out;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out) : "f"(x));
    return out;
}
#endif

__device__ __forceinline__ uint kvq_prmt(uint a, uint b, uint selector) {
    uint out;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(selector));
    return out;
}

__device__ __forceinline__ uint kvq_half2(float low, float high) {
    uint out;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(high), "f"(low));
    return out;
}

// The two fp16 halves of a word as floats, the low one in x.
__device__ __forceinline__ float2 kvq_half2_floats(uint pair) {
    float low, high;
    asm("{ .reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
        : "=f"(low), "=f"(high) : "r"(pair));
    return make_float2(low, high);
}

__device__ __forceinline__ float kvq_half2_sum(uint pair) {
    float2 halves = kvq_half2_floats(pair);
    return halves.x + halves.y;
}

// Scale groups 2 (r / 4) and 2 (r / 4) + 1 of a token's row of scales in a stage (with KVQ_TOKEN_SCALE, its one
// scale for both).
__device__ __forceinline__ float2 kvq_scale_pair(const uchar* row, uint r) {
#if KVQ_TOKEN_SCALE
    float scale;
    asm("cvt.f32.f16 %0, %1;" : "=f"(scale) : "h"(*(const ushort*)row));
    return make_float2(scale, scale);
#elif KVQ_SCALE_HALF
    return kvq_half2_floats(*(const uint*)(row + 4 * (r / 4)));
#else
    return *(const float2*)(row + 8 * (r / 4));
#endif
}

__device__ __forceinline__ float kvq_exp2(float x) {
    float out;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(out) : "f"(x));
    return out;
}

// (lanes & mask) ^ bits in one instruction (written in C, it takes two: LOP3 holds one immediate).
__device__ __forceinline__ uint kvq_and_xor(uint lanes, uint mask, uint bits) {
    uint out;
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(out) : "r"(lanes), "r"(mask), "r"(bits));
    return out;
}

// Codes are two's complement (symmetric layouts) or, with KVQ_OFFSETS, unsigned (a layout with offsets). The low
// nibbles of two 16-bit lanes as fp16 1024 + (n ^ 8) = 1032 + n for a two's complement n, 1024 + n for an unsigned
// one; the high ones as 1024 + 16 (n ^ 8) = 1152 + 16 n, or 1024 + 16 n. A code byte likewise: 1024 + (n ^ 0x80) =
// 1152 + n, or 1024 + n. KVQ_*_BIAS are those biases, which the scores' accumulators start without.
#ifndef KVQ_OFFSETS
#define KVQ_OFFSETS 0
#endif
#if KVQ_OFFSETS
#define KVQ_LOW_BITS 0x64006400u
#define KVQ_HIGH_BITS 0x64006400u
#define KVQ_HIGH_UNBIAS 0xD400D400u  // -64
#define KVQ_BYTE_FLIP 0u
#define KVQ_LOW_BIAS 1024.0f
#define KVQ_HIGH_BIAS 1024.0f
#define KVQ_BYTE_BIAS 1024.0f
#else
#define KVQ_LOW_BITS 0x64086408u
#define KVQ_HIGH_BITS 0x64806480u
#define KVQ_HIGH_UNBIAS 0xD480D480u  // -72
#define KVQ_BYTE_FLIP 0x80808080u
#define KVQ_LOW_BIAS 1032.0f
#define KVQ_HIGH_BIAS 1152.0f
#define KVQ_BYTE_BIAS 1152.0f
#endif
__device__ __forceinline__ uint kvq_biased_low(uint lanes) { return kvq_and_xor(lanes, 0x000F000Fu, KVQ_LOW_BITS); }
__device__ __forceinline__ uint kvq_biased_high(uint lanes) { return kvq_and_xor(lanes, 0x00F000F0u, KVQ_HIGH_BITS); }

// The same as exact fp16 integers n.
__device__ __forceinline__ uint kvq_low_nibbles(uint lanes) {
    uint out;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(out) : "r"(kvq_biased_low(lanes)), "r"(KVQ_LOW_BITS));
    return out;
}
__device__ __forceinline__ uint kvq_high_nibbles(uint lanes) {
    uint out;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(kvq_biased_high(lanes)), "r"(0x2C002C00u),
        "r"(KVQ_HIGH_UNBIAS));
    return out;
}

// (a | b) & mask in one instruction, which the compiler otherwise splits into two or three.
__device__ __forceinline__ uint kvq_or_and(uint a, uint b, uint mask) {
    uint out;
    asm("lop3.b32 %0, %1, %2, %3, 0xa8;" : "=r"(out) : "r"(a), "r"(b), "r"(mask));
    return out;
}

// Narrow codes widened into words of nibbles (code i of the result in bits 4i .. 4i + 3), each step moving every
// other field up by its width: kvq_spread2 takes 8 2-bit codes (bits 0-15, or bits 16-31 where `upper`), kvq_spread3
// 8 3-bit ones (bits 0-23). kvq_spread2's first step is a byte permute; at its next two a field and the one moved
// onto its right meet zeros, so an OR and the mask are one instruction.
__device__ __forceinline__ uint kvq_spread2(uint codes, bool upper = false) {
    uint t = kvq_prmt(codes, 0u, upper ? 0x4342u : 0x4140u);  // the two bytes to bytes 0 and 2
    t = kvq_or_and(t, t << 4, 0x0F0F0F0Fu);
    return kvq_or_and(t, t << 2, 0x33333333u);
}
// kvq_spread3's steps move a field up by w bits as an add of (2^w - 1) times it (t - field + (field << w)), one
// multiply-add where a shift, a mask and an OR would take three.
__device__ __forceinline__ uint kvq_spread3(uint codes) {
    uint t = codes & 0xFFFFFFu;
    t += 15u * (codes & 0xFFF000u);  // the upper 12 bits up by 4: fields at bits 0-11 and 16-27
    t += 3u * (t & 0x0FC00FC0u);     // each field's upper 6 bits up by 2: one 6-bit field a byte
    return t + (t & 0x38383838u);    // each byte's upper 3 bits up by 1: one code a nibble
}
// A run of 32 codes (BITS words, code j at bits BITS j, low word first) as four words of nibbles.
__device__ __forceinline__ void kvq_widen2(uint low, uint high, uint (&words)[4]) {
    words[0] = kvq_spread2(low);
    words[1] = kvq_spread2(low, true);
    words[2] = kvq_spread2(high);
    words[3] = kvq_spread2(high, true);
}
__device__ __forceinline__ void kvq_widen3(uint first, uint second, uint third, uint (&words)[4]) {
    words[0] = kvq_spread3(first);
    words[1] = kvq_spread3(__funnelshift_r(first, second, 24));
    words[2] = kvq_spread3(__funnelshift_r(second, third, 16));
    words[3] = kvq_spread3(third >> 8);
}
// A 16-level codebook as byte tables (kvq_level_tables): the low bytes of fp16 levels 0-3, 4-7, 8-11, 12-15 in
// words 0-3, level 4w + i in byte i of word w, then their high bytes in words 4-7.
struct kvq_levels {
    uint word[8];
};

// Word `i` of the tables of the float32 `levels` (`count` of them, 4, 8 or 16; the tables' other bytes zero).
__device__ __forceinline__ uint kvq_level_table_word(const float* levels, uint count, uint i) {
    uint word = 0;
#pragma unroll
    for (uint k = 0; k < 4; ++k) {
        ushort half = 0;
        uint level = 4 * (i % 4) + k;
        if (level < count) asm("cvt.rn.f16.f32 %0, %1;" : "=h"(half) : "f"(__ldg(levels + level)));
        word |= ((i < 4 ? half : half >> 8) & 0xFFu) << (8 * k);
    }
    return word;
}

// Bytewise c ? b : a, c's bytes 0x00 or 0xFF.
__device__ __forceinline__ uint kvq_select_bytes(uint a, uint b, uint c) {
    uint out;
    asm("lop3.b32 %0, %1, %2, %3, 0xD8;" : "=r"(out) : "r"(a), "r"(b), "r"(c));
    return out;
}

// 8 codes (the nibbles of a word's 4 bytes) as fp16 levels, placed as kvq_biased_low and kvq_biased_high place
// them: the low nibbles of bytes 0, 1 in low[0], of bytes 2, 3 in low[1]; the high nibbles likewise in high[].
// The word's nibbles with bit 3 cleared are the selectors themselves: its low half picks the low and high bytes of
// the levels of bytes 0 and 1's four codes (low nibble, high nibble, low, high), from levels 0-7 and from 8-15, and
// its high half those of bytes 2 and 3's. Each code's bit 3 picks between the two (a byte mask from prmt's sign
// replication of the word and of the word shifted by a nibble), and two permutes interleave the bytes into fp16
// pairs, low nibbles' apart from high nibbles'.
// With `eight_levels` (codes below 8: 2- and 3-bit codes widened into nibbles) every bit 3 is clear, so the first
// tables hold every level and the selection between tables drops out: 8 instructions per 8 codes.
__device__ __forceinline__ void kvq_lookup_levels(const kvq_levels& t, uint codes, uint (&low)[2], uint (&high)[2],
                                                  bool eight_levels = false) {
    uint fields = eight_levels ? codes : codes & 0x77777777u;
    uint shifted = codes << 4;  // a low nibble's bit 3 at its byte's bit 7
#pragma unroll
    for (uint half = 0; half < 2; ++half) {
        uint selector = half ? fields >> 16 : fields;
        uint lows = kvq_prmt(t.word[0], t.word[1], selector), highs = kvq_prmt(t.word[4], t.word[5], selector);
        if (!eight_levels) {
            uint upper = kvq_prmt(shifted, codes, half ? 0xFBEA : 0xD9C8);  // 0xFF where the code's bit 3 is set
            lows = kvq_select_bytes(lows, kvq_prmt(t.word[2], t.word[3], selector), upper);
            highs = kvq_select_bytes(highs, kvq_prmt(t.word[6], t.word[7], selector), upper);
        }
        low[half] = kvq_prmt(lows, highs, 0x6240);
        high[half] = kvq_prmt(lows, highs, 0x7351);
    }
}

// d = a b + d, m16n8k16, fp16 operands, fp32 accumulators.
__device__ __forceinline__ void kvq_mma(float (&d)[4], uint a0, uint a1, uint a2, uint a3, uint b0, uint b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint kvq_shared_address(const void* pointer) {
    uint address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(pointer));
    return address;
}

// 16 bytes global -> shared, zero-filled past `bytes`.
__device__ __forceinline__ void kvq_copy16(uint shared, const void* global, uint bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared), "l"(global), "r"(bytes) : "memory");
}

// V's tile rows sit permuted, and their 16-byte chunks swizzled, so that each of the eight 32-bit reads of
// a step (tokens 2c + e (+ 8), one word per lane) hits 32 distinct banks.
__device__ __forceinline__ uint kvq_v_row(uint token) { return token ^ ((token >> 1) & 1u); }
__device__ __forceinline__ uint kvq_v_chunk(uint token, uint chunk) { return chunk ^ ((token >> 2) & 1u); }
