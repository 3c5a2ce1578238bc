/* The panel GEMM's work-sharing form, for kernels that run it inside their own parallel region
 * (panel_gemm.c). */
#ifndef MODELYARD_PANEL_GEMM_H
#define MODELYARD_PANEL_GEMM_H
#include <stdint.h>

void panel_gemm_shared(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                       int64_t half, int gated, const float *bias, float *y);

#endif
