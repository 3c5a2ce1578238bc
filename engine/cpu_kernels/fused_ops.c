#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* dst row slots[t] = src row t (row_bytes each; src rows row_stride bytes apart): the new tokens'
   K or V written into their cache slots. */
void scatter_rows(const char *src, int64_t src_row_stride, char *dst, const int64_t *slots,
                  int64_t rows, int64_t row_bytes) {
    for (int64_t t = 0; t < rows; t++)
        memcpy(dst + slots[t] * row_bytes, src + t * src_row_stride, (size_t)row_bytes);
}
