/* Decode attention over the paged pools (paged_decode.c): the step's shared layout and the
 * work-sharing form of a layer's attention, for kernels that run it inside their own parallel
 * region (narrow_decode.c). */
#ifndef MODELYARD_PAGED_DECODE_H
#define MODELYARD_PAGED_DECODE_H
#include <stdint.h>

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

/* One layer's decode attention (paged_decode_attention's arguments) run by the calling team: its
 * tasks shared over the team when step->nthreads > 1, else by the team's thread 0 alone; no
 * barrier at its end. Returns -1 when this thread's scratch could not be allocated, else 0. */
int decode_attention_shared(const DecodeStep *step, const void *rows, int64_t row_stride,
                            void *k_cache, void *v_cache, void *out, float scale, int64_t window,
                            float softcap);

#endif
