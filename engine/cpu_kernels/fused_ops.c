#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fast_exp.h"

/* x += delta (when delta is given), then out = x / rms(x) * weight, row by row. */
void add_rms_norm_f32(float *x, const float *delta, const float *weight, float *out,
                      int64_t rows, int64_t hidden, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * hidden;
        float *o = out + r * hidden;
        float sum = 0.0f;
        if (delta) {
            const float *d = delta + r * hidden;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < hidden; i++) {
                float v = xr[i] + d[i];
                xr[i] = v;
                sum += v * v;
            }
        } else {
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < hidden; i++) sum += xr[i] * xr[i];
        }
        float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) o[i] = xr[i] * inv * weight[i];
    }
}

/* Rotary embedding in place on `heads` heads of head_dim at the start of each row of qk
   (row stride `stride` floats): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, halves of a head. */
void rope_f32(float *qk, int64_t stride, const float *cos, const float *sin, int64_t tokens,
              int64_t heads, int64_t head_dim, int nthreads) {
    int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * head_dim;
        const float *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *x = qk + t * stride + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
}

/* silu(x) = x * sigmoid(x), sigmoid through e^-|x| so that nothing overflows. */
static inline float silu(float x) {
    const float e = exp_nonpositive(-fabsf(x));
    return x * (x >= 0.0f ? 1.0f : e) / (1.0f + e);
}

/* out[t] = silu(gate) * up for rows [gate | up] of 2 * width floats: the MLP's activation. */
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t width, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * width, *up = gate + width;
        float *o = out + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; i++) o[i] = silu(gate[i]) * up[i];
    }
}

/* dst row slots[t] = src row t (row_bytes each; src rows row_stride bytes apart): the new tokens'
   K or V written into their cache slots. */
void scatter_rows(const char *src, int64_t src_row_stride, char *dst, const int64_t *slots,
                  int64_t rows, int64_t row_bytes) {
    for (int64_t t = 0; t < rows; t++)
        memcpy(dst + slots[t] * row_bytes, src + t * src_row_stride, (size_t)row_bytes);
}

/* bfloat16 versions: values widen to fp32 (bf16 is an fp32's top half), arithmetic is fp32, and
   each result is rounded once to the nearest bf16 (ties to even). */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* As add_rms_norm_f32; the updated residual x is rounded to bf16 (as a bf16 model's add is). */
void add_rms_norm_bf16(uint16_t *x, const uint16_t *delta, const uint16_t *weight, uint16_t *out,
                       int64_t rows, int64_t hidden, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *xr = x + r * hidden;
        uint16_t *o = out + r * hidden;
        float sum = 0.0f;
        if (delta) {
            const uint16_t *d = delta + r * hidden;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < hidden; i++) {
                const uint16_t rounded = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(d[i]));
                const float v = bf16_to_f32(rounded);
                xr[i] = rounded;
                sum += v * v;
            }
        } else {
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < hidden; i++) sum += bf16_to_f32(xr[i]) * bf16_to_f32(xr[i]);
        }
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++)
            o[i] = f32_to_bf16(bf16_to_f32(xr[i]) * inv * bf16_to_f32(weight[i]));
    }
}

/* As rope_f32 on bf16 rows, with bf16 cos/sin tables. */
void rope_bf16(uint16_t *qk, int64_t stride, const uint16_t *cos, const uint16_t *sin,
               int64_t tokens, int64_t heads, int64_t head_dim, int nthreads) {
    int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * head_dim;
        const uint16_t *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *x = qk + t * stride + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
                x[i] = f32_to_bf16(x1 * bf16_to_f32(c[i]) - x2 * bf16_to_f32(s[i]));
                x[i + half] =
                    f32_to_bf16(x2 * bf16_to_f32(c[i + half]) + x1 * bf16_to_f32(s[i + half]));
            }
        }
    }
}

/* As silu_mul_f32 on bf16 rows; the product is rounded once. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t width,
                   int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * width, *up = gate + width;
        uint16_t *o = out + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; i++)
            o[i] = f32_to_bf16(silu(bf16_to_f32(gate[i])) * bf16_to_f32(up[i]));
    }
}
