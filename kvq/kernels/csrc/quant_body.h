// Fused rotate + lambda + abs-max + pack (and its inverse), or TurboQuant_mse's norm + rotate + nearest level +
// pack: the one algorithm shared by the CUDA build (NVRTC), the Metal build (torch.mps.compile_shader) and the host
// build the tests run. SRFT paper Sec. 3.2 and 7.1; TurboQuant Alg. 1.
//
// One thread per vector, the whole vector in registers: every loop has compile-time bounds and is
// unrolled (KVQ_UNROLL), so every array index is a constant and no shared memory, barrier or
// shuffle is needed. (A threadgroup-per-vector version spent its time on barriers and index
// arithmetic: ~600 instructions per thread for 64 threads per d=128 vector.)
//
// The including prelude defines the backend words: KVQ_DEVICE_FN, KVQ_GMEM (global address space),
// KVQ_THREAD (private address space, for pointers to a thread's arrays), kvq_index (64-bit),
// KVQ_UNROLL, kvq_fma (fused, one rounding), kvq_sqrt, kvq_fabs, kvq_max, kvq_min, kvq_float_bits /
// kvq_bits_float (bit casts), uint4, and the element types' word access: KVQ_IN_T / KVQ_OUT_T,
// KVQ_IN_PER_WORD / KVQ_OUT_PER_WORD (elements per 32-bit word), kvq_in_element(word, e),
// kvq_out_word(values); and an IEEE half type for scales: kvq_half, kvq_to_half (round to nearest even,
// subnormals kept) and kvq_from_half.
// The caller defines the shape constants:
//   KVQ_D      head_dim (power of two, 8..512)
//   KVQ_GROUP  coordinates sharing one scale (KVQ_D for per-token), a power of two >= 2
//   KVQ_BITS   2, 3, 4 or 8: a row's codes as one bit stream, little-end first (4: two nibbles per byte, the even
//              coordinate's low; 3: codes span bytes and words)
//   KVQ_ROT    0 identity, 1 SRHT, 2 SRFT
//   KVQ_TWIDDLES  cos, sin of pi k / (D/2) for k < D/2, as float literals: constant indices into a
//                 constant table let the compiler fold them into the butterflies' instructions
//   KVQ_SCALE_HALF  1: scales are stored as fp16 (ScalarQuantizer's scale_dtype float16), 0: float32
//   KVQ_ASYM   1: unsigned codes c in 0..2^BITS - 1 decoding as c * scale + offset, a vector's offsets stored after
//              its scales (ScalarQuantizer's asymmetric codes); 0: two's-complement codes c decoding as c * scale
//   KVQ_CODEBOOK  1: TurboQuant_mse's codes instead (Alg. 1; BITS 2-4, GROUP D, fp16 scales, no lambda): each
//              coordinate of the rotated unit vector as the index of its nearest level, the vector's norm as its
//              one scale; KVQ_NORM_FLOOR the least norm a vector is divided by
// Host constants (16-byte aligned): sign_words, the rotation's signs as XOR masks over the 32-bit words
// of the input (quantize) or output (dequantize) element type: a sign flip is exact, so it costs one
// logic instruction per word instead of a load and a multiply per element; lam (D floats, read when
// has_lam): lambda floored at RotatedQuantizer's LAMBDA_FLOOR for quantize, its reciprocal for
// dequantize; for codebook builds, the codebook's 2^BITS - 1 midpoints (kvq.quant.codebooks.midpoints) for
// quantize, its 2^BITS ascending levels for dequantize.

#define KVQ_HALF (KVQ_D / 2)
#define KVQ_GROUPS (KVQ_D / KVQ_GROUP)
#if KVQ_ASYM
#define KVQ_QMAX ((1 << KVQ_BITS) - 1)
#define KVQ_STATS (2 * KVQ_GROUPS)  // a vector's scales, then its offsets
#else
#define KVQ_QMAX ((1 << (KVQ_BITS - 1)) - 1)
#define KVQ_STATS KVQ_GROUPS
#endif
#define KVQ_CODE_BYTES (KVQ_D * KVQ_BITS / 8)
#define KVQ_CODES_PER_WORD (32 / KVQ_BITS)
#define KVQ_TWIDDLE_TABLE const float twiddles[KVQ_D] = {KVQ_TWIDDLES}
// 1.5 * 2^23: v + this, for |v| < 2^22, rounds v half-to-even to an integer and leaves it, two's
// complement, in the low bits of the float's word (the ulp there is 1 and the sum stays above 2^23).
#define KVQ_ROUND_MAGIC 12582912.0f
#define KVQ_ROUND_MAGIC_BITS 0x4B400000u

#if KVQ_SCALE_HALF
#define KVQ_SCALE_T kvq_half
#define kvq_scale_value(stored) kvq_from_half(stored)
#else
#define KVQ_SCALE_T float
#define kvq_scale_value(stored) (stored)
#endif

// Stores `value` as a scale or offset is stored and returns what was stored: codes are computed from the
// stored statistics, as the reference's are (ScalarQuantizer._stored).
KVQ_DEVICE_FN float kvq_store_stat(KVQ_GMEM KVQ_SCALE_T* at, float value) {
#if KVQ_SCALE_HALF
    kvq_half stored = kvq_to_half(value);
    *at = stored;
    return kvq_from_half(stored);
#else
    *at = value;
    return value;
#endif
}

// The low bytes of four words, a's lowest.
KVQ_DEVICE_FN uint kvq_low_bytes(uint a, uint b, uint c, uint d) {
    return (a & 0xFFu) | ((b & 0xFFu) << 8) | ((c & 0xFFu) << 16) | (d << 24);
}

KVQ_DEVICE_FN uint kvq_bit_reverse(uint value) {
    uint out = 0;
    KVQ_UNROLL for (uint b = 1; b < KVQ_HALF; b <<= 1) {
        out = (out << 1) | (value & 1u);
        value >>= 1;
    }
    return out;
}

// w (re + i im) = factor (u + i v), factor the larger of Re w and Im w (in size) and u, v one fma each from
// the ratio of the two, so that a sum or difference with the product is one fma per part: a butterfly
// takes 6 instructions instead of 8. (With a constant w the ratio folds at compile time.)
struct kvq_factored {
    float factor, u, v;
};
KVQ_DEVICE_FN kvq_factored kvq_times_twiddle(float wr, float wi, float re, float im) {
    // by cos: w (re + i im) = wr ((re - t im) + i (im + t re)), t = wi / wr;
    // by sin: w (re + i im) = wi ((c re - im) + i (c im + re)), c = wr / wi.
    bool by_cos = kvq_fabs(wr) >= kvq_fabs(wi);
    float ratio = by_cos ? wi / wr : wr / wi;
    kvq_factored out;
    out.factor = by_cos ? wr : wi;
    out.u = by_cos ? kvq_fma(-ratio, im, re) : kvq_fma(ratio, re, -im);
    out.v = by_cos ? kvq_fma(ratio, re, im) : kvq_fma(ratio, im, re);
    return out;
}

// In-place radix-2 decimation-in-time FFT of length KVQ_HALF on re = y[0..HALF), im = y[HALF..D),
// held in bit-reversed order. sign = -1 forward, +1 inverse (unnormalized).
KVQ_DEVICE_FN void kvq_fft(KVQ_THREAD float* y, float sign) {
    KVQ_TWIDDLE_TABLE;
    KVQ_UNROLL for (uint m = 1; m < KVQ_HALF; m <<= 1) {
        KVQ_UNROLL for (uint k = 0; k < m; ++k) {
            uint entry = k * (KVQ_HALF / m);  // angle pi k / m
            float wr = twiddles[2 * entry];
            float wi = sign * twiddles[2 * entry + 1];
            KVQ_UNROLL for (uint i0 = k; i0 < KVQ_HALF; i0 += 2 * m) {
                uint i1 = i0 + m;
                float ar = y[i0], ai = y[KVQ_HALF + i0], br = y[i1], bi = y[KVQ_HALF + i1];
                // Angles 0 and pi/2 multiply by 1 and +-i exactly (cos pi/2 is not 0 in float, and
                // IEEE rules keep a compiler from dropping x * 0): about half the butterflies at d=128.
                if (entry == 0 || 2 * entry == KVQ_HALF) {
                    float tr = entry == 0 ? br : -sign * bi, ti = entry == 0 ? bi : sign * br;
                    y[i0] = ar + tr;
                    y[i1] = ar - tr;
                    y[KVQ_HALF + i0] = ai + ti;
                    y[KVQ_HALF + i1] = ai - ti;
                } else {  // other angles: b w = f (u + i v), each output one fma, a +- f u
                    kvq_factored bw = kvq_times_twiddle(wr, wi, br, bi);
                    y[i0] = kvq_fma(bw.factor, bw.u, ar);
                    y[i1] = kvq_fma(-bw.factor, bw.u, ar);
                    y[KVQ_HALF + i0] = kvq_fma(bw.factor, bw.v, ai);
                    y[KVQ_HALF + i1] = kvq_fma(-bw.factor, bw.v, ai);
                }
            }
        }
    }
}

// In-place orthonormal Sylvester Walsh-Hadamard transform of y[0..D).
KVQ_DEVICE_FN void kvq_fwht(KVQ_THREAD float* y) {
    KVQ_UNROLL for (uint h = 1; h < KVQ_D; h <<= 1) {
        KVQ_UNROLL for (uint i = 0; i < KVQ_D; ++i) {
            if ((i & h) == 0) {
                float u = y[i], w = y[i + h];
                y[i] = u + w;
                y[i + h] = u - w;
            }
        }
    }
    float norm = 1.0f / kvq_sqrt((float)KVQ_D);
    KVQ_UNROLL for (uint i = 0; i < KVQ_D; ++i) y[i] *= norm;
}

// The SRFT's constant factors (the spectrum packing's 1/2 and sqrt 2, the 1 / sqrt D norm) ride on the
// scales, one multiply per scale group, so that the packing spends one fma per output: R x =
// KVQ_ROTATION_NORM * kvq_rotate_forward(x) and R^T y = kvq_rotate_inverse(KVQ_ROTATION_NORM * y).
#define KVQ_ROTATION_NORM (KVQ_ROT == 2 ? 1.0f / kvq_sqrt(2.0f * KVQ_D) : 1.0f)

// Z = FFT(z) with z_t = x_{2t} + i x_{2t+1} sits in y (re | im); replace it by the Eq. 2 packing of
// X = DFT_D(x): y_0 = X_0, y_HALF = X_{D/2}, (y_j, y_{HALF+j}) = sqrt 2 (Re, Im) X_j, over sqrt D, all
// divided by KVQ_ROTATION_NORM = 1 / sqrt(2 D).
// X_j = E_j + e^{-2 pi i j / D} O_j with E_j = (Z_j + conj Z_{n-j}) / 2, O_j = (Z_j - conj Z_{n-j}) / 2i
// (Eq. 1). j and m = n - j share their sums: with Z_j = A + iB, Z_m = C + iD, (c, s) = cos, sin of
// pi j / n, P = c (B + D) - s (A - C) and Q = -s (B + D) - c (A - C),
//   X_j = ((A + C) + P + i ((B - D) + Q)) / 2,  X_m = ((A + C) - P + i (Q - (B - D))) / 2,
// whose 1/2 and sqrt 2 / sqrt D are KVQ_ROTATION_NORM's. P - i Q = (c + i s) ((B + D) + i (A - C)) is
// taken by kvq_times_twiddle, so that each output is one fma: 10 instructions per pair.
KVQ_DEVICE_FN void kvq_unpack_spectrum(KVQ_THREAD float* y) {
    KVQ_TWIDDLE_TABLE;
    float edge = kvq_sqrt(2.0f);  // 1 / sqrt D over KVQ_ROTATION_NORM
    float z0r = y[0], z0i = y[KVQ_HALF];
    y[0] = (z0r + z0i) * edge;         // X_0 = E_0 + O_0 = Re Z_0 + Im Z_0
    y[KVQ_HALF] = (z0r - z0i) * edge;  // X_{D/2} = E_0 - O_0
    KVQ_UNROLL for (uint j = 1; j <= KVQ_HALF / 2; ++j) {
        uint m = KVQ_HALF - j;
        float a = y[j], b = y[KVQ_HALF + j], c = y[m], d = y[KVQ_HALF + m];
        float cos_n = twiddles[2 * j], sin_n = twiddles[2 * j + 1];
        float sum_re = a + c, diff_im = b - d;
        float sum_im = b + d, diff_re = a - c;
        kvq_factored pq = kvq_times_twiddle(cos_n, sin_n, sum_im, diff_re);  // P = f u, Q = -f v
        y[j] = kvq_fma(pq.factor, pq.u, sum_re);
        y[KVQ_HALF + j] = kvq_fma(-pq.factor, pq.v, diff_im);
        y[m] = kvq_fma(-pq.factor, pq.u, sum_re);
        y[KVQ_HALF + m] = kvq_fma(-pq.factor, pq.v, -diff_im);
    }
}

// Inverse of kvq_unpack_spectrum: Eq. 2 packing -> Z_j = E_j + i O_j, the spectrum of z, all times
// 2 / sqrt D, the inverse's output norm (the input comes times KVQ_ROTATION_NORM, so kvq_rotate_inverse
// applies no norm).
KVQ_DEVICE_FN void kvq_repack_spectrum(KVQ_THREAD float* y) {
    KVQ_TWIDDLE_TABLE;
    float edge = kvq_sqrt(2.0f);
    float x0 = y[0], xh = y[KVQ_HALF];
    y[0] = edge * (x0 + xh);         // Z_0 = E_0 + i O_0 with E_0 = (X_0 + X_{D/2}) / 2,
    y[KVQ_HALF] = edge * (x0 - xh);  // O_0 = (X_0 - X_{D/2}) / 2
    KVQ_UNROLL for (uint j = 1; j <= KVQ_HALF / 2; ++j) {
        uint m = KVQ_HALF - j;
        float out[4];  // Re Z_j, Im Z_j, Re Z_m, Im Z_m
        KVQ_UNROLL for (uint side = 0; side < 2; ++side) {
            uint a = side == 0 ? j : m, b = side == 0 ? m : j;
            float xr = y[a], xi = y[KVQ_HALF + a], mr = y[b], mi = y[KVQ_HALF + b];
            // E = (X_a + conj X_b) / 2, O = (X_a - conj X_b) e^{+2 pi i a / D} / 2, over sqrt 2 (the packing's)
            float er = xr + mr, ei = xi - mi, dr = xr - mr, di = xi + mi;
            kvq_factored o = kvq_times_twiddle(twiddles[2 * a], twiddles[2 * a + 1], dr, di);  // O = w (dr + i di)
            out[2 * side] = kvq_fma(-o.factor, o.v, er);     // Re E - Im O
            out[2 * side + 1] = kvq_fma(o.factor, o.u, ei);  // Im E + Re O
        }
        y[j] = out[0];
        y[KVQ_HALF + j] = out[1];
        y[m] = out[2];
        y[KVQ_HALF + m] = out[3];
    }
}

// Moves (re | im) between natural and bit-reversed order (an involution: constant swaps).
KVQ_DEVICE_FN void kvq_bit_reverse_order(KVQ_THREAD float* y) {
    KVQ_UNROLL for (uint t = 0; t < KVQ_HALF; ++t) {
        uint r = kvq_bit_reverse(t);
        if (t < r) {
            float re = y[t], im = y[KVQ_HALF + t];
            y[t] = y[r];
            y[KVQ_HALF + t] = y[KVQ_HALF + r];
            y[r] = re;
            y[KVQ_HALF + r] = im;
        }
    }
}

// y holds the sign-flipped input; leaves R x / KVQ_ROTATION_NORM (the quantizer's rotated vector, unscaled).
KVQ_DEVICE_FN void kvq_rotate_forward(KVQ_THREAD float* y) {
#if KVQ_ROT == 1
    kvq_fwht(y);
#elif KVQ_ROT == 2
    // Deinterleave z_t = x_{2t} + i x_{2t+1} into (re | im), in bit-reversed order for the DIT FFT.
    float z[KVQ_D];
    KVQ_UNROLL for (uint t = 0; t < KVQ_HALF; ++t) {
        uint r = kvq_bit_reverse(t);
        z[r] = y[2 * t];
        z[KVQ_HALF + r] = y[2 * t + 1];
    }
    kvq_fft(z, -1.0f);
    kvq_unpack_spectrum(z);
    KVQ_UNROLL for (uint i = 0; i < KVQ_D; ++i) y[i] = z[i];
#endif
}

// y holds a rotated vector times KVQ_ROTATION_NORM; leaves R^T y (its signs still to be flipped).
KVQ_DEVICE_FN void kvq_rotate_inverse(KVQ_THREAD float* y) {
#if KVQ_ROT == 1
    kvq_fwht(y);
#elif KVQ_ROT == 2
    kvq_repack_spectrum(y);
    kvq_bit_reverse_order(y);
    kvq_fft(y, 1.0f);
    float z[KVQ_D];
    KVQ_UNROLL for (uint t = 0; t < KVQ_HALF; ++t) {
        z[2 * t] = y[t];
        z[2 * t + 1] = y[KVQ_HALF + t];
    }
    KVQ_UNROLL for (uint i = 0; i < KVQ_D; ++i) y[i] = z[i];
#endif
}

// y *= factors (D floats, 16-byte aligned), read as 16-byte chunks.
KVQ_DEVICE_FN void kvq_scale_by(KVQ_THREAD float* y, KVQ_GMEM const float* factors) {
    KVQ_GMEM const uint4* chunks = (KVQ_GMEM const uint4*)factors;
    KVQ_UNROLL for (uint c = 0; c < KVQ_D / 4; ++c) {
        uint4 chunk = chunks[c];
        y[4 * c] *= kvq_bits_float(chunk.x);
        y[4 * c + 1] *= kvq_bits_float(chunk.y);
        y[4 * c + 2] *= kvq_bits_float(chunk.z);
        y[4 * c + 3] *= kvq_bits_float(chunk.w);
    }
}

#define KVQ_IN_CHUNKS (KVQ_D / (4 * KVQ_IN_PER_WORD))    // 16-byte chunks of an input row
#define KVQ_OUT_CHUNKS (KVQ_D / (4 * KVQ_OUT_PER_WORD))  // and of an output row

#define KVQ_CODE_WORDS (KVQ_CODE_BYTES / 4)                // 32-bit words of a vector's codes
#define KVQ_CODE_MASK ((1u << KVQ_BITS) - 1u)

// Coordinate i's field of a row's bit stream held as 32-bit words: put into words zeroed beforehand, or got.
// A field may span two words (3-bit codes); with i a constant, so are the words and shifts.
KVQ_DEVICE_FN void kvq_put_code(KVQ_THREAD uint* words, uint i, uint code) {
    uint bit = i * KVQ_BITS, shift = bit % 32;
    words[bit / 32] |= code << shift;
    if (shift + KVQ_BITS > 32) words[bit / 32 + 1] |= code >> (32 - shift);
}

KVQ_DEVICE_FN uint kvq_get_code(KVQ_THREAD const uint* words, uint i) {
    uint bit = i * KVQ_BITS, shift = bit % 32;
    uint code = words[bit / 32] >> shift;
    if (shift + KVQ_BITS > 32) code |= words[bit / 32 + 1] << (32 - shift);
    return code & KVQ_CODE_MASK;
}

#if KVQ_CODEBOOK
#define KVQ_LEVEL_COUNT (1 << KVQ_BITS)

// The count of the ascending thresholds t (2^BITS - 1 of them) below x, by bisection: each comparison with the
// middle threshold of the range left gives one bit of the count, from the top, and keeps the half of the range
// on its side (selects over constant indices, so the range stays in registers).
KVQ_DEVICE_FN uint kvq_count_below(float x, KVQ_THREAD const float* t) {
    float range[KVQ_LEVEL_COUNT - 1];
    KVQ_UNROLL for (uint k = 0; k + 1 < KVQ_LEVEL_COUNT; ++k) range[k] = t[k];
    uint code = 0;
    KVQ_UNROLL for (uint level = 0; level < KVQ_BITS; ++level) {
        const uint middle = (KVQ_LEVEL_COUNT >> (level + 1)) - 1;
        bool above = x > range[middle];
        code = (code << 1) | (above ? 1u : 0u);
        KVQ_UNROLL for (uint k = 0; k < middle; ++k) range[k] = above ? range[middle + 1 + k] : range[k];
    }
    return code;
}

// TurboQuant_mse's encode (Alg. 1) of a sign-flipped vector y, as kvq.quant.codebooks.encode_unit_vector: its
// norm stored in fp16, then each coordinate of R (y / norm) coded as the count of the codebook's midpoints below
// it (its nearest level, as nearest_level counts), packed little-end first (a code may span two words). R y is
// compared with the midpoints times norm / KVQ_ROTATION_NORM, which counts the same midpoints (the norm and the
// rotation's scale are positive) with 2^BITS - 1 products per vector instead of a division per coordinate. The
// squares are summed in another order than torch's, which the fp16 rounding of the norm hides but within an fp16
// ulp of a rounding boundary; the rotation's arithmetic and the scaled comparison differ from torch's by ~1e-7 of
// the norm, so a code can differ from the reference's only for a coordinate that close to a midpoint (the tests
// count both).
KVQ_DEVICE_FN void kvq_quantize_codebook(KVQ_THREAD float* y, KVQ_GMEM const float* midpoints,
                                         KVQ_GMEM uint* code_words, uint code_swizzle, KVQ_GMEM kvq_half* norms,
                                         uint vec) {
    float squares = 0.0f;
    KVQ_UNROLL for (uint i = 0; i < KVQ_D; ++i) squares = kvq_fma(y[i], y[i], squares);
    kvq_half stored = kvq_to_half(kvq_sqrt(squares));
    norms[vec] = stored;
    float to_rotated = kvq_max(kvq_from_half(stored), KVQ_NORM_FLOOR) / KVQ_ROTATION_NORM;
    kvq_rotate_forward(y);
    float held[KVQ_LEVEL_COUNT - 1];
    KVQ_UNROLL for (uint k = 0; k + 1 < KVQ_LEVEL_COUNT; ++k) held[k] = midpoints[k] * to_rotated;
    uint words[KVQ_CODE_WORDS];
    KVQ_UNROLL for (uint w = 0; w < KVQ_CODE_WORDS; ++w) words[w] = 0;
    KVQ_UNROLL for (uint i = 0; i < KVQ_D; ++i) kvq_put_code(words, i, kvq_count_below(y[i], held));
    KVQ_UNROLL for (uint w = 0; w < KVQ_CODE_WORDS; ++w) code_words[w ^ code_swizzle] = words[w];
}

// The levels that vector `vec`'s codes index, times KVQ_ROTATION_NORM (what kvq_rotate_inverse takes), each picked
// by comparisons over the levels held in registers rather than by an index into memory.
KVQ_DEVICE_FN void kvq_codebook_levels(KVQ_GMEM const uchar* codes, KVQ_GMEM const float* levels,
                                       KVQ_THREAD float* y, uint vec) {
    KVQ_GMEM const uint* code_words = (KVQ_GMEM const uint*)(codes + (kvq_index)vec * KVQ_CODE_BYTES);
    uint words[KVQ_CODE_WORDS];
    KVQ_UNROLL for (uint w = 0; w < KVQ_CODE_WORDS; ++w) words[w] = code_words[w];
    float held[KVQ_LEVEL_COUNT];
    KVQ_UNROLL for (uint k = 0; k < KVQ_LEVEL_COUNT; ++k) held[k] = levels[k];
    KVQ_UNROLL for (uint i = 0; i < KVQ_D; ++i) {
        uint code = kvq_get_code(words, i);
        float level = held[0];
        KVQ_UNROLL for (uint k = 1; k < KVQ_LEVEL_COUNT; ++k) level = code == k ? held[k] : level;
        y[i] = level * KVQ_ROTATION_NORM;
    }
}
#endif

// Vector `vec`, its row given as 16-byte chunks with chunk c at row[c ^ row_swizzle], to scales
// (n, KVQ_GROUPS) and its KVQ_CODE_WORDS code words, word w written to code_words[w ^ code_swizzle].
// An entry may stage rows and codes in shared memory with bank-spreading swizzles and move them to and
// from global memory coalesced; swizzles of 0 read and write in order (rows in place must be 16-byte
// aligned: D * size >= 16).
KVQ_DEVICE_FN void kvq_quantize_body(
    KVQ_GMEM const uint4* row, uint row_swizzle, KVQ_GMEM const uint* sign_words, KVQ_GMEM const float* lam,
    uint has_lam, KVQ_GMEM const float* midpoints, KVQ_GMEM uint* code_words, uint code_swizzle,
    KVQ_GMEM KVQ_SCALE_T* scales, uint vec) {
    float y[KVQ_D];
    KVQ_GMEM const uint4* flips = (KVQ_GMEM const uint4*)sign_words;
    KVQ_UNROLL for (uint c = 0; c < KVQ_IN_CHUNKS; ++c) {
        uint4 chunk = row[c ^ row_swizzle], flip = flips[c];
        uint words[4] = {chunk.x ^ flip.x, chunk.y ^ flip.y, chunk.z ^ flip.z, chunk.w ^ flip.w};
        KVQ_UNROLL for (uint w = 0; w < 4; ++w) {
            KVQ_UNROLL for (uint e = 0; e < KVQ_IN_PER_WORD; ++e) {
                y[(4 * c + w) * KVQ_IN_PER_WORD + e] = kvq_in_element(words[w], e);
            }
        }
    }
#if KVQ_CODEBOOK
    kvq_quantize_codebook(y, midpoints, code_words, code_swizzle, scales, vec);
#else
    kvq_rotate_forward(y);
    if (has_lam) kvq_scale_by(y, lam);
    float inverse[KVQ_GROUPS];
#if KVQ_ASYM
    // Codes are (y - offset) / scale in the reference's units, y * (norm / scale) - offset / scale here, whose
    // rounding differs from the reference's division only at round-half ties (which the tests count).
    float shift[KVQ_GROUPS];
    KVQ_UNROLL for (uint g = 0; g < KVQ_GROUPS; ++g) {
        float lo = y[g * KVQ_GROUP], hi = lo;
        KVQ_UNROLL for (uint i = g * KVQ_GROUP + 1; i < (g + 1) * KVQ_GROUP; ++i) {
            lo = kvq_min(lo, y[i]);
            hi = kvq_max(hi, y[i]);
        }
        float span = hi - lo;
        KVQ_GMEM KVQ_SCALE_T* stats = scales + (kvq_index)vec * KVQ_STATS + g;
        float scale = kvq_store_stat(stats, span > 0.0f ? span / (float)KVQ_QMAX * KVQ_ROTATION_NORM : 1.0f);
        float offset = kvq_store_stat(stats + KVQ_GROUPS, lo * KVQ_ROTATION_NORM);
        inverse[g] = KVQ_ROTATION_NORM / scale;
        shift[g] = -offset / scale;
    }
    // The stored offset may round past the group's minimum or maximum: codes clamp to 0..QMAX as the
    // reference's do.
#define KVQ_ROUNDED(i) kvq_float_bits(kvq_min(kvq_max(kvq_fma(y[i], inverse[(i) / KVQ_GROUP], shift[(i) / KVQ_GROUP]), \
                                                      0.0f), (float)KVQ_QMAX) + KVQ_ROUND_MAGIC)
#else
    KVQ_UNROLL for (uint g = 0; g < KVQ_GROUPS; ++g) {
        float amax = 0.0f;
        KVQ_UNROLL for (uint i = g * KVQ_GROUP; i < (g + 1) * KVQ_GROUP; ++i) amax = kvq_max(amax, kvq_fabs(y[i]));
        float scale = amax > 0.0f ? amax / (float)KVQ_QMAX : 1.0f;  // in the unscaled rotation's units
        float norm = amax > 0.0f ? KVQ_ROTATION_NORM : 1.0f;
#if KVQ_SCALE_HALF
        // Codes divide by the scale as stored, as the reference's do (ScalarQuantizer._stored).
        kvq_half stored = kvq_to_half(scale * norm);
        scales[(kvq_index)vec * KVQ_GROUPS + g] = stored;
        inverse[g] = norm / kvq_from_half(stored);
#else
        scales[(kvq_index)vec * KVQ_GROUPS + g] = scale * norm;
        // One division per group: y * (1 / scale) is within an ulp of y / scale, so codes can differ from
        // the reference's only at round-half ties (which the tests count).
        inverse[g] = 1.0f / scale;
#endif
    }
    // No clamp: |y| <= amax keeps |y * inverse| within QMAX (1 + 3 ulp), which rounds to at most QMAX.
#define KVQ_ROUNDED(i) kvq_float_bits(kvq_fma(y[i], inverse[(i) / KVQ_GROUP], KVQ_ROUND_MAGIC))
#endif
    // A rounded word's low bits are its code, two's complement where signed.
#if KVQ_BITS == 4 || KVQ_BITS == 8
    // Codes pack by gathering low bytes (byte permutes on GPUs); int4 then merges the even and odd
    // coordinates' bytes as nibbles: about one instruction per code, where shifting and masking each took three.
    KVQ_UNROLL for (uint w = 0; w < KVQ_CODE_WORDS; ++w) {
        uint rounded[KVQ_CODES_PER_WORD];
        KVQ_UNROLL for (uint e = 0; e < KVQ_CODES_PER_WORD; ++e) rounded[e] = KVQ_ROUNDED(w * KVQ_CODES_PER_WORD + e);
#if KVQ_BITS == 4
        uint even = kvq_low_bytes(rounded[0], rounded[2], rounded[4], rounded[6]);
        uint odd = kvq_low_bytes(rounded[1], rounded[3], rounded[5], rounded[7]);
        code_words[w ^ code_swizzle] = (even & 0x0F0F0F0Fu) | ((odd << 4) & 0xF0F0F0F0u);
#else
        code_words[w ^ code_swizzle] = kvq_low_bytes(rounded[0], rounded[1], rounded[2], rounded[3]);
#endif
    }
#else
    uint words[KVQ_CODE_WORDS];
    KVQ_UNROLL for (uint w = 0; w < KVQ_CODE_WORDS; ++w) words[w] = 0;
    KVQ_UNROLL for (uint i = 0; i < KVQ_D; ++i) kvq_put_code(words, i, KVQ_ROUNDED(i) & KVQ_CODE_MASK);
    KVQ_UNROLL for (uint w = 0; w < KVQ_CODE_WORDS; ++w) code_words[w ^ code_swizzle] = words[w];
#endif
#undef KVQ_ROUNDED
#endif
}

// A code's exact value from its bits without an int-to-float conversion (a quarter-rate instruction on
// GPUs): an unsigned code placed under KVQ_ROUND_MAGIC's exponent is the float KVQ_ROUND_MAGIC + code; a
// two's-complement one gets there by flipping its sign bit, which gives code + 2^(BITS-1) >= 0.
KVQ_DEVICE_FN float kvq_code_value(uint code_bits) {
#if KVQ_ASYM
    return kvq_bits_float(KVQ_ROUND_MAGIC_BITS | code_bits) - KVQ_ROUND_MAGIC;
#else
    const uint bias = 1u << (KVQ_BITS - 1);
    return kvq_bits_float(KVQ_ROUND_MAGIC_BITS | (code_bits ^ bias)) - (KVQ_ROUND_MAGIC + (float)bias);
#endif
}

// Inverse: vector `vec` of codes, scales -> its row in the output type, written as 16-byte chunks,
// chunk c to row[c ^ swizzle].
KVQ_DEVICE_FN void kvq_dequantize_body(
    KVQ_GMEM const uchar* codes, KVQ_GMEM const KVQ_SCALE_T* scales, KVQ_GMEM const uint* sign_words,
    KVQ_GMEM const float* inverse_lam, uint has_lam, KVQ_GMEM const float* levels, KVQ_GMEM uint4* row, uint swizzle,
    uint vec) {
    float y[KVQ_D];
#if KVQ_CODEBOOK
    kvq_codebook_levels(codes, levels, y, vec);
    kvq_rotate_inverse(y);
    float norm = kvq_from_half(scales[vec]);  // TurboQuant_mse's decode: the rotated levels times the norm
    KVQ_UNROLL for (uint i = 0; i < KVQ_D; ++i) y[i] *= norm;
#else
    KVQ_GMEM const uint* code_words = (KVQ_GMEM const uint*)(codes + (kvq_index)vec * KVQ_CODE_BYTES);
    uint words[KVQ_CODE_WORDS];
    KVQ_UNROLL for (uint w = 0; w < KVQ_CODE_WORDS; ++w) words[w] = code_words[w];
    KVQ_UNROLL for (uint i = 0; i < KVQ_D; ++i) y[i] = kvq_code_value(kvq_get_code(words, i));
    KVQ_UNROLL for (uint g = 0; g < KVQ_GROUPS; ++g) {
        KVQ_GMEM const KVQ_SCALE_T* stats = scales + (kvq_index)vec * KVQ_STATS + g;
        float scale = kvq_scale_value(stats[0]) * KVQ_ROTATION_NORM;
#if KVQ_ASYM
        float offset = kvq_scale_value(stats[KVQ_GROUPS]) * KVQ_ROTATION_NORM;
        KVQ_UNROLL for (uint i = g * KVQ_GROUP; i < (g + 1) * KVQ_GROUP; ++i) y[i] = kvq_fma(y[i], scale, offset);
#else
        KVQ_UNROLL for (uint i = g * KVQ_GROUP; i < (g + 1) * KVQ_GROUP; ++i) y[i] *= scale;
#endif
    }
    if (has_lam) kvq_scale_by(y, inverse_lam);
    kvq_rotate_inverse(y);
#endif
    KVQ_GMEM const uint4* flips = (KVQ_GMEM const uint4*)sign_words;
    KVQ_UNROLL for (uint c = 0; c < KVQ_OUT_CHUNKS; ++c) {
        uint words[4];
        KVQ_UNROLL for (uint w = 0; w < 4; ++w) {
            float values[KVQ_OUT_PER_WORD];
            KVQ_UNROLL for (uint e = 0; e < KVQ_OUT_PER_WORD; ++e) values[e] = y[(4 * c + w) * KVQ_OUT_PER_WORD + e];
            words[w] = kvq_out_word(values);
        }
        uint4 flip = flips[c], chunk;
        chunk.x = words[0] ^ flip.x;
        chunk.y = words[1] ^ flip.y;
        chunk.z = words[2] ^ flip.z;
        chunk.w = words[3] ^ flip.w;
        row[c ^ swizzle] = chunk;
    }
}
