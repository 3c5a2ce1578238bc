/* Fused paged decode attention on CPU: one query token per sequence, K/V read from the block
 * pools through the block tables (no batch-wide gather copy). Arithmetic is fp32; query rows and
 * output are fp32 or bfloat16 (a bf16 model's activations), the pools fp32 or bfloat16. In a
 * decode-only step the same call first rotates the new token's q and k heads and writes its K and
 * V into their slots (DecodeStep.slots / cos / sin), so a layer's attention is one call.
 *
 * One task per sequence (per sequence and KV head when the batch is too small to keep the threads
 * busy). A task walks its visible keys in chunks of up to CHUNK, each in tiles of up to TILE
 * consecutive slots of one block: first the scores of every tile's K rows, then the softmax
 * weights of the whole chunk in one vectorised pass (online across chunks: running max and sum per
 * query head, the output rescaled when the max grows), then every tile's V rows times their
 * weights added into the output, so that no max-exp-sum chain sits between a tile's K and V
 * loads. K and V are read once, in slot order (a block's rows for all KV heads are contiguous),
 * and the rows of the tile read next are asked for a few at a time while the current one
 * computes: the pools, which a decode step's weights evict from the caches, then stream at close
 * to the speed of a plain read of the same blocks (figures for both:
 * docs/PERFORMANCE.md#decode-attention-kernel). The G = Hq / Hkv query heads of a KV head share
 * each tile. Tasks are spread over an OpenMP team; linked against torch's libgomp (same soname,
 * loaded first) the team comes from torch's thread pool.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* the AVX tiles */
#endif

#include "bf16.h"
#include "fast_exp.h"
#include "paged_decode.h"
#include "panel_gemm.h"
#include "spin_barrier.h"

#define TILE 16
#define CHUNK 256               /* keys whose scores a task holds at once */
#define S_STRIDE (CHUNK + TILE) /* floats per query head's scores (a tile's stores run past) */

/* Rows of the tile that starts at key position j: up to TILE, within j's block, before `end`. */
static inline int64_t tile_length(int64_t j, int64_t end, int64_t block_size) {
    int64_t n = block_size - j % block_size < TILE ? block_size - j % block_size : TILE;
    return end - j < n ? end - j : n;
}

/* Visible keys of a query at position seq_len - 1: [first, seq_len). */
static int64_t first_visible(int64_t seq_len, int64_t window) {
    int64_t first = window > 0 ? seq_len - window : 0;
    return first > 0 ? first : 0;
}

#ifdef __AVX512F__
/* 16 vectors -> one vector whose lane i is the sum of v[i]'s lanes: a tree of shuffles and adds
 * (~3 instructions per vector) instead of one horizontal reduction per vector (~8). */
static inline __m512 sum_lanes16(__m512 v[16]) {
    __m512 half[8], quarter[4], eighth[2];
    for (int i = 0; i < 8; i++) /* [a0+a2, a1+a3 | b0+b2, b1+b3] in 128-bit lanes */
        half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                                _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit lane k: 4 partial sums of row 4i + k */
        quarter[i] = _mm512_add_ps(_mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0x88),
                                   _mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* lane k: 2 partials of rows 8i + k, 8i + 4 + k */
        eighth[i] = _mm512_add_ps(_mm512_shuffle_ps(quarter[2 * i], quarter[2 * i + 1], 0x44),
                                  _mm512_shuffle_ps(quarter[2 * i], quarter[2 * i + 1], 0xEE));
    /* position 4k + j holds row 4j + k */
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(eighth[0], eighth[1], 0x88),
                                      _mm512_shuffle_ps(eighth[0], eighth[1], 0xDD));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, sums);
}
#endif

/* A K or V pool [num_blocks, block_size, Hkv, D], fp32 or bf16; strides in elements. */
typedef struct {
    const void *base;
    int bf16; /* elements are bfloat16, else float */
    int64_t block_stride, row_stride;
} Pool;

/* Where row `slot` of block `block` starts (all KV heads). */
static inline const char *row_at(const Pool *pool, int64_t block, int64_t slot) {
    const int64_t element = pool->block_stride * block + pool->row_stride * slot;
    return (const char *)pool->base + element * (pool->bf16 ? 2 : 4);
}

/* n consecutive bf16 rows of one block, starting at `slot` (all KV heads), widened into buf. */
static inline const float *widened_rows(const Pool *pool, int64_t block, int64_t slot, int64_t n,
                                        float *buf) {
    const uint16_t *src = (const uint16_t *)row_at(pool, block, slot);
    const int64_t count = n * pool->row_stride;
#pragma omp simd
    for (int64_t i = 0; i < count; i++) buf[i] = bf16_to_f32(src[i]);
    return buf;
}

/* The n rows (all KV heads) of the tile at key position j of a sequence (block table `table`):
 * in the pool, or widened to fp32 into buf when widen. */
static inline const char *tile_at(const Pool *pool, const int32_t *table, int64_t block_size,
                                  int64_t j, int64_t n, int widen, float *buf) {
    const int64_t block = table[j / block_size], slot = j % block_size;
    if (widen) return (const char *)widened_rows(pool, block, slot, n, buf);
    return row_at(pool, block, slot);
}

/* One KV head's part of the rows of the tile a pass reads next, asked for (into L2) a row at a
 * time while the current tile computes, so that memory and arithmetic overlap. ~400 prefetches
 * issued at once (a whole tile) wait on the core's dozen or so fill buffers and stall it instead,
 * which measured no faster than none. */
typedef struct {
    const char *first;           /* the head's part of the tile's first row; NULL: none */
    int64_t stride, bytes, rows; /* bytes from row to row, bytes of the head's part, rows */
} Upcoming;

/* The Upcoming of KV head `head` in the tile of `pool` at key position j, of a sequence whose keys
 * end at `limit` (none when j >= limit). */
static inline Upcoming upcoming(const Pool *pool, const int32_t *table, int64_t block_size,
                                int64_t j, int64_t limit, int64_t head, int64_t head_dim) {
    const int64_t element = pool->bf16 ? 2 : 4;
    if (j >= limit) return (Upcoming){NULL, 0, 0, 0};
    const char *row = row_at(pool, table[j / block_size], j % block_size);
    return (Upcoming){row + head * head_dim * element, pool->row_stride * element,
                      head_dim * element, tile_length(j, limit, block_size)};
}

static inline void prefetch_row(const Upcoming *up, int64_t t) {
    if (up->first == NULL || t >= up->rows) return;
    for (int64_t offset = 0; offset < up->bytes; offset += 64)
        __builtin_prefetch(up->first + t * up->stride + offset, 0, 2);
}

/* The rows t < TILE that query head g of a group asks for while it scores a tile (t % group == g,
 * spreading a tile's prefetches over the group's passes), as a bit mask: a modulo per row was an
 * integer division per row inside the unrolled tile loop. */
static inline uint32_t prefetch_rows(int64_t g, int64_t group) {
    uint32_t rows = 0;
    for (int64_t t = g; t < TILE; t += group) rows |= 1u << t;
    return rows;
}

/* Running softmax state of one query head. */
typedef struct {
    float max, sum;
} Running;

/* Moves a query head's running max up to chunk_max when it is larger, rescaling what was summed
 * under the old max: the running sum and the output accumulator o. */
static inline void raise_max(Running *r, float chunk_max, float *o, int64_t head_dim) {
    if (!(chunk_max > r->max)) return;
    const float alpha = exp_nonpositive(r->max - chunk_max);
    r->sum *= alpha;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; d++) o[d] *= alpha;
    r->max = chunk_max;
}

/* Softmax weights of one query head's scores s[0..n) of a chunk: moves the running max up
 * (raise_max), leaves e^(s - max) in s and adds them to the running sum. One vectorised pass per
 * chunk instead of one per tile: the max, exponentials and sums of a tile were a dependency chain
 * that the tile's loads waited on. */
static inline void chunk_weights(float *s, int64_t n, Running *r, float *o, int64_t head_dim) {
    float chunk_max = -INFINITY; /* a NaN score is skipped here but makes its weight, the sum and
                                    so the output NaN, as in torch */
#pragma omp simd reduction(max : chunk_max)
    for (int64_t t = 0; t < n; t++) chunk_max = s[t] > chunk_max ? s[t] : chunk_max;
    raise_max(r, chunk_max, o, head_dim);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - r->max);
        sum += s[t];
    }
    r->sum += sum;
}

/* Caps scores s[0..n) at softcap (softcap * tanh(s / softcap)). */
static inline void cap_scores(float *s, int64_t n, float softcap) {
    for (int64_t t = 0; t < n; t++) s[t] = softcap * tanhf(s[t] / softcap);
}

/* Scores of one KV head's part of a tile (n <= TILE rows, rs floats apart) for its `group` query
 * heads q [group, head_dim]: s[g * s_stride + t]. Asks for the upcoming tile's rows on the way. */
static void tile_scores_portable(const float *q, const float *k, int64_t rs, int64_t n,
                                 int64_t group, int64_t head_dim, float softcap, float *s,
                                 int64_t s_stride, const Upcoming *next) {
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * head_dim;
        const uint32_t mine = prefetch_rows(g, group);
        for (int64_t t = 0; t < n; t++) {
            const float *kt = k + t * rs;
            float acc = 0.0f;
            if (mine >> t & 1) prefetch_row(next, t);
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < head_dim; d++) acc += qg[d] * kt[d];
            s[g * s_stride + t] = acc;
        }
        if (softcap > 0.0f) cap_scores(s + g * s_stride, n, softcap);
    }
}

/* o [group, head_dim] += the weights w[g * w_stride + t] times one KV head's part of a tile's n V
 * rows (rs floats apart). Asks for the upcoming tile's rows on the way. */
static void tile_values_portable(const float *w, int64_t w_stride, const float *v, int64_t rs,
                                 int64_t n, int64_t group, int64_t head_dim, float *out,
                                 const Upcoming *next) {
    for (int64_t g = 0; g < group; g++) {
        const float *wg = w + g * w_stride;
        float *o = out + g * head_dim;
        int64_t t = 0;
        for (; t + 4 <= n; t += 4) { /* four V rows per read-modify-write of o */
            const float *v0 = v + t * rs;
            if (g == 0)
                for (int64_t u = t; u < t + 4; u++) prefetch_row(next, u);
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++)
                o[d] += wg[t] * v0[d] + wg[t + 1] * v0[rs + d] + wg[t + 2] * v0[2 * rs + d] +
                        wg[t + 3] * v0[3 * rs + d];
        }
        for (; t < n; t++) {
            const float *vt = v + t * rs;
            if (g == 0) prefetch_row(next, t);
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) o[d] += wg[t] * vt[d];
        }
    }
}

#if defined(__AVX512F__)
/* Elements d..d+15 of a row as fp32: loaded, or bf16 widened in the register (bf16 is the top half
 * of an fp32), faster than widening a tile into a buffer first
 * (docs/PERFORMANCE.md#decode-attention-kernel). */
static inline __m512 load16(const void *row, int64_t d, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)row + d);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Dimensions the SIMD tile routines take at a time: they serve head_dim % SIMD_DIMS == 0. */
#define SIMD_DIMS 64

/* tile_scores_portable for head_dim % 64 == 0 with AVX-512, 64 dims (4 registers) of a row at a
 * time: per query head the 16 rows' dot products accumulate in 16 registers reduced together
 * (sum_lanes16) and stored as one vector. Rows past n repeat row n - 1, so every load is a real row
 * of the tile; their scores land past n, where nothing reads them. The rows hold bf16 when bf16
 * (a constant in each inlined copy), else fp32. */
static inline void tile_scores_simd(const float *q, const void *k, int64_t rs, int64_t n,
                                      int64_t group, int64_t head_dim, float softcap, float *s,
                                      int64_t s_stride, const Upcoming *next, const int bf16) {
    const int64_t row_bytes = rs * (bf16 ? 2 : 4);
    const char *rows[TILE];
    for (int t = 0; t < TILE; t++) rows[t] = (const char *)k + (t < n ? t : n - 1) * row_bytes;
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * head_dim;
        const uint32_t mine = prefetch_rows(g, group);
        __m512 acc[TILE];
#pragma GCC unroll 16
        for (int t = 0; t < TILE; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += 64) {
            __m512 qd[4];
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) qd[c] = _mm512_loadu_ps(qg + d + 16 * c);
#pragma GCC unroll 16
            for (int t = 0; t < TILE; t++) {
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++)
                    acc[t] = _mm512_fmadd_ps(qd[c], load16(rows[t], d + 16 * c, bf16), acc[t]);
                if (d == 0 && (mine >> t & 1)) prefetch_row(next, t);
            }
        }
        _mm512_storeu_ps(s + g * s_stride, sum_lanes16(acc));
        if (softcap > 0.0f) cap_scores(s + g * s_stride, n, softcap);
    }
}

/* Query heads whose outputs tile_values_simd keeps in registers at once (4 registers each). */
#define VALUE_HEADS 4

/* tile_values_portable for head_dim % 64 == 0 with AVX-512: per 64 dims, each V row is loaded
 * once (4 registers) for up to VALUE_HEADS query heads of the group, whose outputs stay in
 * registers for the whole tile. */
static inline void tile_values_simd(const float *w, int64_t w_stride, const void *v, int64_t rs,
                                      int64_t n, int64_t group, int64_t head_dim, float *out,
                                      const Upcoming *next, const int bf16) {
    const int64_t row_bytes = rs * (bf16 ? 2 : 4);
    for (int64_t d = 0; d < head_dim; d += 64) {
        for (int64_t g0 = 0; g0 < group; g0 += VALUE_HEADS) {
            const int64_t heads = group - g0 < VALUE_HEADS ? group - g0 : VALUE_HEADS;
            __m512 od[VALUE_HEADS][4];
#pragma GCC unroll 4
            for (int g = 0; g < VALUE_HEADS; g++)
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++)
                    od[g][c] = g < heads ? _mm512_loadu_ps(out + (g0 + g) * head_dim + d + 16 * c)
                                         : _mm512_setzero_ps();
            for (int64_t t = 0; t < n; t++) {
                const char *row = (const char *)v + t * row_bytes;
                if (d == 0 && g0 == 0) prefetch_row(next, t);
                __m512 vd[4];
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) vd[c] = load16(row, d + 16 * c, bf16);
#pragma GCC unroll 4
                for (int g = 0; g < VALUE_HEADS; g++) {
                    if (g >= heads) break;
                    const __m512 wt = _mm512_set1_ps(w[(g0 + g) * w_stride + t]);
#pragma GCC unroll 4
                    for (int c = 0; c < 4; c++) od[g][c] = _mm512_fmadd_ps(wt, vd[c], od[g][c]);
                }
            }
#pragma GCC unroll 4
            for (int g = 0; g < VALUE_HEADS; g++)
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++)
                    if (g < heads)
                        _mm512_storeu_ps(out + (g0 + g) * head_dim + d + 16 * c, od[g][c]);
        }
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* 8 vectors -> one vector whose lane i is the sum of v[i]'s lanes (as sum_lanes16, for AVX2). */
static inline __m256 sum_lanes8(const __m256 v[8]) {
    const __m256 ab = _mm256_hadd_ps(v[0], v[1]), cd = _mm256_hadd_ps(v[2], v[3]);
    const __m256 ef = _mm256_hadd_ps(v[4], v[5]), gh = _mm256_hadd_ps(v[6], v[7]);
    /* 128-bit lane 0: rows 0-3 (then 4-7) summed over dims 0-3, lane 1 over dims 4-7 */
    const __m256 low = _mm256_hadd_ps(ab, cd), high = _mm256_hadd_ps(ef, gh);
    return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                         _mm256_permute2f128_ps(low, high, 0x31));
}

/* Elements d..d+7 of a row as fp32: loaded, or bf16 widened in the register (as load16). */
static inline __m256 load8(const void *row, int64_t d, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)row + d);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + d));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Dimensions the SIMD tile routines take at a time: they serve head_dim % SIMD_DIMS == 0. */
#define SIMD_DIMS 32

/* tile_scores_portable for head_dim % 32 == 0 with AVX2 + FMA: per query head and 8 rows of the
 * tile at a time, 32 dims (4 registers) of the query against each row into 8 accumulators, reduced
 * together (sum_lanes8) and stored as one vector. Rows past n repeat row n - 1 (as in the AVX-512
 * version); bf16 rows are widened in the register. */
static inline void tile_scores_simd(const float *q, const void *k, int64_t rs, int64_t n,
                                    int64_t group, int64_t head_dim, float softcap, float *s,
                                    int64_t s_stride, const Upcoming *next, const int bf16) {
    const int64_t row_bytes = rs * (bf16 ? 2 : 4);
    const char *rows[TILE];
    for (int t = 0; t < TILE; t++) rows[t] = (const char *)k + (t < n ? t : n - 1) * row_bytes;
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * head_dim;
        const uint32_t mine = prefetch_rows(g, group);
        for (int t0 = 0; t0 < n; t0 += 8) {
            __m256 acc[8];
#pragma GCC unroll 8
            for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
            for (int64_t d = 0; d < head_dim; d += 32) {
                __m256 qd[4];
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) qd[c] = _mm256_loadu_ps(qg + d + 8 * c);
#pragma GCC unroll 8
                for (int t = 0; t < 8; t++) {
#pragma GCC unroll 4
                    for (int c = 0; c < 4; c++)
                        acc[t] = _mm256_fmadd_ps(qd[c], load8(rows[t0 + t], d + 8 * c, bf16),
                                                 acc[t]);
                    if (d == 0 && (mine >> (t0 + t) & 1)) prefetch_row(next, t0 + t);
                }
            }
            _mm256_storeu_ps(s + g * s_stride + t0, sum_lanes8(acc));
        }
        if (softcap > 0.0f) cap_scores(s + g * s_stride, n, softcap);
    }
}

/* Query heads whose outputs tile_values_simd keeps in registers at once (2 registers each). */
#define VALUE_HEADS 4

/* tile_values_portable for head_dim % 32 == 0 with AVX2 + FMA: per 16 dims, each V row is loaded
 * once (2 registers) for up to VALUE_HEADS query heads of the group, whose outputs stay in
 * registers for the whole tile. */
static inline void tile_values_simd(const float *w, int64_t w_stride, const void *v, int64_t rs,
                                    int64_t n, int64_t group, int64_t head_dim, float *out,
                                    const Upcoming *next, const int bf16) {
    const int64_t row_bytes = rs * (bf16 ? 2 : 4);
    for (int64_t d = 0; d < head_dim; d += 16) {
        for (int64_t g0 = 0; g0 < group; g0 += VALUE_HEADS) {
            const int64_t heads = group - g0 < VALUE_HEADS ? group - g0 : VALUE_HEADS;
            __m256 od[VALUE_HEADS][2];
#pragma GCC unroll 4
            for (int g = 0; g < VALUE_HEADS; g++)
#pragma GCC unroll 2
                for (int c = 0; c < 2; c++)
                    od[g][c] = g < heads ? _mm256_loadu_ps(out + (g0 + g) * head_dim + d + 8 * c)
                                         : _mm256_setzero_ps();
            for (int64_t t = 0; t < n; t++) {
                const char *row = (const char *)v + t * row_bytes;
                if (d == 0 && g0 == 0) prefetch_row(next, t);
                const __m256 vd[2] = {load8(row, d, bf16), load8(row, d + 8, bf16)};
#pragma GCC unroll 4
                for (int g = 0; g < VALUE_HEADS; g++) {
                    if (g >= heads) break;
                    const __m256 wt = _mm256_set1_ps(w[(g0 + g) * w_stride + t]);
#pragma GCC unroll 2
                    for (int c = 0; c < 2; c++) od[g][c] = _mm256_fmadd_ps(wt, vd[c], od[g][c]);
                }
            }
#pragma GCC unroll 4
            for (int g = 0; g < VALUE_HEADS; g++)
#pragma GCC unroll 2
                for (int c = 0; c < 2; c++)
                    if (g < heads) _mm256_storeu_ps(out + (g0 + g) * head_dim + d + 8 * c, od[g][c]);
        }
    }
}
#endif

/* Whether the SIMD tile routines serve this head_dim, which also read bf16 rows themselves (the
 * portable ones need them widened to fp32 first). */
static inline int simd_tiles(int64_t head_dim) {
#ifdef SIMD_DIMS
    return head_dim % SIMD_DIMS == 0;
#else
    (void)head_dim;
    return 0;
#endif
}

/* The scores routine for this head_dim on this CPU; k rows hold bf16 when bf16 (only where
 * simd_tiles), else fp32. */
static void tile_scores(const float *q, const void *k, int64_t rs, int64_t n, int64_t group,
                        int64_t head_dim, float softcap, float *s, int64_t s_stride,
                        const Upcoming *next, int bf16) {
#ifdef SIMD_DIMS
    if (simd_tiles(head_dim)) { /* one copy per element type, the branch out of the loops */
        if (bf16)
            tile_scores_simd(q, k, rs, n, group, head_dim, softcap, s, s_stride, next, 1);
        else
            tile_scores_simd(q, k, rs, n, group, head_dim, softcap, s, s_stride, next, 0);
        return;
    }
#endif
    tile_scores_portable(q, k, rs, n, group, head_dim, softcap, s, s_stride, next);
}

/* The values routine for this head_dim on this CPU (v rows as in tile_scores). */
static void tile_values(const float *w, int64_t w_stride, const void *v, int64_t rs, int64_t n,
                        int64_t group, int64_t head_dim, float *out, const Upcoming *next,
                        int bf16) {
#ifdef SIMD_DIMS
    if (simd_tiles(head_dim)) {
        if (bf16)
            tile_values_simd(w, w_stride, v, rs, n, group, head_dim, out, next, 1);
        else
            tile_values_simd(w, w_stride, v, rs, n, group, head_dim, out, next, 0);
        return;
    }
#endif
    tile_values_portable(w, w_stride, v, rs, n, group, head_dim, out, next);
}

/* head_dim elements of a row (fp32, or bf16 widened) at element offset `at`, into dst. */
static inline void load_head(const void *row, int bf16, int64_t at, int64_t head_dim, float *dst) {
    if (!bf16) {
        memcpy(dst, (const float *)row + at, (size_t)head_dim * sizeof(float));
        return;
    }
    const uint16_t *src = (const uint16_t *)row + at;
    for (int64_t d = 0; d < head_dim; d++) dst[d] = bf16_to_f32(src[d]);
}

/* x rotated in place by the token's rotary angles (x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin
 * over the two halves of a head, as in fused_ops.c), times scale. */
static inline void rotate_head(float *x, const float *cos, const float *sin, int64_t head_dim,
                               float scale) {
    const int64_t half = head_dim / 2;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = (x1 * cos[i] - x2 * sin[i]) * scale;
        x[i + half] = (x2 * cos[i + half] + x1 * sin[i + half]) * scale;
    }
}

/* One KV head's new row (fp32, head_dim floats) into its pool slot. */
static inline void store_row(const Pool *pool, int64_t slot, int64_t head, const float *row,
                             int64_t head_dim) {
    const int64_t element = pool->row_stride * slot + head * head_dim; /* blocks are contiguous */
    if (!pool->bf16) {
        memcpy((float *)pool->base + element, row, (size_t)head_dim * sizeof(float));
        return;
    }
    uint16_t *dst = (uint16_t *)pool->base + element;
    for (int64_t d = 0; d < head_dim; d++) dst[d] = f32_to_bf16(row[d]);
}

/* Attention of sequence b's query heads of KV heads [h_begin, h_end) over its keys
 * [first, seq_len); row is its [Hq + 2 Hkv, D] (or [Hq, D]) row, out its [Hq, D] output (element
 * pointers of the activation dtype). scratch holds the task's scaled queries, a key, the fp32
 * output, an fp32 tile and the scores of a chunk (see paged_decode_attention). */
static void attend_sequence(const DecodeStep *step, int64_t b, const void *row, const Pool *k_pool,
                            const Pool *v_pool, void *out, float *scratch, int64_t h_begin,
                            int64_t h_end, float scale, int64_t window, float softcap) {
    const int64_t kv_heads = step->kv_heads, head_dim = step->head_dim;
    const int64_t group = step->q_heads / kv_heads, block_size = step->block_size;
    const int64_t seq_len = step->seq_lens[b], first = first_visible(seq_len, window);
    const int32_t *table = step->block_tables + b * step->table_stride;
    const int64_t q_heads = (h_end - h_begin) * group; /* query heads of this task */
    const int64_t rs = kv_heads * head_dim;           /* elements between two rows of a tile */
    const int act_bf16 = step->act_bf16;
    float *q_scaled = scratch, *key = q_scaled + q_heads * head_dim, *value = key + head_dim;
    float *acc = act_bf16 ? value + head_dim : (float *)out; /* fp32 output accumulator */
    float *tile = value + head_dim + q_heads * head_dim; /* a widened tile */
    float *scores = tile + TILE * rs;                    /* [q_heads, S_STRIDE] */
    const float *cos = step->cos ? step->cos + b * head_dim : NULL;
    const float *sin = step->sin ? step->sin + b * head_dim : NULL;
    Running running[q_heads];

    for (int64_t qh = 0; qh < q_heads; qh++) {
        float *q = q_scaled + qh * head_dim;
        load_head(row, act_bf16, (h_begin * group + qh) * head_dim, head_dim, q);
        if (cos) {
            rotate_head(q, cos, sin, head_dim, scale);
        } else {
            for (int64_t d = 0; d < head_dim; d++) q[d] *= scale;
        }
        running[qh] = (Running){-INFINITY, 0.0f};
    }
    if (step->slots) { /* the new token's K (rotated) and V heads into its slot */
        const int64_t k_at = step->q_heads * head_dim, v_at = k_at + kv_heads * head_dim;
        for (int64_t h = h_begin; h < h_end; h++) {
            load_head(row, act_bf16, k_at + h * head_dim, head_dim, key);
            if (cos) rotate_head(key, cos, sin, head_dim, 1.0f);
            load_head(row, act_bf16, v_at + h * head_dim, head_dim, value);
            store_row(k_pool, step->slots[b], h, key, head_dim);
            store_row(v_pool, step->slots[b], h, value, head_dim);
        }
    }
    memset(acc, 0, (size_t)(q_heads * head_dim) * sizeof(float));
    const int widen = k_pool->bf16 && !simd_tiles(head_dim); /* bf16 tiles to fp32 copies */
    const int64_t tile_element = widen ? 4 : (k_pool->bf16 ? 2 : 4);
    const int bf16_rows = k_pool->bf16 && !widen;
    /* A chunk of up to CHUNK keys at a time: the scores of all its tiles (K rows), the softmax
       weights of the whole chunk at once, then the weighted V rows of all its tiles. */
    for (int64_t start = first; start < seq_len;) {
        const int64_t end = start / TILE * TILE + CHUNK < seq_len ? start / TILE * TILE + CHUNK
                                                                   : seq_len;
        for (int64_t j = start, n; j < end; j += n) {
            n = tile_length(j, end, block_size);
            const char *k_tile = tile_at(k_pool, table, block_size, j, n, widen, tile);
            for (int64_t h = h_begin; h < h_end; h++) {
                const int64_t qh = (h - h_begin) * group; /* first query head of KV head h */
                /* asked for meanwhile: the next tile's K rows, after the last the first V rows */
                const Upcoming next =
                    j + n < end ? upcoming(k_pool, table, block_size, j + n, end, h, head_dim)
                                : upcoming(v_pool, table, block_size, start, end, h, head_dim);
                tile_scores(q_scaled + qh * head_dim, k_tile + h * head_dim * tile_element, rs, n,
                            group, head_dim, softcap, scores + qh * S_STRIDE + (j - start),
                            S_STRIDE, &next, bf16_rows);
            }
        }
        for (int64_t qh = 0; qh < q_heads; qh++)
            chunk_weights(scores + qh * S_STRIDE, end - start, &running[qh], acc + qh * head_dim,
                          head_dim);
        for (int64_t j = start, n; j < end; j += n) {
            n = tile_length(j, end, block_size);
            const char *v_tile = tile_at(v_pool, table, block_size, j, n, widen, tile);
            for (int64_t h = h_begin; h < h_end; h++) {
                const int64_t qh = (h - h_begin) * group;
                /* the next tile's V rows, after the last the next chunk's first K rows */
                const Upcoming next =
                    j + n < end ? upcoming(v_pool, table, block_size, j + n, end, h, head_dim)
                                : upcoming(k_pool, table, block_size, end, seq_len, h, head_dim);
                tile_values(scores + qh * S_STRIDE + (j - start), S_STRIDE,
                            v_tile + h * head_dim * tile_element, rs, n, group, head_dim,
                            acc + qh * head_dim, &next, bf16_rows);
            }
        }
        start = end;
    }
    for (int64_t qh = 0; qh < q_heads; qh++) {
        const float inv_sum = 1.0f / running[qh].sum;
        float *o = acc + qh * head_dim;
        for (int64_t d = 0; d < head_dim; d++) o[d] *= inv_sum;
        if (act_bf16)
            for (int64_t d = 0; d < head_dim; d++)
                ((uint16_t *)out)[qh * head_dim + d] = f32_to_bf16(o[d]);
    }
}

/* Per-thread scratch kept across calls and grown on demand: a fresh malloc of a few hundred KiB
 * per call is an mmap + page faults + munmap, which cost more than a batch-1 layer's attention
 * (docs/PERFORMANCE.md#decode-attention-kernel). The threads are torch's OpenMP pool (and the
 * engine's caller thread), so there are a handful. */
static float *thread_scratch(size_t floats) {
    static __thread float *buffer = NULL;
    static __thread size_t capacity = 0;
    if (floats > capacity) {
        float *grown = realloc(buffer, floats * sizeof(float));
        if (grown == NULL) return NULL;
        buffer = grown;
        capacity = floats;
    }
    return buffer;
}

/* Tasks of one layer's decode attention: a sequence each, or a sequence's KV head each when the
 * batch is too small to keep the threads busy. */
static int64_t task_splits(const DecodeStep *step) {
    return (step->nthreads > 1 && step->batch < 2 * step->nthreads) ? step->kv_heads : 1;
}

/* paged_decode_attention's tasks shared over the calling OpenMP team (an orphaned work-sharing
 * loop without a barrier at its end). Returns -1 when this thread's scratch could not be
 * allocated (its tasks are then skipped, out incomplete), else 0. */
static int attention_tasks(const DecodeStep *step, const void *rows, int64_t row_stride,
                           void *k_cache, void *v_cache, void *out, float scale, int64_t window,
                           float softcap) {
    const int64_t kv_heads = step->kv_heads, head_dim = step->head_dim;
    const int64_t q_heads = step->q_heads, group = q_heads / kv_heads;
    const int64_t pool_row = kv_heads * head_dim, element = step->act_bf16 ? 2 : 4;
    /* scaled queries, a key and a value, the fp32 output, a widened tile, a chunk's scores */
    const size_t scratch_floats =
        (size_t)((2 * q_heads + 2) * head_dim + TILE * pool_row + q_heads * S_STRIDE);
    const Pool k_pool = {k_cache, step->kv_bf16, step->block_size * pool_row, pool_row};
    const Pool v_pool = {v_cache, step->kv_bf16, step->block_size * pool_row, pool_row};
    const int64_t splits = task_splits(step);
    const int64_t heads_per_task = kv_heads / splits, tasks = step->batch * splits;
    float *scratch = thread_scratch(scratch_floats);
#pragma omp for schedule(dynamic) nowait
    for (int64_t t = 0; t < tasks; t++) {
        if (scratch == NULL) continue;
        const int64_t b = t / splits, h_begin = t % splits * heads_per_task;
        const int64_t out_at = (b * q_heads + h_begin * group) * head_dim;
        attend_sequence(step, b, (const char *)rows + b * row_stride * element, &k_pool, &v_pool,
                        (char *)out + out_at * element, scratch, h_begin, h_begin + heads_per_task,
                        scale, window, softcap);
    }
    return scratch == NULL ? -1 : 0;
}

/* One layer's decode attention of a step: sequence b's row at rows + b * row_stride elements (q
 * heads, then with step->slots its new K and V heads; fp32, or bf16 with step->act_bf16);
 * k_cache/v_cache [num_blocks, block_size, Hkv, D]; out [B, Hq, D] in the activation dtype.
 * window > 0: keys j with seq_len - 1 - window < j only; softcap > 0: cap the scaled scores.
 * Returns 0, or -1 when scratch memory could not be allocated (out is then incomplete). */
int paged_decode_attention(const DecodeStep *step, const void *rows, int64_t row_stride,
                           void *k_cache, void *v_cache, void *out, float scale, int64_t window,
                           float softcap) {
    const int nthreads = step->nthreads;
    const int64_t tasks = step->batch * task_splits(step);
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && tasks > 1)
    {
        if (attention_tasks(step, rows, row_stride, k_cache, v_cache, out, scale, window,
                            softcap)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed ? -1 : 0;
}

int decode_attention_shared(const DecodeStep *step, const void *rows, int64_t row_stride,
                            void *k_cache, void *v_cache, void *out, float scale, int64_t window,
                            float softcap) {
    if (step->nthreads > 1)
        return attention_tasks(step, rows, row_stride, k_cache, v_cache, out, scale, window,
                               softcap);
    if (omp_get_thread_num() == 0) /* a nested region: runs on this thread alone */
        return paged_decode_attention(step, rows, row_stride, k_cache, v_cache, out, scale,
                                      window, softcap);
    return 0;
}

/* A decode layer's qkv projection and attention in one parallel region of nthreads (the GEMM's
 * team): rows = x [batch, k] . W^T (+ bias) with n = (Hq + 2 Hkv) D outputs, W packed for the
 * panel GEMM (panel_gemm.c), into `rows` [batch, n] (fp32 activations), then
 * paged_decode_attention over them (step->slots and the rotary tables set: the call writes the
 * new K/V). A separate attention region costs a wake-up of the team's sleeping threads per layer
 * with passive waiting; inside the projection's region they go on to the attention after a spin
 * barrier (figures: docs/PERFORMANCE.md#fused-qkv-and-attention). Attention sized for one thread
 * (step->nthreads) stays on the caller's. projection_seconds, when not NULL, receives the time
 * from the call's start to the barrier (the projection, the team's wake-up included) for the step
 * profile (engine/model/step_profile.py). Returns as paged_decode_attention. Narrow-weight
 * layers run whole in narrow_decode.c. */
int decode_qkv_attention(const DecodeStep *step, const float *x, int64_t k, const float *packed,
                         int64_t n, const float *bias, float *rows, void *k_cache, void *v_cache,
                         void *out, float scale, int64_t window, float softcap, int nthreads,
                         double *projection_seconds) {
    int failed = 0, arrived = 0;
    const double started = projection_seconds ? omp_get_wtime() : 0.0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        panel_gemm_shared(x, step->batch, k, packed, n, 0, 0, bias, rows);
        spin_barrier(&arrived, omp_get_num_threads());
        if (projection_seconds && omp_get_thread_num() == 0)
            *projection_seconds = omp_get_wtime() - started;
        if (decode_attention_shared(step, rows, n, k_cache, v_cache, out, scale, window,
                                    softcap)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed ? -1 : 0;
}

/* The bytes a decode step's attention reads, read and nothing else: for every layer (pools
 * [K0, V0, K1, V1, ...]) and every sequence, the K then V rows [0, seq_lens[b]) of its blocks,
 * through its block table, sequences spread over nthreads (one parallel region for all layers, no
 * barrier between them). block_bytes: one block of one pool. Returns the XOR of all the 64-bit
 * words read (so that the reads happen; a block's rows are contiguous and row_bytes a multiple of
 * 8). The benchmark's floor for attention on this machine's memory (scripts/bench_engine.py). */
uint64_t read_paged_kv(void *const *pools, int64_t num_layers, const int32_t *block_tables,
                       int64_t table_stride, const int32_t *seq_lens, int64_t batch,
                       int64_t block_size, int64_t row_bytes, int nthreads) {
    const int64_t block_bytes = block_size * row_bytes;
    uint64_t mix = 0;
#pragma omp parallel num_threads(nthreads) reduction(^ : mix)
    for (int64_t layer = 0; layer < num_layers; layer++) {
#pragma omp for schedule(dynamic) nowait
        for (int64_t b = 0; b < batch; b++) {
            const int32_t *table = block_tables + b * table_stride;
            for (int kv = 0; kv < 2; kv++) {
                const char *pool = pools[2 * layer + kv];
                for (int64_t block = 0, left = seq_lens[b]; left > 0; block++, left -= block_size) {
                    const uint64_t *words = (const uint64_t *)(pool + table[block] * block_bytes);
                    const int64_t count = (left < block_size ? left : block_size) * row_bytes / 8;
                    uint64_t block_mix = 0;
#pragma omp simd reduction(^ : block_mix)
                    for (int64_t w = 0; w < count; w++) block_mix ^= words[w];
                    mix ^= block_mix;
                }
            }
        }
    }
    return mix;
}
