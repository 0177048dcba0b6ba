// CUDA entry points: one threadgroup (block) of KVQ_VPB * KVQ_D / 2 threads per KVQ_VPB vectors.
extern "C" __global__ void kvq_quantize(const KVQ_IN_T* x, const float* signs, const float* lam, uint has_lam,
                                        uchar* codes, float* scales, uint n) {
    __shared__ float smem[KVQ_SMEM_FLOATS];
    kvq_quantize_body(x, signs, lam, has_lam, codes, scales, n, threadIdx.x, blockIdx.x, smem);
}

extern "C" __global__ void kvq_dequantize(const uchar* codes, const float* scales, const float* signs,
                                          const float* lam, uint has_lam, KVQ_OUT_T* x, uint n) {
    __shared__ float smem[KVQ_SMEM_FLOATS];
    kvq_dequantize_body(codes, scales, signs, lam, has_lam, x, n, threadIdx.x, blockIdx.x, smem);
}
