// CUDA entry points: one thread per vector, in blocks of KVQ_BLOCK threads.
extern "C" __global__ void kvq_quantize(const KVQ_IN_T* x, const float* signs, const float* lam, uint has_lam,
                                        uchar* codes, float* scales, uint n) {
    kvq_quantize_body(x, signs, lam, has_lam, codes, scales, n, blockIdx.x * KVQ_BLOCK + threadIdx.x);
}

extern "C" __global__ void kvq_dequantize(const uchar* codes, const float* scales, const float* signs,
                                          const float* lam, uint has_lam, KVQ_OUT_T* x, uint n) {
    kvq_dequantize_body(codes, scales, signs, lam, has_lam, x, n, blockIdx.x * KVQ_BLOCK + threadIdx.x);
}
