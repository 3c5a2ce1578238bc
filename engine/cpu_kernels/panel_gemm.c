/* fp32 linear layers for decode-sized batches: y = x W^T + b with W repacked once at load into
 * panels of PANEL output columns, each panel [K][PANEL] contiguous (engine/linear.py). A panel is
 * read as one stream and reused from L2 for every group of ROWS input rows; ROWS x PANEL
 * accumulators (24 AVX-512 registers) take one weight load per 6 multiply-adds. Panels are dealt
 * to the OpenMP team dynamically, so the caller's thread starts on them while the others wake (a
 * wake-up costs ~100 us on this VM). At SmolLM2's layer shapes (30 layers' weights streaming from
 * memory, outputs preallocated) this ran 1.2x faster than oneDNN's prepacked GEMMs at 16 and 64
 * rows and 1.3x faster than a plain-weight GEMV at one row before the weight prefetch, which added
 * 1.15x at 16 rows; from a few hundred rows on oneDNN's blocking wins again, and the caller
 * switches back. AVX-512 only: elsewhere panel_gemm_available() is 0 and the caller keeps
 * oneDNN. */
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define PANEL 64
#define ROWS 6
#define PREFETCH_AHEAD 8 /* panel rows (256 bytes each) */

int panel_gemm_available(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* Panels of an n-column output (the last one zero-padded). */
static inline int64_t panel_count(int64_t n) { return (n + PANEL - 1) / PANEL; }

/* Floats of the packed form of an [n, k] weight. */
int64_t panel_gemm_packed_size(int64_t n, int64_t k) { return panel_count(n) * k * PANEL; }

/* w [n, k] row-major -> packed [panels][k][PANEL], columns past n zero. */
void panel_gemm_pack(const float *w, int64_t n, int64_t k, float *packed) {
    const int64_t panels = panel_count(n);
    for (int64_t p = 0; p < panels; p++) {
        float *panel = packed + p * k * PANEL;
        for (int64_t c = 0; c < PANEL; c++) {
            const int64_t col = p * PANEL + c;
            for (int64_t i = 0; i < k; i++) panel[i * PANEL + c] = col < n ? w[col * k + i] : 0.0f;
        }
    }
}

#ifdef __AVX512F__
/* y rows [0, rows) of columns [col, col + PANEL) (those below n) = x rows . panel + bias. */
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t k,
                                                             const float *panel, float *y,
                                                             int64_t n, int64_t col,
                                                             const float *bias, const int rows) {
    __m512 acc[ROWS][4];
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        /* the panel's row PREFETCH_AHEAD ahead: with two or more input rows the hardware
           prefetcher alone left the weight stream behind (batch 16: 1.15x with this); for one row
           it keeps up and the extra instructions only cost */
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
    __mmask16 mask[4];
    __m512 b[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        const int64_t left = n - col - 16 * c;
        mask[c] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        b[c] = bias ? _mm512_maskz_loadu_ps(mask[c], bias + col + 16 * c) : _mm512_setzero_ps();
    }
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; r++) {
        if (r >= rows) break;
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++)
            _mm512_mask_storeu_ps(y + r * n + col + 16 * c, mask[c],
                                  _mm512_add_ps(acc[r][c], b[c]));
    }
}
#endif

/* y [m, n] = x [m, k] . W^T (+ bias [n] when given), W packed by panel_gemm_pack. */
void panel_gemm(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                const float *bias, float *y, int nthreads) {
#ifdef __AVX512F__
    const int64_t panels = panel_count(n);
#pragma omp parallel for schedule(dynamic) num_threads(nthreads) if (nthreads > 1 && panels > 1)
    for (int64_t p = 0; p < panels; p++) {
        const float *panel = packed + p * k * PANEL;
        const int64_t col = p * PANEL;
        int64_t r = 0;
        for (; r + ROWS <= m; r += ROWS)
            panel_rows(x + r * k, k, panel, y + r * n, n, col, bias, ROWS);
        switch (m - r) { /* the last rows, with their count a constant in each copy */
        case 5: panel_rows(x + r * k, k, panel, y + r * n, n, col, bias, 5); break;
        case 4: panel_rows(x + r * k, k, panel, y + r * n, n, col, bias, 4); break;
        case 3: panel_rows(x + r * k, k, panel, y + r * n, n, col, bias, 3); break;
        case 2: panel_rows(x + r * k, k, panel, y + r * n, n, col, bias, 2); break;
        case 1: panel_rows(x + r * k, k, panel, y + r * n, n, col, bias, 1); break;
        }
    }
#else
    (void)x, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)y, (void)nthreads;
#endif
}
