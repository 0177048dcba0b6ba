// Metal words for quant_body.h (compiled by torch.mps.compile_shader on MPS).
#include <metal_stdlib>
using namespace metal;
#define KVQ_DEVICE_FN inline
#define KVQ_GMEM device
#define KVQ_SMEM threadgroup
#define KVQ_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
// precise:: keeps IEEE results under Metal's default fast-math, so codes match the CUDA build.
#define kvq_rint(x) precise::rint(x)
#define kvq_cospi(x) precise::cospi(x)
#define kvq_sinpi(x) precise::sinpi(x)
#define kvq_sqrt(x) precise::sqrt(x)
#define kvq_rsqrt(x) (1.0f / precise::sqrt(x))
#define kvq_fabs(x) fabs(x)
#define kvq_max(a, b) max(a, b)
#define kvq_clamp(x, lo, hi) clamp(x, lo, hi)
#define kvq_float2(a, b) float2(a, b)

#if defined(KVQ_IN_FLOAT32)
#define KVQ_IN_T float
#elif defined(KVQ_IN_FLOAT16)
#define KVQ_IN_T half
#else
#define KVQ_IN_T bfloat
#endif
#define kvq_load_in(p, i) ((float)(p)[i])

#if defined(KVQ_OUT_FLOAT32)
#define KVQ_OUT_T float
#elif defined(KVQ_OUT_FLOAT16)
#define KVQ_OUT_T half
#else
#define KVQ_OUT_T bfloat
#endif
#define kvq_store_out(p, i, v) ((p)[i] = (KVQ_OUT_T)(v))
