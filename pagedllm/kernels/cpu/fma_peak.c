/* The CPU's float32 FMA peak, measured: each OpenMP thread runs NACC independent chains of vector FMAs
 * (enough to cover the FMA latency on every x86 core) for `iters` rounds, the same vector width and
 * instructions as the kernels built for this ISA level (cpu_ops.c). Benchmarks divide achieved GFLOP/s
 * by this (benchmarks/cpu_flops.py). Built by kernels/cpu_kernels.py's build_library like cpu_ops.c. */
#include <stdint.h>

#define NACC 12

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vec;
#define VW 16
#define v_set1 _mm512_set1_ps
#define v_fma _mm512_fmadd_ps
#define v_add _mm512_add_ps
#define v_reduce _mm512_reduce_add_ps
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vec;
#define VW 8
#define v_set1 _mm256_set1_ps
#define v_fma _mm256_fmadd_ps
#define v_add _mm256_add_ps
static inline float v_reduce(__m256 v) {
    float t[8];
    _mm256_storeu_ps(t, v);
    return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
#else
#define VW 4 /* SSE2: a multiply and an add per lane (no FMA unit assumed) */
typedef struct { float x[VW]; } vec;
static inline vec v_set1(float f) { vec v; for (int i = 0; i < VW; ++i) v.x[i] = f; return v; }
static inline vec v_fma(vec a, vec b, vec c) { vec r; for (int i = 0; i < VW; ++i) r.x[i] = a.x[i] * b.x[i] + c.x[i]; return r; }
static inline vec v_add(vec a, vec b) { vec r; for (int i = 0; i < VW; ++i) r.x[i] = a.x[i] + b.x[i]; return r; }
static inline float v_reduce(vec v) { float s = 0.f; for (int i = 0; i < VW; ++i) s += v.x[i]; return s; }
#endif

/* Returns the FLOPs done (2 per lane per FMA, all threads); *sink gets a value that depends on every
 * chain, so none can be optimised away. */
double fma_peak_f32(int64_t iters, float *sink) {
    double total = 0.0;
    float keep = 0.f;
#pragma omp parallel reduction(+ : total, keep)
    {
        vec acc[NACC];
        for (int k = 0; k < NACC; ++k) acc[k] = v_set1(1.f + 0.01f * (float)k);
        const vec a = v_set1(0.9999999f), b = v_set1(1e-7f);
        for (int64_t it = 0; it < iters; ++it)
            for (int k = 0; k < NACC; ++k) acc[k] = v_fma(acc[k], a, b);
        vec s = acc[0];
        for (int k = 1; k < NACC; ++k) s = v_add(s, acc[k]);
        keep += v_reduce(s);
        total += 2.0 * VW * NACC * (double)iters;
    }
    *sink = keep;
    return total;
}
