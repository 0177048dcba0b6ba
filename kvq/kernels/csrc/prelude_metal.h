// Metal words for quant_body.h (compiled by torch.mps.compile_shader on MPS).
#include <metal_stdlib>
using namespace metal;
#define KVQ_DEVICE_FN inline
#define KVQ_GMEM device
#define KVQ_THREAD thread
typedef ulong kvq_index;
#define KVQ_UNROLL _Pragma("unroll")
// precise:: keeps IEEE results under Metal's default fast-math, so codes match the CUDA build (fma is
// always fused, one rounding).
#define kvq_fma(a, b, c) fma(a, b, c)
#define kvq_float_bits(x) as_type<uint>(x)
#define kvq_bits_float(x) as_type<float>(x)
#define kvq_sqrt(x) precise::sqrt(x)
#define kvq_fabs(x) fabs(x)
#define kvq_max(a, b) max(a, b)
#define kvq_min(a, b) min(a, b)
// float -> half rounds to nearest even (Metal Shading Language spec, 2.7), as torch's .to(float16).
typedef half kvq_half;
#define kvq_to_half(x) ((half)(x))
#define kvq_from_half(h) ((float)(h))

#if defined(KVQ_IN_FLOAT32)
#define KVQ_IN_T float
#define KVQ_IN_PER_WORD 1
#define kvq_in_element(word, e) as_type<float>(word)
#elif defined(KVQ_IN_FLOAT16)
#define KVQ_IN_T half
#define KVQ_IN_PER_WORD 2
#define kvq_in_element(word, e) ((float)as_type<half2>(word)[e])
#else
#define KVQ_IN_T bfloat
#define KVQ_IN_PER_WORD 2
#define kvq_in_element(word, e) as_type<float>(((word) >> (16 * (e))) << 16)
#endif

#if defined(KVQ_OUT_FLOAT32)
#define KVQ_OUT_T float
#define KVQ_OUT_PER_WORD 1
#define kvq_out_word(v) as_type<uint>((v)[0])
#elif defined(KVQ_OUT_FLOAT16)
#define KVQ_OUT_T half
#define KVQ_OUT_PER_WORD 2
#define kvq_out_word(v) as_type<uint>(half2((half)(v)[0], (half)(v)[1]))
#else
#define KVQ_OUT_T bfloat
#define KVQ_OUT_PER_WORD 2
#define kvq_out_word(v) as_type<uint>(bfloat2((bfloat)(v)[0], (bfloat)(v)[1]))
#endif
