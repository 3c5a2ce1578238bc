/* Fused paged decode attention on CPU: one query token per sequence, K/V read from the block
 * pools through the block tables (no batch-wide gather copy). Query, output and all arithmetic are
 * fp32; the pools hold fp32 or bfloat16.
 *
 * One task per sequence (per sequence and KV head when the batch is too small to keep the threads
 * busy). Two passes over its visible keys, CHUNK keys at a time staged as fp32 rows in a small
 * per-thread buffer: scores (scaled, optionally soft-capped) into a per-thread scratch, then a
 * max-subtracted softmax whose weights accumulate V rows into the output. The G = Hq / Hkv query
 * heads of a KV head share each K/V row load. Tasks are spread over an OpenMP team; linked against
 * torch's libgomp (same soname, loaded first) the team comes from torch's thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Visible keys of a query at position seq_len - 1: [first, seq_len). */
static int64_t first_visible(int64_t seq_len, int64_t window) {
    int64_t first = window > 0 ? seq_len - window : 0;
    return first > 0 ? first : 0;
}

/* Dot products of one query head with four key rows: four independent FMA chains per step. */
static inline void dot4(const float *q, const float *k0, const float *k1, const float *k2,
                        const float *k3, int64_t head_dim, float *s) {
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t d = 0; d < head_dim; d++) {
        a0 += q[d] * k0[d];
        a1 += q[d] * k1[d];
        a2 += q[d] * k2[d];
        a3 += q[d] * k3[d];
    }
    s[0] = a0, s[1] = a1, s[2] = a2, s[3] = a3;
}

static inline float dot1(const float *q, const float *k, int64_t head_dim) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < head_dim; d++) acc += q[d] * k[d];
    return acc;
}

/* e^x for max-subtracted scores (x <= 0), written so that gcc vectorises it (libm's expf stays
 * scalar without -ffast-math): 2^n times a degree-6 polynomial of the Cody-Waite reduced
 * argument. NaN stays NaN; x below -87.3 (including -inf) gives 0. */
static inline float exp_nonpositive(float x) {
    const float clamped = x > -87.3f ? x : -87.3f; /* NaN -> -87.3 here, restored below */
    const float n = floorf(clamped * 1.44269504088896341f + 0.5f);
    const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return x > -87.3f ? y * two_n : (x == x ? 0.0f : x);
}

static inline float cap(float s, float scale, float softcap) {
    s *= scale;
    return softcap > 0.0f ? softcap * tanhf(s / softcap) : s;
}

/* Keys staged (copied to fp32 rows) at once: a chunk of SmolLM2's K or V is 192 KiB, within L2. */
#define CHUNK 256

/* A K or V pool [num_blocks, block_size, Hkv, D], fp32 or bf16; strides in elements. */
typedef struct {
    const void *base;
    int bf16; /* elements are bfloat16, else float */
    int64_t block_stride, row_stride;
} Pool;

static inline const char *row_address(const Pool *pool, int64_t block, int64_t slot) {
    const int64_t element = pool->block_stride * block + pool->row_stride * slot;
    return (const char *)pool->base + element * (pool->bf16 ? 2 : 4);
}

/* Copy keys [begin, end) of a sequence (all heads) through its block table into buf as fp32 rows
 * of row_stride floats, widening bf16. Staging a chunk with block-sized copies before computing on
 * it keeps many cache-line loads in flight: with the pools out of cache (SmolLM2 shapes, batch 64)
 * computing on the rows in place ran ~20% slower. */
static void stage_rows(const Pool *pool, const int32_t *table, int64_t begin, int64_t end,
                       int64_t block_size, float *buf) {
    for (int64_t j = begin; j < end;) {
        const int64_t slot = j % block_size;
        const int64_t stop = (end - j < block_size - slot) ? end - j : block_size - slot;
        const char *rows = row_address(pool, table[j / block_size], slot);
        const int64_t count = stop * pool->row_stride; /* slots of a block are contiguous */
        float *dst = buf + (j - begin) * pool->row_stride;
        if (!pool->bf16) {
            memcpy(dst, rows, (size_t)count * sizeof(float));
        } else {
            const uint16_t *src = (const uint16_t *)rows;
#pragma omp simd
            for (int64_t i = 0; i < count; i++) {
                const uint32_t bits = (uint32_t)src[i] << 16; /* bf16: top half of an fp32 */
                memcpy(dst + i, &bits, sizeof bits);
            }
        }
        j += stop;
    }
}

/* Attention of one sequence's query heads of KV heads [h_begin, h_end) over its keys
 * [first, seq_len), staged CHUNK keys at a time. q/out point at the first of those query heads
 * ([Hq, D] rows); scores holds (h_end - h_begin) x G x count floats; buf CHUNK x Hkv x D floats. */
static void attend_sequence(const float *q, const Pool *k_pool, const Pool *v_pool,
                            const int32_t *table, int64_t seq_len, float *out, float *scores,
                            float *buf, int64_t h_begin, int64_t h_end, int64_t kv_heads,
                            int64_t group, int64_t head_dim, int64_t block_size, float scale,
                            int64_t window, float softcap) {
    const int64_t first = first_visible(seq_len, window);
    const int64_t count = seq_len - first;
    const int64_t heads = h_end - h_begin;
    const int64_t q_heads = heads * group; /* query heads of this task */
    const int64_t rs = kv_heads * head_dim; /* floats between two staged rows */

    memset(out, 0, (size_t)(q_heads * head_dim) * sizeof(float));
    if (count <= 0) return;
    /* Pass 1: scores[qh * count + i] for key first + i, four keys at a time. */
    for (int64_t c = 0; c < count; c += CHUNK) {
        const int64_t stop = count - c < CHUNK ? count - c : CHUNK;
        stage_rows(k_pool, table, first + c, first + c + stop, block_size, buf);
        for (int64_t h = 0; h < heads; h++) {
            const float *k = buf + (h_begin + h) * head_dim;
            float *s = scores + h * group * count + c;
            const float *qh = q + h * group * head_dim;
            int64_t n = 0;
            for (; n + 4 <= stop; n += 4)
                for (int64_t g = 0; g < group; g++) {
                    float *sg = s + g * count + n;
                    const float *kn = k + n * rs;
                    dot4(qh + g * head_dim, kn, kn + rs, kn + 2 * rs, kn + 3 * rs, head_dim, sg);
                    for (int i = 0; i < 4; i++) sg[i] = cap(sg[i], scale, softcap);
                }
            for (; n < stop; n++)
                for (int64_t g = 0; g < group; g++)
                    s[g * count + n] =
                        cap(dot1(qh + g * head_dim, k + n * rs, head_dim), scale, softcap);
        }
    }
    /* Softmax per query head, max-subtracted, normalised in place. */
    for (int64_t qh = 0; qh < q_heads; qh++) {
        float *sq = scores + qh * count;
        float max = -INFINITY; /* a NaN score is skipped here but makes its exp, the sum and so
                                  the whole output NaN, as in torch */
#pragma omp simd reduction(max : max)
        for (int64_t i = 0; i < count; i++) max = sq[i] > max ? sq[i] : max;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < count; i++) {
            sq[i] = exp_nonpositive(sq[i] - max);
            sum += sq[i];
        }
        const float inv_sum = 1.0f / sum;
        for (int64_t i = 0; i < count; i++) sq[i] *= inv_sum;
    }
    /* Pass 2: out[qh] = sum_i p[qh][i] * V[first + i], four V rows per read-modify-write of out. */
    for (int64_t c = 0; c < count; c += CHUNK) {
        const int64_t stop = count - c < CHUNK ? count - c : CHUNK;
        stage_rows(v_pool, table, first + c, first + c + stop, block_size, buf);
        for (int64_t h = 0; h < heads; h++) {
            const float *v = buf + (h_begin + h) * head_dim;
            const float *p = scores + h * group * count + c;
            float *oh = out + h * group * head_dim;
            int64_t n = 0;
            for (; n + 4 <= stop; n += 4)
                for (int64_t g = 0; g < group; g++) {
                    const float *pg = p + g * count + n, *vn = v + n * rs;
                    const float p0 = pg[0], p1 = pg[1], p2 = pg[2], p3 = pg[3];
                    float *og = oh + g * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++)
                        og[d] += p0 * vn[d] + p1 * vn[rs + d] + p2 * vn[2 * rs + d] +
                                 p3 * vn[3 * rs + d];
                }
            for (; n < stop; n++)
                for (int64_t g = 0; g < group; g++) {
                    const float pn = p[g * count + n], *vn = v + n * rs;
                    float *og = oh + g * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) og[d] += pn * vn[d];
                }
        }
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

/* query/out fp32 [B, Hq, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D], fp32 or (kv_bf16)
 * bfloat16; block_tables int32 [B, table_stride]; seq_lens int32 [B] (including the current
 * token, already in the cache). window > 0: keys j with seq_len - 1 - window < j only;
 * softcap > 0: cap the scaled scores. Returns 0, or -1 when scratch memory could not be allocated
 * (out is then incomplete). */
int paged_decode_attention(const float *query, const void *k_cache, const void *v_cache,
                           int kv_bf16, const int32_t *block_tables, int64_t table_stride,
                           const int32_t *seq_lens, float *out, int64_t batch, int64_t q_heads,
                           int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                           int64_t window, float softcap, int nthreads) {
    const int64_t group = q_heads / kv_heads;
    const int64_t row_stride = kv_heads * head_dim;
    int64_t max_count = 1;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t count = seq_lens[b] - first_visible(seq_lens[b], window);
        max_count = count > max_count ? count : max_count;
    }
    const size_t score_floats = (size_t)(q_heads * max_count);
    const size_t scratch = score_floats + (size_t)(CHUNK * row_stride);
    const Pool k_pool = {k_cache, kv_bf16, block_size * row_stride, row_stride};
    const Pool v_pool = {v_cache, kv_bf16, block_size * row_stride, row_stride};
    /* Few sequences cannot keep the team busy: then split each one by KV head. */
    const int64_t splits = (nthreads > 1 && batch < 2 * nthreads) ? kv_heads : 1;
    const int64_t heads_per_task = kv_heads / splits, tasks = batch * splits;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && tasks > 1)
    {
        float *scores = thread_scratch(scratch);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t t = 0; t < tasks; t++) {
            if (scores == NULL) continue;
            const int64_t b = t / splits, h_begin = t % splits * heads_per_task;
            const int64_t offset = (b * q_heads + h_begin * group) * head_dim;
            attend_sequence(query + offset, &k_pool, &v_pool, block_tables + b * table_stride,
                            seq_lens[b], out + offset, scores, scores + score_floats, h_begin,
                            h_begin + heads_per_task, kv_heads, group, head_dim, block_size,
                            scale, window, softcap);
        }
    }
    return failed ? -1 : 0;
}
