/* Per-row routines shared by the kernels: fp32 / bf16 element access and the residual add +
 * RMSNorm of a row (fused_ops.c's entry points; quant_gemm.c's MLP block, in fp32). */
#ifndef MODELYARD_ROW_OPS_H
#define MODELYARD_ROW_OPS_H
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* Element i of an fp32 or (bf16) bfloat16 array, as fp32; and the store that rounds to it. */
static inline float load(const void *p, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, const int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

#define ROW_ROUTINE static inline __attribute__((always_inline)) void

/* Row r: x += delta (when given; rounded to the dtype, as the model's add is), then
 * out = x / rms(x) * weight. */
ROW_ROUTINE add_rms_norm_row(void *x, const void *delta, const void *weight, void *out, int64_t r,
                             int64_t hidden, float eps, const int bf16) {
    const int64_t at = r * hidden;
    float sum = 0.0f;
    if (delta) {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = at; i < at + hidden; i++) {
            store(x, i, load(x, i, bf16) + load(delta, i, bf16), bf16);
            const float v = load(x, i, bf16);
            sum += v * v;
        }
    } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = at; i < at + hidden; i++) sum += load(x, i, bf16) * load(x, i, bf16);
    }
    const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++)
        store(out, at + i, load(x, at + i, bf16) * inv * load(weight, i, bf16), bf16);
}

#endif
