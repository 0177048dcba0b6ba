// CUDA words for quant_body.h (compiled by NVRTC through torch.cuda._compile_kernel; no headers).
typedef unsigned int uint;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned long long kvq_index;
#define KVQ_DEVICE_FN __device__ __forceinline__
#define KVQ_GMEM
#define KVQ_THREAD
#define KVQ_UNROLL _Pragma("unroll")
#define kvq_fma(a, b, c) fmaf(a, b, c)
#define kvq_float_bits(x) __float_as_uint(x)
#define kvq_bits_float(x) __uint_as_float(x)
#define kvq_sqrt(x) sqrtf(x)
#define kvq_fabs(x) fabsf(x)
#define kvq_max(a, b) fmaxf(a, b)
#define kvq_min(a, b) fminf(a, b)

// Element types travel as their bit patterns: NVRTC has no cuda_fp16.h without an include path.
KVQ_DEVICE_FN float kvq_half_to_float(ushort bits) {
    float out;
    asm("cvt.f32.f16 %0, %1;" : "=f"(out) : "h"(bits));
    return out;
}
KVQ_DEVICE_FN uint kvq_float_to_half(float value) {
    ushort out;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out) : "f"(value));
    return out;
}
typedef ushort kvq_half;
#define kvq_to_half(x) ((kvq_half)kvq_float_to_half(x))
#define kvq_from_half(h) kvq_half_to_float(h)
KVQ_DEVICE_FN uint kvq_float_to_bf16(float value) {
    ushort out;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out) : "f"(value));
    return out;
}

#if defined(KVQ_IN_FLOAT32)
#define KVQ_IN_T float
#define KVQ_IN_PER_WORD 1
#define kvq_in_element(word, e) __uint_as_float(word)
#elif defined(KVQ_IN_FLOAT16)
#define KVQ_IN_T ushort
#define KVQ_IN_PER_WORD 2
#define kvq_in_element(word, e) kvq_half_to_float((ushort)((word) >> (16 * (e))))
#else
#define KVQ_IN_T ushort
#define KVQ_IN_PER_WORD 2
#define kvq_in_element(word, e) __uint_as_float(((word) >> (16 * (e))) << 16)
#endif

#if defined(KVQ_OUT_FLOAT32)
#define KVQ_OUT_T float
#define KVQ_OUT_PER_WORD 1
#define kvq_out_word(v) __float_as_uint((v)[0])
#elif defined(KVQ_OUT_FLOAT16)
#define KVQ_OUT_T ushort
#define KVQ_OUT_PER_WORD 2
#define kvq_out_word(v) (kvq_float_to_half((v)[0]) | (kvq_float_to_half((v)[1]) << 16))
#else
#define KVQ_OUT_T ushort
#define KVQ_OUT_PER_WORD 2
#define kvq_out_word(v) (kvq_float_to_bf16((v)[0]) | (kvq_float_to_bf16((v)[1]) << 16))
#endif
