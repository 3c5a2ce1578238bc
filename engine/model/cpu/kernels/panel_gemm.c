/* fp32 linear layers for decode-sized batches: y = x W^T + b with W repacked once at load into
 * panels of PANEL output columns, each panel [K][PANEL] contiguous (engine/model/cpu/linear.py).
 * A panel is read as one stream and reused from L2 for every group of ROWS input rows; ROWS x PANEL
 * accumulators (24 AVX-512 registers) take one weight load per 6 multiply-adds. Panels are dealt
 * to the OpenMP team dynamically, so the caller's thread starts on them while the others wake.
 * With the weights streaming from memory this beats oneDNN's prepacked GEMMs at decode batch sizes
 * and a plain-weight GEMV at one row; from a few hundred rows on oneDNN's blocking wins again, and
 * the caller switches back. An MLP's [gate; up] weight packed in pairs (below) gets
 * silu(gate) * up applied on the way out, sparing a pass over the GEMM's output (figures:
 * docs/PERFORMANCE.md#panel-gemm). Built for AVX-512, or for AVX2 + FMA, whose 16 registers hold
 * a panel's accumulators for fewer rows and columns at a time (passes over parts of the panel,
 * below); elsewhere panel_gemm_available() is 0 and the caller keeps oneDNN. */
#include <stdint.h>

#include "fast_exp.h"
#include "panel_gemm.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PANEL_GEMM_SIMD
#include <immintrin.h>
#endif

#define PANEL 64
#define ROWS 6
#define PREFETCH_AHEAD 8 /* panel rows (256 bytes each) */

int panel_gemm_available(void) {
#ifdef PANEL_GEMM_SIMD
    return 1;
#else
    return 0;
#endif
}

/* Panel layouts. Plain (half == 0): panel p holds output columns [64p, 64p + 64). Paired, for a
 * [gate; up] weight of n = 2 * half rows: panel p holds gate columns [32p, 32p + 32) in its first
 * 32 lanes and the up columns of the same units in its last 32, so that one panel's accumulators
 * hold both operands of the MLP's silu(gate) * up and the GEMM can apply it on the way out instead
 * of a separate pass over the [rows, 2 * half] output. */
#define HALF_PANEL (PANEL / 2)

/* Panels of an n-column output. */
static inline int64_t panel_count(int64_t n, int64_t half) {
    return half ? (half + HALF_PANEL - 1) / HALF_PANEL : (n + PANEL - 1) / PANEL;
}

/* Output column of lane `lane` of panel p, and how many columns of that half exist from there on
 * (at most 16 of them are the lane's vector). */
static inline int64_t lane_column(int64_t p, int64_t lane, int64_t half, int64_t n,
                                  int64_t *left) {
    if (!half) {
        *left = n - (p * PANEL + lane);
        return p * PANEL + lane;
    }
    const int64_t unit = p * HALF_PANEL + lane % HALF_PANEL; /* index within its half */
    *left = half - unit;
    return lane < HALF_PANEL ? unit : half + unit;
}

/* Floats of the packed form of an [n, k] weight. */
int64_t panel_gemm_packed_size(int64_t n, int64_t k, int64_t half) {
    return panel_count(n, half) * k * PANEL;
}

/* w [n, k] row-major -> packed [panels][k][PANEL] in the layout of `half` (above), lanes without a
 * column zero. */
void panel_gemm_pack(const float *w, int64_t n, int64_t k, int64_t half, float *packed) {
    const int64_t panels = panel_count(n, half);
    for (int64_t p = 0; p < panels; p++) {
        float *panel = packed + p * k * PANEL;
        for (int64_t c = 0; c < PANEL; c++) {
            int64_t left;
            const int64_t col = lane_column(p, c, half, n, &left);
            for (int64_t i = 0; i < k; i++) panel[i * PANEL + c] = left > 0 ? w[col * k + i] : 0.0f;
        }
    }
}

#ifdef __AVX512F__
/* Where a panel's four 16-lane vectors go: output columns, store masks and bias. */
typedef struct {
    int64_t col[4];
    __mmask16 mask[4];
    __m512 bias[4];
} PanelOut;

static PanelOut panel_out(int64_t p, int64_t half, int64_t n, const float *bias) {
    PanelOut out;
    for (int c = 0; c < 4; c++) {
        int64_t left;
        out.col[c] = lane_column(p, 16 * c, half, n, &left);
        out.mask[c] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        out.bias[c] = bias ? _mm512_maskz_loadu_ps(out.mask[c], bias + out.col[c])
                           : _mm512_setzero_ps();
    }
    return out;
}

/* Rows [0, rows) of x times a panel, plus bias, stored to y (row stride ldy): the panel's columns,
 * or with gated (a paired panel) silu(gate) * up at the gate columns. */
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t k,
                                                             const float *panel, float *y,
                                                             int64_t ldy, const PanelOut *out,
                                                             int gated, const int rows) {
    __m512 acc[ROWS][4];
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        /* the panel's row PREFETCH_AHEAD ahead: with two or more input rows the hardware
           prefetcher alone leaves the weight stream behind; for one row it keeps up and the
           extra instructions only cost (figures: docs/PERFORMANCE.md#panel-gemm) */
        if (rows >= 2)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++)
                _mm_prefetch((const char *)(panel + (i + PREFETCH_AHEAD) * PANEL + 16 * c),
                             _MM_HINT_T0);
        __m512 w[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) w[c] = _mm512_loadu_ps(panel + i * PANEL + 16 * c);
#pragma GCC unroll 6
        for (int r = 0; r < ROWS; r++) {
            if (r >= rows) break;
            const __m512 xr = _mm512_set1_ps(x[r * k + i]);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_fmadd_ps(xr, w[c], acc[r][c]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; r++) {
        if (r >= rows) break;
        if (!gated) {
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++)
                _mm512_mask_storeu_ps(y + r * ldy + out->col[c], out->mask[c],
                                      _mm512_add_ps(acc[r][c], out->bias[c]));
            continue;
        }
        float gate[HALF_PANEL], up[HALF_PANEL], act[HALF_PANEL];
        for (int c = 0; c < 2; c++) {
            _mm512_storeu_ps(gate + 16 * c, _mm512_add_ps(acc[r][c], out->bias[c]));
            _mm512_storeu_ps(up + 16 * c, _mm512_add_ps(acc[r][c + 2], out->bias[c + 2]));
        }
#pragma omp simd
        for (int j = 0; j < HALF_PANEL; j++) act[j] = silu(gate[j]) * up[j];
        for (int c = 0; c < 2; c++)
            _mm512_mask_storeu_ps(y + r * ldy + out->col[c], out->mask[c],
                                  _mm512_loadu_ps(act + 16 * c));
    }
}
#elif defined(PANEL_GEMM_SIMD) /* AVX2 + FMA */
#define VECTORS (PANEL / 8) /* 8-lane vectors per panel row */

/* Where a panel's eight 8-lane vectors go: output columns, store masks and bias. */
typedef struct {
    int64_t col[VECTORS];
    __m256i mask[VECTORS];
    __m256 bias[VECTORS];
} PanelOut;

static PanelOut panel_out(int64_t p, int64_t half, int64_t n, const float *bias) {
    PanelOut out;
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int c = 0; c < VECTORS; c++) {
        int64_t left;
        out.col[c] = lane_column(p, 8 * c, half, n, &left);
        const int live = left >= 8 ? 8 : left <= 0 ? 0 : (int)left;
        out.mask[c] = _mm256_cmpgt_epi32(_mm256_set1_epi32(live), lanes);
        out.bias[c] = bias ? _mm256_maskload_ps(bias + out.col[c], out.mask[c])
                           : _mm256_setzero_ps();
    }
    return out;
}

/* Float offset in a panel row of vector j (of `width` vectors) of pass s over the panel: half
 * from the gate lanes [0, 32) and half from the up lanes of the same units, so that a paired
 * panel's pass holds both operands of silu(gate) * up. */
static inline int vector_offset(int s, int j, const int width) {
    const int pairs = width / 2, unit = s * pairs + (j < pairs ? j : j - pairs);
    return (j < pairs ? 0 : HALF_PANEL) + 8 * unit;
}

/* A pass's sums acc[r][j] (vector j at float offset off[j] of the panel row) plus bias, stored to y
 * (row stride ldy), or with gated silu(gate) * up at the gate columns. Not inlined: inlined, the
 * compiler kept its masks in registers across the pass's loop and spilled an accumulator there. */
static __attribute__((noinline)) void store_pass(__m256 acc[ROWS][VECTORS], const int *off,
                                                 int rows, int width, float *y, int64_t ldy,
                                                 const PanelOut *out, int gated) {
    for (int r = 0; r < rows; r++) {
        if (!gated) {
            for (int j = 0; j < width; j++) {
                const int c = off[j] / 8;
                _mm256_maskstore_ps(y + r * ldy + out->col[c], out->mask[c],
                                    _mm256_add_ps(acc[r][j], out->bias[c]));
            }
            continue;
        }
        float gate[HALF_PANEL], up[HALF_PANEL], act[HALF_PANEL];
        const int pairs = width / 2;
        for (int j = 0; j < pairs; j++) {
            const int g = off[j] / 8, u = off[j + pairs] / 8;
            _mm256_storeu_ps(gate + 8 * j, _mm256_add_ps(acc[r][j], out->bias[g]));
            _mm256_storeu_ps(up + 8 * j, _mm256_add_ps(acc[r][j + pairs], out->bias[u]));
        }
#pragma omp simd
        for (int j = 0; j < 8 * pairs; j++) act[j] = silu(gate[j]) * up[j];
        for (int j = 0; j < pairs; j++) {
            const int g = off[j] / 8;
            _mm256_maskstore_ps(y + r * ldy + out->col[g], out->mask[g],
                                _mm256_loadu_ps(act + 8 * j));
        }
    }
}

/* panel_rows' work on the `width` vectors of pass s (8 / width passes cover the panel) for rows
 * [0, rows): rows x width <= 12 accumulators, which with the weight vectors and the broadcast
 * input fit AVX2's 16 registers. Prefetch as in the AVX-512 code, the lines this pass reads. */
static inline __attribute__((always_inline)) void panel_pass(const float *x, int64_t k,
                                                             const float *panel, float *y,
                                                             int64_t ldy, const PanelOut *out,
                                                             int gated, const int rows,
                                                             const int width, const int s) {
    int off[VECTORS];
    __m256 acc[ROWS][VECTORS], sums[ROWS][VECTORS];
#pragma GCC unroll 8
    for (int j = 0; j < width; j++) off[j] = vector_offset(s, j, width);
#pragma GCC unroll 6
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 8
        for (int j = 0; j < width; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        const float *row = panel + i * PANEL;
        if (rows >= 2 && s == 0) /* the whole panel row: the later passes find it in L2 */
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++)
                _mm_prefetch((const char *)(row + PREFETCH_AHEAD * PANEL + 16 * c), _MM_HINT_T0);
        __m256 w[VECTORS];
#pragma GCC unroll 8
        for (int j = 0; j < width; j++) w[j] = _mm256_loadu_ps(row + off[j]);
#pragma GCC unroll 6
        for (int r = 0; r < rows; r++) {
            const __m256 xr = _mm256_broadcast_ss(x + r * k + i);
#pragma GCC unroll 8
            for (int j = 0; j < width; j++) acc[r][j] = _mm256_fmadd_ps(xr, w[j], acc[r][j]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 8
        for (int j = 0; j < width; j++) sums[r][j] = acc[r][j];
    store_pass(sums, off, rows, width, y, ldy, out, gated);
}

/* Rows [0, rows) of x times a panel, as the AVX-512 panel_rows: one row in one pass over the whole
 * panel (8 accumulators), up to 3 rows in two passes of 4 vectors, more in four passes of 2 (the
 * 6 x 16 tile of BLIS's Haswell kernel). */
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t k,
                                                             const float *panel, float *y,
                                                             int64_t ldy, const PanelOut *out,
                                                             int gated, const int rows) {
    const int width = rows == 1 ? 8 : rows <= 3 ? 4 : 2;
#pragma GCC unroll 4
    for (int s = 0; s < VECTORS / width; s++)
        panel_pass(x, k, panel, y, ldy, out, gated, rows, width, s);
}
#endif

/* y = x [m, k] . W^T (+ bias [n] when given), W [n, k] packed by panel_gemm_pack with `half`:
 * y [m, n]; with gated (half > 0) y [m, half] = silu(gate) * up of the two halves. The panels are
 * shared over the calling OpenMP team (an orphaned work-sharing loop, without a barrier at its
 * end: the caller synchronises); outside a parallel region the caller's thread does them all. */
void panel_gemm_shared(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                       int64_t half, int gated, const float *bias, float *y) {
#ifdef PANEL_GEMM_SIMD
    const int64_t panels = panel_count(n, half);
    const int64_t ldy = gated ? half : n;
#pragma omp for schedule(dynamic) nowait
    for (int64_t p = 0; p < panels; p++) {
        const float *panel = packed + p * k * PANEL;
        const PanelOut out = panel_out(p, half, n, bias);
        int64_t r = 0;
        for (; r + ROWS <= m; r += ROWS)
            panel_rows(x + r * k, k, panel, y + r * ldy, ldy, &out, gated, ROWS);
        switch (m - r) { /* the last rows, with their count a constant in each copy */
        case 5: panel_rows(x + r * k, k, panel, y + r * ldy, ldy, &out, gated, 5); break;
        case 4: panel_rows(x + r * k, k, panel, y + r * ldy, ldy, &out, gated, 4); break;
        case 3: panel_rows(x + r * k, k, panel, y + r * ldy, ldy, &out, gated, 3); break;
        case 2: panel_rows(x + r * k, k, panel, y + r * ldy, ldy, &out, gated, 2); break;
        case 1: panel_rows(x + r * k, k, panel, y + r * ldy, ldy, &out, gated, 1); break;
        }
    }
#else
    (void)x, (void)m, (void)k, (void)packed, (void)n, (void)half, (void)gated, (void)bias, (void)y;
#endif
}

/* panel_gemm_shared on a team of nthreads of its own. */
void panel_gemm(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                int64_t half, int gated, const float *bias, float *y, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && panel_count(n, half) > 1)
    panel_gemm_shared(x, m, k, packed, n, half, gated, bias, y);
}
