/* The narrow-weight GEMM's work-sharing form (quant_gemm.c), for kernels that run it inside their
 * own parallel region (narrow_decode.c). */
#ifndef MODELYARD_QUANT_GEMM_H
#define MODELYARD_QUANT_GEMM_H
#include <stdint.h>

#define QUANT_BLOCK 32 /* inputs per block of a weight row and of the quantised activations */

/* One row of activations quantised: q [k] int8, d [nb] scales, s [nb] = d * sum(q) per block of
 * QUANT_BLOCK, c [3 nb] = -128 * sum(q) of each block's elements 0-15, 16-31 and all 32: the
 * corrections of the weights' unsigned int8s (quant_gemm.c). */
typedef struct {
    int8_t *q;
    float *d;
    float *s;
    int32_t *c;
} QuantRow;

/* A linear layer on narrow weights: W [n, k] packed by quant_pack, bias [n] or NULL. */
typedef struct {
    int format;
    const uint8_t *packed;
    int64_t n, k;
    const float *bias;
} NarrowLinear;

/* m rows of k activations' QuantRows and their storage in one block (free() releases it), or
 * NULL when out of memory. */
QuantRow *quant_rows_alloc(int64_t m, int64_t k);

/* Rows first, first + step, ... below m of x [m, k] quantised into rows: split over a team by
 * giving each thread its own first. */
void quant_rows_fill(const float *x, int64_t m, int64_t k, QuantRow *rows, int64_t first,
                     int64_t step);

/* y [m, n] = the quantised rows times W^T (+ bias), its tiles shared over the calling team (an
 * orphaned work-sharing loop without a barrier at its end). */
void quant_gemm_shared(const NarrowLinear *w, const QuantRow *rows, int64_t m, float *y);

/* The gated MLP's activation on the gate: silu (Llama's SwiGLU) or the tanh-approximated gelu
 * (Gemma's GeGLU). */
enum { ACT_SILU, ACT_GELU_TANH };

/* act [m, width] = activation(gate) * up of a [gate; up] weight (gate_up->n = 2 width,
 * width % 8 == 0: each gate group beside its up group), shared like quant_gemm_shared. */
void quant_gated_shared(const NarrowLinear *gate_up, const QuantRow *rows, int64_t m, float *act,
                        int activation);

#endif
