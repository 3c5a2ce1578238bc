/* A decode step's decoder layers on narrow weights in one call and one parallel region: for each
 * layer of the pre-norm Llama block (engine/model/cpu/lean_forward.py), with the extras of
 * engine/model/cpu/lean_layers.py's families in brackets (Qwen3's q/k norms; Gemma 3's sandwich
 * norms, GeGLU and per-layer rotary table),
 *
 *   x += delta; h = rms_norm(x) * input_norm       (delta: the previous layer's MLP output)
 *   rows = qkv(h); [each q and k head of rows = rms_norm(head) * qk_norm]
 *   attn = attention(rope(rows))                   (writes the token's K/V: paged_decode.c)
 *   out = o(attn); [out = rms_norm(out) * attn_out_norm]
 *   x += out; h = rms_norm(x) * post_norm
 *   delta = down(act(gate(h)) * up(h))             (act: silu [or tanh-approximated gelu])
 *   [delta = rms_norm(delta) * mlp_out_norm]
 *
 * then the model's head: x += delta; h = rms_norm(x) * final_norm; logits = lm_head(h) (when
 * asked for and narrow too), with the GEMMs of quant_gemm.c, activations quantised to int8 row
 * by row on the way in. The team syncs on spin barriers between the steps. One call per layer
 * and GEMM instead cost a wake-up of the team's sleeping threads per call (with passive waiting)
 * and the Python between the calls, which at batch 1 added up to more than streaming the weights
 * (figures: docs/PERFORMANCE.md#narrow-weights). */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "paged_decode.h"
#include "quant_gemm.h"
#include "row_ops.h"
#include "spin_barrier.h"

/* One decoder layer on narrow weights; gate_up is the MLP's [gate; up] (n = 2 down.k). The
 * extras' weights are NULL where the layer has none. */
typedef struct {
    const float *input_norm, *post_norm; /* RMSNorm weights [hidden] */
    float input_eps, post_eps;
    NarrowLinear qkv, o, gate_up, down;
    float scale;    /* attention's score scale */
    int64_t window; /* sliding window; 0: none */
    const float *qk_norm; /* per-head RMSNorm weights [(q_heads + kv_heads) * head_dim] */
    const float *attn_out_norm, *mlp_out_norm; /* RMSNorm weights [hidden] of o's and down's out */
    float qk_eps, attn_out_eps, mlp_out_eps;
    int activation; /* the gate's: ACT_SILU or ACT_GELU_TANH (quant_gemm.h) */
    int rope;       /* which of the call's rotary tables rotates its q and k heads */
} NarrowLayer;

/* The final norm and the lm_head (lm_head.packed NULL: not on narrow weights, the caller's). */
typedef struct {
    const float *norm;
    float eps;
    NarrowLinear lm_head;
} NarrowHead;

/* The step's fp32 activations, [batch, width] each. x: the residual stream (the embeddings in,
 * the last layer's stream out); h: out, the final norm's rows; logits: NULL, or out [batch,
 * vocabulary] (the lm_head's). The others are scratch: the MLP output, qkv rows, attention
 * output, o's output, the MLP's activation. And the step's rotary tables, rotary [cos0, sin0,
 * cos1, sin1, ...] of `tables` tables ([batch, head_dim] each), of which a layer's rope picks
 * one (Gemma 3: local and global). */
typedef struct {
    float *x, *delta, *qkv, *attn, *o_out, *h, *act, *logits;
    const float *const *rotary;
    int64_t tables;
} NarrowActivations;

/* Thread 0's clock per layer, for the step profile: seconds from the layer's start to the end of
 * the qkv GEMM and of attention (the team's wake-up is in the first layer's). */
enum { SPAN_QKV, SPAN_ATTENTION, SPANS };

/* The spin barriers of one layer and of the head (each counter is used once). */
#define LAYER_BARRIERS 10
#define HEAD_BARRIERS 1

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static int shapes_fit(const DecodeStep *step, const NarrowLayer *layers, int64_t count,
                      const NarrowHead *head, int64_t tables) {
    const int64_t hidden = layers[0].o.n, q_width = step->q_heads * step->head_dim;
    if (head->lm_head.packed && head->lm_head.k != hidden) return 0;
    const int64_t qkv_width = q_width + 2 * step->kv_heads * step->head_dim;
    for (int64_t l = 0; l < count; l++) {
        const NarrowLayer *L = &layers[l];
        const int64_t width = L->down.k;
        if (L->qkv.k != hidden || L->qkv.n != qkv_width || L->o.k != q_width ||
            L->o.n != hidden || L->gate_up.k != hidden || L->gate_up.n != 2 * width ||
            L->down.n != hidden || L->down.k != layers[0].down.k || hidden % QUANT_BLOCK ||
            q_width % QUANT_BLOCK || width % QUANT_BLOCK || L->rope < 0 || L->rope >= tables ||
            (L->activation != ACT_SILU && L->activation != ACT_GELU_TANH))
            return 0;
    }
    return 1;
}

/* Rows me, me + team, ... of x: x += delta (when given), h = rms_norm(x) * weight, h quantised
 * into rows. */
static void norm_rows(float *x, const float *delta, const float *weight, float eps, float *h,
                      QuantRow *rows, int64_t m, int64_t hidden, int me, int team) {
    for (int64_t r = me; r < m; r += team) add_rms_norm_row(x, delta, weight, h, r, hidden, eps, 0);
    quant_rows_fill(h, m, hidden, rows, me, team);
}

/* Rows me, me + team, ... of y [m, hidden]: y = rms_norm(y) * weight in place (when given). The
 * rows norm_rows gives this thread next: no barrier in between. */
static void out_norm_rows(float *y, const float *weight, float eps, int64_t m, int64_t hidden,
                          int me, int team) {
    if (weight == NULL) return;
    for (int64_t r = me; r < m; r += team) add_rms_norm_row(y, NULL, weight, y, r, hidden, eps, 0);
}

/* Heads me, me + team, ... of the q and k heads (the first `heads` of each row of qkv [m,
 * stride]): head = rms_norm(head) * its row of weight [heads, head_dim], in place. */
static void head_norms(float *qkv, int64_t stride, const float *weight, float eps, int64_t m,
                       int64_t heads, int64_t head_dim, int me, int team) {
    for (int64_t t = me; t < m * heads; t += team) {
        float *head = qkv + (t / heads) * stride + (t % heads) * head_dim;
        add_rms_norm_row(head, NULL, weight + (t % heads) * head_dim, head, 0, head_dim, eps, 0);
    }
}

/* Every layer of `layers` (count of them) and the head for a decode-only step (step->slots set;
 * fp32 activations; the rotary tables in a), pools [K0, V0, K1, V1, ...] the layers' KV pools, on
 * nthreads threads (attention on step->nthreads of them); the logits too when a->logits is set
 * (and head->lm_head.packed). The lm_head in the same region spares a wake-up of the team and
 * the Python between two calls. seconds: NULL, or [count][SPANS] filled as the enum above says.
 * Returns 0, or -1 when a shape does not fit or memory ran out (the activations are then
 * incomplete). */
int decode_narrow_layers(const DecodeStep *step, const NarrowLayer *layers, int64_t count,
                         const NarrowHead *head, void *const *pools, const NarrowActivations *a,
                         int nthreads, double *seconds) {
    const int64_t m = step->batch;
    if (m <= 0 || count <= 0) return m == 0 || count == 0 ? 0 : -1;
    if (step->act_bf16 || !shapes_fit(step, layers, count, head, a->tables)) return -1;
    if (a->logits && !head->lm_head.packed) return -1;
    const int64_t hidden = layers[0].o.n, q_width = layers[0].o.k, width = layers[0].down.k;
    const int64_t qkv_width = layers[0].qkv.n, qk_heads = step->q_heads + step->kv_heads;
    QuantRow *rows = quant_rows_alloc(m, max64(hidden, max64(q_width, width)));
    int *arrived = calloc((size_t)(count * LAYER_BARRIERS + HEAD_BARRIERS), sizeof(int));
    int failed = rows == NULL || arrived == NULL;
    if (!failed) {
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
        {
            const int team = omp_get_num_threads(), me = omp_get_thread_num();
            for (int64_t l = 0; l < count; l++) {
                const NarrowLayer *L = &layers[l];
                DecodeStep own = *step; /* the step with the layer's rotary table */
                own.cos = a->rotary[2 * L->rope];
                own.sin = a->rotary[2 * L->rope + 1];
                int *barrier = arrived + l * LAYER_BARRIERS;
                double *clock = seconds && me == 0 ? seconds + l * SPANS : NULL;
                const double started = clock ? omp_get_wtime() : 0.0;
                norm_rows(a->x, l ? a->delta : NULL, L->input_norm, L->input_eps, a->h, rows, m,
                          hidden, me, team);
                spin_barrier(&barrier[0], team);
                quant_gemm_shared(&L->qkv, rows, m, a->qkv);
                spin_barrier(&barrier[1], team);
                if (L->qk_norm) {
                    head_norms(a->qkv, qkv_width, L->qk_norm, L->qk_eps, m, qk_heads,
                               step->head_dim, me, team);
                    spin_barrier(&barrier[2], team);
                }
                if (clock) clock[SPAN_QKV] = omp_get_wtime() - started;
                if (decode_attention_shared(&own, a->qkv, qkv_width, pools[2 * l],
                                            pools[2 * l + 1], a->attn, L->scale, L->window,
                                            0.0f)) {
#pragma omp atomic write
                    failed = 1;
                }
                spin_barrier(&barrier[3], team);
                if (clock) clock[SPAN_ATTENTION] = omp_get_wtime() - started;
                quant_rows_fill(a->attn, m, q_width, rows, me, team);
                spin_barrier(&barrier[4], team);
                quant_gemm_shared(&L->o, rows, m, a->o_out);
                spin_barrier(&barrier[5], team);
                out_norm_rows(a->o_out, L->attn_out_norm, L->attn_out_eps, m, hidden, me, team);
                norm_rows(a->x, a->o_out, L->post_norm, L->post_eps, a->h, rows, m, hidden, me,
                          team);
                spin_barrier(&barrier[6], team);
                quant_gated_shared(&L->gate_up, rows, m, a->act, L->activation);
                spin_barrier(&barrier[7], team);
                quant_rows_fill(a->act, m, width, rows, me, team);
                spin_barrier(&barrier[8], team);
                quant_gemm_shared(&L->down, rows, m, a->delta);
                spin_barrier(&barrier[9], team);
                out_norm_rows(a->delta, L->mlp_out_norm, L->mlp_out_eps, m, hidden, me, team);
            }
            norm_rows(a->x, a->delta, head->norm, head->eps, a->h, rows, m, hidden, me, team);
            if (a->logits) {
                spin_barrier(&arrived[count * LAYER_BARRIERS], team);
                quant_gemm_shared(&head->lm_head, rows, m, a->logits);
            }
        }
    }
    free(arrived);
    free(rows);
    return failed ? -1 : 0;
}
