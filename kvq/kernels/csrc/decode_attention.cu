// Split-K partials of fused decode attention (kvq.kernels.decode_attention) for head_dim 128, 2-, 3-, 4- or 8-bit K
// (KVQ_KEY_BITS) and 2-4-bit V (KVQ_VALUE_BITS) with scale groups of 32 (or codebook codes, KVQ_CODEBOOK, below), and
// up to 4 query heads per KV head: Open-TQ-Metal Alg. 1 with
// FlashDecoding's split-K, in tensor-core fragments chosen so that packed codes become mma operands in
// registers, with no layout change through shared memory (Triton's layouts rebuild V's and the query's
// operands through shared memory and register moves on every tile).
//
// Each program is KVQ_WARPS warps on one (batch, KV head) and one split of the packed tokens. It maps its query
// heads into the codes' domain itself (kvq_map_query), so no map kernel runs before it, at the price of every
// program reading the 32 KB map. Its warps
// take 16-token tiles in turn, each streaming its own tiles through a private cp.async ring, and merge
// their partial softmaxes at the end. The last split takes the residual window (exact rows) instead.
//
// Scores, S = Q K^T (mma m16n8k16, tokens as N): the 16 query rows are (head, scale group) pairs, row r
// of the lane group r being head r % 4, group 2 (r / 4), row r + 8 the next group, each holding its group's
// coordinates only, so one product gives every group's share of q . k and each share meets its token's
// scale in float32. Lane (r, c) holds K's B fragment of token r: k indices 2c, 2c+1, 2c+8, 2c+9 of each
// 16-wide chunk, which are this lane's 16 code bytes of group c (one 16-byte load), converted nibble pair
// by nibble pair; the query's fragments are permuted to the same coordinates once per program.
// Codes enter biased (1032 + n low, 1152 + 16 n high, the high ones' query coordinates divided by 16) and
// the accumulator starts at minus the query's product with the biases. Int8 keys: the lane's 32 code bytes of
// group c (two 16-byte loads) enter byte by byte as fp16 1024 + (n ^ 0x80) = 1152 + n, each word's four bytes
// (coordinates 4w .. 4w + 3) two k-pairs of one mma, the query in the codes' own order.
//
// Output, O^T = V^T P^T (dims as M): the score fragments are exactly P^T's B fragments (lane (r, c): head
// r % 4, tokens 2c, 2c+1, 2c+8, 2c+9), columns 0-3 the heads under one V scale group, 4-7 under another,
// the probabilities times that group's scales. V's A fragments pair tokens: one two-source byte permute
// puts the same code byte of two tokens side by side, so nibbles convert straight into operands. Lane
// (r, c) keeps the products whose dims lie in its columns' group (r / 4 == c / 2), half its accumulators.
//
// Scores are in log2 units (the query carries scale * log2 e); maxima leave in natural units, as the
// reduce kernel reads them.
//
// Scales are float32, or fp16 with KVQ_SCALE_HALF 1 (ScalarQuantizer's scale_dtype float16): 16 or 8 bytes per
// token and role. With KVQ_OFFSETS 1, K and V are both a layout with offsets: unsigned codes c decoding as
// c s + z, each token's row of stats its four scales, then its four offsets. A key's score gains z times the
// query's sum over the group (its scaled rows' sums, taken once per program); a value group's z meets the
// probabilities in a running sum per (head, group), kept beside the softmax's and added to each of the group's
// coordinates when the warps merge.
//
// With KVQ_KEY_CHANNELS G (KIVI's keys, with KVQ_OFFSETS 1 and int4 keys), keys carry a scale s_i and an offset z_i
// per channel i over each group of G tokens instead of stats per token: q . k = sum_i (q_i s_i) c_i + sum_i q_i z_i.
// A stage holds its tile's group's channel stats (every tile lies in one group, as G is a multiple of the tile). Each
// warp takes tiles two at a time, and at the first tile of a group folds the group's scales into the query's
// fragments and its offsets into the rows' starting scores; a token's share of the score then meets no scale of its
// own.
//
// Codes narrower than 4 bits (KVQ_KEY_BITS, KVQ_VALUE_BITS 2 or 3: KIVI-2's, TurboQuant_mse-3's) are unsigned, with
// offsets or as codebook indices. A stage holds a tile's rows as they are packed (each run of 32 coordinates BITS
// whole words, code j at bits BITS j of them, as kvq.quant.packing.pack writes them), copied 16 bytes a lane in order;
// a lane widens the codes it reads into words of nibbles, as int4 rows hold them (kvq_widen2, kvq_widen3), and they
// go on as int4 codes do: fewer bytes from memory, the same fragments.
//
// With KVQ_CODEBOOK 1 (TurboQuant_mse's codes, llama.cpp's iq4_nl), K's and V's 2-4-bit codes index a 16-level table
// each (the roles' float32 levels, made fp16 byte tables once per program in shared memory, key_levels and
// value_levels): byte permutes look up 8 codes' levels at a time in registers (kvq_lookup_levels), the low nibbles'
// and the high nibbles' as the int4 conversion places them, exact, so no bias and no division of the query. With
// KVQ_TOKEN_SCALE 1 a token's one fp16 stat (TurboQuant's norm) scales all four of its groups; its stage holds the
// tile's 16 stats per role, copied 8 at a time.

#define KVQ_D 128
#ifndef KVQ_KEY_BITS
#define KVQ_KEY_BITS 4
#endif
#ifndef KVQ_VALUE_BITS
#define KVQ_VALUE_BITS 4
#endif
#define KVQ_KEY_ROW_BYTES (KVQ_D * KVQ_KEY_BITS / 8)
#define KVQ_VALUE_ROW_BYTES (KVQ_D * KVQ_VALUE_BITS / 8)
#define KVQ_GROUPS 4                      // scale groups of 32 coordinates
#ifndef KVQ_CODEBOOK
#define KVQ_CODEBOOK 0
#endif
#ifndef KVQ_TOKEN_SCALE
#define KVQ_TOKEN_SCALE 0
#endif
#if KVQ_TOKEN_SCALE
#define KVQ_STATS 1                       // one scale per token and role
#else
#define KVQ_STATS (KVQ_GROUPS * (1 + KVQ_OFFSETS))  // stats per token and role: scales, then any offsets
#endif
#ifndef KVQ_KEY_CHANNELS
#define KVQ_KEY_CHANNELS 0
#endif
#if KVQ_CODEBOOK && (KVQ_KEY_BITS > 4 || KVQ_OFFSETS || KVQ_KEY_CHANNELS)
#error "codebook codes are 2-4-bit indices with scales and no offsets"
#endif
#if (KVQ_KEY_BITS < 4 || KVQ_VALUE_BITS < 4) && !(KVQ_OFFSETS || KVQ_CODEBOOK)
#error "codes narrower than 4 bits are read unsigned: with offsets, or as codebook indices"
#endif
#if KVQ_VALUE_BITS > 4 || KVQ_VALUE_BITS < 2 || KVQ_KEY_BITS < 2
#error "values are 2-4-bit codes, keys 2-4 or 8"
#endif
#if KVQ_TOKEN_SCALE && !(KVQ_CODEBOOK && KVQ_SCALE_HALF)
#error "one scale per token is TurboQuant_mse's fp16 norm"
#endif
#if KVQ_KEY_CHANNELS && !(KVQ_SCALE_HALF && KVQ_OFFSETS && KVQ_KEY_BITS <= 4)
#error "per-channel keys are KIVI's: 2-4-bit codes with fp16 scales and offsets"
#endif
#define KVQ_HEADS 4                       // query rows per group in the fragments
#define KVQ_TILE 16                       // tokens per warp step
#define KVQ_WARPS 4
#define KVQ_MIN_BLOCKS 3
#define KVQ_VALUE_CODES_BYTES (KVQ_TILE * KVQ_VALUE_ROW_BYTES)
#if KVQ_SCALE_HALF
typedef unsigned short kvq_scale;
#define KVQ_SCALE_BYTES 2
#else
typedef float kvq_scale;
#define KVQ_SCALE_BYTES 4
#endif
#define KVQ_SCALE_ROW_BYTES (KVQ_STATS * KVQ_SCALE_BYTES)  // one token's stats
#define KVQ_OFFSETS_AT (KVQ_GROUPS * KVQ_SCALE_BYTES)       // its offsets, in its row
#define KVQ_SCALES_BYTES (KVQ_TILE * KVQ_SCALE_ROW_BYTES)
#if KVQ_KEY_CHANNELS
#define KVQ_KEY_STATS_BYTES (2 * KVQ_D * KVQ_SCALE_BYTES)  // the tile's group's scales, then its offsets
#else
#define KVQ_KEY_STATS_BYTES KVQ_SCALES_BYTES
#endif
#define KVQ_KEY_STATS_CHUNK (KVQ_KEY_STATS_BYTES / KVQ_TILE)  // per-channel key stats: each K-stats lane's share
#define KVQ_KEY_CODES_BYTES (KVQ_TILE * KVQ_KEY_ROW_BYTES)
#define KVQ_V_AT KVQ_KEY_CODES_BYTES
#define KVQ_KS_AT (KVQ_V_AT + KVQ_VALUE_CODES_BYTES)
#define KVQ_VS_AT (KVQ_KS_AT + KVQ_KEY_STATS_BYTES)
#define KVQ_STAGE_BYTES (KVQ_VS_AT + KVQ_SCALES_BYTES)
// Tiles a warp keeps in flight + 1: as many as fit in 48 KB of static shared memory beside the mapped rows, at most
// four (int4 codes with float32 scales). Three programs per SM with four stages rather than four with three, now
// that every program maps its query: a program fewer per SM reads the 32 KB map a quarter less often, and the
// registers it frees end the loop's re-materialized addresses and constants.
#define KVQ_SHARED_FOR_STAGES (48 * 1024 - KVQ_HEADS * KVQ_D * 4)
#define KVQ_STAGES (KVQ_SHARED_FOR_STAGES >= 4 * KVQ_WARPS * KVQ_STAGE_BYTES ? 4 \
                    : KVQ_SHARED_FOR_STAGES >= 3 * KVQ_WARPS * KVQ_STAGE_BYTES ? 3 : 2)
#define KVQ_LOG2E 1.4426950408889634f
#define KVQ_LN2 0.6931471805599453f
#define KVQ_FULL 0xFFFFFFFFu
#define KVQ_NEG_INF __int_as_float(0xFF800000)

#define KVQ_SECOND_CHUNK 512  // a lane's second chunk of a tile's codes, 32 chunks on

// One lane's share of a tile's copies (16-byte chunks of codes and one token's stats): where they go in a stage, and
// where they come from for the warp's first tile (its later ones: kvq_tile, kvq_sources). A tile's codes of each role
// are one run of 16-byte chunks in memory; the lane copies chunk `lane` of each and chunk lane + 32 where the run is
// that long (KVQ_SECOND_CHUNK): for int4 rows, chunk lane % 4 of tokens lane / 4 and + 8. Int8 keys take chunks
// lane % 4 and + 4 of those tokens' rows.
struct kvq_copy_plan {
    const uchar* key;         // codes: the lane's first K and V chunks
    const uchar* value;
    const kvq_scale* scales;  // lanes 0-15: K stats of token lane (per-channel: chunk lane of a group's); 16-31: V
                              // stats of token lane - 16
    unsigned long long head_row;  // the (batch, KV head)'s first row in the buffers
    uint first_t0;                // the warp's first tile's first token (in the head's rows)
    uint token, scale_token;
    uint key_at, value_at, value_next_at, scale_at;  // stage offsets
};

__device__ __forceinline__ kvq_copy_plan kvq_plan_copies(uint lane, unsigned long long head_row, uint first_t0,
                                                          const uchar* key_codes, const uchar* value_codes,
                                                          const kvq_scale* key_scales, const kvq_scale* value_scales) {
    kvq_copy_plan plan;
    plan.head_row = head_row;
    plan.first_t0 = first_t0;
    unsigned long long first_token = head_row + first_t0;
#if KVQ_KEY_BITS == 8 || KVQ_VALUE_BITS == 4
    uint chunk = lane % 4;
#endif
    plan.token = lane / 4;
#if KVQ_TOKEN_SCALE
    plan.scale_token = 8 * (lane % KVQ_TILE);  // lanes 0, 1 (K) and 16, 17 (V): tokens 0-7 and 8-15; the rest none
#else
    plan.scale_token = lane % KVQ_TILE;
#endif
#if KVQ_KEY_BITS == 8
    plan.key_at = plan.token * KVQ_KEY_ROW_BYTES + 16 * chunk;
#else
    plan.key_at = 16 * lane;
#endif
    plan.key = key_codes + first_token * KVQ_KEY_ROW_BYTES + plan.key_at;
    plan.value = value_codes + first_token * KVQ_VALUE_ROW_BYTES + 16 * lane;
    plan.scales = (lane < KVQ_TILE ? key_scales : value_scales) + (first_token + plan.scale_token) * KVQ_STATS;
#if KVQ_VALUE_BITS == 4
    plan.value_at = KVQ_V_AT + kvq_v_row(plan.token) * KVQ_VALUE_ROW_BYTES + 16 * kvq_v_chunk(plan.token, chunk);
    plan.value_next_at = KVQ_V_AT + kvq_v_row(plan.token + 8) * KVQ_VALUE_ROW_BYTES +
                         16 * kvq_v_chunk(plan.token + 8, chunk);
#else  // in order: kvq_value_word reads them where they are packed
    plan.value_at = KVQ_V_AT + 16 * lane;
    plan.value_next_at = plan.value_at + KVQ_SECOND_CHUNK;
#endif
    plan.scale_at = (lane < KVQ_TILE ? KVQ_KS_AT : KVQ_VS_AT) + plan.scale_token * KVQ_SCALE_ROW_BYTES;
#if KVQ_KEY_CHANNELS
    if (lane < KVQ_TILE) {
        plan.scales = key_scales + lane * (KVQ_KEY_STATS_CHUNK / KVQ_SCALE_BYTES);
        plan.scale_at = KVQ_KS_AT + lane * KVQ_KEY_STATS_CHUNK;
    }
#endif
    return plan;
}

#define KVQ_NEXT_KEY_ROWS (8 * KVQ_KEY_ROW_BYTES)
#define KVQ_KEY_HALF_ROW 64               // int8 keys: a lane's second chunk of each row, 4 chunks on

// The token that chunk `chunk` of a tile's run of rows of `row_bytes` each lies in.
__device__ __forceinline__ uint kvq_chunk_token(uint chunk, uint row_bytes) { return 16 * chunk / row_bytes; }

// The i-th tile of warp `warp` in its split: the warps take tiles in turn; for per-channel keys, pairs of tiles in
// turn, so that a warp's two tiles of a 32-token group follow each other and share one fold of the group's scales
// into the query.
__device__ __forceinline__ uint kvq_tile(uint warp, uint i) {
#if KVQ_KEY_CHANNELS
    return 2 * KVQ_WARPS * (i / 2) + 2 * warp + i % 2;
#else
    return warp + KVQ_WARPS * i;
#endif
}

// How many of a split's `tiles` warp `warp` takes.
__device__ __forceinline__ uint kvq_tiles_of(uint warp, uint tiles) {
#if KVQ_KEY_CHANNELS
    uint rest = tiles % (2 * KVQ_WARPS);
    return 2 * (tiles / (2 * KVQ_WARPS)) + (rest > 2 * warp ? min(2u, rest - 2 * warp) : 0u);
#else
    return tiles > warp ? (tiles - warp + KVQ_WARPS - 1) / KVQ_WARPS : 0;
#endif
}

// Where the lane's copies of the warp's tile at token t0 come from.
struct kvq_tile_sources {
    const uchar* key;
    const uchar* value;
    const kvq_scale* scales;
};

__device__ __forceinline__ kvq_tile_sources kvq_sources(const kvq_copy_plan& plan, uint t0) {
    unsigned long long step = t0 - plan.first_t0;
    return {plan.key + step * KVQ_KEY_ROW_BYTES, plan.value + step * KVQ_VALUE_ROW_BYTES,
            plan.scales + step * KVQ_STATS};
}

// One token's stats global -> shared (8-byte copies for a row of four fp16 scales, which is 8-byte aligned only;
// 16-byte ones otherwise), zero-filled unless `valid`.
__device__ __forceinline__ void kvq_copy_stats(uint shared, const kvq_scale* global, bool valid) {
#if KVQ_SCALE_ROW_BYTES == 8
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(shared), "l"(global), "r"(valid ? 8 : 0)
                 : "memory");
#else
#pragma unroll
    for (uint at = 0; at < KVQ_SCALE_ROW_BYTES; at += 16) {
        kvq_copy16(shared + at, (const uchar*)global + at, valid ? 16 : 0);
    }
#endif
}

// One scale per token: the lane's 8 tokens' scales from `scales` (its first), `tokens` of them valid, the rest
// zero-filled (a zero scale times a zero probability adds nothing, where a stale one could be inf or NaN).
__device__ __forceinline__ void kvq_copy_token_scales(const kvq_copy_plan& plan, uint stage, const kvq_scale* scales,
                                                      uint tokens) {
    if (plan.scale_token < KVQ_TILE) {
        kvq_copy16(stage + plan.scale_at, tokens ? scales : scales - plan.scale_token, 2 * tokens);
    }
}

// A tile's stats: per token (a lane's token's row, zero-filled unless `valid`), or for per-channel keys the K-stats
// lanes' chunks of the group that holds token t0 (every token of the tile is in it).
__device__ __forceinline__ void kvq_copy_tile_stats(const kvq_copy_plan& plan, uint stage, const kvq_scale* scales,
                                                    uint t0, bool valid) {
#if KVQ_KEY_CHANNELS
    if (plan.scale_at < KVQ_VS_AT) {
        const uchar* group = (const uchar*)(plan.scales + (plan.head_row + t0) / KVQ_KEY_CHANNELS * (2 * KVQ_D));
#pragma unroll
        for (uint at = 0; at < KVQ_KEY_STATS_CHUNK; at += 16) kvq_copy16(stage + plan.scale_at + at, group + at, 16);
        return;
    }
#endif
    kvq_copy_stats(stage + plan.scale_at, scales, valid);
}

// The lane's chunks of a tile's run of codes (rows of `row_bytes`; the lane's first chunk `from`, its second
// KVQ_SECOND_CHUNK on) into the stage at `at` and `second` bytes on, chunks of tokens from `end` on zero-filled.
__device__ __forceinline__ void kvq_copy_run(uint at, const uchar* from, uint lane, uint t0, uint end, uint row_bytes,
                                             uint second = KVQ_SECOND_CHUNK) {
    const uchar* first_row = from - 16 * lane;
    bool valid = t0 + kvq_chunk_token(lane, row_bytes) < end;
    kvq_copy16(at, valid ? from : first_row, valid ? 16 : 0);
    if (lane + 32 < row_bytes) {  // 16 tokens' rows are row_bytes chunks
        bool next_valid = t0 + kvq_chunk_token(lane + 32, row_bytes) < end;
        kvq_copy16(at + second, next_valid ? from + KVQ_SECOND_CHUNK : first_row, next_valid ? 16 : 0);
    }
}

// Issues the copies of the warp's i-th tile (its first token `t0`; tokens from `end` on are zero-filled,
// read from the tile's first row instead) into `stage`.
__device__ __forceinline__ void kvq_issue_tile(const kvq_copy_plan& plan, uint stage, uint t0, uint end) {
    kvq_tile_sources from = kvq_sources(plan, t0);
    const uchar *key = from.key, *value = from.value;
    const kvq_scale* scales = from.scales;
    uint lane = threadIdx.x % 32;
    bool scale_valid = t0 + plan.scale_token < end;
#if KVQ_KEY_BITS == 8
    bool valid = t0 + plan.token < end, next_valid = t0 + plan.token + 8 < end;
    const uint next_key = KVQ_NEXT_KEY_ROWS, half = KVQ_KEY_HALF_ROW;
    const uchar* first_key = key - plan.token * KVQ_KEY_ROW_BYTES;
    kvq_copy16(stage + plan.key_at, valid ? key : first_key, valid ? 16 : 0);
    kvq_copy16(stage + plan.key_at + next_key, next_valid ? key + next_key : first_key, next_valid ? 16 : 0);
    kvq_copy16(stage + plan.key_at + half, valid ? key + half : first_key, valid ? 16 : 0);
    kvq_copy16(stage + plan.key_at + next_key + half, next_valid ? key + next_key + half : first_key,
               next_valid ? 16 : 0);
#else
    kvq_copy_run(stage + plan.key_at, key, lane, t0, end, KVQ_KEY_ROW_BYTES);
#endif
    kvq_copy_run(stage + plan.value_at, value, lane, t0, end, KVQ_VALUE_ROW_BYTES, plan.value_next_at - plan.value_at);
#if KVQ_TOKEN_SCALE
    kvq_copy_token_scales(plan, stage, scales, scale_valid ? min(end - t0 - plan.scale_token, 8u) : 0u);
#else
    kvq_copy_tile_stats(plan, stage, scale_valid ? scales : scales - plan.scale_token * KVQ_STATS, t0, scale_valid);
#endif
}

// The same for a tile wholly before `end` (all of a split's but its last): no bounds to check, no zero fill,
// which halves the loop's copy instructions.
__device__ __forceinline__ void kvq_copy16_whole(uint shared, const void* global) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared), "l"(global) : "memory");
}

// kvq_copy_run for a tile wholly before `end`.
__device__ __forceinline__ void kvq_copy_whole_run(uint at, const uchar* from, uint lane, uint row_bytes,
                                                   uint second = KVQ_SECOND_CHUNK) {
    kvq_copy16_whole(at, from);
    if (lane + 32 < row_bytes) kvq_copy16_whole(at + second, from + KVQ_SECOND_CHUNK);
}

__device__ __forceinline__ void kvq_issue_whole_tile(const kvq_copy_plan& plan, uint stage, uint t0) {
    kvq_tile_sources from = kvq_sources(plan, t0);
    uint lane = threadIdx.x % 32;
#if KVQ_KEY_BITS == 8
    kvq_copy16_whole(stage + plan.key_at, from.key);
    kvq_copy16_whole(stage + plan.key_at + KVQ_NEXT_KEY_ROWS, from.key + KVQ_NEXT_KEY_ROWS);
    kvq_copy16_whole(stage + plan.key_at + KVQ_KEY_HALF_ROW, from.key + KVQ_KEY_HALF_ROW);
    kvq_copy16_whole(stage + plan.key_at + KVQ_NEXT_KEY_ROWS + KVQ_KEY_HALF_ROW,
                     from.key + KVQ_NEXT_KEY_ROWS + KVQ_KEY_HALF_ROW);
#else
    kvq_copy_whole_run(stage + plan.key_at, from.key, lane, KVQ_KEY_ROW_BYTES);
#endif
    kvq_copy_whole_run(stage + plan.value_at, from.value, lane, KVQ_VALUE_ROW_BYTES,
                       plan.value_next_at - plan.value_at);
#if KVQ_TOKEN_SCALE
    kvq_copy_token_scales(plan, stage, from.scales, 8);
#else
    kvq_copy_tile_stats(plan, stage, from.scales, t0, true);
#endif
}

// The query map, x -> x M for the program's query rows, as mma's with M^T as the A operand in the host's fragment
// order (kvq.kernels.decode_attention.fragment_order: one 16-byte load per lane per m-tile and k-step) and the
// rows as B (lane (r, c): row r's coordinates 16 s + 2c, + 1 and + 8, + 9; zeros for rows r >= gqa). Warp w
// computes coordinates 32 w .. 32 w + 31; its A fragments are loaded before the wait (they do not depend on the
// previous kernel), and the mapped rows land in `rows` as [head][D] float32. The map and the query enter in fp16
// with float32 sums: the scores' mma takes the mapped query in fp16 anyway.
struct kvq_query_map_fragments {
    uint4 a[2][8];
};

__device__ __forceinline__ kvq_query_map_fragments kvq_load_query_map(const uint4* query_map, uint warp, uint lane) {
    kvq_query_map_fragments map;
#pragma unroll
    for (uint i = 0; i < 2; ++i)
#pragma unroll
        for (uint s = 0; s < 8; ++s) map.a[i][s] = __ldg(query_map + ((2 * warp + i) * 8 + s) * 32 + lane);
    return map;
}

__device__ __forceinline__ void kvq_map_query(const kvq_query_map_fragments& map, const kvq_elem* query, float* rows,
                                              uint bh, uint gqa, uint warp, uint r, uint c) {
    bool live = r < gqa;
    const kvq_elem* q_row = query + ((unsigned long long)bh * gqa + min(r, gqa - 1)) * KVQ_D + 2 * c;
    uint b[8][2];
#pragma unroll
    for (uint s = 0; s < 8; ++s) {
        const kvq_elem* at = q_row + 16 * s;
        b[s][0] = live ? kvq_half2(kvq_to_float(at[0]), kvq_to_float(at[1])) : 0u;
        b[s][1] = live ? kvq_half2(kvq_to_float(at[8]), kvq_to_float(at[9])) : 0u;
    }
#pragma unroll
    for (uint i = 0; i < 2; ++i) {
        float mapped[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (uint s = 0; s < 8; ++s) {
            kvq_mma(mapped, map.a[i][s].x, map.a[i][s].y, map.a[i][s].z, map.a[i][s].w, b[s][0], b[s][1]);
        }
        // lane (r, c): coordinates 16 m + r and + 8 of heads 2c, 2c + 1
        if (c < KVQ_HEADS / 2) {
            uint at = 16 * (2 * warp + i) + r;
            rows[2 * c * KVQ_D + at] = mapped[0];
            rows[(2 * c + 1) * KVQ_D + at] = mapped[1];
            rows[2 * c * KVQ_D + at + 8] = mapped[2];
            rows[(2 * c + 1) * KVQ_D + at + 8] = mapped[3];
        }
    }
}

// The query's halves as the scores' mma takes them. Lane (r, c) holds group c's coordinates `q` of row r (c even)
// or row r + 8 (c odd) where that row's group is c (`live`), zeros otherwise. Int4 keys: chunk 2w + e pairs the low
// nibbles of code bytes 4w + 2e and 4w + 2e + 1 of the lane's group (coordinates 8w + 4e and + 2) and their high
// nibbles (+ 1, + 3), the high ones' coordinates divided by 16. Int8 keys: chunk w holds coordinates 4w, 4w + 1 (low)
// and 4w + 2, 4w + 3 (high). Returns the codes' bias against them; q_sum: the query's sum over the coordinates (what
// a per-token offset multiplies).
__device__ __forceinline__ float kvq_query_halves(const float* q, bool live, float q_scale, uint (&q_low)[8],
                                                  uint (&q_high)[8], float& q_sum) {
    float bias = 0.0f;
    q_sum = 0.0f;
#pragma unroll
    for (uint chunk = 0; chunk < 8; ++chunk) {
#if KVQ_KEY_BITS == 8
        float4 coords = live ? *(const float4*)(q + 4 * chunk) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        q_sum += coords.x + coords.y + coords.z + coords.w;
        q_low[chunk] = kvq_half2(coords.x * q_scale, coords.y * q_scale);
        q_high[chunk] = kvq_half2(coords.z * q_scale, coords.w * q_scale);
        bias += KVQ_BYTE_BIAS * (kvq_half2_sum(q_low[chunk]) + kvq_half2_sum(q_high[chunk]));
#else
        uint at = 8 * (chunk / 2) + 4 * (chunk % 2);
        float4 coords = live ? *(const float4*)(q + at) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        q_sum += coords.x + coords.y + coords.z + coords.w;
        q_low[chunk] = kvq_half2(coords.x * q_scale, coords.z * q_scale);
#if KVQ_CODEBOOK  // levels come in exact
        q_high[chunk] = kvq_half2(coords.y * q_scale, coords.w * q_scale);
#else
        q_high[chunk] = kvq_half2(coords.y * q_scale * 0.0625f, coords.w * q_scale * 0.0625f);
        bias += KVQ_LOW_BIAS * kvq_half2_sum(q_low[chunk]) + KVQ_HIGH_BIAS * kvq_half2_sum(q_high[chunk]);
#endif
#endif
    }
    return bias;
}

// A chunk's halves as the A fragment of the lane's row: registers 0, 2 for row r, 1, 3 for row r + 8.
__device__ __forceinline__ void kvq_place(uint (&fragment)[4], uint low, uint high, uint own_row) {
    fragment[0] = own_row == 0 ? low : 0u;
    fragment[1] = own_row == 1 ? low : 0u;
    fragment[2] = own_row == 0 ? high : 0u;
    fragment[3] = own_row == 1 ? high : 0u;
}

#if KVQ_KEY_CHANNELS
__device__ __forceinline__ uint kvq_hmul2(uint a, uint b) {
    uint out;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(a), "r"(b));
    return out;
}

// Per-channel keys: a tile's query fragments and its rows' starting scores (base[0]: row r, base[2]: row r + 8). The
// query's halves (int4 chunks, kvq_query_halves) times the group's channel scales, in fp16 (KIVI's stats are fp16);
// then, on the tensor cores, those fragments against -1024 (the codes' bias, so that it cancels as it is computed)
// and the halves themselves against the group's offsets (16 times them for the high halves). `channels`: the scales
// of the lane's group's coordinates, their offsets KVQ_D stats on.
__device__ __forceinline__ void kvq_channel_operands(const uint (&q_low)[8], const uint (&q_high)[8],
                                                     const uchar* channels, uint own_row, uint (&q_frag)[8][4],
                                                     float (&base)[4]) {
    const uint minus_bias = 0xE400E400u, sixteen = 0x4C004C00u;  // fp16 -1024, 16
    base[0] = base[1] = base[2] = base[3] = 0.0f;
#pragma unroll
    for (uint w = 0; w < 4; ++w) {  // coordinates 8w .. 8w + 7: chunks 2w, 2w + 1
        uint4 scales = *(const uint4*)(channels + 16 * w);
        uint4 offsets = *(const uint4*)(channels + KVQ_D * KVQ_SCALE_BYTES + 16 * w);
        uint scale_words[4] = {scales.x, scales.y, scales.z, scales.w};
        uint offset_words[4] = {offsets.x, offsets.y, offsets.z, offsets.w};
#pragma unroll
        for (uint e = 0; e < 2; ++e) {
            uint chunk = 2 * w + e, first = scale_words[2 * e], second = scale_words[2 * e + 1];
            // coordinates 8w + 4e, + 2 (low) and + 1, + 3 (high) of the pairs (+ 0, + 1), (+ 2, + 3)
            kvq_place(q_frag[chunk], kvq_hmul2(q_low[chunk], kvq_prmt(first, second, 0x5410)),
                      kvq_hmul2(q_high[chunk], kvq_prmt(first, second, 0x7632)), own_row);
            kvq_mma(base, q_frag[chunk][0], q_frag[chunk][1], q_frag[chunk][2], q_frag[chunk][3], minus_bias,
                    minus_bias);
            uint unscaled[4];
            kvq_place(unscaled, q_low[chunk], q_high[chunk], own_row);
            first = offset_words[2 * e];
            second = offset_words[2 * e + 1];
            kvq_mma(base, unscaled[0], unscaled[1], unscaled[2], unscaled[3], kvq_prmt(first, second, 0x5410),
                    kvq_hmul2(kvq_prmt(first, second, 0x7632), sixteen));
        }
    }
}
#endif

// Group c's 32 key codes of a token's `row` in a stage as four words of nibbles, as int4 rows hold them (coordinates
// 32 c + 8 w .. + 7 in word w).
__device__ __forceinline__ void kvq_key_group_words(const uchar* row, uint c, uint (&words)[4]) {
#if KVQ_KEY_BITS == 4
    uint4 codes = *(const uint4*)(row + 16 * c);
    words[0] = codes.x, words[1] = codes.y, words[2] = codes.z, words[3] = codes.w;
#elif KVQ_KEY_BITS == 3
    const uint* run = (const uint*)(row + 12 * c);
    kvq_widen3(run[0], run[1], run[2], words);
#else
    uint2 run = *(const uint2*)(row + 8 * c);
    kvq_widen2(run.x, run.y, words);
#endif
}

// Value codes 8 eighth .. 8 eighth + 7 of a tile's token as a word of nibbles (int4 rows: the stage's word itself).
__device__ __forceinline__ uint kvq_value_word(const uchar* tile, uint token, uint eighth) {
#if KVQ_VALUE_BITS == 4
    return *(const uint*)(tile + KVQ_V_AT + kvq_v_row(token) * KVQ_VALUE_ROW_BYTES +
                          kvq_v_chunk(token, eighth / 4) * 16 + 4 * (eighth % 4));
#elif KVQ_VALUE_BITS == 3  // three bytes, wherever they lie in their words (the one after a row's last is in the stage)
    uint at = KVQ_V_AT + token * KVQ_VALUE_ROW_BYTES + 3 * eighth;
    const uint* words = (const uint*)(tile + (at & ~3u));
    return kvq_spread3(__funnelshift_r(words[0], words[1], 8 * (at & 3u)));
#else
    return kvq_spread2(*(const ushort*)(tile + KVQ_V_AT + token * KVQ_VALUE_ROW_BYTES + 2 * eighth));
#endif
}

// kvq_decode_partial's arguments as one __grid_constant__ parameter, which the split functions read in place
// (kvq.kernels.cuda_decode.DecodeArguments mirrors it field for field).
struct kvq_decode_args {
    const uint4* query_map;
    const kvq_elem* query;
    const uchar* key_codes;
    const kvq_scale* key_scales;
    const uchar* value_codes;
    const kvq_scale* value_scales;
    const float* key_levels;    // KVQ_CODEBOOK: each role's 16 float32 levels (else unread)
    const float* value_levels;
    const kvq_elem* window_keys;
    const kvq_elem* window_values;
    float* partial;
    float* maxima;
    float* sums;
    const long long* lengths;
    uint n_packed, n_window, tokens_per_split, n_packed_splits, gqa, capacity, window_capacity;
    float scale;
    uint device_lengths;
};

// Tokens [start, end) of (batch, KV head) bh: split `split` of the grid's.
__device__ __forceinline__ void kvq_packed_split(const kvq_decode_args& args, uchar* stages, float* rows,
                                                 const kvq_levels* tables, uint start, uint end, uint bh, uint split) {
    const kvq_elem* query = args.query;
    const uchar *key_codes = args.key_codes, *value_codes = args.value_codes;
    const kvq_scale *key_scales = args.key_scales, *value_scales = args.value_scales;
    float *partial = args.partial, *maxima = args.maxima, *sums = args.sums;
    uint gqa = args.gqa, capacity = args.capacity, n_splits = gridDim.y;
    float scale = args.scale;
    uint warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, c = lane % 4;
    uint head = r % KVQ_HEADS;

    // The first tiles' copies go out first: the query's setup below runs while they are in flight.
    uint tiles = end > start ? (end - start + KVQ_TILE - 1) / KVQ_TILE : 0;
    uint my_tiles = kvq_tiles_of(warp, tiles);
    uchar* ring = stages + warp * KVQ_STAGES * KVQ_STAGE_BYTES;
    uint ring_address = kvq_shared_address(ring);
    unsigned long long row = (unsigned long long)bh * capacity;
    kvq_copy_plan plan = kvq_plan_copies(lane, row, start + KVQ_TILE * kvq_tile(warp, 0), key_codes, value_codes,
                                         key_scales, value_scales);
#pragma unroll
    for (uint i = 0; i < KVQ_STAGES - 1; ++i) {
        if (i < my_tiles) {
            kvq_issue_tile(plan, ring_address + i * KVQ_STAGE_BYTES, start + KVQ_TILE * kvq_tile(warp, i), end);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    kvq_query_map_fragments map = kvq_load_query_map(args.query_map, warp, lane);
    kvq_map_query(map, query, rows, bh, gqa, warp, r, c);
    __syncthreads();
    bool live = c / 2 == r / 4 && head < gqa;
    const float* q = rows + head * KVQ_D + 32 * c;
    float q_scale = scale * KVQ_LOG2E;
    uint own_row = c % 2;
    uint q_frag[8][4];
    uint q_low[8], q_high[8];
    float q_sum;
    float bias = kvq_query_halves(q, live, q_scale, q_low, q_high, q_sum);
#if KVQ_KEY_CHANNELS
    float score_base, score_base_next;  // each key group's
    uint folded_group = 0xFFFFFFFFu;     // the group whose scales the query's fragments hold
#else
#pragma unroll
    for (uint chunk = 0; chunk < 8; ++chunk) kvq_place(q_frag[chunk], q_low[chunk], q_high[chunk], own_row);
    float score_base = -__shfl_sync(KVQ_FULL, bias, 4 * r + 2 * (r / 4));
    float score_base_next = -__shfl_sync(KVQ_FULL, bias, 4 * r + 2 * (r / 4) + 1);
#endif
#if KVQ_OFFSETS && !KVQ_KEY_CHANNELS  // what the key offsets of groups 2 (r / 4) and 2 (r / 4) + 1 multiply
    float q_sum_row = __shfl_sync(KVQ_FULL, q_sum, 4 * r + 2 * (r / 4)) * q_scale;
    float q_sum_next_row = __shfl_sync(KVQ_FULL, q_sum, 4 * r + 2 * (r / 4) + 1) * q_scale;
#endif
#if KVQ_OFFSETS
    float2 value_offsets = make_float2(0.0f, 0.0f);  // p . z of V groups 2 (r / 4), + 1 for head r % 4
#endif

    float acc[2][4][4];
#pragma unroll
    for (uint j = 0; j < 2; ++j)
#pragma unroll
        for (uint k = 0; k < 4; ++k)
#pragma unroll
            for (uint i = 0; i < 4; ++i) acc[j][k][i] = 0.0f;
    float m = KVQ_NEG_INF, l = 0.0f;

    uint head_a = 2 * (c % 2);  // this lane's accumulator columns: heads head_a, head_a + 1
    for (uint i = 0; i < my_tiles; ++i) {
        asm volatile("cp.async.wait_group %0;" ::"n"(KVQ_STAGES - 2) : "memory");
        __syncwarp();
        uint ahead = i + KVQ_STAGES - 1;
        if (ahead < my_tiles) {
            uint ahead_t0 = start + KVQ_TILE * kvq_tile(warp, ahead);
            uint stage = ring_address + (ahead % KVQ_STAGES) * KVQ_STAGE_BYTES;
            if (ahead_t0 + KVQ_TILE <= end) {
                kvq_issue_whole_tile(plan, stage, ahead_t0);
            } else {
                kvq_issue_tile(plan, stage, ahead_t0, end);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
        const uchar* tile = ring + (i % KVQ_STAGES) * KVQ_STAGE_BYTES;
        uint t0 = start + KVQ_TILE * kvq_tile(warp, i);
#if KVQ_KEY_CHANNELS
        if (t0 / KVQ_KEY_CHANNELS != folded_group) {  // the tile's group: its scales into the query
            folded_group = t0 / KVQ_KEY_CHANNELS;
            float base[4];
            kvq_channel_operands(q_low, q_high, tile + KVQ_KS_AT + 32 * c * KVQ_SCALE_BYTES, own_row, q_frag, base);
            score_base = base[0];
            score_base_next = base[2];
        }
#endif

        // scores of tokens r (n-tile 0) and 8 + r (n-tile 1) against all 16 rows
#if KVQ_CODEBOOK
        const kvq_levels key_levels = tables[0];  // from shared memory per tile: no registers held across the loop
#endif
        float s[2][4];
#pragma unroll
        for (uint n = 0; n < 2; ++n) {
            s[n][0] = s[n][1] = score_base;
            s[n][2] = s[n][3] = score_base_next;
#if KVQ_KEY_BITS == 8
            // group c's 32 code bytes, 32 c .. 32 c + 31 of the row
            const uchar* key_row = tile + (8 * n + r) * KVQ_KEY_ROW_BYTES;
            uint4 front_codes = *(const uint4*)(key_row + 32 * c), back_codes = *(const uint4*)(key_row + 32 * c + 16);
            uint words[8] = {front_codes.x, front_codes.y, front_codes.z, front_codes.w,
                             back_codes.x, back_codes.y, back_codes.z, back_codes.w};
#pragma unroll
            for (uint w = 0; w < 8; ++w) {
                uint biased = words[w] ^ KVQ_BYTE_FLIP;
                kvq_mma(s[n], q_frag[w][0], q_frag[w][1], q_frag[w][2], q_frag[w][3],
                        kvq_prmt(biased, 0x64646464u, 0x5150), kvq_prmt(biased, 0x64646464u, 0x5352));
            }
#elif KVQ_CODEBOOK
            uint words[4];
            kvq_key_group_words(tile + (8 * n + r) * KVQ_KEY_ROW_BYTES, c, words);
#pragma unroll
            for (uint w = 0; w < 4; ++w) {
                uint low[2], high[2];
                kvq_lookup_levels(key_levels, words[w], low, high, KVQ_KEY_BITS < 4);
                kvq_mma(s[n], q_frag[2 * w][0], q_frag[2 * w][1], q_frag[2 * w][2], q_frag[2 * w][3], low[0], high[0]);
                kvq_mma(s[n], q_frag[2 * w + 1][0], q_frag[2 * w + 1][1], q_frag[2 * w + 1][2], q_frag[2 * w + 1][3],
                        low[1], high[1]);
            }
#else
            uint words[4];
            kvq_key_group_words(tile + (8 * n + r) * KVQ_KEY_ROW_BYTES, c, words);
#pragma unroll
            for (uint w = 0; w < 4; ++w) {
                uint front = kvq_prmt(words[w], 0, 0x4140), back = kvq_prmt(words[w], 0, 0x4342);
                kvq_mma(s[n], q_frag[2 * w][0], q_frag[2 * w][1], q_frag[2 * w][2], q_frag[2 * w][3],
                        kvq_biased_low(front), kvq_biased_high(front));
                kvq_mma(s[n], q_frag[2 * w + 1][0], q_frag[2 * w + 1][1], q_frag[2 * w + 1][2], q_frag[2 * w + 1][3],
                        kvq_biased_low(back), kvq_biased_high(back));
            }
#endif
        }
        // lane (r, c): head r % 4 at tokens 2c, 2c+1 (n-tile 0) and 8 + 2c, 9 + 2c (n-tile 1)
        float score[4], tile_max = KVQ_NEG_INF;
        float2 v_scale[4];
#if KVQ_OFFSETS
        float2 v_offset[4];
#endif
#pragma unroll
        for (uint n = 0; n < 2; ++n) {
#pragma unroll
            for (uint e = 0; e < 2; ++e) {
                uint token = 8 * n + 2 * c + e;
                v_scale[2 * n + e] = kvq_scale_pair(tile + KVQ_VS_AT + token * KVQ_SCALE_ROW_BYTES, r);
#if KVQ_OFFSETS
                v_offset[2 * n + e] = kvq_scale_pair(tile + KVQ_VS_AT + token * KVQ_SCALE_ROW_BYTES + KVQ_OFFSETS_AT,
                                                     r);
#endif
#if KVQ_KEY_CHANNELS
                float share = s[n][e] + s[n][2 + e];
#else
                float2 k_scale = kvq_scale_pair(tile + KVQ_KS_AT + token * KVQ_SCALE_ROW_BYTES, r);
                float share = k_scale.x * s[n][e] + k_scale.y * s[n][2 + e];
#if KVQ_OFFSETS
                float2 k_offset = kvq_scale_pair(tile + KVQ_KS_AT + token * KVQ_SCALE_ROW_BYTES + KVQ_OFFSETS_AT, r);
                share += k_offset.x * q_sum_row + k_offset.y * q_sum_next_row;
#endif
#endif
                float full = share + __shfl_xor_sync(KVQ_FULL, share, 16);
                score[2 * n + e] = full;
            }
        }
        if (t0 + KVQ_TILE > end) {  // only a split's last tile runs past its end: the others skip the checks
#pragma unroll
            for (uint t = 0; t < 4; ++t) {
                if (t0 + 8 * (t / 2) + 2 * c + t % 2 >= end) score[t] = KVQ_NEG_INF;
            }
        }
#pragma unroll
        for (uint t = 0; t < 4; ++t) tile_max = fmaxf(tile_max, score[t]);
        tile_max = fmaxf(tile_max, __shfl_xor_sync(KVQ_FULL, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(KVQ_FULL, tile_max, 2));
        float m_new = fmaxf(m, tile_max);
        float base = m_new == KVQ_NEG_INF ? 0.0f : m_new;
        float alpha = kvq_exp2(m - base);
        if (!__all_sync(KVQ_FULL, m_new == m)) {
            float alpha_a = __shfl_sync(KVQ_FULL, alpha, 4 * head_a);
            float alpha_b = __shfl_sync(KVQ_FULL, alpha, 4 * head_a + 4);
#pragma unroll
            for (uint j = 0; j < 2; ++j)
#pragma unroll
                for (uint k = 0; k < 4; ++k) {
                    acc[j][k][0] *= alpha_a;
                    acc[j][k][1] *= alpha_b;
                    acc[j][k][2] *= alpha_a;
                    acc[j][k][3] *= alpha_b;
                }
        }
        m = m_new;
        float p[4];
#pragma unroll
        for (uint t = 0; t < 4; ++t) p[t] = kvq_exp2(score[t] - base);
        l = l * alpha + (p[0] + p[1] + p[2] + p[3]);
#if KVQ_OFFSETS
        value_offsets.x = value_offsets.x * alpha + (p[0] * v_offset[0].x + p[1] * v_offset[1].x +
                                                     p[2] * v_offset[2].x + p[3] * v_offset[3].x);
        value_offsets.y = value_offsets.y * alpha + (p[0] * v_offset[0].y + p[1] * v_offset[1].y +
                                                     p[2] * v_offset[2].y + p[3] * v_offset[3].y);
#endif

        // P^T's B fragments per V group pair j: columns r: head r % 4 under group 2 (r / 4) + j
#if KVQ_CODEBOOK
        const kvq_levels value_levels = tables[1];
#endif
        uint b[2][2];
        b[0][0] = kvq_half2(p[0] * v_scale[0].x, p[1] * v_scale[1].x);
        b[0][1] = kvq_half2(p[2] * v_scale[2].x, p[3] * v_scale[3].x);
        b[1][0] = kvq_half2(p[0] * v_scale[0].y, p[1] * v_scale[1].y);
        b[1][1] = kvq_half2(p[2] * v_scale[2].y, p[3] * v_scale[3].y);
#pragma unroll
        for (uint j = 0; j < 2; ++j) {
            uint chunk = j + 2 * (r / 4);  // V's group j + 2 (r / 4): code bytes 16 chunk + 4 (r % 4) .. + 3
            uint word[4];
#pragma unroll
            for (uint t = 0; t < 4; ++t) {
                uint token = 8 * (t / 2) + 2 * c + t % 2;
                word[t] = kvq_value_word(tile, token, 4 * chunk + r % 4);
            }
#if KVQ_CODEBOOK
            // byte k of the four tokens side by side (a 4 x 4 byte transpose), then their 8 codes' levels
            uint pairs_front = kvq_prmt(word[0], word[1], 0x5140), pairs_back = kvq_prmt(word[0], word[1], 0x7362);
            uint far_front = kvq_prmt(word[2], word[3], 0x5140), far_back = kvq_prmt(word[2], word[3], 0x7362);
            uint bytes[4] = {kvq_prmt(pairs_front, far_front, 0x5410), kvq_prmt(pairs_front, far_front, 0x7632),
                             kvq_prmt(pairs_back, far_back, 0x5410), kvq_prmt(pairs_back, far_back, 0x7632)};
#pragma unroll
            for (uint k = 0; k < 4; ++k) {
                uint low[2], high[2];  // low[0], high[0]: tokens 0, 1 (near); low[1], high[1]: tokens 2, 3 (far)
                kvq_lookup_levels(value_levels, bytes[k], low, high, KVQ_VALUE_BITS < 4);
                kvq_mma(acc[j][k], low[0], high[0], low[1], high[1], b[j][0], b[j][1]);
            }
#else
#pragma unroll
            for (uint k = 0; k < 4; ++k) {
                uint selector = k | (4 + k) << 8;  // byte k of both tokens into the two 16-bit lanes
                uint near = kvq_prmt(word[0], word[1], selector), far = kvq_prmt(word[2], word[3], selector);
                kvq_mma(acc[j][k], kvq_low_nibbles(near), kvq_high_nibbles(near), kvq_low_nibbles(far),
                        kvq_high_nibbles(far), b[j][0], b[j][1]);
            }
#endif
        }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");

    // Merge the warps: each leaves its maxima, sums and own outputs in its ring, then thread (h, 4x) combines
    // head h's coordinates 4x .. 4x + 3.
    l += __shfl_xor_sync(KVQ_FULL, l, 1);
    l += __shfl_xor_sync(KVQ_FULL, l, 2);
    float offset_a[2] = {0.0f, 0.0f}, offset_b[2] = {0.0f, 0.0f};  // heads head_a, head_a + 1 in groups j + 2 (r / 4)
#if KVQ_OFFSETS
#pragma unroll
    for (uint mask = 1; mask <= 2; mask *= 2) {
        value_offsets.x += __shfl_xor_sync(KVQ_FULL, value_offsets.x, mask);
        value_offsets.y += __shfl_xor_sync(KVQ_FULL, value_offsets.y, mask);
    }
    uint holder = 4 * (head_a + 4 * (r / 4));  // a lane of row head_a + 4 (r / 4): head_a's sums for these groups
    offset_a[0] = __shfl_sync(KVQ_FULL, value_offsets.x, holder);
    offset_a[1] = __shfl_sync(KVQ_FULL, value_offsets.y, holder);
    offset_b[0] = __shfl_sync(KVQ_FULL, value_offsets.x, holder + 4);
    offset_b[1] = __shfl_sync(KVQ_FULL, value_offsets.y, holder + 4);
#endif
    float* merge = (float*)ring;  // [head][D] outputs, then [head] maxima, then [head] sums
    if (r / 4 == c / 2) {
#pragma unroll
        for (uint j = 0; j < 2; ++j)
#pragma unroll
            for (uint k = 0; k < 4; ++k) {
                uint dim = 2 * (16 * (j + 2 * (r / 4)) + 4 * (r % 4) + k);
                merge[head_a * KVQ_D + dim] = acc[j][k][0] + offset_a[j];
                merge[(head_a + 1) * KVQ_D + dim] = acc[j][k][1] + offset_b[j];
                merge[head_a * KVQ_D + dim + 1] = acc[j][k][2] + offset_a[j];
                merge[(head_a + 1) * KVQ_D + dim + 1] = acc[j][k][3] + offset_b[j];
            }
    }
    if (c == 0 && r < KVQ_HEADS) {
        merge[KVQ_HEADS * KVQ_D + r] = m;
        merge[KVQ_HEADS * KVQ_D + KVQ_HEADS + r] = l;
    }
    __syncthreads();
    uint h = threadIdx.x / 32, x = 4 * (threadIdx.x % 32);
    if (h >= gqa) return;
    float top = KVQ_NEG_INF;
#pragma unroll
    for (uint w = 0; w < KVQ_WARPS; ++w) {
        top = fmaxf(top, ((const float*)(stages + w * KVQ_STAGES * KVQ_STAGE_BYTES))[KVQ_HEADS * KVQ_D + h]);
    }
    float4 out = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float total = 0.0f;
#pragma unroll
    for (uint w = 0; w < KVQ_WARPS; ++w) {
        const float* theirs = (const float*)(stages + w * KVQ_STAGES * KVQ_STAGE_BYTES);
        float their_max = theirs[KVQ_HEADS * KVQ_D + h];
        float weight = their_max == KVQ_NEG_INF ? 0.0f : kvq_exp2(their_max - top);
        float4 o = *(const float4*)(theirs + h * KVQ_D + x);
        out.x += weight * o.x;
        out.y += weight * o.y;
        out.z += weight * o.z;
        out.w += weight * o.w;
        total += weight * theirs[KVQ_HEADS * KVQ_D + KVQ_HEADS + h];
    }
    unsigned long long stat = ((unsigned long long)bh * gqa + h) * n_splits + split;
    kvq_await_previous_kernel();  // the previous step's reduce reads the partials
    *(float4*)(partial + stat * KVQ_D + x) = out;
    if (x == 0) {
        maxima[stat] = top * KVQ_LN2;
        sums[stat] = total;
    }
}

// The residual window (exact rows, at most a few dozen): warp h scores head h against each row in float32.
__device__ __forceinline__ void kvq_window_split(const kvq_decode_args& args, uint n_window, uint bh, uint split) {
    const kvq_elem *query = args.query, *window_keys = args.window_keys, *window_values = args.window_values;
    float *partial = args.partial, *maxima = args.maxima, *sums = args.sums;
    uint gqa = args.gqa, window_capacity = args.window_capacity, n_splits = gridDim.y;
    float scale = args.scale;
    uint h = threadIdx.x / 32, lane = threadIdx.x % 32;
    kvq_await_previous_kernel();
    if (h >= gqa) return;
    unsigned long long head = (unsigned long long)bh * gqa + h;
    float q[4], o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (uint i = 0; i < 4; ++i) q[i] = kvq_to_float(query[head * KVQ_D + 4 * lane + i]) * scale * KVQ_LOG2E;
    float m = KVQ_NEG_INF, l = 0.0f;
    for (uint t = 0; t < n_window; ++t) {
        unsigned long long at = ((unsigned long long)bh * window_capacity + t) * KVQ_D + 4 * lane;
        float dot = 0.0f;
#pragma unroll
        for (uint i = 0; i < 4; ++i) dot += q[i] * kvq_to_float(window_keys[at + i]);
#pragma unroll
        for (uint offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(KVQ_FULL, dot, offset);
        float m_new = fmaxf(m, dot);
        float alpha = kvq_exp2(m - m_new), p = kvq_exp2(dot - m_new);
        l = l * alpha + p;
#pragma unroll
        for (uint i = 0; i < 4; ++i) o[i] = o[i] * alpha + p * kvq_to_float(window_values[at + i]);
        m = m_new;
    }
    unsigned long long stat = head * n_splits + split;
    *(float4*)(partial + stat * KVQ_D + 4 * lane) = make_float4(o[0], o[1], o[2], o[3]);
    if (lane == 0) {
        maxima[stat] = m * KVQ_LN2;
        sums[stat] = l;
    }
}

// Grid (batch * KV heads, splits), KVQ_WARPS warps. Buffers as the Triton partial kernel's: codes and scales
// (B, Hkv, capacity, .), windows (B, Hkv, window_capacity, D), query (B, Hq, D), partials (B, Hq, splits, D) and
// (B, Hq, splits); the query map in fragment order (D x D fp16, kvq_map_query). With device_lengths the token
// counts come from `lengths` (packed << 32 | window).
extern "C" __global__ void __launch_bounds__(KVQ_WARPS * 32, KVQ_MIN_BLOCKS) kvq_decode_partial(
    const __grid_constant__ kvq_decode_args args) {
    uint n_packed = args.n_packed, n_window = args.n_window;
    __shared__ __align__(16) uchar stages[KVQ_WARPS * KVQ_STAGES * KVQ_STAGE_BYTES];
    __shared__ __align__(16) float mapped_rows[KVQ_HEADS * KVQ_D];
#if KVQ_CODEBOOK
    __shared__ __align__(16) kvq_levels tables[2];  // K's, then V's
#else
    const kvq_levels* tables = nullptr;
#endif
    // Programmatic dependent launch: the next kernel may launch now, and this one may run beside the previous one. Its
    // packed programs read the counts, the query and the packed rows before kvq_await_previous_kernel, so the previous
    // kernel must not write those: a static cache's write (kvq_write_rows) writes rows past the packed ones read and
    // the ring, and the model's kernels that make the query never let this one launch before they end. They write
    // their partials only after it, as the previous step's reduce reads them; the window program reads the ring
    // after it.
    kvq_launch_dependents();
    if (args.device_lengths) {  // never past the buffers, whatever the device holds
        long long counts = *args.lengths;
        n_packed = min((uint)(counts >> 32), args.capacity);
        n_window = min((uint)(counts & 0xFFFFFFFF), args.window_capacity);
    }
    uint bh = blockIdx.x, split = blockIdx.y;
    if (split < args.n_packed_splits) {
        uint start = split * args.tokens_per_split, end = min(start + args.tokens_per_split, n_packed);
#if KVQ_CODEBOOK  // constants, read before the previous kernel ends; kvq_packed_split syncs before their use
        if (threadIdx.x < 16) {
            tables[threadIdx.x / 8].word[threadIdx.x % 8] = threadIdx.x < 8
                ? kvq_level_table_word(args.key_levels, 1u << KVQ_KEY_BITS, threadIdx.x % 8)
                : kvq_level_table_word(args.value_levels, 1u << KVQ_VALUE_BITS, threadIdx.x % 8);
        }
#endif
        kvq_packed_split(args, stages, mapped_rows, tables, start, end, bh, split);
    } else {
        kvq_window_split(args, n_window, bh, split);
    }
}

// The reduce pass (FlashDecoding Eq. 5) after kvq_decode_partial: o = sum_c e^{m_c - m} o_c / sum_c e^{m_c - m} l_c,
// with the packed splits' sum mapped by output_map (D, D) before the window split (the last) is added. One block
// per (batch, query head), of KVQ_REDUCE_SLICES x KVQ_D threads: thread (g, t) takes output column t of the
// packed splits g, g + KVQ_REDUCE_SLICES, ... with all their loads in flight at once, so that the partials
// arrive in one round trip after the wait; then the slices combine through shared memory, and thread (g, t)
// maps rows 16 g .. 16 g + 15 of the sum into column t, with its rows of output_map read before the wait.
// The Triton reduce, one program per 32 columns, reads every split's whole row per program and combines through
// layout changes, a chain of round trips where this takes one.
#define KVQ_REDUCE_SLICES 8
#define KVQ_MAP_ROWS (KVQ_D / KVQ_REDUCE_SLICES)
#define KVQ_REDUCE_UNROLL 10  // splits per slice whose loads go out together: one round trip for the splits
                              // of a 132-SM GPU at 8 KV heads (more spill at 1024 threads' 64 registers)

// e^{m - top} for a maximum m in natural units against top >= m, 0 for an empty split (m = -inf).
__device__ __forceinline__ float kvq_weight(float m, float top) {
    return m == KVQ_NEG_INF ? 0.0f : kvq_exp2((m - top) * KVQ_LOG2E);
}

extern "C" __global__ void __launch_bounds__(KVQ_REDUCE_SLICES * KVQ_D) kvq_decode_reduce(
    const float* partial, const float* maxima, const float* sums, const float* output_map, kvq_elem* out,
    uint n_splits) {
    __shared__ float slice_out[KVQ_REDUCE_SLICES][KVQ_D];
    __shared__ float slice_max[KVQ_REDUCE_SLICES], slice_sum[KVQ_REDUCE_SLICES];
    __shared__ float packed_sum[KVQ_D];
    uint t = threadIdx.x % KVQ_D, g = threadIdx.x / KVQ_D;
    float map_rows[KVQ_MAP_ROWS];
#pragma unroll
    for (uint k = 0; k < KVQ_MAP_ROWS; ++k) map_rows[k] = output_map[(KVQ_MAP_ROWS * g + k) * KVQ_D + t];
    kvq_launch_dependents();
    kvq_await_previous_kernel();

    unsigned long long head = blockIdx.x;
    const float* m_c = maxima + head * n_splits;
    const float* l_c = sums + head * n_splits;
    const float* o_c = partial + head * n_splits * KVQ_D + t;
    uint packed_splits = n_splits - 1, window = n_splits - 1;
    float window_out = 0.0f, window_max = KVQ_NEG_INF, window_sum = 0.0f;
    if (g == 0) {
        window_out = o_c[window * KVQ_D];
        window_max = m_c[window];
        window_sum = l_c[window];
    }
    // this slice's splits as one running softmax (the same in every thread of the slice but for the column)
    float top = KVQ_NEG_INF, total = 0.0f, sum = 0.0f;
    for (uint first = g; first < packed_splits; first += KVQ_REDUCE_SLICES * KVQ_REDUCE_UNROLL) {
        float m[KVQ_REDUCE_UNROLL], l[KVQ_REDUCE_UNROLL], o[KVQ_REDUCE_UNROLL];
#pragma unroll
        for (uint i = 0; i < KVQ_REDUCE_UNROLL; ++i) {
            uint split = first + KVQ_REDUCE_SLICES * i;
            bool live = split < packed_splits;
            m[i] = live ? m_c[split] : KVQ_NEG_INF;
            l[i] = live ? l_c[split] : 0.0f;
            o[i] = live ? o_c[(unsigned long long)split * KVQ_D] : 0.0f;
        }
        float chunk_top = top;
#pragma unroll
        for (uint i = 0; i < KVQ_REDUCE_UNROLL; ++i) chunk_top = fmaxf(chunk_top, m[i]);
        float rescale = kvq_weight(top, chunk_top);
        total *= rescale;
        sum *= rescale;
#pragma unroll
        for (uint i = 0; i < KVQ_REDUCE_UNROLL; ++i) {
            float w = kvq_weight(m[i], chunk_top);
            total += w * l[i];
            sum += w * o[i];
        }
        top = chunk_top;
    }
    slice_out[g][t] = sum;
    if (t == 0) {
        slice_max[g] = top;
        slice_sum[g] = total;
    }
    __syncthreads();
    float packed_top = KVQ_NEG_INF, packed_total = 0.0f;  // slice 0's
    if (g == 0) {
#pragma unroll
        for (uint s = 0; s < KVQ_REDUCE_SLICES; ++s) packed_top = fmaxf(packed_top, slice_max[s]);
        float column = 0.0f;
#pragma unroll
        for (uint s = 0; s < KVQ_REDUCE_SLICES; ++s) {
            float w = kvq_weight(slice_max[s], packed_top);
            column += w * slice_out[s][t];
            packed_total += w * slice_sum[s];
        }
        packed_sum[t] = column;
    }
    __syncthreads();
    float mapped = 0.0f;
#pragma unroll
    for (uint k = 0; k < KVQ_MAP_ROWS; ++k) mapped += packed_sum[KVQ_MAP_ROWS * g + k] * map_rows[k];
    slice_out[g][t] = mapped;
    __syncthreads();
    if (g != 0) return;
    mapped = 0.0f;
#pragma unroll
    for (uint s = 0; s < KVQ_REDUCE_SLICES; ++s) mapped += slice_out[s][t];
    float top_all = fmaxf(packed_top, window_max);
    float packed_weight = kvq_weight(packed_top, top_all), window_weight = kvq_weight(window_max, top_all);
    out[head * KVQ_D + t] = kvq_from_float((mapped * packed_weight + window_out * window_weight) /
                                           (packed_total * packed_weight + window_sum * window_weight));
}
