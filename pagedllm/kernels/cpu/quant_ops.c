/* GGUF-quantized linear layers on the CPU: weights stay as their GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K).
 *
 * Two designs of y[M,N] = x[M,K] · W[N,K]ᵀ (both OpenMP over output rows):
 *  (a) "int8": x is quantized per row into blocks of 32 int8 with one fp32 scale d and s = d·Σq (llama.cpp's
 *      Q8_1), and each weight block is dotted with integer multiply-adds (AVX-512 VNNI vpdpbusd, AVX-VNNI, or
 *      AVX2 vpmaddubsw + vpmaddwd), scaled once per block;
 *  (b) "dequant": a tile of TILE_N weight rows is dequantized into fp32 and multiplied by fp32 x with FMAs
 *      (a 4×4 register block of dot products).
 * dequantize_rows() is the plain reference dequantization (bit-exact with gguf.quants; used for the embedding
 * lookup and the tests).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* ggml_type values */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12 };
#define QK 32
/* Software prefetch distance in bytes: the weights stream from DRAM once per step; prefetching this far ahead
 * made the single-row int8 GEMM over a whole model 1.8x faster (BENCHMARKS.md §20). */
#define PF_AHEAD 2048
#define QK_K 256
#define TILE_N 8
#define MB 4

static inline float h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0) {
        float f = ldexpf((float)m, -24);
        return s ? -f : f;
    }
    bits = e == 31 ? (s | 0x7f800000u | (m << 13)) : (s | ((e + 112u) << 23) | (m << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* Bytes per row of K elements; 0 for an unsupported type or a K the type cannot hold. */
int64_t quant_row_bytes(int type, int64_t K) {
    switch (type) {
        case T_Q4_0: return K % QK ? 0 : K / QK * 18;
        case T_Q4_1: return K % QK ? 0 : K / QK * 20;
        case T_Q8_0: return K % QK ? 0 : K / QK * 34;
        case T_Q4_K: return K % QK_K ? 0 : K / QK_K * 144;
        default: return 0;
    }
}

static inline void q4k_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * Reference dequantization (scalar, same float operations as gguf.quants: bit-exact). */

static void dequant_row(int type, const uint8_t *w, int64_t K, float *y) {
    if (type == T_Q4_K) {
        for (int64_t b = 0; b < K / QK_K; ++b, w += 144, y += QK_K) {
            const float d = h2f(rd16(w)), dmin = h2f(rd16(w + 2));
            const uint8_t *scales = w + 4, *qs = w + 16;
            for (int j = 0; j < 4; ++j) {
                uint8_t sc1, m1, sc2, m2;
                q4k_scale_min(2 * j, scales, &sc1, &m1);
                q4k_scale_min(2 * j + 1, scales, &sc2, &m2);
                const float d1 = d * (float)sc1, dm1 = dmin * (float)m1;
                const float d2 = d * (float)sc2, dm2 = dmin * (float)m2;
                for (int l = 0; l < 32; ++l) {
                    y[64 * j + l] = d1 * (float)(qs[32 * j + l] & 0xF) - dm1;
                    y[64 * j + 32 + l] = d2 * (float)(qs[32 * j + l] >> 4) - dm2;
                }
            }
        }
        return;
    }
    for (int64_t b = 0; b < K / QK; ++b, y += QK) {
        const float d = h2f(rd16(w));
        if (type == T_Q8_0) {
            const int8_t *qs = (const int8_t *)(w + 2);
            for (int l = 0; l < QK; ++l) y[l] = (float)qs[l] * d;
            w += 34;
        } else if (type == T_Q4_0) {
            const uint8_t *qs = w + 2;
            for (int l = 0; l < 16; ++l) {
                y[l] = d * (float)((int)(qs[l] & 0xF) - 8);
                y[l + 16] = d * (float)((int)(qs[l] >> 4) - 8);
            }
            w += 18;
        } else { /* Q4_1 */
            const float m = h2f(rd16(w + 2));
            const uint8_t *qs = w + 4;
            for (int l = 0; l < 16; ++l) {
                y[l] = d * (float)(qs[l] & 0xF) + m;
                y[l + 16] = d * (float)(qs[l] >> 4) + m;
            }
            w += 20;
        }
    }
}

/* out[i, :] = dequantized row ids[i] of w ([rows, row_bytes]); 0 on success, -1 for a bad type/K. */
int dequantize_rows(int type, const uint8_t *w, int64_t K, const int64_t *ids, int64_t n, float *out) {
    const int64_t rb = quant_row_bytes(type, K);
    if (rb == 0) return -1;
#pragma omp parallel for schedule(static) if (n * K >= (1 << 16))
    for (int64_t i = 0; i < n; ++i) dequant_row(type, w + ids[i] * rb, K, out + i * K);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------
 * Activations → Q8 blocks of 32: q = round(x / d), d = max|x| / 127, s = d · Σq (llama.cpp's Q8_1). */

void quantize_rows_q8(const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *s) {
    const int64_t nb = K / QK;
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t i = 0; i < M * nb; ++i) {
        const float *xb = x + i * QK;
        int8_t *qb = q + i * QK;
        float amax = 0.0f;
        for (int l = 0; l < QK; ++l) amax = fmaxf(amax, fabsf(xb[l]));
        const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        int sum = 0;
        for (int l = 0; l < QK; ++l) {
            const int v = (int)nearbyintf(xb[l] * id);
            qb[l] = (int8_t)v;
            sum += v;
        }
        d[i] = db;
        s[i] = db * (float)sum;
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * Design (a): integer dot products of weight blocks with Q8 activation blocks. */

#if defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (s))
#elif defined(__AVXVNNI__)
#define DPBUSD(u, s) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (u), (s))
#else
static inline __m256i DPBUSD(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif

static inline float hsum256(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

static inline __m256i unpack_nibbles16(const uint8_t *qs) {
    const __m128i t = _mm_loadu_si128((const __m128i *)qs);
    const __m256i v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

/* One weight block of 32 as unsigned bytes `wu` (x signed by `sgn` for Q8_0) against `mc` activation rows:
 * acc[m] += dw·dx·Σ(wu·x); corr[m] += cw·sx. */
#define BLOCK_DOT(wu, sgn, dw, cw, b)                                                              \
    for (int m = 0; m < mc; ++m) {                                                                 \
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * K + (b) * QK));                 \
        if (sgn) xv = _mm256_sign_epi8(xv, wsigned);                                               \
        const __m256i p = DPBUSD((wu), xv);                                                        \
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps((dw) * xd[m * nb + (b)]), acc[m]); \
        corr[m] += (cw) * xs[m * nb + (b)];                                                        \
    }

static inline __attribute__((always_inline)) void dot_rows_int8(
    const int type, const uint8_t *w, int64_t K, const int8_t *xq, const float *xd, const float *xs, int mc,
    float *out, int64_t ldo) {
    const int64_t nb = K / QK;
    __m256 acc[MB];
    float corr[MB];
    __m256i wsigned = _mm256_setzero_si256();
    for (int m = 0; m < MB; ++m) { acc[m] = _mm256_setzero_ps(); corr[m] = 0.0f; }
    if (type == T_Q4_K) {
        for (int64_t sb = 0; sb < K / QK_K; ++sb, w += 144) {
            const float d = h2f(rd16(w)), dmin = h2f(rd16(w + 2));
            _mm_prefetch((const char *)w + PF_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char *)w + PF_AHEAD + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)w + PF_AHEAD + 128, _MM_HINT_T0);
            for (int j = 0; j < 4; ++j) {
                uint8_t sc1, m1, sc2, m2;
                q4k_scale_min(2 * j, w + 4, &sc1, &m1);
                q4k_scale_min(2 * j + 1, w + 4, &sc2, &m2);
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
                const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
                const int64_t b = sb * 8 + 2 * j;
                BLOCK_DOT(lo, 0, d * (float)sc1, -dmin * (float)m1, b)
                BLOCK_DOT(hi, 0, d * (float)sc2, -dmin * (float)m2, b + 1)
            }
        }
    } else {
        for (int64_t b = 0; b < nb; ++b) {
            const float d = h2f(rd16(w));
            _mm_prefetch((const char *)w + PF_AHEAD, _MM_HINT_T0);
            if (type == T_Q8_0) {
                wsigned = _mm256_loadu_si256((const __m256i *)(w + 2));
                const __m256i wu = _mm256_sign_epi8(wsigned, wsigned);
                BLOCK_DOT(wu, 1, d, 0.0f, b)
                w += 34;
            } else if (type == T_Q4_0) {
                const __m256i wu = unpack_nibbles16(w + 2);
                BLOCK_DOT(wu, 0, d, -8.0f * d, b)
                w += 18;
            } else {
                const float mn = h2f(rd16(w + 2));
                const __m256i wu = unpack_nibbles16(w + 4);
                BLOCK_DOT(wu, 0, d, mn, b)
                w += 20;
            }
        }
    }
    for (int m = 0; m < mc; ++m) out[m * ldo] = hsum256(acc[m]) + corr[m];
}
#else /* portable scalar path */
static inline void dot_rows_int8(const int type, const uint8_t *w, int64_t K, const int8_t *xq, const float *xd,
                                 const float *xs, int mc, float *out, int64_t ldo) {
    const int64_t nb = K / QK;
    for (int m = 0; m < mc; ++m) {
        const uint8_t *wr = w;
        const int8_t *x = xq + m * K;
        float total = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            const int8_t *xb = x + b * QK;
            float dw, cw;
            int isum = 0;
            if (type == T_Q4_K) {
                const int64_t sb = b / 8, j = b % 8;
                const uint8_t *blk = wr + sb * 144;
                uint8_t sc, mn;
                q4k_scale_min((int)j, blk + 4, &sc, &mn);
                const uint8_t *qs = blk + 16 + 32 * (j / 2);
                const int shift = (j % 2) * 4;
                for (int l = 0; l < QK; ++l) isum += ((qs[l] >> shift) & 0xF) * xb[l];
                dw = h2f(rd16(blk)) * (float)sc;
                cw = -h2f(rd16(blk + 2)) * (float)mn;
            } else if (type == T_Q8_0) {
                const uint8_t *blk = wr + b * 34;
                const int8_t *qs = (const int8_t *)(blk + 2);
                for (int l = 0; l < QK; ++l) isum += qs[l] * xb[l];
                dw = h2f(rd16(blk));
                cw = 0.0f;
            } else {
                const int q41 = type == T_Q4_1;
                const uint8_t *blk = wr + b * (q41 ? 20 : 18), *qs = blk + (q41 ? 4 : 2);
                for (int l = 0; l < 16; ++l) isum += (qs[l] & 0xF) * xb[l] + (qs[l] >> 4) * xb[l + 16];
                dw = h2f(rd16(blk));
                cw = q41 ? h2f(rd16(blk + 2)) : -8.0f * dw;
            }
            total += dw * xd[m * nb + b] * (float)isum + cw * xs[m * nb + b];
        }
        out[m * ldo] = total;
    }
}
#endif

static inline __attribute__((always_inline)) void gemm_int8_rows(const int type, const uint8_t *w, int64_t rb, int64_t n0, int64_t n1, int64_t K,
                           const int8_t *xq, const float *xd, const float *xs, int64_t M, float *y, int64_t N) {
    const int64_t nb = K / QK;
    for (int64_t n = n0; n < n1; ++n)
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const int mc = (int)(M - m0 < MB ? M - m0 : MB);
            dot_rows_int8(type, w + n * rb, K, xq + m0 * K, xd + m0 * nb, xs + m0 * nb, mc, y + m0 * N + n, N);
        }
}

/* ---------------------------------------------------------------------------------------------------------
 * Design (b): dequantize TILE_N rows into fp32, then a 4×4 block of fp32 dot products with FMAs. */

#if defined(__AVX512F__)
#define VW 16
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VHSUM(v) _mm512_reduce_add_ps(v)
#elif defined(__AVX2__)
#define VW 8
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VHSUM(v) hsum256(v)
#endif

#if defined(VW)
/* 16 quants (uint8, or int8 when `sgn`) → y[0..16) = q · d + off, with FMAs (not bit-exact: the GEMM only). */
static inline void store16(float *y, __m128i q, int sgn, float d, float off) {
#if defined(__AVX512F__)
    const __m512i qi = sgn ? _mm512_cvtepi8_epi32(q) : _mm512_cvtepu8_epi32(q);
    _mm512_storeu_ps(y, _mm512_fmadd_ps(_mm512_cvtepi32_ps(qi), _mm512_set1_ps(d), _mm512_set1_ps(off)));
#else
    const __m128i q2 = _mm_srli_si128(q, 8);
    const __m256i a = sgn ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q);
    const __m256i b = sgn ? _mm256_cvtepi8_epi32(q2) : _mm256_cvtepu8_epi32(q2);
    const __m256 vd = _mm256_set1_ps(d), vo = _mm256_set1_ps(off);
    _mm256_storeu_ps(y, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), vd, vo));
    _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), vd, vo));
#endif
}

static void dequant_row_simd(int type, const uint8_t *w, int64_t K, float *y) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    if (type == T_Q4_K) {
        for (int64_t b = 0; b < K / QK_K; ++b, w += 144, y += QK_K) {
            const float d = h2f(rd16(w)), dmin = h2f(rd16(w + 2));
            _mm_prefetch((const char *)w + PF_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char *)w + PF_AHEAD + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)w + PF_AHEAD + 128, _MM_HINT_T0);
            for (int j = 0; j < 4; ++j) {
                uint8_t sc1, m1, sc2, m2;
                q4k_scale_min(2 * j, w + 4, &sc1, &m1);
                q4k_scale_min(2 * j + 1, w + 4, &sc2, &m2);
                const __m128i v0 = _mm_loadu_si128((const __m128i *)(w + 16 + 32 * j));
                const __m128i v1 = _mm_loadu_si128((const __m128i *)(w + 32 + 32 * j));
                float *yj = y + 64 * j;
                store16(yj, _mm_and_si128(v0, mask), 0, d * (float)sc1, -dmin * (float)m1);
                store16(yj + 16, _mm_and_si128(v1, mask), 0, d * (float)sc1, -dmin * (float)m1);
                store16(yj + 32, _mm_and_si128(_mm_srli_epi16(v0, 4), mask), 0, d * (float)sc2, -dmin * (float)m2);
                store16(yj + 48, _mm_and_si128(_mm_srli_epi16(v1, 4), mask), 0, d * (float)sc2, -dmin * (float)m2);
            }
        }
        return;
    }
    for (int64_t b = 0; b < K / QK; ++b, y += QK) {
        const float d = h2f(rd16(w));
        _mm_prefetch((const char *)w + PF_AHEAD, _MM_HINT_T0);
        if (type == T_Q8_0) {
            store16(y, _mm_loadu_si128((const __m128i *)(w + 2)), 1, d, 0.0f);
            store16(y + 16, _mm_loadu_si128((const __m128i *)(w + 18)), 1, d, 0.0f);
            w += 34;
        } else {
            const int q41 = type == T_Q4_1;
            const float off = q41 ? h2f(rd16(w + 2)) : -8.0f * d;
            const __m128i v = _mm_loadu_si128((const __m128i *)(w + (q41 ? 4 : 2)));
            store16(y, _mm_and_si128(v, mask), 0, d, off);
            store16(y + 16, _mm_and_si128(_mm_srli_epi16(v, 4), mask), 0, d, off);
            w += q41 ? 20 : 18;
        }
    }
}
#define DEQUANT_TILE_ROW dequant_row_simd
#else
#define DEQUANT_TILE_ROW dequant_row
#endif

static void gemm_dequant_rows(int type, const uint8_t *w, int64_t rb, int64_t n0, int64_t n1, int64_t K,
                              const float *x, int64_t M, float *y, int64_t N, float *tile) {
    for (int64_t nt = n0; nt < n1; nt += TILE_N) {
        const int nc = (int)(n1 - nt < TILE_N ? n1 - nt : TILE_N);
        for (int r = 0; r < nc; ++r) DEQUANT_TILE_ROW(type, w + (nt + r) * rb, K, tile + r * K);
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int mc = (int)(M - m0 < 4 ? M - m0 : 4);
            for (int r0 = 0; r0 < nc; r0 += 4) {
                const int rc = nc - r0 < 4 ? nc - r0 : 4;
#if defined(VW)
                if (mc == 4 && rc == 4) {
                    vf acc[4][4];
                    for (int i = 0; i < 4; ++i)
                        for (int j = 0; j < 4; ++j) acc[i][j] = VZERO();
                    for (int64_t k = 0; k < K; k += VW) {
                        vf xv[4], wv[4];
                        for (int i = 0; i < 4; ++i) xv[i] = VLOAD(x + (m0 + i) * K + k);
                        for (int j = 0; j < 4; ++j) wv[j] = VLOAD(tile + (r0 + j) * K + k);
                        for (int i = 0; i < 4; ++i)
                            for (int j = 0; j < 4; ++j) acc[i][j] = VFMA(xv[i], wv[j], acc[i][j]);
                    }
                    for (int i = 0; i < 4; ++i)
                        for (int j = 0; j < 4; ++j) y[(m0 + i) * N + nt + r0 + j] = VHSUM(acc[i][j]);
                    continue;
                }
                for (int i = 0; i < mc; ++i)
                    for (int j = 0; j < rc; ++j) {
                        vf acc = VZERO();
                        for (int64_t k = 0; k < K; k += VW)
                            acc = VFMA(VLOAD(x + (m0 + i) * K + k), VLOAD(tile + (r0 + j) * K + k), acc);
                        y[(m0 + i) * N + nt + r0 + j] = VHSUM(acc);
                    }
#else
                for (int i = 0; i < mc; ++i)
                    for (int j = 0; j < rc; ++j) {
                        float acc = 0.0f;
                        for (int64_t k = 0; k < K; ++k) acc += x[(m0 + i) * K + k] * tile[(r0 + j) * K + k];
                        y[(m0 + i) * N + nt + r0 + j] = acc;
                    }
#endif
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * Entry point: y[M,N] = x[M,K] · Wᵀ, W = [N, row_bytes] GGUF blocks. method 0: int8 dot (a), 1: dequant (b).
 * Returns 0, -1 for a bad type/K, -2 when out of memory. */

const char *quant_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "avx512_vnni";
#elif defined(__AVXVNNI__)
    return "avx_vnni";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "scalar";
#endif
}

int quant_linear(int type, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                 int method) {
    const int64_t rb = quant_row_bytes(type, K);
    if (rb == 0) return -1;
    int status = 0;
    if (method == 0) {
        const int64_t nb = K / QK;
        int8_t *xq = malloc((size_t)(M * K));
        float *xd = malloc((size_t)(M * nb) * sizeof(float)), *xs = malloc((size_t)(M * nb) * sizeof(float));
        if (!xq || !xd || !xs) {
            status = -2;
        } else {
            quantize_rows_q8(x, M, K, xq, xd, xs);
#pragma omp parallel
            {
#if defined(_OPENMP)
                extern int omp_get_thread_num(void), omp_get_num_threads(void);
                const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
                const int64_t t = 0, nt = 1;
#endif
                const int64_t chunk = (N + nt - 1) / nt, n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
                if (n0 < n1) {
                    switch (type) { /* constant type: each case is its own specialised loop */
                        case T_Q4_0: gemm_int8_rows(T_Q4_0, w, rb, n0, n1, K, xq, xd, xs, M, y, N); break;
                        case T_Q4_1: gemm_int8_rows(T_Q4_1, w, rb, n0, n1, K, xq, xd, xs, M, y, N); break;
                        case T_Q8_0: gemm_int8_rows(T_Q8_0, w, rb, n0, n1, K, xq, xd, xs, M, y, N); break;
                        default: gemm_int8_rows(T_Q4_K, w, rb, n0, n1, K, xq, xd, xs, M, y, N); break;
                    }
                }
            }
        }
        free(xq);
        free(xd);
        free(xs);
        return status;
    }
#pragma omp parallel
    {
#if defined(_OPENMP)
        extern int omp_get_thread_num(void), omp_get_num_threads(void);
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t t = 0, nt = 1;
#endif
        const int64_t per = ((N + nt - 1) / nt + TILE_N - 1) / TILE_N * TILE_N;
        const int64_t n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
        float *tile = malloc((size_t)(TILE_N * K) * sizeof(float));
        if (!tile) {
#pragma omp atomic write
            status = -2;
        } else if (n0 < n1) {
            gemm_dequant_rows(type, w, rb, n0, n1, K, x, M, y, N, tile);
        }
        free(tile);
    }
    return status;
}
