// Host entry points: the GPU builds' one-thread-per-vector bodies, run over the vectors in a loop.
extern "C" void kvq_quantize(const float* x, const float* signs, const float* lam, uint has_lam, uchar* codes,
                             float* scales, uint n) {
    for (uint vec = 0; vec < n; ++vec) kvq_quantize_body(x, signs, lam, has_lam, codes, scales, n, vec);
}

extern "C" void kvq_dequantize(const uchar* codes, const float* scales, const float* signs, const float* lam,
                               uint has_lam, float* x, uint n) {
    for (uint vec = 0; vec < n; ++vec) kvq_dequantize_body(codes, scales, signs, lam, has_lam, x, n, vec);
}
