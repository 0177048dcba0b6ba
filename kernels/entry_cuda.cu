// CUDA entry points: one thread per vector, in blocks of KVQ_BLOCK threads.
//
// A thread's row and codes sit a whole row's stride from its neighbours', so touching them in place
// makes every warp-wide access hit 32 cache lines with a few bytes each (the identity rotation ran at
// 41% of HBM bandwidth, the inverse at 26%). The block instead moves them between global and shared
// memory coalesced, item i of row r at r * ITEMS + (i ^ (r & SWIZZLE(ITEMS))) in shared memory so that
// neighbouring threads hit different banks (RESULTS.md items 13 and 15).

#define KVQ_SWIZZLE(items, limit) ((items) < (limit) ? (items) - 1 : (limit) - 1)

// Each stages what fits: codes and output rows in 32 KB, input rows beside the codes in 40 KB (static
// shared memory stops at 48 KB).
#define KVQ_STAGE_CODES (KVQ_BLOCK * KVQ_CODE_BYTES <= 32768)
#define KVQ_STAGE_ROWS (KVQ_STAGE_CODES && KVQ_BLOCK * (KVQ_CODE_BYTES + KVQ_IN_CHUNKS * 16) <= 40960)
#define KVQ_STAGE_OUT (KVQ_BLOCK * KVQ_OUT_CHUNKS * 16 <= 32768)

// Coalesced copy of the block's first `valid_rows` rows of ITEMS items of T between global memory and a
// swizzled tile (into the tile when INTO_TILE), every load issued before the stores that wait on them.
// Item k of the block's flat range is row k / ITEMS, item k % ITEMS; with ITEMS dividing KVQ_BLOCK a
// thread keeps its item and steps KVQ_BLOCK / ITEMS rows per pass, written so that the swizzle folds to
// a constant per pass.
template <typename T, uint ITEMS, uint LIMIT, bool INTO_TILE, bool ALL_ROWS>
__device__ __forceinline__ void kvq_copy_some_rows(T* global, T* tile, uint valid_rows) {
    static_assert(KVQ_BLOCK % ITEMS == 0, "a staged row's items must divide the block");
    uint first_row = threadIdx.x / ITEMS, item = threadIdx.x % ITEMS;
    T* own_global = global + threadIdx.x;
    T* first_row_tile = tile + first_row * ITEMS;
#pragma unroll
    for (uint i = 0; i < ITEMS; ++i) {
        uint r = first_row + i * (KVQ_BLOCK / ITEMS);
        T* slot = first_row_tile + i * KVQ_BLOCK + (item ^ (r & KVQ_SWIZZLE(ITEMS, LIMIT)));  // tile row r
        if (ALL_ROWS || r < valid_rows) {
            if (INTO_TILE) *slot = own_global[i * KVQ_BLOCK];
            else own_global[i * KVQ_BLOCK] = *slot;
        }
    }
}

// A whole block's rows copy without bounds checks: one predicate per item outnumbers the predicate
// registers, and saving and restoring them, with each swizzled address computed afresh, made the two
// copies ~400 of the kernel's 2960 SASS instructions (RESULTS.md item 23).
template <typename T, uint ITEMS, uint LIMIT, bool INTO_TILE>
__device__ __forceinline__ void kvq_copy_rows(T* global, T* tile, uint valid_rows) {
    if (valid_rows == KVQ_BLOCK) kvq_copy_some_rows<T, ITEMS, LIMIT, INTO_TILE, true>(global, tile, valid_rows);
    else kvq_copy_some_rows<T, ITEMS, LIMIT, INTO_TILE, false>(global, tile, valid_rows);
}

// Three blocks per SM: left alone, the staged build takes 204 registers and fits two.
extern "C" __global__ void __launch_bounds__(KVQ_BLOCK, 3) kvq_quantize(
    const KVQ_IN_T* x, const uint* sign_words, const float* lam, uint has_lam, uchar* codes, float* scales, uint n) {
    uint first = blockIdx.x * KVQ_BLOCK, vec = first + threadIdx.x;
#if KVQ_STAGE_CODES
    // Codes as 32-bit words: a 16-way swizzle leaves at most two threads of a warp on one bank. Rows as
    // 16-byte chunks: an 8-way swizzle spreads the 8 threads of each 16-byte access phase over the banks.
    __shared__ uint tile[KVQ_BLOCK * KVQ_CODE_WORDS];
    uint valid = min(KVQ_BLOCK, n - first);
#if KVQ_STAGE_ROWS
    __shared__ uint4 rows[KVQ_BLOCK * KVQ_IN_CHUNKS];
    kvq_copy_rows<uint4, KVQ_IN_CHUNKS, 8, true>((uint4*)(x + (kvq_index)first * KVQ_D), rows, valid);
    __syncthreads();
    const uint4* row = rows + threadIdx.x * KVQ_IN_CHUNKS;
    uint row_swizzle = threadIdx.x & KVQ_SWIZZLE(KVQ_IN_CHUNKS, 8);
#else
    const uint4* row = (const uint4*)(x + (kvq_index)vec * KVQ_D);
    uint row_swizzle = 0;
#endif
    if (vec < n) {
        kvq_quantize_body(row, row_swizzle, sign_words, lam, has_lam, tile + threadIdx.x * KVQ_CODE_WORDS,
                          threadIdx.x & KVQ_SWIZZLE(KVQ_CODE_WORDS, 16), scales, vec);
    }
    __syncthreads();
    kvq_copy_rows<uint, KVQ_CODE_WORDS, 16, false>((uint*)(codes + (kvq_index)first * KVQ_CODE_BYTES), tile, valid);
#else
    if (vec >= n) return;
    kvq_quantize_body((const uint4*)(x + (kvq_index)vec * KVQ_D), 0, sign_words, lam, has_lam,
                      (uint*)(codes + (kvq_index)vec * KVQ_CODE_BYTES), 0, scales, vec);
#endif
}

extern "C" __global__ void kvq_dequantize(const uchar* codes, const float* scales, const uint* sign_words,
                                          const float* inverse_lam, uint has_lam, KVQ_OUT_T* x, uint n) {
    uint first = blockIdx.x * KVQ_BLOCK, vec = first + threadIdx.x;
#if KVQ_STAGE_OUT
    __shared__ uint4 tile[KVQ_BLOCK * KVQ_OUT_CHUNKS];
    if (vec < n) {
        kvq_dequantize_body(codes, scales, sign_words, inverse_lam, has_lam, tile + threadIdx.x * KVQ_OUT_CHUNKS,
                            threadIdx.x & KVQ_SWIZZLE(KVQ_OUT_CHUNKS, 8), vec);
    }
    __syncthreads();
    kvq_copy_rows<uint4, KVQ_OUT_CHUNKS, 8, false>((uint4*)(x + (kvq_index)first * KVQ_D), tile, min(KVQ_BLOCK, n - first));
#else
    if (vec >= n) return;
    kvq_dequantize_body(codes, scales, sign_words, inverse_lam, has_lam, (uint4*)(x + (kvq_index)vec * KVQ_D), 0, vec);
#endif
}
