// Metal entry points: one thread per vector, as the CUDA build.
// Scalars arrive as one-element uint32 buffers (compile_shader binds tensors by buffer index).
kernel void kvq_quantize(device const KVQ_IN_T* x [[buffer(0)]], device const float* signs [[buffer(1)]],
                         device const float* lam [[buffer(2)]], device const uint* has_lam [[buffer(3)]],
                         device uchar* codes [[buffer(4)]], device float* scales [[buffer(5)]],
                         device const uint* n [[buffer(6)]], uint vec [[thread_position_in_grid]]) {
    kvq_quantize_body(x, signs, lam, has_lam[0], codes, scales, n[0], vec);
}

kernel void kvq_dequantize(device const uchar* codes [[buffer(0)]], device const float* scales [[buffer(1)]],
                           device const float* signs [[buffer(2)]], device const float* lam [[buffer(3)]],
                           device const uint* has_lam [[buffer(4)]], device KVQ_OUT_T* x [[buffer(5)]],
                           device const uint* n [[buffer(6)]], uint vec [[thread_position_in_grid]]) {
    kvq_dequantize_body(codes, scales, signs, lam, has_lam[0], x, n[0], vec);
}
