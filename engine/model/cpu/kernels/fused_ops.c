/* The lean forward's elementwise glue, fp32 and bf16 (fused_ops.py beside this file), and the
 * sampler's greedy argmax (argmax.py). The bf16 versions widen to fp32
 * (exactly), compute in fp32 and round each result once. Each entry point is a row loop over one
 * per-row routine, inlined with its element type fixed, so that gcc vectorises each version on its
 * own. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fast_exp.h"
#include "row_ops.h"

/* The loop of every entry point over its rows r: split over `nthreads` threads when above 1. */
#define FOR_EACH_ROW(count)                                                                    \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)")        \
    for (int64_t r = 0; r < (count); r++)

/* Token t: rotary embedding in place on `heads` heads of head_dim at the start of its row of qk
 * (rows `stride` elements apart): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, halves of a head;
 * cos/sin [tokens, head_dim] in the same dtype. */
ROW_ROUTINE rope_row(void *qk, int64_t stride, const void *cos, const void *sin, int64_t t,
                     int64_t heads, int64_t head_dim, const int bf16) {
    const int64_t half = head_dim / 2, angles = t * head_dim;
    for (int64_t h = 0; h < heads; h++) {
        const int64_t x = t * stride + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float x1 = load(qk, x + i, bf16), x2 = load(qk, x + i + half, bf16);
            store(qk, x + i,
                  x1 * load(cos, angles + i, bf16) - x2 * load(sin, angles + i, bf16), bf16);
            store(qk, x + i + half,
                  x2 * load(cos, angles + i + half, bf16) + x1 * load(sin, angles + i + half, bf16),
                  bf16);
        }
    }
}

/* Row r: out = silu(gate) * up of the row [gate | up] (2 * width elements), the MLP's
 * activation. */
ROW_ROUTINE silu_mul_row(const void *gate_up, void *out, int64_t r, int64_t width, const int bf16) {
    const int64_t gate = r * 2 * width, up = gate + width;
#pragma omp simd
    for (int64_t i = 0; i < width; i++)
        store(out, r * width + i, silu(load(gate_up, gate + i, bf16)) * load(gate_up, up + i, bf16),
              bf16);
}

void add_rms_norm_f32(float *x, const float *delta, const float *weight, float *out,
                      int64_t rows, int64_t hidden, float eps, int nthreads) {
    FOR_EACH_ROW(rows) add_rms_norm_row(x, delta, weight, out, r, hidden, eps, 0);
}

void add_rms_norm_bf16(uint16_t *x, const uint16_t *delta, const uint16_t *weight, uint16_t *out,
                       int64_t rows, int64_t hidden, float eps, int nthreads) {
    FOR_EACH_ROW(rows) add_rms_norm_row(x, delta, weight, out, r, hidden, eps, 1);
}

void rope_f32(float *qk, int64_t stride, const float *cos, const float *sin, int64_t tokens,
              int64_t heads, int64_t head_dim, int nthreads) {
    FOR_EACH_ROW(tokens) rope_row(qk, stride, cos, sin, r, heads, head_dim, 0);
}

void rope_bf16(uint16_t *qk, int64_t stride, const uint16_t *cos, const uint16_t *sin,
               int64_t tokens, int64_t heads, int64_t head_dim, int nthreads) {
    FOR_EACH_ROW(tokens) rope_row(qk, stride, cos, sin, r, heads, head_dim, 1);
}

void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t width, int nthreads) {
    FOR_EACH_ROW(rows) silu_mul_row(gate_up, out, r, width, 0);
}

void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t width,
                   int nthreads) {
    FOR_EACH_ROW(rows) silu_mul_row(gate_up, out, r, width, 1);
}

/* out[r] = the first index of row r's largest value, or of its first NaN if it has one (what
 * torch.max(dim=-1) answers): a greedy token per logits row. A vectorised max over the row (NaN
 * noted), then the search for its first position 64 elements at a time, from L2 (a row is a
 * vocabulary's worth), where torch's max with indices took a visible share of a decode step
 * (figures: docs/PERFORMANCE.md#step-bookkeeping). */
ROW_ROUTINE argmax_row(const void *x, int64_t *out, int64_t r, int64_t cols, const int bf16) {
    const int64_t at = r * cols, end = at + cols;
    float best = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
    for (int64_t i = at; i < end; i++) {
        const float v = load(x, i, bf16);
        best = v > best ? v : best;
        nan |= v != v;
    }
    out[r] = 0; /* a row of -inf: its first */
    for (int64_t chunk = at; chunk < end; chunk += 64) {
        const int64_t stop = chunk + 64 < end ? chunk + 64 : end;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = chunk; i < stop; i++) {
            const float v = load(x, i, bf16);
            hit |= nan ? v != v : v == best;
        }
        if (!hit) continue;
        for (int64_t i = chunk; i < stop; i++) {
            const float v = load(x, i, bf16);
            if (nan ? v != v : v == best) {
                out[r] = i - at;
                return;
            }
        }
    }
}

void argmax_rows_f32(const float *x, int64_t *out, int64_t rows, int64_t cols, int nthreads) {
    FOR_EACH_ROW(rows) argmax_row(x, out, r, cols, 0);
}

void argmax_rows_bf16(const uint16_t *x, int64_t *out, int64_t rows, int64_t cols,
                      int nthreads) {
    FOR_EACH_ROW(rows) argmax_row(x, out, r, cols, 1);
}

/* dst row slots[t] = src row t (row_bytes each; src rows row_stride bytes apart): the new tokens'
 * K or V written into their cache slots. */
void scatter_rows(const char *src, int64_t src_row_stride, char *dst, const int64_t *slots,
                  int64_t rows, int64_t row_bytes) {
    for (int64_t t = 0; t < rows; t++)
        memcpy(dst + slots[t] * row_bytes, src + t * src_row_stride, (size_t)row_bytes);
}
