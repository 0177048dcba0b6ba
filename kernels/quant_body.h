// Fused rotate + lambda + abs-max + pack (and its inverse): the one algorithm shared by the CUDA
// build (NVRTC) and the Metal build (torch.mps.compile_shader). SRFT paper Sec. 3.2 and 7.1.
//
// The including prelude defines the backend words: KVQ_DEVICE_FN, KVQ_GMEM (global address space),
// KVQ_SMEM (threadgroup/shared address space), KVQ_BARRIER(), kvq_rint (round half to even, as
// torch.round), kvq_cospi/kvq_sinpi, kvq_load_in/kvq_store_out (the input and output element types),
// KVQ_IN_T/KVQ_OUT_T. The caller defines the shape constants:
//   KVQ_D      head_dim (power of two, 8..512)
//   KVQ_GROUP  coordinates sharing one scale (KVQ_D for per-token), a power of two >= 2
//   KVQ_BITS   4 (two nibbles per byte, even coordinate in the low nibble) or 8 (one byte)
//   KVQ_ROT    0 identity, 1 SRHT, 2 SRFT
// Thread layout: KVQ_D / 2 threads per vector, thread j owning coordinates 2j and 2j+1;
// KVQ_VPB vectors per threadgroup. Every barrier is reached by all threads (inactive lanes of a
// partial last group only skip memory traffic), as Sec. 3.2 requires.

#define KVQ_HALF (KVQ_D / 2)
#define KVQ_QMAX ((1 << (KVQ_BITS - 1)) - 1)
#define KVQ_GROUPS (KVQ_D / KVQ_GROUP)
#define KVQ_CODE_BYTES (KVQ_D * KVQ_BITS / 8)
// Per threadgroup scratch, in floats: two FFT ping-pong buffers and the reduction lanes per vector,
// then one shared twiddle table (cos, sin of pi k / (D/2)).
#define KVQ_SMEM_FLOATS (KVQ_VPB * (2 * KVQ_D + KVQ_HALF) + KVQ_D)

KVQ_DEVICE_FN uint kvq_bit_reverse(uint value, uint bits) {
    uint out = 0;
    for (uint b = 0; b < bits; ++b) {
        out = (out << 1) | ((value >> b) & 1u);
    }
    return out;
}

KVQ_DEVICE_FN uint kvq_log2(uint value) {
    uint bits = 0;
    while ((1u << bits) < value) ++bits;
    return bits;
}

// twiddles[2k], twiddles[2k+1] = cos, sin of pi k / (D/2) for k < D/2: one cospi/sinpi per thread
// instead of one per butterfly. Stage m's angle pi k / m is entry k * (D/2) / m, the same float.
KVQ_DEVICE_FN void kvq_fill_twiddles(KVQ_SMEM float* twiddles, uint tid) {
    if (tid < KVQ_HALF) {
        twiddles[2 * tid] = kvq_cospi((float)tid / (float)KVQ_HALF);
        twiddles[2 * tid + 1] = kvq_sinpi((float)tid / (float)KVQ_HALF);
    }
}

// Radix-2 decimation-in-time FFT of length KVQ_HALF on (re, im) held at index j of `src`, after a
// bit-reversed load by the caller. sign = -1 forward, +1 inverse (unnormalized). Returns the buffer
// that holds the result (ping-pong between the two halves of the scratch).
KVQ_DEVICE_FN KVQ_SMEM float* kvq_fft(KVQ_SMEM float* src, KVQ_SMEM float* dst, KVQ_SMEM const float* twiddles,
                                      uint j, float sign) {
    for (uint m = 1; m < KVQ_HALF; m <<= 1) {
        KVQ_BARRIER();
        uint pos = j % (2 * m);
        uint k = pos % m;
        uint top = pos < m;
        uint i0 = j - pos + k;
        uint i1 = i0 + m;
        uint entry = k * (KVQ_HALF / m);
        float wr = twiddles[2 * entry];
        float wi = sign * twiddles[2 * entry + 1];
        float br = src[i1], bi = src[KVQ_HALF + i1];
        float tr = wr * br - wi * bi;
        float ti = wr * bi + wi * br;
        float ar = src[i0], ai = src[KVQ_HALF + i0];
        dst[j] = top ? ar + tr : ar - tr;
        dst[KVQ_HALF + j] = top ? ai + ti : ai - ti;
        KVQ_SMEM float* swap = src;
        src = dst;
        dst = swap;
    }
    KVQ_BARRIER();
    return src;
}

// In-place Sylvester Walsh-Hadamard transform of the KVQ_D values in `buf`, unnormalized.
KVQ_DEVICE_FN void kvq_fwht(KVQ_SMEM float* buf, uint j) {
    for (uint h = 1; h < KVQ_D; h <<= 1) {
        KVQ_BARRIER();
        uint i = (j / h) * 2 * h + (j % h);
        float u = buf[i], w = buf[i + h];
        KVQ_BARRIER();
        buf[i] = u + w;
        buf[i + h] = u - w;
    }
    KVQ_BARRIER();
}

// Forward rotation of (a, b) = signed coordinates (2j, 2j+1); leaves the rotated vector in y[0..D).
KVQ_DEVICE_FN void kvq_rotate_forward(float a, float b, KVQ_SMEM float* scratch, KVQ_SMEM float* y,
                                      KVQ_SMEM const float* twiddles, uint j) {
#if KVQ_ROT == 0
    y[2 * j] = a;
    y[2 * j + 1] = b;
    KVQ_BARRIER();
#elif KVQ_ROT == 1
    y[2 * j] = a;
    y[2 * j + 1] = b;
    kvq_fwht(y, j);
    float norm = kvq_rsqrt((float)KVQ_D);
    float u = y[2 * j] * norm, w = y[2 * j + 1] * norm;
    KVQ_BARRIER();
    y[2 * j] = u;
    y[2 * j + 1] = w;
    KVQ_BARRIER();
#else
    // z_t = x_{2t} + i x_{2t+1}; Z = FFT_{D/2}(z); Hermitian unpack to X_k (Eq. 1), pack (Eq. 2).
    uint r = kvq_bit_reverse(j, kvq_log2(KVQ_HALF));
    scratch[r] = a;
    scratch[KVQ_HALF + r] = b;
    KVQ_SMEM float* z = kvq_fft(scratch, y, twiddles, j, -1.0f);
    uint mirror = (KVQ_HALF - j) % KVQ_HALF;
    float zr = z[j], zi = z[KVQ_HALF + j];
    float cr = z[mirror], ci = -z[KVQ_HALF + mirror];  // conj(Z_{n-j})
    float er = 0.5f * (zr + cr), ei = 0.5f * (zi + ci);  // E_j
    float dr = zr - cr, di = zi - ci;                    // O_j = (Z_j - conj Z_{n-j}) / 2i
    float or_ = 0.5f * di, oi = -0.5f * dr;
    float wr = twiddles[2 * j], wi = -twiddles[2 * j + 1];
    float xr = er + wr * or_ - wi * oi;
    float xi = ei + wr * oi + wi * or_;
    float norm = kvq_rsqrt((float)KVQ_D);
    KVQ_BARRIER();
    if (j == 0) {
        y[0] = (er + or_) * norm;          // X_0 = E_0 + O_0, real
        y[KVQ_HALF] = (er - or_) * norm;   // X_{D/2} = E_0 - O_0, real
    } else {
        float packed_norm = norm * kvq_sqrt(2.0f);
        y[j] = xr * packed_norm;
        y[KVQ_HALF + j] = xi * packed_norm;
    }
    KVQ_BARRIER();
#endif
}

// Inverse rotation of the vector in y[0..D); returns the unsigned coordinates (2j, 2j+1).
KVQ_DEVICE_FN float2 kvq_rotate_inverse(KVQ_SMEM float* scratch, KVQ_SMEM float* y, KVQ_SMEM const float* twiddles,
                                        uint j) {
#if KVQ_ROT == 0
    return kvq_float2(y[2 * j], y[2 * j + 1]);
#elif KVQ_ROT == 1
    kvq_fwht(y, j);
    float norm = kvq_rsqrt((float)KVQ_D);
    return kvq_float2(y[2 * j] * norm, y[2 * j + 1] * norm);
#else
    // Unpack X_j and X_{n-j} (ortho scale; j = 0 pairs the real X_0 with the real X_{D/2}), then
    // rebuild Z_j = E_j + i O_j and run the inverse FFT of length D/2.
    float inv_sqrt2 = kvq_rsqrt(2.0f);
    float xr = y[0], xi = 0.0f, mr = y[KVQ_HALF], mi = 0.0f;
    if (j != 0) {
        uint mirror = KVQ_HALF - j;
        xr = y[j] * inv_sqrt2; xi = y[KVQ_HALF + j] * inv_sqrt2;
        mr = y[mirror] * inv_sqrt2; mi = y[KVQ_HALF + mirror] * inv_sqrt2;
    }
    // E_j = (X_j + conj X_{n-j}) / 2, O_j = (X_j - conj X_{n-j}) e^{+2 pi i j / D} / 2
    float er = 0.5f * (xr + mr), ei = 0.5f * (xi - mi);
    float dr = 0.5f * (xr - mr), di = 0.5f * (xi + mi);
    float wr = twiddles[2 * j], wi = twiddles[2 * j + 1];
    float or_ = wr * dr - wi * di, oi = wr * di + wi * dr;
    uint r = kvq_bit_reverse(j, kvq_log2(KVQ_HALF));
    KVQ_BARRIER();
    scratch[r] = er - oi;        // Z_j = E_j + i O_j
    scratch[KVQ_HALF + r] = ei + or_;
    KVQ_SMEM float* z = kvq_fft(scratch, y, twiddles, j, 1.0f);
    float norm = 2.0f * kvq_rsqrt((float)KVQ_D);
    return kvq_float2(z[j] * norm, z[KVQ_HALF + j] * norm);
#endif
}

KVQ_DEVICE_FN float kvq_lambda(KVQ_GMEM const float* lam, uint i) {
    return kvq_max(lam[i], 1e-6f);  // RotatedQuantizer's LAMBDA_FLOOR
}

// Where a thread works: its vector within the threadgroup, its coordinate pair j, that vector's
// scratch and the shared twiddle table (filled here; the caller's next barrier publishes it).
struct KvqSlot {
    uint local, j, vec, active;
    KVQ_SMEM float* scratch;
    KVQ_SMEM float* y;
    KVQ_SMEM float* twiddles;
};

KVQ_DEVICE_FN KvqSlot kvq_slot(uint tid, uint group_id, uint n, KVQ_SMEM float* smem) {
    KvqSlot slot;
    slot.local = tid / KVQ_HALF;
    slot.j = tid % KVQ_HALF;
    slot.vec = group_id * KVQ_VPB + slot.local;
    slot.active = slot.vec < n;
    slot.scratch = smem + slot.local * 2 * KVQ_D;
    slot.y = slot.scratch + KVQ_D;
    slot.twiddles = smem + KVQ_VPB * (2 * KVQ_D + KVQ_HALF);
    kvq_fill_twiddles(slot.twiddles, tid);
    return slot;
}

// One vector per KVQ_HALF threads: x (n, D) -> codes (n, KVQ_CODE_BYTES), scales (n, KVQ_GROUPS).
KVQ_DEVICE_FN void kvq_quantize_body(
    KVQ_GMEM const KVQ_IN_T* x, KVQ_GMEM const float* signs, KVQ_GMEM const float* lam, uint has_lam,
    KVQ_GMEM uchar* codes, KVQ_GMEM float* scales, uint n, uint tid, uint group_id, KVQ_SMEM float* smem) {
    KvqSlot slot = kvq_slot(tid, group_id, n, smem);
    uint j = slot.j, vec = slot.vec, active = slot.active;
    KVQ_SMEM float* scratch = slot.scratch;
    KVQ_SMEM float* y = slot.y;
    KVQ_SMEM float* twiddles = slot.twiddles;
    KVQ_SMEM float* lanes = smem + KVQ_VPB * 2 * KVQ_D + slot.local * KVQ_HALF;
    float a = 0.0f, b = 0.0f;
    if (active) {
        a = kvq_load_in(x, vec * KVQ_D + 2 * j) * signs[2 * j];
        b = kvq_load_in(x, vec * KVQ_D + 2 * j + 1) * signs[2 * j + 1];
    }
    KVQ_BARRIER();
    kvq_rotate_forward(a, b, scratch, y, twiddles, j);
    float v0 = y[2 * j], v1 = y[2 * j + 1];
    if (has_lam) {
        v0 *= kvq_lambda(lam, 2 * j);
        v1 *= kvq_lambda(lam, 2 * j + 1);
    }
    // Tree max over the KVQ_GROUP / 2 lanes of this thread's group.
    uint lane_in_group = j % (KVQ_GROUP / 2);
    lanes[j] = kvq_max(kvq_fabs(v0), kvq_fabs(v1));
    for (uint s = KVQ_GROUP / 4; s > 0; s >>= 1) {
        KVQ_BARRIER();
        if (lane_in_group < s) lanes[j] = kvq_max(lanes[j], lanes[j + s]);
    }
    KVQ_BARRIER();
    float amax = lanes[j - lane_in_group];
    float scale = amax > 0.0f ? amax / (float)KVQ_QMAX : 1.0f;
    int q0 = (int)kvq_clamp(kvq_rint(v0 / scale), -(float)KVQ_QMAX, (float)KVQ_QMAX);
    int q1 = (int)kvq_clamp(kvq_rint(v1 / scale), -(float)KVQ_QMAX, (float)KVQ_QMAX);
    if (active) {
        if (lane_in_group == 0) scales[vec * KVQ_GROUPS + (2 * j) / KVQ_GROUP] = scale;
#if KVQ_BITS == 4
        codes[vec * KVQ_CODE_BYTES + j] = (uchar)(((q1 & 0xF) << 4) | (q0 & 0xF));
#else
        codes[vec * KVQ_CODE_BYTES + 2 * j] = (uchar)(q0 & 0xFF);
        codes[vec * KVQ_CODE_BYTES + 2 * j + 1] = (uchar)(q1 & 0xFF);
#endif
    }
}

KVQ_DEVICE_FN int kvq_sign_extend(int code) {
    return (code ^ (1 << (KVQ_BITS - 1))) - (1 << (KVQ_BITS - 1));
}

// Inverse: codes, scales -> x (n, D) in the output type.
KVQ_DEVICE_FN void kvq_dequantize_body(
    KVQ_GMEM const uchar* codes, KVQ_GMEM const float* scales, KVQ_GMEM const float* signs,
    KVQ_GMEM const float* lam, uint has_lam, KVQ_GMEM KVQ_OUT_T* x, uint n, uint tid, uint group_id,
    KVQ_SMEM float* smem) {
    KvqSlot slot = kvq_slot(tid, group_id, n, smem);
    uint j = slot.j, vec = slot.vec, active = slot.active;
    KVQ_SMEM float* scratch = slot.scratch;
    KVQ_SMEM float* y = slot.y;
    KVQ_SMEM float* twiddles = slot.twiddles;
    float v0 = 0.0f, v1 = 0.0f;
    if (active) {
#if KVQ_BITS == 4
        int byte = codes[vec * KVQ_CODE_BYTES + j];
        int q0 = kvq_sign_extend(byte & 0xF), q1 = kvq_sign_extend(byte >> 4);
#else
        int q0 = kvq_sign_extend(codes[vec * KVQ_CODE_BYTES + 2 * j]);
        int q1 = kvq_sign_extend(codes[vec * KVQ_CODE_BYTES + 2 * j + 1]);
#endif
        float scale = scales[vec * KVQ_GROUPS + (2 * j) / KVQ_GROUP];
        v0 = (float)q0 * scale;
        v1 = (float)q1 * scale;
        if (has_lam) {
            v0 /= kvq_lambda(lam, 2 * j);
            v1 /= kvq_lambda(lam, 2 * j + 1);
        }
    }
    y[2 * j] = v0;
    y[2 * j + 1] = v1;
    KVQ_BARRIER();
    float2 out = kvq_rotate_inverse(scratch, y, twiddles, j);
    if (active) {
        kvq_store_out(x, vec * KVQ_D + 2 * j, out.x * signs[2 * j]);
        kvq_store_out(x, vec * KVQ_D + 2 * j + 1, out.y * signs[2 * j + 1]);
    }
}
