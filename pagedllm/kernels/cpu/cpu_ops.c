/* The CPU path's native kernels (float32): PagedAttention for a flat batch of decodes and prompt
 * chunks, the cache write, and the fused elementwise ops (RMSNorm, Gemma's (1 + w) RMSNorm, RoPE, SiLU·mul,
 * GeGLU's gelu_tanh·mul) that kernels/triton_fused_ops.py provides on CUDA.
 *
 * Built on first use by pagedllm/kernels/cpu_kernels.py, once per ISA level (kernels/cpu_isa.py:
 * -mavx512f…, -mavx2 -mfma, or plain -O3), and called through ctypes with raw pointers. The OpenMP runtime it links is libgomp.so.1, which resolves to the
 * copy torch has already loaded, so these loops share torch's thread pool.
 *
 * Cache layout, as everywhere in pagedllm: [num_blocks, block_size, num_kv_heads, head_dim], so token j
 * of block b, head h starts at ((b * block_size + j) * num_kv_heads + h) * head_dim. The pool holds
 * float32 or, with --kv-cache-dtype bfloat16, bf16 (half the bytes that attention streams): written with
 * round-to-nearest-even as torch's .to(torch.bfloat16), read back exactly by a 16-bit shift. With
 * --kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2 it holds one byte per value (a quarter of float32's): x / scale
 * saturated and rounded to nearest even, as kernels/kv_quant.py's quantize, read back as fp8 · scale.
 * The torch reference (kernels/reference.py) is the oracle these are tested against.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One vector type per ISA: VW float lanes and the few operations the kernels need. The AVX-512 and AVX2
 * builds share every kernel below; only the horizontal sums differ. Scalar builds (VECTOR_PATH 0) take
 * the plain loops, which the compiler vectorises for whatever it targets. */
#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vec;
#define VW 16
#define v_load _mm512_loadu_ps
#define v_store _mm512_storeu_ps
#define v_set1 _mm512_set1_ps
#define v_zero _mm512_setzero_ps
#define v_fma _mm512_fmadd_ps
#define v_add _mm512_add_ps
#define v_sub _mm512_sub_ps
#define v_mul _mm512_mul_ps
#define v_div _mm512_div_ps
#define v_max _mm512_max_ps
#define v_reduce _mm512_reduce_add_ps
__m512 _ZGVeN16v_expf(__m512); /* glibc's libmvec: expf on 16 lanes (≤ 4 ulp) */
#define v_exp _ZGVeN16v_expf
#define VECTOR_PATH 1
#define v_abs _mm512_abs_ps
/* a < b ? x : y, lane by lane */
static inline vec v_select_lt(vec a, vec b, vec x, vec y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x);
}
/* |m| (m's sign bit clear) with s's sign */
static inline vec v_with_sign(vec m, vec s) {
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(s), _mm512_set1_epi32(INT32_MIN));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(m), sign));
}

/* The 16 horizontal sums of v[0..15], as one vector (lane j = sum of v[j]): a transpose-add tree. */
static inline vec hsum_run(const vec v[VW]) {
    __m512 s1[8], s2[4];
    for (int i = 0; i < 8; ++i) /* per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3) */
        s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) /* per 128-bit lane: partial sums of 4 consecutive vectors */
        s2[i] = _mm512_add_ps(_mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0x44),
                              _mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0xEE));
    const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], 0x88), _mm512_shuffle_f32x4(s2[0], s2[1], 0xDD));
    const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2], s2[3], 0x88), _mm512_shuffle_f32x4(s2[2], s2[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}
/* dst[e * dst_stride + j] = src[j][e] for a 16 × 16 tile of float32 (rows src[0..15]): 64 shuffles. */
static inline void transpose_tile(const float *const src[VW], float *dst, int64_t dst_stride) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src[i]);
    for (int i = 0; i < 8; ++i) { /* per 128-bit lane L: rows 2i, 2i+1 interleaved */
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) { /* r[4i + c], lane L: column 4L + c of rows 4i .. 4i+3 */
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int c = 0; c < 4; ++c) { /* a 4 × 4 transpose of 128-bit lanes across r[c], r[4 + c], r[8 + c], r[12 + c] */
        const __m512 w0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44), w1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
        const __m512 w2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
        const __m512 w3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
        _mm512_storeu_ps(dst + c * dst_stride, _mm512_shuffle_f32x4(w0, w2, 0x88));
        _mm512_storeu_ps(dst + (4 + c) * dst_stride, _mm512_shuffle_f32x4(w0, w2, 0xDD));
        _mm512_storeu_ps(dst + (8 + c) * dst_stride, _mm512_shuffle_f32x4(w1, w3, 0x88));
        _mm512_storeu_ps(dst + (12 + c) * dst_stride, _mm512_shuffle_f32x4(w1, w3, 0xDD));
    }
}
/* Register tiles: a score tile is QK_ROWS query rows × QK_VECS vectors of keys (one accumulator each, every
 * broadcast query value feeds QK_VECS FMAs); a probability tile is PV_ROWS rows × four vectors of dims. */
#define QK_ROWS 6
#define QK_VECS 4
#define PV_ROWS 6
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vec;
#define VW 8
#define v_load _mm256_loadu_ps
#define v_store _mm256_storeu_ps
#define v_set1 _mm256_set1_ps
#define v_zero _mm256_setzero_ps
#define v_fma _mm256_fmadd_ps
#define v_add _mm256_add_ps
#define v_sub _mm256_sub_ps
#define v_mul _mm256_mul_ps
#define v_div _mm256_div_ps
#define v_max _mm256_max_ps
__m256 _ZGVdN8v_expf(__m256); /* glibc's libmvec: expf on 8 lanes (AVX2) */
#define v_exp _ZGVdN8v_expf
#define VECTOR_PATH 1
static inline vec v_abs(vec x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), x); }
static inline vec v_select_lt(vec a, vec b, vec x, vec y) { return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
static inline vec v_with_sign(vec m, vec s) { return _mm256_or_ps(m, _mm256_and_ps(s, _mm256_set1_ps(-0.f))); }

static inline float v_reduce(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The 8 horizontal sums of v[0..7], as one vector (lane j = sum of v[j]). */
static inline vec hsum_run(const vec v[VW]) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* u0 = (sums of v0..v3 over the low 128 bits | over the high 128 bits); likewise u1 for v4..v7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
/* dst[e * dst_stride + j] = src[j][e] for an 8 × 8 tile of float32 (rows src[0..7]): 24 shuffles. */
static inline void transpose_tile(const float *const src[VW], float *dst, int64_t dst_stride) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src[i]);
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) { /* r[4i + c], 128-bit lane L: column 4L + c of rows 4i .. 4i+3 */
        r[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int c = 0; c < 4; ++c) {
        _mm256_storeu_ps(dst + c * dst_stride, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));
        _mm256_storeu_ps(dst + (4 + c) * dst_stride, _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));
    }
}
#define QK_ROWS 6
#define QK_VECS 2
#define PV_ROWS 3
#else
/* Scalar stand-ins, so that the score and probability tiles below compile for any target. */
typedef float vec;
#define VW 1
#define VECTOR_PATH 0
#define v_load(p) (*(p))
#define v_store(p, x) (*(p) = (x))
#define v_set1(x) (x)
#define v_zero() 0.f
#define v_fma(a, b, c) ((a) * (b) + (c))
#define v_add(a, b) ((a) + (b))
#define v_mul(a, b) ((a) * (b))
static inline void transpose_tile(const float *const src[VW], float *dst, int64_t dst_stride) {
    (void)dst_stride;
    dst[0] = src[0][0];
}
#define QK_ROWS 4
#define QK_VECS 4
#define PV_ROWS 4
#endif

/* ---- The token path: decodes and short chunks, one query token at a time against K/V rows as stored ---- */

/* PREFETCH_AHEAD: how many blocks ahead of the one it reads the token path prefetches. PREFETCH_LOCALITY 2
 * (prefetcht1): the lines go to L2, whose miss queue holds far more lines in flight than L1's few fill buffers;
 * into L1 (3) the random block reads of a 64-sequence decode ran at 13-14 GB/s, into L2 at 17-18 (Zen 4), and at
 * 21-23 with the prefetches spread between the FMAs (run_scores, weigh_span) rather than issued per slice. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 2
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2
#endif

/* scores[g * stride] = scale * (q_g · k) for the `group` query rows that share one K row. */
static inline void group_scores(const float *restrict q, const float *restrict k, int group, int head_dim,
                                float scale, float *restrict scores, int64_t stride) {
#if VECTOR_PATH
    if (head_dim % VW == 0 && group <= 16) {
        vec acc[16];
        for (int g = 0; g < group; ++g) acc[g] = v_zero();
        for (int d = 0; d < head_dim; d += VW) {
            const vec kv = v_load(k + d);
            for (int g = 0; g < group; ++g) acc[g] = v_fma(v_load(q + g * head_dim + d), kv, acc[g]);
        }
        for (int g = 0; g < group; ++g) scores[g * stride] = scale * v_reduce(acc[g]);
        return;
    }
#endif
    /* Eight lanes summed in a fixed order, not an `omp simd` reduction: this is inlined into several loops, and
     * the order a compiler picks for such a reduction could differ between them, so a query token would not get
     * the same bits in a chunk as alone. */
    for (int g = 0; g < group; ++g) {
        const float *qg = q + g * head_dim;
        float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        int d = 0;
        for (; d + 8 <= head_dim; d += 8)
            for (int l = 0; l < 8; ++l) lane[l] += qg[d + l] * k[d + l];
        float acc = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
        for (; d < head_dim; ++d) acc += qg[d] * k[d];
        scores[g * stride] = scale * acc;
    }
}

/* Scores of a run of VW tokens: out[g * stride + j] = scale * (q_g · k_j), k_j = k + j * row_stride, for the
 * `group` query rows sharing these K rows (vector builds with head_dim % VW == 0 only). */
static inline void run_scores(const float *restrict q, const float *restrict k, int64_t row_stride, int group,
                              int head_dim, float scale, float *restrict out, int64_t stride, const char *pf,
                              int64_t pf_bytes) {
#if VECTOR_PATH
    /* pf[0 : pf_bytes): lines of a later block, prefetched a few per vector of dims, between the FMAs */
    const int64_t per = (pf_bytes / 64 + group * (head_dim / VW) - 1) / (group * (head_dim / VW));
    int64_t off = 0;
    const vec vscale = v_set1(scale);
    for (int g = 0; g < group; ++g) {
        vec acc[VW];
        for (int j = 0; j < VW; ++j) acc[j] = v_zero();
        for (int d = 0; d < head_dim; d += VW) {
            const vec qv = v_load(q + g * head_dim + d);
            for (int j = 0; j < VW; ++j) acc[j] = v_fma(qv, v_load(k + j * row_stride + d), acc[j]);
            for (int64_t l = 0; l < per && off < pf_bytes; ++l, off += 64) __builtin_prefetch(pf + off, 0, PREFETCH_LOCALITY);
        }
        v_store(out + g * stride, v_mul(hsum_run(acc), vscale));
    }
#else
    (void)q, (void)k, (void)row_stride, (void)group, (void)head_dim, (void)scale, (void)out, (void)stride, (void)pf,
        (void)pf_bytes;
#endif
}

/* ---- The tile path: prompt chunks, scores and probabilities as small GEMMs ---- */

/* kt[e * ldk + j] = key_rows[j][e] for j < ldk (a multiple of VW) and e < width (all KV heads' dims): a run of
 * keys, transposed. Whole VW × VW tiles go through registers; the scalar loop covers widths VW does not divide. */
static inline void transpose_keys(const float *const *key_rows, int64_t ldk, int64_t width, float *restrict kt) {
    if (VECTOR_PATH && width % VW == 0) {
        for (int64_t j0 = 0; j0 < ldk; j0 += VW)
            for (int64_t e0 = 0; e0 < width; e0 += VW) {
                const float *src[VW];
                for (int j = 0; j < VW; ++j) src[j] = key_rows[j0 + j] + e0;
                transpose_tile(src, kt + e0 * ldk + j0, ldk);
            }
        return;
    }
    for (int64_t e = 0; e < width; ++e)
        for (int64_t j = 0; j < ldk; ++j) kt[e * ldk + j] = key_rows[j][e];
}

/* out[r * out_stride + j] = scale * (q_r · k_j) for N query rows, given transposed (qt[d * ldq + r]), and the
 * `keys` keys of a transposed K run (kt[d * ldk + j], QK_VECS·VW columns). Keys run along the vector lanes;
 * each dot product is one chain of FMAs over d = 0 .. head_dim-1, in that order, whatever the tile. */
static inline __attribute__((always_inline)) void score_rows(const float *restrict qt, int64_t ldq, const int N,
                                                             const float *restrict kt, int64_t ldk, int keys,
                                                             int head_dim, float scale, float *out,
                                                             int64_t out_stride) {
    vec acc[QK_ROWS][QK_VECS];
    for (int r = 0; r < N; ++r)
        for (int v = 0; v < QK_VECS; ++v) acc[r][v] = v_zero();
    for (int d = 0; d < head_dim; ++d) {
        vec k[QK_VECS];
        for (int v = 0; v < QK_VECS; ++v) k[v] = v_load(kt + d * ldk + v * VW);
        for (int r = 0; r < N; ++r) {
            const vec b = v_set1(qt[d * ldq + r]);
            for (int v = 0; v < QK_VECS; ++v) acc[r][v] = v_fma(b, k[v], acc[r][v]);
        }
    }
    const vec vscale = v_set1(scale);
    float lanes[VW];
    for (int r = 0; r < N; ++r)
        for (int v = 0; v < QK_VECS && v * VW < keys; ++v) {
            float *o = out + r * out_stride + v * VW;
            if ((v + 1) * VW <= keys) {
                v_store(o, v_mul(acc[r][v], vscale));
            } else {
                v_store(lanes, v_mul(acc[r][v], vscale));
                memcpy(o, lanes, sizeof(float) * (size_t)(keys - v * VW));
            }
        }
}

/* score_rows for any n ≤ QK_ROWS rows, each count compiled with its accumulators in registers. */
static void score_tile(const float *qt, int64_t ldq, int n, const float *kt, int64_t ldk, int keys, int head_dim,
                       float scale, float *out, int64_t out_stride) {
    switch (n) {
#define SCORE_CASE(N) case N: score_rows(qt, ldq, N, kt, ldk, keys, head_dim, scale, out, out_stride); break;
        SCORE_CASE(1) SCORE_CASE(2) SCORE_CASE(3) SCORE_CASE(4)
#if QK_ROWS > 4
        SCORE_CASE(5) SCORE_CASE(6)
#endif
#undef SCORE_CASE
    default: break;
    }
}

/* acc[i * acc_stride + d0 ..][: C·VW] += Σ_j p[i * p_stride + j] * v_j[d0 : d0 + C·VW] over the n rows
 * v_j = v + j * row_stride, for N query rows: each row's sum is taken in registers from zero over j in order,
 * then added to its accumulator once; each V vector loaded serves all N rows (N·C chains of FMAs, enough to
 * hide the FMA latency, plus N broadcast weights and one V vector: 16 registers for AVX2's 3 × 4). */
static inline __attribute__((always_inline)) void weigh_span(const float *restrict p, int64_t p_stride, const int N,
                                                             const float *restrict v, int64_t row_stride, int n,
                                                             float *acc, int64_t acc_stride, int d0, const int C,
                                                             const char *pf, int64_t pf_bytes) {
    /* pf[0 : pf_bytes): lines of a later block, prefetched a few per key, between the FMAs */
    const int64_t per = n > 0 ? (pf_bytes / 64 + n - 1) / n : 0;
    int64_t off = 0;
    vec r[PV_ROWS][4];
    for (int i = 0; i < N; ++i)
        for (int c = 0; c < C; ++c) r[i][c] = v_zero();
    for (int j = 0; j < n; ++j) {
        const float *vj = v + j * row_stride + d0;
        vec w[PV_ROWS];
        for (int i = 0; i < N; ++i) w[i] = v_set1(p[i * p_stride + j]);
        for (int c = 0; c < C; ++c) {
            const vec x = v_load(vj + c * VW);
            for (int i = 0; i < N; ++i) r[i][c] = v_fma(w[i], x, r[i][c]);
        }
        for (int64_t l = 0; l < per && off < pf_bytes; ++l, off += 64) __builtin_prefetch(pf + off, 0, PREFETCH_LOCALITY);
    }
    for (int i = 0; i < N; ++i)
        for (int c = 0; c < C; ++c) {
            float *a = acc + i * acc_stride + d0 + c * VW;
            v_store(a, v_add(v_load(a), r[i][c]));
        }
}

/* All of head_dim (a multiple of VW) in spans of four vectors, the last span shorter. */
static inline __attribute__((always_inline)) void weigh_rows(const float *p, int64_t p_stride, const int N,
                                                             const float *v, int64_t row_stride, int n, float *acc,
                                                             int64_t acc_stride, int head_dim, const char *pf,
                                                             int64_t pf_bytes) {
    int d0 = 0; /* the first span issues the prefetches */
    for (; d0 + 4 * VW <= head_dim; d0 += 4 * VW, pf_bytes = 0)
        weigh_span(p, p_stride, N, v, row_stride, n, acc, acc_stride, d0, 4, pf, pf_bytes);
    switch ((head_dim - d0) / VW) {
    case 3: weigh_span(p, p_stride, N, v, row_stride, n, acc, acc_stride, d0, 3, pf, pf_bytes); break;
    case 2: weigh_span(p, p_stride, N, v, row_stride, n, acc, acc_stride, d0, 2, pf, pf_bytes); break;
    case 1: weigh_span(p, p_stride, N, v, row_stride, n, acc, acc_stride, d0, 1, pf, pf_bytes); break;
    default: break;
    }
}

/* weigh_rows for any n ≤ PV_ROWS rows. */
static void weigh_tile(const float *p, int64_t p_stride, int n, const float *v, int64_t row_stride, int keys,
                       float *acc, int64_t acc_stride, int head_dim, const char *pf, int64_t pf_bytes) {
    switch (n) {
#define WEIGH_CASE(N) case N: weigh_rows(p, p_stride, N, v, row_stride, keys, acc, acc_stride, head_dim, pf, pf_bytes); break;
        WEIGH_CASE(1) WEIGH_CASE(2)
#if PV_ROWS > 2
        WEIGH_CASE(3)
#endif
#if PV_ROWS > 3
        WEIGH_CASE(4)
#endif
#if PV_ROWS > 4
        WEIGH_CASE(5) WEIGH_CASE(6)
#endif
#undef WEIGH_CASE
    default: break;
    }
}

/* acc[g, :] += Σ_j p[g * stride + j] * v_j over the n (≤ block_size) rows v_j = v + j * row_stride, for the
 * `group` query rows that share these V rows: the token path where the vector tiles cannot cover head_dim
 * (scalar builds, or head_dim not a multiple of VW). */
static inline void group_block_axpy(const float *restrict p, int64_t stride, const float *restrict v,
                                    int64_t row_stride, int n, int group, int head_dim, float *restrict acc) {
    for (int g = 0; g < group; ++g)
        for (int j = 0; j < n; ++j) {
            const float w = p[g * stride + j];
            const float *vj = v + j * row_stride;
            float *a = acc + g * head_dim;
#pragma omp simd
            for (int d = 0; d < head_dim; ++d) a[d] += w * vj[d];
        }
}

/* max(row[0:n]), n ≥ 1 (vector lanes: a scalar chain of compares is latency-bound). */
static inline float row_max(const float *row, int n) {
    float m = row[0];
    int t = 0;
#if VECTOR_PATH
    if (n >= VW) {
        vec vm = v_load(row);
        for (t = VW; t + VW <= n; t += VW) vm = v_max(vm, v_load(row + t));
        float lanes[VW];
        v_store(lanes, vm);
        m = lanes[0];
        for (int i = 1; i < VW; ++i) m = lanes[i] > m ? lanes[i] : m;
    }
#endif
    for (; t < n; ++t) m = row[t] > m ? row[t] : m;
    return m;
}

#if VECTOR_PATH
/* v_exp with the lanes below -105 set to 0 (what expf gives there) before libmvec sees them. libmvec's vector
 * expf hands a whole vector with any lane out of its fast range to scalar code, and masked logits (-inf: the
 * grammar bitmask of structured outputs) put such a lane in nearly every vector: 64 rows of 49 152 logits with 98 %
 * masked took 13.3 ms to sample against 1.6 ms unmasked (BENCHMARKS.md §76.5). The same bits as v_exp. */
static inline vec v_exp_flush(vec x) {
    const vec lo = v_set1(-105.f);
    return v_select_lt(x, lo, v_zero(), v_exp(v_select_lt(x, lo, v_zero(), x)));
}
#endif

/* row[0:n] = exp(row[0:n] - m); returns their sum. */
static inline float exp_shifted(float *row, int n, float m) {
    float sum = 0.f;
    int t = 0;
#if VECTOR_PATH
    vec vsum = v_zero();
    const vec vm = v_set1(m);
    for (; t + VW <= n; t += VW) {
        const vec e = v_exp_flush(v_sub(v_load(row + t), vm));
        v_store(row + t, e);
        vsum = v_add(vsum, e);
    }
    sum = v_reduce(vsum);
#endif
    for (; t < n; ++t) {
        row[t] = expf(row[t] - m);
        sum += row[t];
    }
    return sum;
}

/* cap · tanh(x / cap) (attention-logit soft-capping, Gemma 2), with y = x · (1 / cap): a multiply, not a divide,
 * within an ulp. tanh(y) is y's odd Taylor series to y^15 where |y| < 0.5 (truncated under 1e-8; 1 - 2 / (e^2|y| + 1)
 * would cancel there) and that formula elsewhere, with y's sign (saturating to ±1, NaN staying NaN). */
#if VECTOR_PATH
static inline vec v_soft_cap(vec x, vec cap, vec inv_cap) {
    const vec y = v_mul(x, inv_cap), a = v_abs(y), z = v_mul(a, a), one = v_set1(1.f), two = v_set1(2.f);
    vec p = v_fma(z, v_set1(-929569.f / 638512875), v_set1(21844.f / 6081075));
    p = v_fma(z, p, v_set1(-1382.f / 155925));
    p = v_fma(z, p, v_set1(62.f / 2835));
    p = v_fma(z, p, v_set1(-17.f / 315));
    p = v_fma(z, p, v_set1(2.f / 15));
    p = v_fma(z, p, v_set1(-1.f / 3));
    const vec series = v_fma(v_mul(a, z), p, a);
    const vec exact = v_sub(one, v_div(two, v_add(v_exp(v_mul(two, a)), one)));
    return v_with_sign(v_mul(cap, v_select_lt(a, v_set1(0.5f), series, exact)), y);
}
#else
static inline float soft_cap_one(float x, float cap, float inv_cap) {
    const float y = x * inv_cap, a = fabsf(y), z = a * a;
    const float p = -1.f / 3 + z * (2.f / 15 + z * (-17.f / 315 + z * (62.f / 2835 + z * (-1382.f / 155925 +
                    z * (21844.f / 6081075 + z * (-929569.f / 638512875))))));
    return copysignf(cap * (a < 0.5f ? a + a * z * p : 1.f - 2.f / (expf(2.f * a) + 1.f)), y);
}
#endif

/* row[0:n] capped in place. Vector builds take a short tail through one padded vector, so each element's value
 * depends on that element alone, not on where its row starts: a token keeps its own bits in any tile. */
static void soft_cap_scores(float *row, int n, float cap) {
    const float inv_cap = 1.f / cap;
#if VECTOR_PATH
    const vec vcap = v_set1(cap), vinv = v_set1(inv_cap);
    int t = 0;
    for (; t + VW <= n; t += VW) v_store(row + t, v_soft_cap(v_load(row + t), vcap, vinv));
    if (t < n) {
        float lanes[VW] = {0.f};
        memcpy(lanes, row + t, sizeof(float) * (size_t)(n - t));
        v_store(lanes, v_soft_cap(v_load(lanes), vcap, vinv));
        memcpy(row + t, lanes, sizeof(float) * (size_t)(n - t));
    }
#else
    for (int t = 0; t < n; ++t) row[t] = soft_cap_one(row[t], cap, inv_cap);
#endif
}

static inline void prefetch_bytes(const void *block, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)block + i, 0, PREFETCH_LOCALITY);
}

/* Prefetches block[done : upto) by 64-byte lines and returns the new `done` (no-op for a NULL block). The token
 * path fetches a later block a slice per piece of work on the current one, its lines spread between that work's
 * FMAs: a whole block's prefetches at once queue on the core's miss buffers and the work stalls behind them (a
 * random-block read with this much work per byte: +40 % bandwidth in slices, nothing as one burst). */
static inline int64_t prefetch_upto(const char *block, int64_t done, int64_t upto) {
    if (block == NULL) return done;
    for (; done < upto; done += 64) __builtin_prefetch(block + done, 0, PREFETCH_LOCALITY);
    return done;
}

/* The token path reads a work item's K blocks b_lo .. n_blocks-1, then its V blocks: block `pos` of that sequence
 * (NULL past its end), which the K pass prefetches PREFETCH_AHEAD blocks ahead of the one it reads. */
static inline const char *pass_block(const void *key_cache, const void *value_cache, const int32_t *table, int b_lo,
                                     int n_blocks, int pos, int64_t block_bytes) {
    const int n = n_blocks - b_lo;
    if (pos < n) return (const char *)key_cache + (int64_t)table[b_lo + pos] * block_bytes;
    if (pos < 2 * n) return (const char *)value_cache + (int64_t)table[b_lo + pos - n] * block_bytes;
    return NULL;
}

typedef uint32_t __attribute__((may_alias)) u32_alias;

/* dst[0:n] = the float32 values of bf16 src[0:n] (exact: the bf16 bits are the float's top half). */
static inline const float *bf16_to_f32(float *restrict dst, const uint16_t *restrict src, int64_t n) {
    u32_alias *d = (u32_alias *)dst;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) d[i] = (uint32_t)src[i] << 16;
    return dst;
}

/* The pool's element type (paged_attention_f32's kv_format, the cache writes' format). */
enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8_E4M3 = 2, KV_FP8_E5M2 = 3 };

static inline int kv_elem_bytes(int format) { return format == KV_F32 ? 4 : format == KV_BF16 ? 2 : 1; }

/* fp8 src[0:n] → float32 dst[0:n] (unscaled), without vector instructions beyond the compiler's: the float32 bits
 * built in integers (a subnormal normalised by its leading bit), independent of the FPU's denormal mode. */
static inline void fp8_decode_plain(float *restrict dst, const uint8_t *restrict src, int64_t n, int e5m2) {
    const uint32_t mbits = e5m2 ? 2u : 3u, shift = 23u - mbits, sub_mask = (1u << mbits) - 1u;
    const uint32_t rebias = (e5m2 ? 112u : 120u) << 23; /* 127 - the format's exponent bias */
    const uint32_t sub_exp = e5m2 ? 111u : 118u;        /* float32 exponent field of the subnormal step 2^-16 / 2^-9 */
    const uint32_t special = e5m2 ? 0x7Cu : 0x7Fu, top = e5m2 ? 0x7f800000u : 0x7fc00000u, nan = 0x7fc00000u;
    u32_alias *d = (u32_alias *)dst;
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t b = src[i], mag = b & 0x7Fu, m = mag & sub_mask;
        const uint32_t lead = (m >= 4u) + (m >= 2u); /* a subnormal's leading bit (m < 8) */
        const uint32_t sub_bits = m ? ((sub_exp + lead) << 23) | ((m << (23u - lead)) & 0x7FFFFFu) : 0u;
        const uint32_t bits = mag > sub_mask ? (mag << shift) + rebias : sub_bits;
        const uint32_t spec = mag == special ? top : nan; /* the top code(s): inf / NaN */
        d[i] = (mag >= special ? spec : bits) | ((b & 0x80u) << 24);
    }
}

/* The same times scale (the product rounded once). Long runs go through a table of the 256 codes. */
static inline void fp8_to_f32_plain(float *restrict dst, const uint8_t *restrict src, int64_t n, int e5m2,
                                    float scale) {
    if (n >= 1024) {
        uint8_t codes[256];
        float table[256];
        for (int c = 0; c < 256; ++c) codes[c] = (uint8_t)c;
        fp8_decode_plain(table, codes, 256, e5m2);
        for (int64_t i = 0; i < n; ++i) dst[i] = table[src[i]] * scale;
        return;
    }
    fp8_decode_plain(dst, src, n, e5m2);
    for (int64_t i = 0; i < n; ++i) dst[i] *= scale;
}

/* dst[0:n] = fp8 src[0:n] (e4m3fn, or e5m2) as float32 times scale: fp8.float() * scale, the product rounded
 * once. With F16C each byte becomes an fp16 exactly and the hardware widens it: e5m2 is fp16's top byte, and an
 * e4m3 magnitude shifted left by 7 is the fp16 of its value · 2^-8 (normal and subnormal alike), so its scale
 * carries the 2^8 (a power of two: still one rounding); e4m3's NaN code (0x7F) gets an fp16 NaN's exponent. */
#if defined(__F16C__) && defined(__AVX2__)
static inline __m256i fp8x16_to_half(__m256i w, int e5m2) {
    if (e5m2) return _mm256_slli_epi16(w, 8);
    const __m256i lo7 = _mm256_set1_epi16(0x7F);
    const __m256i mag = _mm256_and_si256(w, lo7);
    const __m256i nan = _mm256_and_si256(_mm256_cmpeq_epi16(mag, lo7), _mm256_set1_epi16(0x7E00));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
    return _mm256_or_si256(_mm256_or_si256(_mm256_slli_epi16(mag, 7), nan), sign);
}
#endif

static inline const float *fp8_to_f32(float *restrict dst, const uint8_t *restrict src, int64_t n, int e5m2,
                                      float scale) {
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
    const float mul = e5m2 ? scale : scale * 256.f;
#if defined(__AVX512F__)
    const __m512 vmul = _mm512_set1_ps(mul);
    for (; i + 16 <= n; i += 16) {
        const __m256i h = fp8x16_to_half(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + i))), e5m2);
        _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtph_ps(h), vmul));
    }
#else
    const __m256 vmul = _mm256_set1_ps(mul);
    for (; i + 16 <= n; i += 16) {
        const __m256i h = fp8x16_to_half(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + i))), e5m2);
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), vmul));
        _mm256_storeu_ps(dst + i + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), vmul));
    }
#endif
#endif
    fp8_to_f32_plain(dst + i, src + i, n - i, e5m2, scale);
    return dst;
}

/* x / scale saturated to the format's largest finite value and rounded to the nearest fp8 (ties to even), as
 * kernels/kv_quant.py's quantize (torch's clamp, then .to(float8)); NaN stays NaN. */
static inline uint8_t f32_to_fp8(float x, int e5m2, float scale) {
    const float y = x / scale;
    uint32_t u;
    memcpy(&u, &y, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return sign | 0x7Fu;
    float a = fabsf(y);
    const float max_finite = e5m2 ? 57344.f : 448.f;
    if (a > max_finite) a = max_finite;
    if (a < (e5m2 ? 0x1p-14f : 0x1p-6f)) /* subnormal steps of 2^-16 / 2^-9 (the top one rounds to the min normal) */
        return sign | (uint8_t)nearbyintf(a * (e5m2 ? 0x1p16f : 0x1p9f));
    memcpy(&u, &a, sizeof u);
    const int drop = e5m2 ? 21 : 20; /* float32 mantissa bits the format drops */
    u += ((1u << (drop - 1)) - 1u) + ((u >> drop) & 1u);
    return sign | (uint8_t)((u >> drop) - ((e5m2 ? 112u : 120u) << (23 - drop)));
}

/* A block's first n values as float32: in a float32 pool as they are, in a bf16 or fp8 pool widened into
 * `widened` (fp8 times its scale). `pool` is the cache's base, `offset` in elements. */
static inline const float *block_as_f32(int format, const void *pool, int64_t offset, int64_t n, float *widened,
                                        float scale) {
    switch (format) {
    case KV_BF16: return bf16_to_f32(widened, (const uint16_t *)pool + offset, n);
    case KV_FP8_E4M3: return fp8_to_f32(widened, (const uint8_t *)pool + offset, n, 0, scale);
    case KV_FP8_E5M2: return fp8_to_f32(widened, (const uint8_t *)pool + offset, n, 1, scale);
    default: return (const float *)pool + offset;
    }
}

/* float32 → bf16, round to nearest even (NaN stays NaN), as torch's conversion. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Tile geometry (each can be overridden with -D when tuning). QUERY_TILE: query tokens of one sequence per work
 * item, at least; TILE_ROWS: rows per KV head a tile aims for where few query heads share one (MHA gets more
 * tokens per tile, so each transposed key run serves more rows); SCORES_BUDGET: scores scratch per thread, in
 * floats: the tile shrinks for long contexts × many heads to stay within it; PARTITION_KEYS: keys per partition
 * of a token-path sequence's context (whole blocks; at least one); PARTITION_SPREAD_TILES: tiles per thread below
 * which a batch's partitions become work items of their own. */
#ifndef QUERY_TILE
#define QUERY_TILE 16
#endif
#ifndef TILE_ROWS
#define TILE_ROWS 48
#endif
#ifndef SCORES_BUDGET
#define SCORES_BUDGET (1 << 22)
#endif
#ifndef PARTITION_KEYS
#define PARTITION_KEYS 256
#endif
#ifndef PARTITION_SPREAD_TILES
#define PARTITION_SPREAD_TILES 2
#endif

/* PagedAttention for a flat batch of query tokens (decodes and prompt chunks alike): sequence s owns
 * tokens query_start_loc[s] .. query_start_loc[s+1]-1, the last of them at position seq_lens[s] - 1,
 * and token i of its chunk attends causally to the first seq_lens[s] - qlen + i + 1 cached tokens
 * (this step's K/V are already in the cache), read block by block through block_tables[s]:
 * out[t, h*group + g] = softmax(q_t·Kᵀ·scale) V. One work item is a tile of consecutive query tokens of one
 * sequence (a decode: one token); its rows are (token, query head) pairs, and each KV head's rows (GQA's
 * `group` query heads of every token) are scored and weighed together. Each K/V block is read once per tile.
 *
 * Two paths, chosen per sequence by its chunk's own length, so all tokens of a chunk alike:
 * - token path (chunks under min_tile_query_len tokens: decodes, speculative verifications): each token's
 *   rows against K rows as stored, one transpose-add tree per 16 keys; probabilities · V with PV_ROWS rows of
 *   the chunk's tokens sharing each V load, each row summed on its own; a token gets a lone decode's bits.
 *   A token with more keys than one partition (PARTITION_KEYS) takes each partition's softmax on its own (its
 *   max, its exp sum, Σ exp · V) and combines them in order at the end, as vLLM's PagedAttention V2 does; with
 *   few tiles in the batch the partitions are separate work items, so one long sequence uses every thread.
 * - tile path (longer prompt chunks): scores as a small GEMM (a run of blocks is transposed so keys lie along
 *   the vector lanes, the tile's queries are transposed once, and each broadcast query value feeds QK_VECS
 *   FMAs); probabilities · V block by block with PV_ROWS rows sharing each V load; the softmax's 1/sum is
 *   applied to the output rows.
 * On either path a token's arithmetic does not depend on the tile or the batch (keys past a token's position, or
 * before its window, get weight 0 and add exact zeros), so each token's result is the same in any batch.
 * kv_format: the caches hold float32 (KV_F32), bf16 or fp8 (keys times k_scale, values times v_scale): each
 * block's rows that the tile reads are widened to float32 once per work item, and the float32 code runs on that.
 * window > 0 (a sliding window): the token at position p attends to keys p - window < j <= p only. A work item
 * skips the blocks before its first token's window without reading them (and a partition wholly before it);
 * a partitioned token combines only the partitions its window reaches. soft_cap > 0: each scaled score s becomes
 * soft_cap · tanh(s / soft_cap) before the softmax. sinks != NULL (GPT-OSS's attention sinks, [num_q_heads]): query
 * head h's softmax denominator gains exp(sinks[h] - m) once, at the final normalisation (a token's own softmax, or
 * the merge of its partitions), m being the max its exp values are shifted by; sinks weigh no value. NULL leaves
 * the arithmetic as it is without them. Returns 0, or -1 when scratch memory could not be allocated. */
int paged_attention_sinks_f32(float *out, int64_t out_token_stride, const float *q, int64_t q_token_stride,
                              const void *key_cache, const void *value_cache, const int32_t *block_tables,
                              int64_t table_stride, const int32_t *seq_lens, const int32_t *query_start_loc,
                              int num_seqs, int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                              float scale, int kv_format, int min_tile_query_len, float k_scale, float v_scale,
                              int window, float soft_cap, const float *sinks) {
    const int group = num_q_heads / num_kv_heads;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t block_stride = (int64_t)block_size * token_stride;
    const int64_t block_bytes = block_stride * kv_elem_bytes(kv_format);
    int max_len = 1;
    for (int s = 0; s < num_seqs; ++s)
        if (seq_lens[s] > max_len) max_len = seq_lens[s];
    /* QUERY_TILE tokens, more where few query heads share a KV head (each transposed K run then serves
     * about TILE_ROWS rows), fewer where the scores of long contexts × many heads would overflow the budget */
    int64_t tile = TILE_ROWS / group > QUERY_TILE ? TILE_ROWS / group : QUERY_TILE;
    const int64_t fit = SCORES_BUDGET / ((int64_t)num_q_heads * max_len);
    tile = tile > fit ? fit : tile;
    tile = tile < 1 ? 1 : tile;
    const int qtile = (int)tile;
    /* The tile path scores a run of whole blocks at a time: at least QK_VECS vectors of keys where blocks are small. */
    const int run_blocks = block_size >= QK_VECS * VW ? 1 : QK_VECS * VW / block_size;
    const int64_t ldk = ((int64_t)run_blocks * block_size + QK_VECS * VW - 1) / (QK_VECS * VW) * (QK_VECS * VW);
    const int64_t ldq = (int64_t)qtile * group;             /* one KV head's rows in a tile */
    const int64_t head_rows = ldq * max_len;                /* scores of one KV head's rows */
    /* Token-path contexts longer than one partition of part_blocks blocks are read a partition per work item (so
     * that one long sequence spreads over the threads), and each token's partitions are combined at the end. */
    const int part_blocks = PARTITION_KEYS / block_size > 1 ? PARTITION_KEYS / block_size : 1;
    const int part_keys = part_blocks * block_size;
    /* tile_start[s]: the first work item of sequence s, which has parts[s] partitions per tile; its tokens'
     * partial results start at partial row part_start[s] (token i, partition p: part_start[s] + i * parts[s] + p) */
    int64_t *tile_start = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    int64_t *part_start = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    int *parts = malloc(sizeof(int) * (size_t)(num_seqs + 1));
    if (tile_start == NULL || part_start == NULL || parts == NULL) {
        free(tile_start), free(part_start), free(parts);
        return -1;
    }
    tile_start[0] = part_start[0] = 0;
    for (int s = 0; s < num_seqs; ++s) {
        const int qlen = query_start_loc[s + 1] - query_start_loc[s];
        const int split = qlen < min_tile_query_len && seq_lens[s] > part_keys;
        parts[s] = split ? (seq_lens[s] + part_keys - 1) / part_keys : 1;
        part_start[s + 1] = part_start[s] + (split ? (int64_t)qlen * parts[s] : 0);
    }
    /* Partitions are separate work items only where the tiles alone are too few to keep every thread busy (one or
     * a few sequences); else each tile's partitions run in order in one item, its next block prefetched across
     * them. Either way each partition's arithmetic is the same. */
    int64_t num_tiles = 0;
    for (int s = 0; s < num_seqs; ++s) num_tiles += (query_start_loc[s + 1] - query_start_loc[s] + qtile - 1) / qtile;
    const int spread = num_tiles < PARTITION_SPREAD_TILES * (int64_t)omp_get_max_threads();
    for (int s = 0; s < num_seqs; ++s) {
        const int qlen = query_start_loc[s + 1] - query_start_loc[s];
        tile_start[s + 1] = tile_start[s] + (int64_t)(qlen + qtile - 1) / qtile * (spread ? parts[s] : 1);
    }
    const int64_t num_items = tile_start[num_seqs];
    const int64_t num_partials = part_start[num_seqs];
    /* per partial row (partial row × query head): the partition's score max, its exp sum, and Σ exp · V */
    float *part_max = malloc(sizeof(float) * (size_t)(num_partials * num_q_heads + 1));
    float *part_sum = malloc(sizeof(float) * (size_t)(num_partials * num_q_heads + 1));
    float *part_acc = malloc(sizeof(float) * (size_t)(num_partials * num_q_heads * head_dim + 1));
    if (part_max == NULL || part_sum == NULL || part_acc == NULL) {
        free(tile_start), free(part_start), free(parts), free(part_max), free(part_sum), free(part_acc);
        return -1;
    }
    int failed = 0;
    /* One work item (a single-sequence decode) needs no team, no barrier for an idle thread. */
#pragma omp parallel if (num_items > 1)
    {
        /* scores[(h * ldq + i * group + g) * max_len + t]: token i of the tile, query head h * group + g */
        float *scores = malloc(sizeof(float) * (size_t)(num_kv_heads * head_rows));
        /* acc[(h * ldq + i * group + g) * head_dim + d]: the same rows' outputs */
        float *acc = malloc(sizeof(float) * (size_t)(num_kv_heads * ldq * head_dim));
        /* bf16 or fp8 blocks as float32: one per block of a tile-path run */
        float *widened = kv_format != KV_F32 ? malloc(sizeof(float) * (size_t)(run_blocks * block_stride)) : NULL;
        float *kt = malloc(sizeof(float) * (size_t)(token_stride * ldk)); /* a run of keys, transposed */
        const float **key_rows = malloc(sizeof(float *) * (size_t)ldk);     /* each key's row of the run */
        /* the tile's queries, transposed */
        float *qt = malloc(sizeof(float) * (size_t)(num_kv_heads * head_dim * ldq));
        float *zeros = calloc((size_t)token_stride, sizeof(float));        /* stands in for missing key rows */
        float *norm = malloc(sizeof(float) * (size_t)(num_kv_heads * ldq)); /* 1 / each tile row's softmax sum */
        const int ok = scores != NULL && acc != NULL && kt != NULL && qt != NULL && zeros != NULL && norm != NULL &&
                       key_rows != NULL && (kv_format == KV_F32 || widened != NULL);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < num_items; ++it) {
            /* last items first: a chunk's later tiles read the most keys, so the threads finish together */
            const int64_t item = num_items - 1 - it;
            if (!ok) continue;
            int s = 0, hi = num_seqs - 1; /* the last sequence whose items start at or before this one */
            while (s < hi) {
                const int mid = (s + hi + 1) / 2;
                if (tile_start[mid] <= item) s = mid;
                else hi = mid - 1;
            }
            const int qlen = query_start_loc[s + 1] - query_start_loc[s];
            /* np partitions per tile: one item each when spread over the threads, else one item for them all */
            const int np = parts[s], per_tile = spread ? np : 1;
            const int i0 = (int)((item - tile_start[s]) / per_tile) * qtile;
            const int p_lo = spread ? (int)((item - tile_start[s]) % per_tile) : 0, p_hi = spread ? p_lo + 1 : np;
            const int nq = qlen - i0 < qtile ? qlen - i0 : qtile;
            const int64_t first = query_start_loc[s] + i0; /* the tile's first query token */
            const int len0 = seq_lens[s] - qlen + i0 + 1;  /* token i of the tile attends to len0 + i keys */
            const int last = len0 + nq - 1;                /* keys the tile's last token reads */
            const int all_blocks = (last + block_size - 1) / block_size;
            /* the block of the tile's first key: its first token's window start (every later token's starts later) */
            const int b_win = window > 0 && len0 > window ? (len0 - window) / block_size : 0;
            const int32_t *table = block_tables + s * table_stride;
            const int rows_all = nq * group;               /* rows per KV head */

            const int tiled = qlen >= min_tile_query_len; /* by the chunk's own length: all its tokens alike */
            for (int h = 0; tiled && h < num_kv_heads; ++h) /* qt[(h * head_dim + d) * ldq + i * group + g] */
                for (int i = 0; i < nq; ++i)
                    for (int g = 0; g < group; ++g) {
                        const float *qrow = q + (first + i) * q_token_stride + (int64_t)(h * group + g) * head_dim;
                        float *col = qt + (int64_t)h * head_dim * ldq + i * group + g;
                        for (int d = 0; d < head_dim; ++d) col[d * ldq] = qrow[d];
                    }
            for (int part = p_lo; part < p_hi; ++part) { /* the item's partitions, in order */
                /* this item's blocks [b_lo, num_blocks): its partition's (all when np == 1), from the window's on */
                const int p_first = np == 1 ? 0 : part * part_blocks;
                const int num_blocks = np == 1 || all_blocks - p_first < part_blocks ? all_blocks : p_first + part_blocks;
                if (p_first >= num_blocks) break; /* an earlier tile's tokens end before this partition */
                const int b_lo = p_first > b_win ? p_first : b_win;
                if (b_lo >= num_blocks) continue; /* the partition ends before the tile's window starts */
                const int t_lo = b_lo * block_size, t_hi = num_blocks * block_size; /* its keys */

                for (int pos = 1; !tiled && pos < PREFETCH_AHEAD; ++pos) /* what the first blocks' slices do not cover */
                    prefetch_upto(pass_block(key_cache, value_cache, table, b_lo, num_blocks, pos, block_bytes), 0,
                                  block_bytes);
                for (int b = b_lo; !tiled && b < num_blocks; ++b) { /* pass 1, token path: scaled scores */
                    const int t0 = b * block_size;
                    const int64_t rows = last - t0 < block_size ? last - t0 : block_size;
                    const float *kb = block_as_f32(kv_format, key_cache, table[b] * block_stride, rows * token_stride,
                                                   widened, k_scale);
                    const char *next = pass_block(key_cache, value_cache, table, b_lo, num_blocks,
                                                  b - b_lo + PREFETCH_AHEAD, block_bytes);
                    const int i_first = t0 >= len0 ? t0 - len0 + 1 : 0; /* the first token that reaches block b */
                    /* the next block in slices: one per KV head of each run of VW keys of each token */
                    const int64_t slices = (int64_t)((block_size + VW - 1) / VW) * num_kv_heads * (nq - i_first);
                    int64_t fetched = 0, slice = 0;
                    for (int i = i_first; i < nq; ++i) {
                        const int len = len0 + i;
                        const int n = len - t0 < block_size ? len - t0 : block_size;
                        const float *qs = q + (first + i) * q_token_stride;
                        int j0 = 0; /* runs of VW tokens: one transpose-add tree per query row */
                        for (; VECTOR_PATH && j0 + VW <= n && head_dim % VW == 0; j0 += VW)
                            for (int h = 0; h < num_kv_heads; ++h) {
                                const int64_t upto = next != NULL && slice < slices ? block_bytes * ++slice / slices : fetched;
                                run_scores(qs + (int64_t)h * group * head_dim, kb + j0 * token_stride + (int64_t)h * head_dim,
                                           token_stride, group, head_dim, scale,
                                           scores + (h * ldq + i * group) * (int64_t)max_len + t0 + j0, max_len,
                                           next != NULL ? next + fetched : NULL, upto - fetched);
                                fetched = upto;
                            }
                        for (int j = j0; j < n; ++j)
                            for (int h = 0; h < num_kv_heads; ++h)
                                group_scores(qs + (int64_t)h * group * head_dim, kb + j * token_stride + (int64_t)h * head_dim,
                                             group, head_dim, scale,
                                             scores + (h * ldq + i * group) * (int64_t)max_len + t0 + j, max_len);
                    }
                    prefetch_upto(next, fetched, block_bytes); /* whatever the slices left */
                }
                for (int b0 = b_lo; tiled && b0 < num_blocks; b0 += run_blocks) { /* pass 1, tile path: a run of blocks */
                    const int t0 = b0 * block_size;
                    const int nb = num_blocks - b0 < run_blocks ? num_blocks - b0 : run_blocks;
                    const int keys = last - t0 < nb * block_size ? last - t0 : nb * block_size;
                    for (int b = 0; b < nb; ++b) {
                        const int rows = keys - b * block_size < block_size ? keys - b * block_size : block_size;
                        const float *kb = block_as_f32(kv_format, key_cache, table[b0 + b] * block_stride,
                                                       rows * token_stride,
                                                       kv_format != KV_F32 ? widened + b * block_stride : NULL, k_scale);
                        if (b0 + b + 1 < num_blocks)
                            prefetch_bytes((const char *)key_cache + (int64_t)table[b0 + b + 1] * block_bytes, block_bytes);
                        for (int j = 0; j < rows; ++j) key_rows[b * block_size + j] = kb + j * token_stride;
                    }
                    for (int64_t j = keys; j < ldk; ++j) key_rows[j] = zeros;
                    transpose_keys(key_rows, ldk, token_stride, kt);
                    const int r0 = (t0 >= len0 ? t0 - len0 + 1 : 0) * group; /* rows of the tokens that reach the run */
                    for (int h = 0; h < num_kv_heads; ++h) {
                        const float *kth = kt + (int64_t)h * head_dim * ldk, *qth = qt + (int64_t)h * head_dim * ldq;
                        float *sh = scores + h * head_rows + t0;
                        for (int j0 = 0; j0 < keys; j0 += QK_VECS * VW)
                            for (int r = r0; r < rows_all; r += QK_ROWS)
                                score_tile(qth + r, ldq, rows_all - r < QK_ROWS ? rows_all - r : QK_ROWS, kth + j0, ldk,
                                           keys - j0, head_dim, scale, sh + r * (int64_t)max_len + j0, max_len);
                    }
                }
                prefetch_bytes((const char *)value_cache + (int64_t)table[b_lo] * block_bytes, block_bytes);
                for (int h = 0; h < num_kv_heads; ++h)
                    for (int r = 0; r < rows_all; ++r) { /* softmax (the tile path applies its 1 / sum to the outputs) */
                        float *row = scores + h * head_rows + (int64_t)r * max_len;
                        const int len = len0 + r / group;
                        const int end = len < t_hi ? len : t_hi; /* this token's keys in the item's blocks: start .. end */
                        if (end <= t_lo) continue;             /* none: its rows never reach these blocks */
                        const int stop = last < t_hi ? last : t_hi; /* the keys pass 2 weighs its rows over */
                        const int start = window > 0 && len - window > t_lo ? len - window : t_lo;
                        if (start >= end) { /* its window starts after these blocks (a partition it does not
                                             * combine): weight 0 throughout, so pass 2 weighs defined values */
                            for (int t = t_lo; t < stop; ++t) row[t] = 0.f;
                            continue;
                        }
                        for (int t = t_lo; t < start; ++t) row[t] = 0.f; /* keys the tile reads before its window */
                        if (soft_cap > 0.f) soft_cap_scores(row + start, end - start, soft_cap);
                        const float m = row_max(row + start, end - start);
                        const float sum = exp_shifted(row + start, end - start, m);
                        if (len > part_keys && !tiled) { /* one partition of several: combined after every item */
                            const int64_t at = (part_start[s] + (int64_t)(i0 + r / group) * np + part) * num_q_heads +
                                               h * group + r % group;
                            part_max[at] = m;
                            part_sum[at] = sum;
                        } else {
                            /* exp(sink - m) may overflow to inf for a sink far above the scores: weight 0, their
                             * true weights being under float's range anyway */
                            const float inv = sinks == NULL ? 1.f / sum
                                                            : 1.f / (sum + expf(sinks[h * group + r % group] - m));
                            if (tiled) norm[h * ldq + r] = inv; /* applied to the output row instead */
                            else
                                for (int t = start; t < end; ++t) row[t] *= inv;
                        }
                        /* keys past this token that the tile's later tokens read: weight 0 (adds exact zeros) */
                        for (int t = end; t < stop; ++t) row[t] = 0.f;
                    }
                for (int h = 0; h < num_kv_heads; ++h)
                    memset(acc + (int64_t)h * ldq * head_dim, 0, sizeof(float) * (size_t)rows_all * head_dim);
                for (int b = b_lo; b < num_blocks; ++b) { /* pass 2: probabilities · V */
                    const int t0 = b * block_size;
                    const int rows = last - t0 < block_size ? last - t0 : block_size;
                    const float *vb = block_as_f32(kv_format, value_cache, table[b] * block_stride, rows * token_stride,
                                                   widened, v_scale);
                    /* after the partition's last V block: the K block that the item's next partition starts with */
                    const char *next = b + PREFETCH_AHEAD < num_blocks
                                           ? (const char *)value_cache + (int64_t)table[b + PREFETCH_AHEAD] * block_bytes
                                       : b + 1 < num_blocks ? NULL
                                       : part + 1 < p_hi && b + 1 < all_blocks
                                           ? (const char *)key_cache + (int64_t)table[b + 1] * block_bytes
                                           : NULL;
                    int64_t fetched = 0; /* the next block in slices, one per KV head */
                    const int r0 = (t0 >= len0 ? t0 - len0 + 1 : 0) * group; /* rows of the tokens that reach block b */
                    for (int h = 0; h < num_kv_heads; fetched = prefetch_upto(next, fetched, block_bytes * ++h / num_kv_heads)) {
                        const float *vh = vb + (int64_t)h * head_dim;
                        const float *ph = scores + h * head_rows + t0;
                        float *ah = acc + (int64_t)h * ldq * head_dim;
                        if (!tiled && !(VECTOR_PATH && head_dim % VW == 0)) { /* token path, scalar: token by token */
                            for (int i = r0 / group; i < nq; ++i) {
                                const int n = len0 + i - t0 < block_size ? len0 + i - t0 : block_size;
                                group_block_axpy(ph + (int64_t)i * group * max_len, max_len, vh, token_stride, n, group, head_dim,
                                                 ah + (int64_t)i * group * head_dim);
                            }
                            continue;
                        }
                        if (head_dim % VW) { /* dims the vector tiles cannot cover: a plain loop per row */
                            for (int r = r0; r < rows_all; ++r)
                                for (int j = 0; j < rows; ++j) {
                                    const float w = ph[r * (int64_t)max_len + j];
                                    float *a = ah + (int64_t)r * head_dim;
#pragma omp simd
                                    for (int d = 0; d < head_dim; ++d) a[d] += w * vh[j * token_stride + d];
                                }
                            continue;
                        }
                        /* Both paths: PV_ROWS rows share each V load, whichever tokens they belong to. A token-path row
                         * gets a lone decode's bits here too: each row's sum runs over j in order from zero, and the
                         * keys past its own token weigh +0, whose products add exact zeros to it. */
                        const int tiles = (rows_all - r0 + PV_ROWS - 1) / PV_ROWS; /* this head's slice, split per tile */
                        for (int r = r0, tile = 1; r < rows_all; r += PV_ROWS, ++tile) {
                            const int64_t upto = next != NULL ? block_bytes * ((int64_t)h * tiles + tile) /
                                                                    ((int64_t)num_kv_heads * tiles) : fetched;
                            weigh_tile(ph + r * (int64_t)max_len, max_len, rows_all - r < PV_ROWS ? rows_all - r : PV_ROWS,
                                       vh, token_stride, rows, ah + (int64_t)r * head_dim, head_dim, head_dim,
                                       next != NULL ? next + fetched : NULL, upto - fetched);
                            fetched = upto;
                        }
                    }
                }
                for (int i = 0; i < nq; ++i) /* acc[(h * ldq + i * group + g) * head_dim]: query head h * group + g */
                    for (int h = 0; h < num_kv_heads; ++h) {
                        float *o = out + (first + i) * out_token_stride + (int64_t)h * group * head_dim;
                        const float *a = acc + ((int64_t)h * ldq + i * group) * head_dim;
                        if (!tiled) {
                            if (len0 + i <= t_lo) continue; /* the token ends before this item's blocks */
                            if (len0 + i > part_keys) /* one partition of several: its partial rows */
                                o = part_acc + ((part_start[s] + (int64_t)(i0 + i) * np + part) * num_q_heads + h * group) *
                                                   head_dim;
                            memcpy(o, a, sizeof(float) * (size_t)group * head_dim);
                            continue;
                        }
                        for (int g = 0; g < group; ++g) {
                            const float inv = norm[h * ldq + i * group + g];
#pragma omp simd
                            for (int d = 0; d < head_dim; ++d) o[g * head_dim + d] = a[g * head_dim + d] * inv;
                        }
                    }
            }
        }
        /* each partitioned token's query heads: its partitions combined in order (after every item: the loop's
         * barrier), M = max of their maxima, out = Σ exp(m_p - M) acc_p / Σ exp(m_p - M) sum_p */
#pragma omp for schedule(static)
        for (int64_t pr = 0; pr < num_partials; ++pr) {
            int s = 0, top = num_seqs - 1; /* the last sequence whose partial rows start at or before pr */
            while (s < top) {
                const int mid = (s + top + 1) / 2;
                if (part_start[mid] <= pr) s = mid;
                else top = mid - 1;
            }
            const int np = parts[s], qlen = query_start_loc[s + 1] - query_start_loc[s];
            if (!ok || (pr - part_start[s]) % np) continue; /* one pass per token: at its partition 0 */
            const int i = (int)((pr - part_start[s]) / np);
            const int len = seq_lens[s] - qlen + i + 1;
            if (len <= part_keys) continue; /* a lone partition: written by its item */
            const int used = (len + part_keys - 1) / part_keys;
            const int p0 = window > 0 && len > window ? (len - window) / part_keys : 0; /* where its window starts */
            for (int qh = 0; qh < num_q_heads; ++qh) {
                const float *mx = part_max + pr * num_q_heads + qh, *sm = part_sum + pr * num_q_heads + qh;
                float top_max = mx[(int64_t)p0 * num_q_heads];
                for (int p = p0 + 1; p < used; ++p) top_max = fmaxf(top_max, mx[(int64_t)p * num_q_heads]);
                float *o = out + (query_start_loc[s] + i) * out_token_stride + (int64_t)qh * head_dim;
                float total = 0.f;
                for (int p = p0; p < used; ++p) {
                    const float c = expf(mx[(int64_t)p * num_q_heads] - top_max);
                    const float *a = part_acc + ((pr + p) * num_q_heads + qh) * head_dim;
                    total += c * sm[(int64_t)p * num_q_heads];
                    if (p == p0)
                        for (int d = 0; d < head_dim; ++d) o[d] = c * a[d];
                    else
                        for (int d = 0; d < head_dim; ++d) o[d] += c * a[d];
                }
                if (sinks != NULL) total += expf(sinks[qh] - top_max);
                const float inv = 1.f / total;
                for (int d = 0; d < head_dim; ++d) o[d] *= inv;
            }
        }
        free(scores);
        free(acc);
        free(widened);
        free(kt);
        free(qt);
        free(zeros);
        free(norm);
        free(key_rows);
    }
    free(tile_start), free(part_start), free(parts), free(part_max), free(part_sum), free(part_acc);
    return failed ? -1 : 0;
}

/* paged_attention_sinks_f32 without sinks (the entry point of callers that never pass them). */
int paged_attention_f32(float *out, int64_t out_token_stride, const float *q, int64_t q_token_stride,
                        const void *key_cache, const void *value_cache, const int32_t *block_tables,
                        int64_t table_stride, const int32_t *seq_lens, const int32_t *query_start_loc,
                        int num_seqs, int num_q_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                        int kv_format, int min_tile_query_len, float k_scale, float v_scale, int window,
                        float soft_cap) {
    return paged_attention_sinks_f32(out, out_token_stride, q, q_token_stride, key_cache, value_cache, block_tables,
                                     table_stride, seq_lens, query_start_loc, num_seqs, num_q_heads, num_kv_heads,
                                     head_dim, block_size, scale, kv_format, min_tile_query_len, k_scale, v_scale,
                                     window, soft_cap, NULL);
}

/* Tokens ahead whose cache rows the write requests while it stores the current one. */
#ifndef WRITE_AHEAD
#define WRITE_AHEAD 4
#endif

/* dst[0:n] = src[0:n] as the pool stores it: float32 as is, rounded to bf16, or quantized to fp8 by `scale`. */
static inline void store_row(void *dst, const float *src, int64_t n, int format, float scale) {
    if (format == KV_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    } else if (format == KV_BF16) {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
    } else {
        uint8_t *d = dst;
        const int e5m2 = format == KV_FP8_E5M2;
        for (int64_t i = 0; i < n; ++i) d[i] = f32_to_fp8(src[i], e5m2, scale);
    }
}

/* Write each token's K and V rows (num_kv_heads * head_dim floats, `src_stride` floats apart) into
 * slot slot_mapping[t] of the caches (of `format`; fp8 keys by k_scale, values by v_scale); slots < 0 are
 * padding and skipped. */
static void write_kv_rows(const float *key, const float *value, int64_t src_stride, char *key_cache, char *value_cache,
                          const int64_t *slot_mapping, int64_t num_tokens, int64_t row, int format, float k_scale,
                          float v_scale) {
    const int64_t row_bytes = row * kv_elem_bytes(format);
#pragma omp parallel for schedule(static) if (num_tokens > 64)
    for (int64_t t = 0; t < num_tokens; ++t) {
        /* A decode's slots lie in blocks no one touched lately: each store would wait for its lines one by one
         * (read for ownership), so the rows a few tokens ahead are requested for writing now. */
        const int64_t ahead = t + WRITE_AHEAD < num_tokens ? slot_mapping[t + WRITE_AHEAD] : -1;
        if (ahead >= 0)
            for (int64_t i = 0; i < row_bytes; i += 64) {
                __builtin_prefetch(key_cache + ahead * row_bytes + i, 1, 3);
                __builtin_prefetch(value_cache + ahead * row_bytes + i, 1, 3);
            }
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        store_row(key_cache + slot * row_bytes, key + t * src_stride, row, format, k_scale);
        store_row(value_cache + slot * row_bytes, value + t * src_stride, row, format, v_scale);
    }
}

void reshape_and_cache_f32(const float *key, const float *value, int64_t src_stride, float *key_cache,
                           float *value_cache, const int64_t *slot_mapping, int64_t num_tokens, int64_t row) {
    write_kv_rows(key, value, src_stride, (char *)key_cache, (char *)value_cache, slot_mapping, num_tokens, row, KV_F32,
                  1.f, 1.f);
}

/* The same for a bf16 pool: each float is rounded to the nearest bf16 (ties to even). */
void reshape_and_cache_bf16(const float *key, const float *value, int64_t src_stride, uint16_t *key_cache,
                            uint16_t *value_cache, const int64_t *slot_mapping, int64_t num_tokens, int64_t row) {
    write_kv_rows(key, value, src_stride, (char *)key_cache, (char *)value_cache, slot_mapping, num_tokens, row,
                  KV_BF16, 1.f, 1.f);
}

/* The same for an fp8 pool (e4m3fn, or e5m2 where e5m2 != 0): x / scale saturated and rounded to nearest even. */
void reshape_and_cache_fp8(const float *key, const float *value, int64_t src_stride, uint8_t *key_cache,
                           uint8_t *value_cache, const int64_t *slot_mapping, int64_t num_tokens, int64_t row, int e5m2,
                           float k_scale, float v_scale) {
    write_kv_rows(key, value, src_stride, (char *)key_cache, (char *)value_cache, slot_mapping, num_tokens, row,
                  e5m2 ? KV_FP8_E5M2 : KV_FP8_E4M3, k_scale, v_scale);
}

/* ---- Fused elementwise ops: the CPU twins of kernels/triton_fused_ops.py (float32) ---- */

static inline int rows_parallel(int64_t rows, int64_t cols) { return rows * cols > 16384; }

/* One row: out = w * src * rsqrt(mean(src²) + eps), w = weight, or (1 + weight) with unit_offset (Gemma's norms: the
 * float32 sum rounded once, then the product, as the module path's `weight + 1.0` times the normalised row); out may
 * be src (in place). Both norms below call it, so a row's bits are the same whichever of them normalises it. */
static inline void rms_row(float *out, const float *src, const float *weight, int64_t hidden, float eps,
                           int unit_offset) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < hidden; ++i) ss += src[i] * src[i];
    const float r = 1.f / sqrtf(ss / (float)hidden + eps);
    if (unit_offset) {
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) out[i] = (weight[i] + 1.f) * (src[i] * r);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) out[i] = weight[i] * (src[i] * r);
    }
}

/* out[t] = w * s * rsqrt(mean(s²) + eps) with s = x[t] (+ residual[t], then also stored in residual_out[t]) and w as
 * rms_row takes it. x and residual rows are `x_stride` / `res_stride` floats apart; outputs are dense. */
void rms_norm_f32(float *out, float *residual_out, const float *x, int64_t x_stride, const float *residual,
                  int64_t res_stride, const float *weight, int64_t num_tokens, int64_t hidden, float eps,
                  int unit_offset) {
#pragma omp parallel for schedule(static) if (rows_parallel(num_tokens, hidden))
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *xt = x + t * x_stride;
        const float *src = xt;
        if (residual != NULL) {
            const float *rt = residual + t * res_stride;
            float *st = residual_out + t * hidden;
#pragma omp simd
            for (int64_t i = 0; i < hidden; ++i) st[i] = xt[i] + rt[i];
            src = st;
        }
        rms_row(out + t * hidden, src, weight, hidden, eps, unit_offset);
    }
}

/* Per-head q/k norms (Qwen3's; Gemma 3's with unit_offset), in place: each of `heads` rows of head_dim at
 * x + t * stride (heads adjacent) is normalised with the one `weight` of head_dim, as rms_norm_f32 normalises a row. */
void rms_norm_heads_f32(float *x, int64_t stride, int64_t heads, const float *weight, int64_t num_tokens,
                        int64_t head_dim, float eps, int unit_offset) {
    const int64_t rows = num_tokens * heads;
#pragma omp parallel for schedule(static) if (rows_parallel(rows, head_dim))
    for (int64_t r = 0; r < rows; ++r) {
        float *row = x + (r / heads) * stride + (r % heads) * head_dim;
        rms_row(row, row, weight, head_dim, eps, unit_offset);
    }
}

/* Rotate-half RoPE in place on the first rotary_dim dims of each of `heads` heads of head_dim starting at
 * base[t * stride], using row positions[t] of cos/sin caches [max_pos, rotary_dim] (each row = [f, f] halves); the
 * last head_dim - rotary_dim dims of each head (partial rotary, Phi-4-mini) are not read or written. With rotary_dim ==
 * head_dim this is the whole-head rotation, element for element the same operations. */
static void rotate_rows(float *base, int64_t stride, int heads, const int64_t *positions, const float *cos_cache,
                        const float *sin_cache, int64_t num_tokens, int head_dim, int rotary_dim) {
    const int half = rotary_dim / 2;
#pragma omp parallel for schedule(static) if (rows_parallel(num_tokens, (int64_t)heads * rotary_dim))
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *c = cos_cache + positions[t] * rotary_dim;
        const float *s = sin_cache + positions[t] * rotary_dim;
        for (int h = 0; h < heads; ++h) {
            float *x1 = base + t * stride + (int64_t)h * head_dim, *x2 = x1 + half;
#pragma omp simd
            for (int i = 0; i < half; ++i) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}

void rotary_embedding_f32(float *q, int64_t q_stride, int num_q_heads, float *k, int64_t k_stride, int num_kv_heads,
                          const int64_t *positions, const float *cos_cache, const float *sin_cache,
                          int64_t num_tokens, int head_dim, int rotary_dim) {
    rotate_rows(q, q_stride, num_q_heads, positions, cos_cache, sin_cache, num_tokens, head_dim, rotary_dim);
    rotate_rows(k, k_stride, num_kv_heads, positions, cos_cache, sin_cache, num_tokens, head_dim, rotary_dim);
}

/* out[t, i] = silu(x[t, i]) * x[t, inter + i] for x rows [gate | up] `x_stride` floats apart. */
void silu_and_mul_f32(float *out, const float *x, int64_t x_stride, int64_t num_tokens, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows_parallel(num_tokens, inter))
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *gate = x + t * x_stride, *up = gate + inter;
        float *o = out + t * inter;
        int64_t i = 0;
#if VECTOR_PATH
        const vec one = v_set1(1.f);
        for (; i + VW <= inter; i += VW) {
            const vec g = v_load(gate + i);
            const vec e = v_exp(v_sub(v_zero(), g));
            const vec silu = v_div(g, v_add(one, e));
            v_store(o + i, v_mul(silu, v_load(up + i)));
        }
#endif
        for (; i < inter; ++i) o[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
    }
}

/* GeGLU (Gemma's MLP): out[t, i] = gelu_tanh(g) * x[t, inter + i], g = x[t, i], for x rows [gate | up] `x_stride`
 * floats apart. gelu_tanh(g) = 0.5·g·(1 + tanh(u)), u = √(2/π)·(g + 0.044715·g³) (torch's approximate="tanh"), taken
 * as g / (1 + exp(-2u)): the same function (0.5·(1 + tanh(u)) = 1 / (1 + e^-2u)) without the cancellation of 1 + tanh
 * where g < 0: one exp and a divide, a few float32 ulps from the exact function of the float32 u (torch's own result
 * is off by up to ~|g|·2^-24 there). u is computed as torch computes it (g·g·g, then separate products and a sum).
 * Vector builds take a short tail through one padded vector, so each element's bits depend on its gate and up alone,
 * not on the row's width or where the element sits in it. */
#define GELU_BETA 0.7978845608028654f /* √2 · (2/√π) · 0.5 = √(2/π), as torch's kBeta in float32 */
#define GELU_KAPPA 0.044715f
#if VECTOR_PATH
static inline vec v_gelu_tanh_mul(vec g, vec up) {
    const vec u = v_mul(v_set1(GELU_BETA), v_add(g, v_mul(v_set1(GELU_KAPPA), v_mul(v_mul(g, g), g))));
    const vec e = v_exp(v_mul(v_set1(-2.f), u));
    return v_mul(v_div(g, v_add(v_set1(1.f), e)), up);
}
#endif
static inline float gelu_tanh_mul_one(float g, float up) {
    const float u = GELU_BETA * (g + GELU_KAPPA * (g * g * g));
    return g / (1.f + expf(-2.f * u)) * up;
}

void gelu_tanh_and_mul_f32(float *out, const float *x, int64_t x_stride, int64_t num_tokens, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows_parallel(num_tokens, inter))
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *gate = x + t * x_stride, *up = gate + inter;
        float *o = out + t * inter;
#if VECTOR_PATH
        int64_t i = 0;
        for (; i + VW <= inter; i += VW) v_store(o + i, v_gelu_tanh_mul(v_load(gate + i), v_load(up + i)));
        if (i < inter) {
            const size_t n = sizeof(float) * (size_t)(inter - i);
            float g_lanes[VW] = {0.f}, u_lanes[VW] = {0.f};
            memcpy(g_lanes, gate + i, n);
            memcpy(u_lanes, up + i, n);
            v_store(g_lanes, v_gelu_tanh_mul(v_load(g_lanes), v_load(u_lanes)));
            memcpy(o + i, g_lanes, n);
        }
#else
        for (int64_t i = 0; i < inter; ++i) o[i] = gelu_tanh_mul_one(gate[i], up[i]);
#endif
    }
}

/* Structured outputs: logits[r, t] = -inf for each r in rows wherever bit t % 32 of word t / 32 of the
 * packed bitmask row r is 0. Words with every bit set are skipped; empty words are a straight fill. */
void apply_token_bitmask_f32(float *logits, int64_t logits_stride, const int32_t *bitmask, int64_t mask_stride,
                             const int64_t *rows, int64_t num_rows, int64_t vocab) {
    const float ninf = -INFINITY;
    for (int64_t i = 0; i < num_rows; ++i) {
        float *row = logits + rows[i] * logits_stride;
        const int32_t *words = bitmask + rows[i] * mask_stride;
        for (int64_t base = 0; base < vocab; base += 32) {
            const uint32_t bits = (uint32_t)words[base / 32];
            if (bits == 0xFFFFFFFFu) continue;
            const int n = vocab - base < 32 ? (int)(vocab - base) : 32;
#if VECTOR_PATH
            if (n == 32) { /* branch-free: the compiler vectorises it (variable shifts and a blend), 1.6-1.8x */
                float *w = row + base;
                for (int j = 0; j < 32; ++j) w[j] = (bits >> j) & 1u ? w[j] : ninf;
                continue;
            }
#endif
            for (int j = 0; j < n; ++j)
                if (!((bits >> j) & 1u)) row[base + j] = ninf;
        }
    }
}

/* ---- Sampling (model/layers/sampler.py's native path for float32 logits on the CPU) ---- */
#define SAMPLE_BLOCK 256

/* Σ exp((row[lo:hi] - m) · it) in float (vector lanes, then the tail). */
static inline float block_exp_sum(const float *row, int64_t lo, int64_t hi, float m, float it) {
    float sum = 0.f;
    int64_t t = lo;
#if VECTOR_PATH
    vec vsum = v_zero();
    const vec vm = v_set1(m), vit = v_set1(it);
    for (; t + VW <= hi; t += VW) vsum = v_add(vsum, v_exp_flush(v_mul(v_sub(v_load(row + t), vm), vit)));
    sum = v_reduce(vsum);
#endif
    for (; t < hi; ++t) sum += expf((row[t] - m) * it);
    return sum;
}

/* For each row r of the raw logits x [rows, vocab] (row stride `stride`; not modified), m = its max:
 *   logprobs[r] = x[token] - (m + log Σ exp(x - m))   (the raw distribution's log-probability);
 *   u[r] < 0:  token = the first index of m (greedy);
 *   u[r] in [0, 1): the first token whose cumulative weight exp((x - m) · inv_temp[r]) exceeds u[r] times
 *   the row's total (inverse CDF: the block sums of SAMPLE_BLOCK tokens, summed in double, choose a block,
 *   then a scan of that block). A token of weight 0 (logit -inf) is never chosen.
 * ws: rows × ceil(vocab / SAMPLE_BLOCK) doubles of scratch. */
void sample_rows_f32(const float *x, int64_t stride, int64_t rows, int64_t vocab, const float *inv_temp,
                     const double *u, int64_t *tokens, float *logprobs, double *ws) {
    const int64_t nb = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
#pragma omp parallel for schedule(static) if (rows_parallel(rows, vocab))
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * stride;
        const float m = row_max(row, (int)vocab);
        const float it = inv_temp[r];
        const int random = u[r] >= 0.0;
        const int tempered = random && it != 1.f;
        double *bs = ws + r * nb;
        double s_raw = 0.0, total = 0.0;
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t lo = b * SAMPLE_BLOCK, hi = lo + SAMPLE_BLOCK < vocab ? lo + SAMPLE_BLOCK : vocab;
            const float e = block_exp_sum(row, lo, hi, m, 1.f);
            s_raw += e;
            bs[b] = tempered ? block_exp_sum(row, lo, hi, m, it) : e;
            total += bs[b];
        }
        int64_t tok = 0;
        if (!random || !(total > 0.0)) {
            while (tok < vocab - 1 && !(row[tok] == m)) ++tok;
        } else {
            double target = u[r] * total;
            if (target >= total) target = nextafter(total, 0.0);
            int64_t b = -1, last_block = 0;
            double cum = 0.0, cum_before_last = 0.0;
            for (int64_t i = 0; i < nb; ++i) {
                if (bs[i] > 0.0) { last_block = i; cum_before_last = cum; }
                if (bs[i] > 0.0 && cum + bs[i] > target) { b = i; break; }
                cum += bs[i];
            }
            if (b < 0) { b = last_block; cum = cum_before_last; }  /* rounding: the last block with weight */
            const int64_t lo = b * SAMPLE_BLOCK, hi = lo + SAMPLE_BLOCK < vocab ? lo + SAMPLE_BLOCK : vocab;
            tok = -1;
            int64_t last = lo;
            for (int64_t j = lo; j < hi; ++j) {
                const float w = expf((row[j] - m) * it);
                if (!(w > 0.f)) continue;
                last = j;
                cum += w;
                if (cum > target) { tok = j; break; }
            }
            if (tok < 0) tok = last;  /* the block's scalar sum fell short of its vector sum: its last token */
        }
        tokens[r] = tok;
        logprobs[r] = (float)((double)row[tok] - ((double)m + log(s_raw)));
    }
}

/* ---- top-k / top-p filtering without a sort of the vocabulary ---- */
/* A sort of 64 rows of 49 152 logits took ~150 ms in torch on a 2-core CPU (BENCHMARKS.md §76.6), 60x a draw.
 * Here each row's weights w = exp(x - max) in (0, 1] fall into buckets by the top bits of their float encoding
 * (exponent and 5 mantissa bits: 32 buckets per octave, bucket 0 holds the largest; the last collects everything
 * below 2^-64); the bucket that the k-th token or the top-p mass falls in is found from the buckets' counts and
 * masses, and only that bucket's tokens are sorted. */
#define TKP_BUCKETS 2048

static inline int tkp_bucket(float w) {
    uint32_t bits;
    memcpy(&bits, &w, 4);
    const int b = (int)(0x3F800000u >> 18) - (int)(bits >> 18); /* 1.0f: bucket 0 */
    return b < 0 ? 0 : b >= TKP_BUCKETS ? TKP_BUCKETS - 1 : b;
}

static int tkp_desc(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* Top-k alone needs no weights: the keys are the top bits of d = max - x (>= 0), which orders the logits as
 * the weights do (float subtraction is monotone), so no exponential, no masses and no memcpy. 8 192 buckets cover
 * every finite d and +inf (a -inf logit); NaN falls in the last. */
#define TK_BUCKETS 8192

static inline int tk_bucket(float x, float m) {
    const float d = m - x;
    uint32_t bits;
    memcpy(&bits, &d, 4);
    const uint32_t b = (bits & 0x7FFFFFFFu) >> 18; /* -0.0 (x == m) as 0 */
    return b >= TK_BUCKETS ? TK_BUCKETS - 1 : (int)b;
}

/* The k-th largest logit of row (its max m given); c: vocab floats of scratch. */
static float kth_largest(const float *row, int64_t vocab, int64_t k, float m, float *c) {
    int32_t count[TK_BUCKETS];
    memset(count, 0, sizeof count);
    for (int64_t t = 0; t < vocab; ++t) ++count[tk_bucket(row[t], m)];
    int64_t seen = 0;
    int b = 0;
    while (b < TK_BUCKETS - 1 && seen + count[b] < k) seen += count[b++];
    if (b >= tk_bucket(-INFINITY, m)) return -INFINITY; /* fewer than k finite logits (a masked row): keep all */
    int64_t n = 0;
    for (int64_t t = 0; t < vocab; ++t)
        if (tk_bucket(row[t], m) == b) c[n++] = row[t];
    qsort(c, (size_t)n, sizeof(float), tkp_desc);
    return c[k - seen - 1];
}

/* The smallest logit that top-p keeps among `kept` (n values sorted descending, m the row's max): the most likely
 * while the mass of those more likely is below p of the kept mass, at least one. */
static float top_p_threshold(const float *kept, int64_t n, float m, float p) {
    double mass = 0.0;
    for (int64_t i = 0; i < n; ++i) mass += expf(kept[i] - m);
    const double target = (double)p * mass;
    double above = 0.0;
    float thr = kept[0];
    for (int64_t i = 0; i < n && (i == 0 || above < target); ++i) {
        thr = kept[i];
        above += expf(kept[i] - m);
    }
    return thr;
}

/* Top-k of at most TK_SORT_MAX tokens, then top-p: only the kept tokens are weighed, once sorted. */
#define TK_SORT_MAX 2048

/* out[r] = logits[r] (row stride `stride`, out contiguous) with -inf where top-k (top_k[r] > 0 and < vocab: keep the
 * logits at least the k-th largest, ties included) and then top-p (top_p[r] < 1: of what top-k kept, keep the most
 * likely tokens while the mass of those more likely is below top_p of the kept mass, at least one; tokens whose
 * logit equals the last kept one's are kept too) drop. ws: 2 · vocab floats of scratch per row (rows × 2 · vocab). */
void top_k_top_p_f32(const float *x, int64_t stride, int64_t rows, int64_t vocab, const int64_t *top_k,
                     const float *top_p, float *out, float *ws) {
#pragma omp parallel for schedule(static) if (rows_parallel(rows, vocab))
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * stride;
        float *o = out + r * vocab, *e = ws + r * 2 * vocab, *c = e + vocab;
        const int64_t k = top_k[r] > 0 && top_k[r] < vocab ? top_k[r] : 0;
        const float p = top_p[r];
        if (k == 0 && !(p < 1.f)) {
            memcpy(o, row, (size_t)vocab * sizeof(float));
            continue;
        }
        if (k > 0 && (!(p < 1.f) || k <= TK_SORT_MAX)) {
            const float m = row_max(row, (int)vocab);
            float thr = kth_largest(row, vocab, k, m, c);
            if (p < 1.f) {
                int64_t n = 0; /* (-inf logits weigh nothing: a masked row sorts only what it allows) */
                for (int64_t t = 0; t < vocab; ++t)
                    if (row[t] >= thr && row[t] > -INFINITY) c[n++] = row[t];
                qsort(c, (size_t)n, sizeof(float), tkp_desc);
                if (n > 0) thr = top_p_threshold(c, n, m, p);
            }
            for (int64_t t = 0; t < vocab; ++t) o[t] = row[t] >= thr ? row[t] : -INFINITY;
            continue;
        }
        const float m = row_max(row, (int)vocab);
        memcpy(e, row, (size_t)vocab * sizeof(float));
        exp_shifted(e, (int)vocab, m); /* e = exp(row - m): 1 at the max, 0 for -inf */
        int32_t count[TKP_BUCKETS];
        double mass[TKP_BUCKETS];
        memset(count, 0, sizeof count);
        memset(mass, 0, sizeof mass);
        for (int64_t t = 0; t < vocab; ++t) {
            const int b = tkp_bucket(e[t]);
            ++count[b];
            mass[b] += e[t];
        }
        float thr = -INFINITY; /* keep the logits >= thr */
        double kept_mass = 0.0;
        for (int b = 0; b < TKP_BUCKETS; ++b) kept_mass += mass[b];
        int last = TKP_BUCKETS - 1; /* the last bucket holding kept tokens */
        if (k > 0) { /* the bucket of the k-th largest, then its logits sorted */
            int64_t seen = 0;
            int b = 0;
            while (b < TKP_BUCKETS - 1 && seen + count[b] < k) seen += count[b++];
            int64_t n = 0;
            for (int64_t t = 0; t < vocab; ++t)
                if (tkp_bucket(e[t]) == b) c[n++] = row[t];
            qsort(c, (size_t)n, sizeof(float), tkp_desc);
            thr = c[k - seen - 1];
            kept_mass = 0.0;
            for (int a = 0; a < b; ++a) kept_mass += mass[a];
            for (int64_t t = 0; t < vocab; ++t)
                if (tkp_bucket(e[t]) == b && row[t] >= thr) kept_mass += e[t];
            last = b;
        }
        if (p < 1.f) { /* the bucket where the mass from the top reaches top_p, then its kept logits sorted */
            const double target = (double)p * kept_mass;
            double above = 0.0;
            int b = 0;
            while (b < last && above + mass[b] < target) above += mass[b++];
            int64_t n = 0;
            for (int64_t t = 0; t < vocab; ++t)
                if (tkp_bucket(e[t]) == b && row[t] >= thr) c[n++] = row[t];
            qsort(c, (size_t)n, sizeof(float), tkp_desc);
            for (int64_t i = 0; i < n && (i == 0 || above < target); ++i) {
                thr = c[i];
                above += expf(c[i] - m);
            }
        }
        for (int64_t t = 0; t < vocab; ++t) o[t] = row[t] >= thr ? row[t] : -INFINITY;
    }
}

/* ---- Mamba-2 decode (model/layers/mamba2.py): one token per row, the state updated in place at its slot -------- */

/* The causal depthwise conv's step: out[r, c] = SiLU(bias[c] + sum_k w[c, k] * window[k]) over the slot's saved
   `width` inputs and this token's, after which the saved inputs shift by one and take this token's.
   state [slots, channels, width] contiguous; w [channels, width + 1] contiguous. */
void mamba_conv_decode_f32(float *state, const int64_t *slots, const float *x, int64_t x_stride, const float *w,
                           const float *bias, float *out, int64_t out_stride, int64_t batch, int64_t channels,
                           int64_t width) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < batch; r++) {
        float *st = state + slots[r] * channels * width;
        const float *xr = x + r * x_stride;
        float *o = out + r * out_stride;
        for (int64_t c = 0; c < channels; c++) {
            float *s = st + c * width;
            const float *wc = w + c * (width + 1);
            float acc = (bias ? bias[c] : 0.f) + wc[width] * xr[c];
            for (int64_t k = 0; k < width; k++) acc += wc[k] * s[k];
            for (int64_t k = 0; k + 1 < width; k++) s[k] = s[k + 1];
            s[width - 1] = xr[c];
            o[c] = acc / (1.f + expf(-acc));
        }
    }
}

/* The selective-state step: with dt = softplus(dt_raw + dt_bias) (torch's threshold 20), h = exp(-exp(a_log)·dt)·h +
   dt·x ⊗ B and y = h·C + D·x, per head; B and C are shared by the heads of a group. xbc rows hold x (heads ×
   head_dim), then B, then C (n_groups × d_state each). state [slots, heads, head_dim, d_state] contiguous. */
void mamba_ssm_decode_f32(float *state, const int64_t *slots, const float *xbc, int64_t xbc_stride, const float *dt,
                          int64_t dt_stride, const float *dt_bias, const float *a_log, const float *d, float *y,
                          int64_t y_stride, int64_t batch, int64_t heads, int64_t head_dim, int64_t d_state,
                          int64_t n_groups) {
    const int64_t inter = heads * head_dim, per_group = heads / n_groups;
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < batch; r++) {
        for (int64_t h = 0; h < heads; h++) {
            const float v = dt[r * dt_stride + h] + dt_bias[h];
            const float step = v > 20.f ? v : log1pf(expf(v));
            const float decay = expf(-expf(a_log[h]) * step);
            const int64_t g = h / per_group;
            const float *row = xbc + r * xbc_stride;
            const float *x = row + h * head_dim, *B = row + inter + g * d_state;
            const float *C = row + inter + (n_groups + g) * d_state;
            float *s = state + (slots[r] * heads + h) * head_dim * d_state;
            float *out = y + r * y_stride + h * head_dim;
            for (int64_t p = 0; p < head_dim; p++) {
                float *sp = s + p * d_state;
                const float dx = step * x[p];
                float acc = 0.f;
                #pragma omp simd reduction(+:acc)
                for (int64_t n = 0; n < d_state; n++) {
                    const float nv = sp[n] * decay + dx * B[n];
                    sp[n] = nv;
                    acc += nv * C[n];
                }
                out[p] = acc + d[h] * x[p];
            }
        }
    }
}

/* Mamba-1's selective scan over packed sequences (model/layers/mamba1.py; kernels/triton_mamba.py's selective_scan
 * on a GPU): sequence s (tokens starts[s] .. starts[s] + lens[s] - 1 of the packed rows) continues from state slot
 * slots[s] ([channels, d_state] floats each) and leaves it at its last token; h = exp(dt·A)·h + dt·x·B, y = h·C per
 * channel, dt already softplus'd, a = A (negative). snap (NULL or [T]): where snap[t] >= 0, that slot also gets the
 * state after token t (prefix caching's snapshots). Each (sequence, channel) keeps its d_state values in a local array
 * while it walks its tokens: one read and one write of its state per call, where a torch loop over token positions
 * moves every sequence's whole state for each token. */
#define MAMBA1_MAX_STATE 256 /* d_state at most (the callers check): Mamba-1 models use 16 */
void mamba1_scan_f32(float *state, const int64_t *slots, const int64_t *starts, const int64_t *lens, int64_t num_seqs,
                     const float *x, int64_t x_stride, const float *dt, int64_t dt_stride, const float *a,
                     const float *b, int64_t b_stride, const float *c, int64_t c_stride, const int64_t *snap,
                     float *y, int64_t y_stride, int64_t channels, int64_t d_state) {
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t s = 0; s < num_seqs; s++) {
        for (int64_t ch = 0; ch < channels; ch++) {
            float h[MAMBA1_MAX_STATE];
            float *home = state + (slots[s] * channels + ch) * d_state;
            memcpy(h, home, (size_t)d_state * sizeof(float));
            const float *ar = a + ch * d_state;
            for (int64_t t = starts[s]; t < starts[s] + lens[s]; t++) {
                const float step = dt[t * dt_stride + ch];
                const float dx = step * x[t * x_stride + ch];
                const float *B = b + t * b_stride, *C = c + t * c_stride;
                float acc = 0.f;
                int64_t n = 0;
#if VECTOR_PATH
                vec accv = v_zero();
                const vec sv = v_set1(step), dxv = v_set1(dx);
                for (; n + VW <= d_state; n += VW) {
                    const vec nv = v_fma(v_load(h + n), v_exp_flush(v_mul(sv, v_load(ar + n))),
                                         v_mul(dxv, v_load(B + n)));
                    v_store(h + n, nv);
                    accv = v_fma(nv, v_load(C + n), accv);
                }
                acc = v_reduce(accv);
#endif
                for (; n < d_state; n++) {
                    h[n] = h[n] * expf(step * ar[n]) + dx * B[n];
                    acc += h[n] * C[n];
                }
                y[t * y_stride + ch] = acc;
                if (snap && snap[t] >= 0)
                    memcpy(state + (snap[t] * channels + ch) * d_state, h, (size_t)d_state * sizeof(float));
            }
            memcpy(home, h, (size_t)d_state * sizeof(float));
        }
    }
}
