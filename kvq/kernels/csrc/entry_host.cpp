// Host entry points: the GPU builds' one-thread-per-vector bodies, run over the vectors in a loop (rows
// and codes in place).
extern "C" void kvq_quantize(const float* x, const uint* sign_words, const float* lam, uint has_lam,
                             const float* midpoints, uchar* codes, KVQ_SCALE_T* scales, uint n) {
    for (uint vec = 0; vec < n; ++vec) {
        uint* code_words = (uint*)(codes + (kvq_index)vec * KVQ_CODE_BYTES);
        kvq_quantize_body((const uint4*)(x + (kvq_index)vec * KVQ_D), 0, sign_words, lam, has_lam, midpoints, code_words,
                          0, scales, vec);
    }
}

extern "C" void kvq_dequantize(const uchar* codes, const KVQ_SCALE_T* scales, const uint* sign_words,
                               const float* inverse_lam, uint has_lam, const float* levels, float* x, uint n) {
    for (uint vec = 0; vec < n; ++vec) {
        kvq_dequantize_body(codes, scales, sign_words, inverse_lam, has_lam, levels, (uint4*)(x + (kvq_index)vec * KVQ_D),
                            0, vec);
    }
}
