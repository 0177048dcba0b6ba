// Metal entry points: one thread per vector, as the CUDA build (rows and codes read and written in place).
// Scalars arrive as one-element uint32 buffers (compile_shader binds tensors by buffer index).
kernel void kvq_quantize(device const KVQ_IN_T* x [[buffer(0)]], device const uint* sign_words [[buffer(1)]],
                         device const float* lam [[buffer(2)]], device const uint* has_lam [[buffer(3)]],
                         device const float* midpoints [[buffer(4)]], device uchar* codes [[buffer(5)]],
                         device KVQ_SCALE_T* scales [[buffer(6)]], device const uint* n [[buffer(7)]],
                         uint vec [[thread_position_in_grid]]) {
    if (vec >= n[0]) return;
    device uint* code_words = (device uint*)(codes + (kvq_index)vec * KVQ_CODE_BYTES);
    device const uint4* row = (device const uint4*)(x + (kvq_index)vec * KVQ_D);
    kvq_quantize_body(row, 0, sign_words, lam, has_lam[0], midpoints, code_words, 0, scales, vec);
}

kernel void kvq_dequantize(device const uchar* codes [[buffer(0)]], device const KVQ_SCALE_T* scales [[buffer(1)]],
                           device const uint* sign_words [[buffer(2)]],
                           device const float* inverse_lam [[buffer(3)]],
                           device const uint* has_lam [[buffer(4)]], device const float* levels [[buffer(5)]],
                           device KVQ_OUT_T* x [[buffer(6)]], device const uint* n [[buffer(7)]],
                           uint vec [[thread_position_in_grid]]) {
    if (vec >= n[0]) return;
    device uint4* row = (device uint4*)(x + (kvq_index)vec * KVQ_D);
    kvq_dequantize_body(codes, scales, sign_words, inverse_lam, has_lam[0], levels, row, 0, vec);
}
