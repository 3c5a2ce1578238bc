/* Fused paged decode attention on CPU: one query token per sequence, K/V read from the block
 * pools through the block tables (no batch-wide gather copy). Arithmetic is fp32; query rows and
 * output are fp32 or bfloat16 (a bf16 model's activations), the pools fp32 or bfloat16. In a
 * decode-only step the same call first rotates the new token's q and k heads and writes its K and
 * V into their slots (DecodeStep.slots / cos / sin), so a layer's attention is one call.
 *
 * One task per sequence (per sequence and KV head when the batch is too small to keep the threads
 * busy). A task walks its visible keys once, a tile of up to TILE consecutive slots of one block at
 * a time, with an online softmax (running max and sum per query head, the output rescaled when the
 * max grows): scores of the tile's K rows, then their weights times the V rows added into the
 * output. K and V are read once, in slot order (a block's rows for all KV heads are contiguous),
 * and the next tile's rows are asked for a few at a time while the current one computes: at
 * SmolLM2's shapes, batch 64 and pools not in cache (a decode step's weights evict them) this made
 * the kernel 1.3x faster (19 GB/s of the 23 GB/s that a plain read of the same 12 KiB blocks gets
 * on 2 cores). The G = Hq / Hkv query heads of a KV head share each tile. Tasks are
 * spread over an OpenMP team; linked against torch's libgomp (same soname, loaded first) the team
 * comes from torch's thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "bf16.h"
#include "fast_exp.h"

#define TILE 16

/* Rows of the tile that starts at position j of a sequence: up to TILE, within j's block. */
static inline int64_t tile_length(int64_t j, int64_t seq_len, int64_t block_size) {
    int64_t n = block_size - j % block_size < TILE ? block_size - j % block_size : TILE;
    return seq_len - j < n ? seq_len - j : n;
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

/* One KV head's rows in the tile after the current one, asked for while the current one computes
 * so that memory and arithmetic overlap. */
typedef struct {
    const char *k, *v;           /* the head's part of the tile's first K and V row; NULL: none */
    int64_t stride, bytes, rows; /* bytes from row to row, bytes of the head's part, rows */
} NextRows;

/* Asks for row t of the next tile (its K and V part) into L2. Called for a few rows at a time
 * between the current tile's loads: ~400 prefetches issued at once (a whole tile) wait on the
 * core's dozen or so fill buffers and stall it instead, which measured no faster than none. */
static inline void prefetch_next_row(const NextRows *next, int64_t t) {
    if (next->k == NULL || t >= next->rows) return;
    for (int64_t offset = 0; offset < next->bytes; offset += 64) {
        __builtin_prefetch(next->k + t * next->stride + offset, 0, 2);
        __builtin_prefetch(next->v + t * next->stride + offset, 0, 2);
    }
}

/* Running softmax state of one query head. */
typedef struct {
    float max, sum;
} Running;

/* Moves a query head's running max up to tile_max when it is larger, rescaling what was summed
 * under the old max: the running sum and the output accumulator o. */
static inline void raise_max(Running *r, float tile_max, float *o, int64_t head_dim) {
    if (!(tile_max > r->max)) return;
    const float alpha = exp_nonpositive(r->max - tile_max);
    r->sum *= alpha;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; d++) o[d] *= alpha;
    r->max = tile_max;
}

/* Softmax weights of a tile's scores s[0..n) for one query head: caps them (softcap > 0), moves
 * the running max up (raise_max), leaves e^(s - max) in s. */
static inline void tile_weights(float *s, int64_t n, float softcap, Running *r, float *o,
                                int64_t head_dim) {
    float tile_max = -INFINITY; /* a NaN score is skipped here but makes its weight, the sum and
                                   so the output NaN, as in torch */
    for (int64_t t = 0; t < n; t++) {
        if (softcap > 0.0f) s[t] = softcap * tanhf(s[t] / softcap);
        tile_max = s[t] > tile_max ? s[t] : tile_max;
    }
    raise_max(r, tile_max, o, head_dim);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - r->max);
        sum += s[t];
    }
    r->sum += sum;
}

/* One tile (n <= TILE rows, rs floats apart) of one KV head for its `group` query heads: q and o
 * are [group, head_dim], running [group]. Asks for the next tile's rows on the way (next). */
static void attend_tile_portable(const float *q, const float *k, const float *v, int64_t rs,
                                 int64_t n, int64_t group, int64_t head_dim, float softcap,
                                 Running *running, float *out, const NextRows *next) {
    float s[TILE];
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * head_dim;
        float *o = out + g * head_dim;
        for (int64_t t = 0; t < n; t++) {
            const float *kt = k + t * rs;
            float acc = 0.0f;
            if (t % group == g) prefetch_next_row(next, t); /* spread over the group's passes */
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < head_dim; d++) acc += qg[d] * kt[d];
            s[t] = acc;
        }
        tile_weights(s, n, softcap, &running[g], o, head_dim);
        int64_t t = 0;
        for (; t + 4 <= n; t += 4) { /* four V rows per read-modify-write of o */
            const float *v0 = v + t * rs;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++)
                o[d] += s[t] * v0[d] + s[t + 1] * v0[rs + d] + s[t + 2] * v0[2 * rs + d] +
                        s[t + 3] * v0[3 * rs + d];
        }
        for (; t < n; t++) {
            const float *vt = v + t * rs;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) o[d] += s[t] * vt[d];
        }
    }
}

#ifdef __AVX512F__
/* exp_nonpositive on 16 lanes: the same reduction and polynomial, 2^n applied by scalef. */
static inline __m512 exp_nonpositive16(__m512 x) {
    const __m512 floor_ = _mm512_set1_ps(-87.3f);
    const __m512 clamped = _mm512_max_ps(x, floor_); /* NaN -> -87.3 (max returns the 2nd) */
    const __m512 scaled = _mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    y = _mm512_scalef_ps(y, n);
    const __mmask16 in_range = _mm512_cmp_ps_mask(x, floor_, _CMP_GT_OQ);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(_mm512_maskz_mov_ps(in_range, y), nan, x);
}

/* Elements d..d+15 of a row as fp32: loaded, or bf16 widened in the register (bf16 is the top half
 * of an fp32), which measured 1.1x faster than widening a tile into a buffer first. */
static inline __m512 load16(const void *row, int64_t d, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)row + d);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* attend_tile_portable for head_dim % 64 == 0 with AVX-512, 64 dims (4 registers) of a row at a
 * time: per query head the 16 rows' dot products accumulate in 16 registers reduced together
 * (sum_lanes16), the softmax step runs on all 16 scores at once, then o accumulates the weighted V
 * rows in 8 registers (two interleaved chains per 16 dims, so the adds do not wait on each other).
 * Rows past n repeat row n - 1 with weight 0, so every load is a real row of the tile. The rows
 * hold bf16 when bf16 (a constant in each inlined copy), else fp32. */
static inline void attend_tile_avx512(const float *q, const void *k, const void *v, int64_t rs,
                                      int64_t n, int64_t group, int64_t head_dim, float softcap,
                                      Running *running, float *out, const NextRows *next,
                                      const int bf16) {
    const int64_t row_bytes = rs * (bf16 ? 2 : 4);
    const char *k_rows[TILE], *v_rows[TILE];
    for (int t = 0; t < TILE; t++) {
        const int64_t row = t < n ? t : n - 1;
        k_rows[t] = (const char *)k + row * row_bytes;
        v_rows[t] = (const char *)v + row * row_bytes;
    }
    const __mmask16 valid = (__mmask16)((1u << n) - 1);
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * head_dim;
        float *o = out + g * head_dim;
        Running *r = &running[g];
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
                    acc[t] =
                        _mm512_fmadd_ps(qd[c], load16(k_rows[t], d + 16 * c, bf16), acc[t]);
                if (d == 0 && t % group == g) prefetch_next_row(next, t);
            }
        }
        __m512 scores = sum_lanes16(acc);
        if (softcap > 0.0f) {
            float s[TILE];
            _mm512_storeu_ps(s, scores);
            for (int t = 0; t < TILE; t++) s[t] = softcap * tanhf(s[t] / softcap);
            scores = _mm512_loadu_ps(s);
        }
        /* NaN scores may or may not win this max; either way their weights, the sum and so the
           output turn NaN, as in torch */
        raise_max(r, _mm512_mask_reduce_max_ps(valid, scores), o, head_dim);
        const __m512 shifted = _mm512_sub_ps(scores, _mm512_set1_ps(r->max));
        const __m512 weights = _mm512_maskz_mov_ps(valid, exp_nonpositive16(shifted));
        r->sum += _mm512_reduce_add_ps(weights);
        float w[TILE];
        _mm512_storeu_ps(w, weights);
        for (int64_t d = 0; d < head_dim; d += 64) {
            __m512 od[8];
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                od[c] = _mm512_loadu_ps(o + d + 16 * c);
                od[4 + c] = _mm512_setzero_ps();
            }
#pragma GCC unroll 16
            for (int t = 0; t < TILE; t++) {
                const __m512 wt = _mm512_set1_ps(w[t]);
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++)
                    od[(t & 1) * 4 + c] = _mm512_fmadd_ps(
                        wt, load16(v_rows[t], d + 16 * c, bf16), od[(t & 1) * 4 + c]);
            }
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++)
                _mm512_storeu_ps(o + d + 16 * c, _mm512_add_ps(od[c], od[4 + c]));
        }
    }
}
#endif

/* Whether attend_tile takes the AVX-512 routine for this head_dim, which also reads bf16 rows
 * itself (the portable one needs them widened to fp32 first). */
static inline int avx512_tiles(int64_t head_dim) {
#ifdef __AVX512F__
    return head_dim % 64 == 0;
#else
    (void)head_dim;
    return 0;
#endif
}

/* The tile routine for this head_dim on this CPU; k and v rows hold bf16 when bf16 (only where
 * avx512_tiles), else fp32. */
static void attend_tile(const float *q, const void *k, const void *v, int64_t rs, int64_t n,
                        int64_t group, int64_t head_dim, float softcap, Running *running,
                        float *out, const NextRows *next, int bf16) {
#ifdef __AVX512F__
    if (avx512_tiles(head_dim)) { /* one copy per element type, the branch out of the loops */
        if (bf16)
            attend_tile_avx512(q, k, v, rs, n, group, head_dim, softcap, running, out, next, 1);
        else
            attend_tile_avx512(q, k, v, rs, n, group, head_dim, softcap, running, out, next, 0);
        return;
    }
#endif
    attend_tile_portable(q, k, v, rs, n, group, head_dim, softcap, running, out, next);
}

/* What every layer's decode attention call of one step shares (filled once per step). */
typedef struct {
    int64_t batch, q_heads, kv_heads, head_dim, block_size;
    const int32_t *block_tables; /* [batch, table_stride] */
    int64_t table_stride;
    const int32_t *seq_lens; /* context lengths including the current token */
    /* The fused step: each sequence's row also holds its new token's K and V heads (after the q
       heads), written at slots[b] before attending. NULL: the pools already hold them. */
    const int64_t *slots;
    /* fp32 rotary tables [batch, head_dim] applied to the row's q and k heads first; NULL: the
       rows are rotated already. */
    const float *cos, *sin;
    int kv_bf16;  /* the pools hold bfloat16, else fp32 */
    int act_bf16; /* rows and output are bfloat16 (a bf16 model's activations), else fp32 */
    int nthreads;
} DecodeStep;

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
 * over the two halves of a head, as in engine/cpu_kernels/fused_ops.c), times scale. */
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
 * output and two fp32 tiles (see paged_decode_attention). */
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
    float *k_buf = value + head_dim + q_heads * head_dim, *v_buf = k_buf + TILE * rs;
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
    const int64_t element = k_pool->bf16 ? 2 : 4;
    const int widen = k_pool->bf16 && !avx512_tiles(head_dim); /* bf16 tiles to fp32 copies */
    const int64_t tile_element = widen ? 4 : element;
    for (int64_t j = first, n = tile_length(j, seq_len, block_size); j < seq_len;) {
        const int64_t block = table[j / block_size], slot = j % block_size;
        const int64_t next_n = tile_length(j + n, seq_len, block_size);
        const char *next_k = NULL, *next_v = NULL; /* the next tile's first rows */
        if (next_n > 0) {
            const int64_t next_block = table[(j + n) / block_size];
            next_k = row_at(k_pool, next_block, (j + n) % block_size);
            next_v = row_at(v_pool, next_block, (j + n) % block_size);
        }
        const char *k_tile = widen ? (const char *)widened_rows(k_pool, block, slot, n, k_buf)
                                   : row_at(k_pool, block, slot);
        const char *v_tile = widen ? (const char *)widened_rows(v_pool, block, slot, n, v_buf)
                                   : row_at(v_pool, block, slot);
        for (int64_t h = h_begin; h < h_end; h++) {
            const int64_t qh = (h - h_begin) * group; /* first query head of KV head h */
            const int64_t head_bytes = head_dim * element;
            const NextRows next = {next_k ? next_k + h * head_bytes : NULL,
                                   next_v ? next_v + h * head_bytes : NULL,
                                   k_pool->row_stride * element, head_bytes, next_n};
            attend_tile(q_scaled + qh * head_dim, k_tile + h * head_dim * tile_element,
                        v_tile + h * head_dim * tile_element, rs, n, group, head_dim, softcap,
                        running + qh, acc + qh * head_dim, &next, k_pool->bf16 && !widen);
        }
        j += n;
        n = next_n;
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
 * per call is an mmap + page faults + munmap, ~10 us, more than a batch-1 layer's attention. The
 * threads are torch's OpenMP pool (and the engine's caller thread), so there are a handful. */
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

/* One layer's decode attention of a step: sequence b's row at rows + b * row_stride elements (q
 * heads, then with step->slots its new K and V heads; fp32, or bf16 with step->act_bf16);
 * k_cache/v_cache [num_blocks, block_size, Hkv, D]; out [B, Hq, D] in the activation dtype.
 * window > 0: keys j with seq_len - 1 - window < j only; softcap > 0: cap the scaled scores.
 * Returns 0, or -1 when scratch memory could not be allocated (out is then incomplete). */
int paged_decode_attention(const DecodeStep *step, const void *rows, int64_t row_stride,
                           void *k_cache, void *v_cache, void *out, float scale, int64_t window,
                           float softcap) {
    const int64_t kv_heads = step->kv_heads, head_dim = step->head_dim;
    const int64_t q_heads = step->q_heads, group = q_heads / kv_heads;
    const int64_t pool_row = kv_heads * head_dim, element = step->act_bf16 ? 2 : 4;
    const int nthreads = step->nthreads;
    /* scaled queries, a key and a value, the fp32 output, then a K and a V tile (bf16 widened) */
    const size_t scratch_floats = (size_t)((2 * q_heads + 2) * head_dim + 2 * TILE * pool_row);
    const Pool k_pool = {k_cache, step->kv_bf16, step->block_size * pool_row, pool_row};
    const Pool v_pool = {v_cache, step->kv_bf16, step->block_size * pool_row, pool_row};
    /* Few sequences cannot keep the team busy: then split each one by KV head. */
    const int64_t splits = (nthreads > 1 && step->batch < 2 * nthreads) ? kv_heads : 1;
    const int64_t heads_per_task = kv_heads / splits, tasks = step->batch * splits;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && tasks > 1)
    {
        float *scratch = thread_scratch(scratch_floats);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t t = 0; t < tasks; t++) {
            if (scratch == NULL) continue;
            const int64_t b = t / splits, h_begin = t % splits * heads_per_task;
            const int64_t out_at = (b * q_heads + h_begin * group) * head_dim;
            attend_sequence(step, b, (const char *)rows + b * row_stride * element, &k_pool,
                            &v_pool, (char *)out + out_at * element, scratch, h_begin,
                            h_begin + heads_per_task, scale, window, softcap);
        }
    }
    return failed ? -1 : 0;
}
