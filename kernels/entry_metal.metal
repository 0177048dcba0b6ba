// Metal entry points: threadgroups of KVQ_VPB * KVQ_D / 2 threads, as the CUDA build's blocks.
// Scalars arrive as one-element uint32 buffers (compile_shader binds tensors by buffer index).
kernel void kvq_quantize(device const KVQ_IN_T* x [[buffer(0)]], device const float* signs [[buffer(1)]],
                         device const float* lam [[buffer(2)]], device const uint* has_lam [[buffer(3)]],
                         device uchar* codes [[buffer(4)]], device float* scales [[buffer(5)]],
                         device const uint* n [[buffer(6)]], uint tid [[thread_position_in_threadgroup]],
                         uint group_id [[threadgroup_position_in_grid]]) {
    threadgroup float smem[KVQ_SMEM_FLOATS];
    kvq_quantize_body(x, signs, lam, has_lam[0], codes, scales, n[0], tid, group_id, smem);
}

kernel void kvq_dequantize(device const uchar* codes [[buffer(0)]], device const float* scales [[buffer(1)]],
                           device const float* signs [[buffer(2)]], device const float* lam [[buffer(3)]],
                           device const uint* has_lam [[buffer(4)]], device KVQ_OUT_T* x [[buffer(5)]],
                           device const uint* n [[buffer(6)]], uint tid [[thread_position_in_threadgroup]],
                           uint group_id [[threadgroup_position_in_grid]]) {
    threadgroup float smem[KVQ_SMEM_FLOATS];
    kvq_dequantize_body(codes, scales, signs, lam, has_lam[0], x, n[0], tid, group_id, smem);
}
