/* float32 GEMM for decode-sized row counts on the CPU: y[m, n] = x[m, k] · w[n, k]ᵀ (+ bias).
 *
 * A decode step multiplies a few rows by every weight of the model, and the weights come from memory each
 * step. oneDNN's packed GEMM reaches under half of what the memory allows at 4-16 rows and under half of the
 * FMA peak at 64 (BENCHMARKS.md §42.3). This kernel streams each weight once per MR rows: the weight is packed
 * at load into panels of NB output columns, K rows of NB contiguous floats each, so that a panel is one
 * linear read; a tile of MR rows × NB columns keeps its 2·MR vector accumulators in registers while it walks
 * the panel. Panels are shared out among the OpenMP threads (libgomp, torch's pool); the rows beyond MR
 * re-read the panel from L2.
 *
 * Each output is one FMA chain over k in order, whatever the row count, the row's place in the batch or the
 * thread count: a row's result does not depend on the batch it runs in (speculative verification relies on
 * that), only on the packed weight.
 *
 * The panel is prefetched PREFETCH_ROWS rows ahead: without it the tile's arithmetic and the panel's memory
 * latency did not overlap, and 4 rows took 1.4x as long as one (BENCHMARKS.md §42.3).
 *
 * Built per ISA level by pagedllm/kernels/cpu_f32_gemm.py (kernels/cpu_isa.py's flags, -ffp-contract=fast):
 * AVX-512 (NB 32, MR 12), AVX2+FMA (NB 16, MR 6), portable (NB 8, MR 4); GCC vector extensions, so one source
 * serves all levels.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#define VEC_BYTES 64
#ifndef MR
#define MR 12
#endif
#elif defined(__AVX2__)
#define VEC_BYTES 32
#ifndef MR
#define MR 6
#endif
#else
#define VEC_BYTES 16
#ifndef MR
#define MR 4
#endif
#endif
#define VL (VEC_BYTES / 4)
#define NB (2 * VL)
/* The tiles after a panel's first request the next panel into L2, a slice each (see f32_gemm). On an AMD
 * Zen 3 with AVX2 that was 0.83-0.94x at 64-256 rows (BENCHMARKS.md §45.3); on an AVX-512 Xeon it gave
 * 1.06-1.19x at 16-128 rows (§53.1), so AVX-512 builds do it from NEXT_PANEL_MIN_TILES tiles of rows. */
#ifndef NEXT_PANEL_PREFETCH
#if defined(__AVX512F__)
#define NEXT_PANEL_PREFETCH 1
#else
#define NEXT_PANEL_PREFETCH 0
#endif
#endif
#ifndef NEXT_PANEL_MIN_TILES
#define NEXT_PANEL_MIN_TILES 2
#endif
#ifndef NEXT_PANEL_LOCALITY
#define NEXT_PANEL_LOCALITY 2
#endif
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 32
#endif

typedef float vf __attribute__((vector_size(VEC_BYTES), aligned(4)));

static inline vf vfma(vf acc, vf w, float x) {
    /* contracted to one FMA by -ffp-contract=fast */
    return acc + w * x;
}

int f32_gemm_panel_width(void) { return NB; }
int f32_gemm_tile_rows(void) { return MR; }

/* w [n, k] (row stride ldw) → ceil(n / NB) panels of k × NB floats: panel p, row kk holds
 * w[p·NB + j][kk] for j < NB, zeros past n. `out` holds panels · k · NB floats. */
void f32_gemm_pack(const float *w, int64_t ldw, int64_t n, int64_t k, float *out) {
    int64_t panels = (n + NB - 1) / NB;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = out + p * k * NB;
        for (int j = 0; j < NB; j++) {
            int64_t col = p * NB + j;
            for (int64_t kk = 0; kk < k; kk++)
                dst[kk * NB + j] = col < n ? w[col * ldw + kk] : 0.0f;
        }
    }
}

/* One tile: rows x[0:m) (m ≤ MR, a compile-time constant where inlined) against one panel; writes
 * `cols` (≤ NB) columns of y. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const float *panel,
                                                       int64_t k, float *y, int64_t ldy, int cols,
                                                       const float *bias, const char *pf, const int64_t pf_lines,
                                                       const int m) {
    vf a0[MR], a1[MR];
    for (int r = 0; r < m; r++) {
        a0[r] = (vf){0};
        a1[r] = (vf){0};
    }
    for (int64_t kk = 0; kk < k; kk++) {
        __builtin_prefetch(panel + (kk + PREFETCH_ROWS) * NB);
        __builtin_prefetch(panel + (kk + PREFETCH_ROWS) * NB + VL);
        if (NEXT_PANEL_PREFETCH && kk < pf_lines) /* one line of the next panel per k step, from the slice's start */
            __builtin_prefetch(pf + kk * 64, 0, NEXT_PANEL_LOCALITY);
        vf w0 = *(const vf *)(panel + kk * NB);
        vf w1 = *(const vf *)(panel + kk * NB + VL);
        for (int r = 0; r < m; r++) {
            float xv = x[r * ldx + kk];
            a0[r] = vfma(a0[r], w0, xv);
            a1[r] = vfma(a1[r], w1, xv);
        }
    }
    for (int r = 0; r < m; r++) {
        float lanes[NB];
        *(vf *)lanes = a0[r];
        *(vf *)(lanes + VL) = a1[r];
        float *dst = y + r * ldy;
        if (bias) {
            for (int j = 0; j < cols; j++) dst[j] = lanes[j] + bias[j];
        } else {
            for (int j = 0; j < cols; j++) dst[j] = lanes[j];
        }
    }
}

#define TILE_CASE(M) \
    case M: tile(x, ldx, panel, k, y, ldy, cols, bias, pf, pf_lines, M); break;

static void tile_any(const float *x, int64_t ldx, const float *panel, int64_t k, float *y, int64_t ldy,
                     int cols, const float *bias, const char *pf, int64_t pf_lines, int m) {
    switch (m) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4)
#if MR > 4
        TILE_CASE(5) TILE_CASE(6)
#endif
#if MR > 6
        TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
#endif
#if MR > 12
        TILE_CASE(13) TILE_CASE(14)
#endif
        default: break;
    }
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) · Wᵀ (+ bias [n], or NULL), W packed by
 * f32_gemm_pack. Returns 0. */
int f32_gemm(const float *x, int64_t ldx, int64_t m, int64_t k, const float *packed, int64_t n,
             const float *bias, float *y, int64_t ldy) {
    int64_t panels = (n + NB - 1) / NB;
#pragma omp parallel for schedule(static) if (panels > 1 && m * n * k > 65536)
    for (int64_t p = 0; p < panels; p++) {
        const float *panel = packed + p * k * NB;
        int cols = (int)(n - p * NB < NB ? n - p * NB : NB);
        const float *b = bias ? bias + p * NB : 0;
        /* The first tile reads the panel from memory, the others from L2. With enough tiles, each later one
         * requests a slice of the next panel's lines (one per k step), so that its first tile finds it in L2:
         * the memory traffic overlaps the later tiles' arithmetic. The bits do not change. */
        const int64_t tiles = (m + MR - 1) / MR;
        const int64_t lines = k * NB * 4 / 64;
        const int prefetch_next = NEXT_PANEL_PREFETCH && p + 1 < panels && tiles >= NEXT_PANEL_MIN_TILES;
        const int64_t slice = prefetch_next ? (lines + tiles - 2) / (tiles - 1) : 0;
        for (int64_t r0 = 0, t = 0; r0 < m; r0 += MR, t++) {
            int rows = (int)(m - r0 < MR ? m - r0 : MR);
            const char *pf = (const char *)(panel + k * NB);
            int64_t pf_lines = 0;
            if (t > 0 && slice > 0) {
                int64_t first = (t - 1) * slice, left = lines - first;
                pf += first * 64;
                pf_lines = left <= 0 ? 0 : left < slice ? left : slice;
            }
            if (pf_lines > k) /* two tiles: the first k lines (two per k step were slower: §53.1) */
                pf_lines = k;
            tile_any(x + r0 * ldx, ldx, panel, k, y + r0 * ldy + p * NB, ldy, cols, b, pf, pf_lines, rows);
        }
    }
    return 0;
}

