// CUDA entry points: one thread per vector, in blocks of KVQ_BLOCK threads.
//
// A thread's row and codes sit a whole row's stride from its neighbours', so touching them in place
// makes every warp-wide access hit 32 cache lines with a few bytes each, far below HBM bandwidth. Each warp
// instead moves its 32 rows between global and shared memory coalesced, item i of row r at
// r * ITEMS + (i ^ (r & SWIZZLE(ITEMS))) in shared memory so that neighbouring threads hit different banks.

#define KVQ_SWIZZLE(items, limit) ((items) < (limit) ? (items) - 1 : (limit) - 1)

// Each stages what fits: codes and output rows in 32 KB, input rows beside the codes in 40 KB (static
// shared memory stops at 48 KB).
// Codes stage as whole words that divide a warp or are whole warps (3-bit codes, 12 words at D = 128, do not).
#define KVQ_STAGE_CODES (KVQ_BLOCK * KVQ_CODE_BYTES <= 32768 && \
                         (KVQ_CODE_WORDS <= KVQ_WARP ? KVQ_WARP % KVQ_CODE_WORDS : KVQ_CODE_WORDS % KVQ_WARP) == 0)
#define KVQ_STAGE_ROWS (KVQ_STAGE_CODES && KVQ_BLOCK * (KVQ_CODE_BYTES + KVQ_IN_CHUNKS * 16) <= 40960)
#define KVQ_STAGE_OUT (KVQ_BLOCK * KVQ_OUT_CHUNKS * 16 <= 32768)

// A warp stages its own rows and waits on nothing wider than itself: it starts computing as soon as its
// rows land, while the block's other warps may still wait for theirs (block-wide staging between barriers
// would hold every warp to the slowest).
#define KVQ_WARP 32

// Coalesced copy of a warp's first `valid_rows` rows (of 32) of ITEMS items of T between global memory
// and its swizzled tile (into the tile when INTO_TILE), every load issued before the stores that wait on
// them. Pass i of ITEMS moves 32 items: with ITEMS <= 32, item lane % ITEMS of rows i + ITEMS * h
// (h = lane / ITEMS), whose swizzle bits (below ITEMS) are i's alone and fold to a constant per pass;
// with more, a 32-item slice of row i / (ITEMS / 32). (The rows of one pass sit ITEMS^2 items apart, on
// the same banks, so 32-bit items, the codes, copy with 2-way conflicts at 16 per row; adjacent rows
// would avoid them at the price of a per-pass XOR in every address.)
template <typename T, uint ITEMS, uint LIMIT, bool INTO_TILE, bool ALL_ROWS>
__device__ __forceinline__ void kvq_copy_some_rows(T* global, T* tile, uint valid_rows) {
    static_assert((ITEMS <= KVQ_WARP ? KVQ_WARP % ITEMS : ITEMS % KVQ_WARP) == 0,
                  "a staged row's items must divide the warp or be whole warps");
    uint lane = threadIdx.x % KVQ_WARP;
#pragma unroll
    for (uint i = 0; i < ITEMS; ++i) {
        uint r = ITEMS <= KVQ_WARP ? i + ITEMS * (lane / ITEMS) : i / (ITEMS / KVQ_WARP);
        uint item = ITEMS <= KVQ_WARP ? lane % ITEMS : (i % (ITEMS / KVQ_WARP)) * KVQ_WARP + lane;
        T* slot = tile + r * ITEMS + (item ^ (r & KVQ_SWIZZLE(ITEMS, LIMIT)));
        T* at = global + r * ITEMS + item;
        if (ALL_ROWS || r < valid_rows) {
            if (INTO_TILE) *slot = *at;
            else *at = *slot;
        }
    }
}

// A whole warp's rows copy without bounds checks: one predicate per item outnumbers the predicate
// registers, and saving and restoring them, with each swizzled address computed afresh, made the two
// copies a large share of the kernel's instructions.
template <typename T, uint ITEMS, uint LIMIT, bool INTO_TILE>
__device__ __forceinline__ void kvq_copy_rows(T* global, T* tile, uint valid_rows) {
    if (valid_rows >= KVQ_WARP) kvq_copy_some_rows<T, ITEMS, LIMIT, INTO_TILE, true>(global, tile, valid_rows);
    else kvq_copy_some_rows<T, ITEMS, LIMIT, INTO_TILE, false>(global, tile, valid_rows);
}

// Each warp, once its own rows are in shared memory, prefetches into L2 the rows of the warp `ahead` rows on
// (the host passes ~0.6 of the rows the SMs hold at once), which starts about when this one finishes: that
// warp then finds its rows in L2 instead of waiting on HBM, and HBM stays busy while the SMs compute.
// Without it the first wave's blocks all loaded, then all computed with HBM idle, and every later block
// waited on HBM before computing. The prefetch goes after the warp's own loads, which must not queue behind
// it. Builds that read rows in place (no staging) do not prefetch: unmeasured.
__device__ __forceinline__ void kvq_prefetch_rows(const KVQ_IN_T* x, uint first, uint ahead, uint n) {
    if (threadIdx.x % KVQ_WARP == 0 && ahead && first < n && ahead < n - first) {
        uint rows = min((uint)KVQ_WARP, n - first - ahead);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(x + (kvq_index)(first + ahead) * KVQ_D),
                     "r"(rows * KVQ_D * (uint)sizeof(KVQ_IN_T)) : "memory");
    }
}

// Twelve warps per SM at 168 registers: left alone, the staged build took 204 registers, for fewer warps.
extern "C" __global__ void __launch_bounds__(KVQ_BLOCK, 12 * KVQ_WARP / KVQ_BLOCK) kvq_quantize(
    const KVQ_IN_T* x, const uint* sign_words, const float* lam, uint has_lam, const float* midpoints, uchar* codes,
    KVQ_SCALE_T* scales, uint n, uint prefetch_ahead) {
    uint vec = blockIdx.x * KVQ_BLOCK + threadIdx.x;
#if KVQ_STAGE_CODES
    uint lane = threadIdx.x % KVQ_WARP;
    uint first = vec - lane;  // the warp's first row; its part of each tile starts at row first % KVQ_BLOCK
    // Codes as 32-bit words: a 16-way swizzle leaves at most two threads of a warp on one bank. Rows as
    // 16-byte chunks: an 8-way swizzle spreads the 8 threads of each 16-byte access phase over the banks.
    __shared__ uint block_tile[KVQ_BLOCK * KVQ_CODE_WORDS];
    uint* tile = block_tile + (first % KVQ_BLOCK) * KVQ_CODE_WORDS;
    uint valid = first < n ? n - first : 0;
#if KVQ_STAGE_ROWS
    __shared__ uint4 block_rows[KVQ_BLOCK * KVQ_IN_CHUNKS];
    uint4* rows = block_rows + (first % KVQ_BLOCK) * KVQ_IN_CHUNKS;
    kvq_copy_rows<uint4, KVQ_IN_CHUNKS, 8, true>((uint4*)(x + (kvq_index)first * KVQ_D), rows, valid);
    kvq_prefetch_rows(x, first, prefetch_ahead, n);
    __syncwarp();
    const uint4* row = rows + lane * KVQ_IN_CHUNKS;
    uint row_swizzle = lane & KVQ_SWIZZLE(KVQ_IN_CHUNKS, 8);
#else
    const uint4* row = (const uint4*)(x + (kvq_index)vec * KVQ_D);
    uint row_swizzle = 0;
#endif
    if (vec < n) {
        kvq_quantize_body(row, row_swizzle, sign_words, lam, has_lam, midpoints, tile + lane * KVQ_CODE_WORDS,
                          lane & KVQ_SWIZZLE(KVQ_CODE_WORDS, 16), scales, vec);
    }
    __syncwarp();
    kvq_copy_rows<uint, KVQ_CODE_WORDS, 16, false>((uint*)(codes + (kvq_index)first * KVQ_CODE_BYTES), tile, valid);
#else
    if (vec >= n) return;
    kvq_quantize_body((const uint4*)(x + (kvq_index)vec * KVQ_D), 0, sign_words, lam, has_lam, midpoints,
                      (uint*)(codes + (kvq_index)vec * KVQ_CODE_BYTES), 0, scales, vec);
#endif
}

extern "C" __global__ void __launch_bounds__(KVQ_BLOCK) kvq_dequantize(
    const uchar* codes, const KVQ_SCALE_T* scales, const uint* sign_words, const float* inverse_lam, uint has_lam,
    const float* levels, KVQ_OUT_T* x, uint n) {
    uint vec = blockIdx.x * KVQ_BLOCK + threadIdx.x, lane = threadIdx.x % KVQ_WARP, first = vec - lane;
#if KVQ_STAGE_OUT
    __shared__ uint4 block_tile[KVQ_BLOCK * KVQ_OUT_CHUNKS];
    uint4* tile = block_tile + (first % KVQ_BLOCK) * KVQ_OUT_CHUNKS;
    if (vec < n) {
        kvq_dequantize_body(codes, scales, sign_words, inverse_lam, has_lam, levels, tile + lane * KVQ_OUT_CHUNKS,
                            lane & KVQ_SWIZZLE(KVQ_OUT_CHUNKS, 8), vec);
    }
    __syncwarp();
    kvq_copy_rows<uint4, KVQ_OUT_CHUNKS, 8, false>((uint4*)(x + (kvq_index)first * KVQ_D), tile,
                                                   first < n ? n - first : 0);
#else
    if (vec >= n) return;
    kvq_dequantize_body(codes, scales, sign_words, inverse_lam, has_lam, levels, (uint4*)(x + (kvq_index)vec * KVQ_D),
                        0, vec);
#endif
}

// A static cache's write (kvq.ops.write_rows) of up to KVQ_WRITE_ROLES roles of one layout (its K and V), role
// blockIdx.y: row r = head * tokens + t of the role's (heads, tokens) new rows is quantized with the role's constants
// into position length[0] + t of its head's `capacity` rows of codes and stats, and, where it is among the last
// `window` of its head's new rows, copied exact into its head's ring of `window` rows at that position modulo
// `window`. The position is read on the device, so one launch sequence, captured once, writes every decode step. One
// thread per row, read in place: a decode step writes one row per head and role, far too few to stage, and the
// roles share one launch because each alone is latency, not bytes.
#define KVQ_WRITE_ROLES 2

// One role's rows and where they go (kvq.kernels.backends.WriteRole mirrors it).
struct kvq_write_role {
    const KVQ_IN_T* x;
    const uint* sign_words;
    const float* lam;
    const float* midpoints;
    uchar* codes;
    KVQ_SCALE_T* scales;
    KVQ_IN_T* ring;
    uint has_lam;
};

// kvq_write_rows' arguments as one __grid_constant__ parameter (kvq.kernels.backends.WriteArguments mirrors it).
struct kvq_write_args {
    kvq_write_role roles[KVQ_WRITE_ROLES];
    const long long* length;
    uint n, tokens, capacity, window;
};

extern "C" __global__ void __launch_bounds__(KVQ_BLOCK) kvq_write_rows(const __grid_constant__ kvq_write_args args) {
    // A decode attention's partial kernel may launch now and stream the packed rows beside this write, which writes
    // only rows past them and the ring; it awaits this kernel before it reads the ring or writes anything. A kernel
    // launched without the attribute still waits for this one to end.
    kvq_launch_dependents();
    const kvq_write_role& role = args.roles[blockIdx.y];
    uint vec = blockIdx.x * KVQ_BLOCK + threadIdx.x;
    if (vec >= args.n) return;
    uint head = vec / args.tokens, t = vec % args.tokens;
    kvq_index position = (kvq_index)args.length[0] + t;
    kvq_index slot = (kvq_index)head * args.capacity + position;
    const uint4* row = (const uint4*)(role.x + (kvq_index)vec * KVQ_D);
    kvq_quantize_body(row, 0, role.sign_words, role.lam, role.has_lam, role.midpoints,
                      (uint*)(role.codes + slot * KVQ_CODE_BYTES), 0, role.scales, (uint)slot);
    if (t + args.window >= args.tokens) {
        uint4* exact = (uint4*)(role.ring + ((kvq_index)head * args.window + position % args.window) * KVQ_D);
        KVQ_UNROLL for (uint c = 0; c < KVQ_IN_CHUNKS; ++c) exact[c] = row[c];
    }
}
