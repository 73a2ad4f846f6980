#include <immintrin.h>
#include <stdint.h>
/* per block: read it (sum), then `work` dependent-ish FMA iterations on registers (compute stand-in) */
float read_blocks_work(const float *base, const int32_t *idx, int64_t nblk, int64_t bsz_f, int pf, int work, int spread) {
    float total = 0;
#pragma omp parallel for schedule(static) reduction(+:total)
    for (int64_t i = 0; i < nblk; i++) {
        const float *b = base + (int64_t)idx[i] * bsz_f;
        const char *nb = i + 1 < nblk ? (const char *)(base + (int64_t)idx[i + 1] * bsz_f) : 0;
        if (pf && nb && !spread) for (int64_t o = 0; o < bsz_f * 4; o += 64) __builtin_prefetch(nb + o, 0, 3);
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t lines = bsz_f / 16, chunks = bsz_f / 32;
        for (int64_t j = 0; j < bsz_f; j += 32) {
            if (pf && nb && spread) { int64_t l0 = (j / 32) * lines / chunks, l1 = (j / 32 + 1) * lines / chunks;
                for (int64_t l = l0; l < l1; l++) __builtin_prefetch(nb + 64 * l, 0, 3); }
            __m256 x0 = _mm256_loadu_ps(b + j), x1 = _mm256_loadu_ps(b + j + 8), x2 = _mm256_loadu_ps(b + j + 16), x3 = _mm256_loadu_ps(b + j + 24);
            for (int w = 0; w < work; w++) {
                a0 = _mm256_fmadd_ps(x0, x1, a0); a1 = _mm256_fmadd_ps(x1, x2, a1);
                a2 = _mm256_fmadd_ps(x2, x3, a2); a3 = _mm256_fmadd_ps(x3, x0, a3);
            }
        }
        __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        float t[8]; _mm256_storeu_ps(t, s); total += t[0] + t[7];
    }
    return total;
}
