// CUDA words for quant_body.h (compiled by NVRTC through torch.cuda._compile_kernel; no headers).
typedef unsigned int uint;
typedef unsigned char uchar;
typedef unsigned short ushort;
#define KVQ_DEVICE_FN __device__ __forceinline__
#define KVQ_GMEM
#define KVQ_SMEM
#define KVQ_BARRIER() __syncthreads()
#define kvq_rint(x) rintf(x)
#define kvq_cospi(x) cospif(x)
#define kvq_sinpi(x) sinpif(x)
#define kvq_sqrt(x) sqrtf(x)
#define kvq_rsqrt(x) (1.0f / sqrtf(x))
#define kvq_fabs(x) fabsf(x)
#define kvq_max(a, b) fmaxf(a, b)
#define kvq_clamp(x, lo, hi) fminf(fmaxf(x, lo), hi)
#define kvq_float2(a, b) make_float2(a, b)

// Element types travel as their bit patterns: NVRTC has no cuda_fp16.h without an include path.
KVQ_DEVICE_FN float kvq_half_to_float(ushort bits) {
    float out;
    asm("cvt.f32.f16 %0, %1;" : "=f"(out) : "h"(bits));
    return out;
}
KVQ_DEVICE_FN ushort kvq_float_to_half(float value) {
    ushort out;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out) : "f"(value));
    return out;
}
KVQ_DEVICE_FN float kvq_bf16_to_float(ushort bits) { return __int_as_float(((int)bits) << 16); }
KVQ_DEVICE_FN ushort kvq_float_to_bf16(float value) {
    ushort out;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out) : "f"(value));
    return out;
}

#if defined(KVQ_IN_FLOAT32)
#define KVQ_IN_T float
#define kvq_load_in(p, i) ((p)[i])
#elif defined(KVQ_IN_FLOAT16)
#define KVQ_IN_T ushort
#define kvq_load_in(p, i) kvq_half_to_float((p)[i])
#else
#define KVQ_IN_T ushort
#define kvq_load_in(p, i) kvq_bf16_to_float((p)[i])
#endif

#if defined(KVQ_OUT_FLOAT32)
#define KVQ_OUT_T float
#define kvq_store_out(p, i, v) ((p)[i] = (v))
#elif defined(KVQ_OUT_FLOAT16)
#define KVQ_OUT_T ushort
#define kvq_store_out(p, i, v) ((p)[i] = kvq_float_to_half(v))
#else
#define KVQ_OUT_T ushort
#define kvq_store_out(p, i, v) ((p)[i] = kvq_float_to_bf16(v))
#endif
