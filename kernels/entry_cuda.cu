// CUDA entry points: one thread per vector, in blocks of KVQ_BLOCK threads.
//
// A thread's codes (and, in dequantize, its output row) sit a whole row's stride from its neighbours',
// so writing them in place makes every warp-wide store touch 32 cache lines with a few bytes each (the
// identity rotation ran at 40% of HBM bandwidth, the inverse at 25%). The block instead gathers them in
// shared memory, item i of row r at r * ITEMS + (i ^ (r & SWIZZLE(ITEMS))) so that neighbouring threads
// hit different banks, and writes them out coalesced. Loads stay in place: staging them was slower.

#define KVQ_SWIZZLE(items, limit) ((items) < (limit) ? (items) - 1 : (limit) - 1)

// Coalesced copy of the block's valid rows of ITEMS words of T from tile (swizzled) to out.
template <typename T, uint ITEMS, uint LIMIT>
__device__ __forceinline__ void kvq_write_rows(const T* tile, T* out, uint valid_rows) {
#pragma unroll
    for (uint i = 0; i < ITEMS; ++i) {
        uint k = i * KVQ_BLOCK + threadIdx.x, r = k / ITEMS;
        if (r < valid_rows) out[k] = tile[r * ITEMS + ((k % ITEMS) ^ (r & KVQ_SWIZZLE(ITEMS, LIMIT)))];
    }
}

// Each gathers where the block's share fits in 32 KB of shared memory (static shared memory stops at 48).
#define KVQ_STAGE_CODES (KVQ_BLOCK * KVQ_CODE_BYTES <= 32768)
#define KVQ_STAGE_OUT (KVQ_BLOCK * KVQ_OUT_CHUNKS * 16 <= 32768)

extern "C" __global__ void kvq_quantize(const KVQ_IN_T* x, const uint* sign_words, const float* lam, uint has_lam,
                                        uchar* codes, float* scales, uint n) {
    uint first = blockIdx.x * KVQ_BLOCK, vec = first + threadIdx.x;
#if KVQ_STAGE_CODES
    // 32-bit words: a 16-way swizzle leaves at most two threads of a warp on one bank.
    __shared__ uint tile[KVQ_BLOCK * KVQ_CODE_WORDS];
    if (vec < n) {
        kvq_quantize_body(x, sign_words, lam, has_lam, tile + threadIdx.x * KVQ_CODE_WORDS,
                          threadIdx.x & KVQ_SWIZZLE(KVQ_CODE_WORDS, 16), scales, vec);
    }
    __syncthreads();
    kvq_write_rows<uint, KVQ_CODE_WORDS, 16>(tile, (uint*)(codes + (kvq_index)first * KVQ_CODE_BYTES),
                                             min(KVQ_BLOCK, n - first));
#else
    if (vec >= n) return;
    kvq_quantize_body(x, sign_words, lam, has_lam, (uint*)(codes + (kvq_index)vec * KVQ_CODE_BYTES), 0, scales, vec);
#endif
}

extern "C" __global__ void kvq_dequantize(const uchar* codes, const float* scales, const uint* sign_words,
                                          const float* inverse_lam, uint has_lam, KVQ_OUT_T* x, uint n) {
    uint first = blockIdx.x * KVQ_BLOCK, vec = first + threadIdx.x;
#if KVQ_STAGE_OUT
    // 16-byte chunks: an 8-way swizzle puts the 8 threads of each 16-byte access phase on distinct banks.
    __shared__ uint4 tile[KVQ_BLOCK * KVQ_OUT_CHUNKS];
    if (vec < n) {
        kvq_dequantize_body(codes, scales, sign_words, inverse_lam, has_lam, tile + threadIdx.x * KVQ_OUT_CHUNKS,
                            threadIdx.x & KVQ_SWIZZLE(KVQ_OUT_CHUNKS, 8), vec);
    }
    __syncthreads();
    kvq_write_rows<uint4, KVQ_OUT_CHUNKS, 8>(tile, (uint4*)(x + (kvq_index)first * KVQ_D), min(KVQ_BLOCK, n - first));
#else
    if (vec >= n) return;
    kvq_dequantize_body(codes, scales, sign_words, inverse_lam, has_lam, (uint4*)(x + (kvq_index)vec * KVQ_D), 0, vec);
#endif
}
