#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
#include <string.h>
/* read nblk blocks of bsz bytes in the order of idx; 8 accumulators; returns checksum */
float read_blocks(const float *base, const int32_t *idx, int64_t nblk, int64_t bsz_f, int pf) {
    float total = 0;
#pragma omp parallel for schedule(static) reduction(+:total)
    for (int64_t i = 0; i < nblk; i++) {
        const float *b = base + (int64_t)idx[i] * bsz_f;
        if (pf && i + 1 < nblk) { const char *nb = (const char *)(base + (int64_t)idx[i + 1] * bsz_f);
            for (int64_t o = 0; o < bsz_f * 4; o += 64) __builtin_prefetch(nb + o, 0, 3); }
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < bsz_f; j += 32) {
            a0 = _mm256_add_ps(a0, _mm256_loadu_ps(b + j)); a1 = _mm256_add_ps(a1, _mm256_loadu_ps(b + j + 8));
            a2 = _mm256_add_ps(a2, _mm256_loadu_ps(b + j + 16)); a3 = _mm256_add_ps(a3, _mm256_loadu_ps(b + j + 24));
        }
        __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        float t[8]; _mm256_storeu_ps(t, s); total += t[0] + t[7];
    }
    return total;
}
