/* The CPU path's native kernels (float32): PagedAttention for a flat batch of decodes and prompt
 * chunks, the cache write, and the fused elementwise ops (RMSNorm, RoPE, SiLU·mul) that
 * kernels/triton_fused_ops.py provides on CUDA.
 *
 * Built on first use by pagedllm/kernels/cpu_kernels.py, once per ISA level (kernels/cpu_isa.py:
 * -mavx512f…, -mavx2 -mfma, or plain -O3), and called through ctypes with raw pointers. The OpenMP runtime it links is libgomp.so.1, which resolves to the
 * copy torch has already loaded, so these loops share torch's thread pool.
 *
 * Cache layout, as everywhere in pagedllm: [num_blocks, block_size, num_kv_heads, head_dim], so token j
 * of block b, head h starts at ((b * block_size + j) * num_kv_heads + h) * head_dim. The pool holds
 * float32 or, with --kv-cache-dtype bfloat16, bf16 (half the bytes that attention streams): written with
 * round-to-nearest-even as torch's .to(torch.bfloat16), read back exactly by a 16-bit shift.
 * The torch reference (kernels/reference.py) is the oracle these are tested against.
 */
#include <math.h>
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
#else
#define VW 1
#define VECTOR_PATH 0
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
    for (int g = 0; g < group; ++g) {
        const float *qg = q + g * head_dim;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int d = 0; d < head_dim; ++d) acc += qg[d] * k[d];
        scores[g * stride] = scale * acc;
    }
}

/* Scores of a run of VW tokens: out[g * stride + j] = scale * (q_g · k_j), k_j = k + j * row_stride, for the
 * `group` query rows sharing these K rows (vector builds with head_dim % VW == 0 only). */
static inline void run_scores(const float *restrict q, const float *restrict k, int64_t row_stride, int group,
                              int head_dim, float scale, float *restrict out, int64_t stride) {
#if VECTOR_PATH
    const vec vscale = v_set1(scale);
    for (int g = 0; g < group; ++g) {
        vec acc[VW];
        for (int j = 0; j < VW; ++j) acc[j] = v_zero();
        for (int d = 0; d < head_dim; d += VW) {
            const vec qv = v_load(q + g * head_dim + d);
            for (int j = 0; j < VW; ++j) acc[j] = v_fma(qv, v_load(k + j * row_stride + d), acc[j]);
        }
        v_store(out + g * stride, v_mul(hsum_run(acc), vscale));
    }
#else
    (void)q, (void)k, (void)row_stride, (void)group, (void)head_dim, (void)scale, (void)out, (void)stride;
#endif
}

/* acc[g, :] += Σ_j p[g * stride + j] * v_j over the n (≤ block_size) rows v_j = v + j * row_stride,
 * for the `group` query rows that share these V rows. The block's rows are summed in registers and
 * added to `acc` once, so consecutive tokens do not chain through memory. */
static inline void group_block_axpy(const float *restrict p, int64_t stride, const float *restrict v,
                                    int64_t row_stride, int n, int group, int head_dim, float *restrict acc) {
#if VECTOR_PATH
    if (head_dim % VW == 0) {
        for (int g = 0; g < group; ++g) {
            const float *pg = p + g * stride;
            float *a = acc + g * head_dim;
            for (int d0 = 0; d0 < head_dim; d0 += 4 * VW) { /* four independent accumulators */
                const int chunks = (head_dim - d0) / VW < 4 ? (head_dim - d0) / VW : 4;
                vec r0 = v_zero(), r1 = r0, r2 = r0, r3 = r0;
                for (int j = 0; j < n; ++j) {
                    const vec w = v_set1(pg[j]);
                    const float *vj = v + j * row_stride + d0;
                    r0 = v_fma(w, v_load(vj), r0);
                    if (chunks > 1) r1 = v_fma(w, v_load(vj + VW), r1);
                    if (chunks > 2) r2 = v_fma(w, v_load(vj + 2 * VW), r2);
                    if (chunks > 3) r3 = v_fma(w, v_load(vj + 3 * VW), r3);
                }
                v_store(a + d0, v_add(v_load(a + d0), r0));
                if (chunks > 1) v_store(a + d0 + VW, v_add(v_load(a + d0 + VW), r1));
                if (chunks > 2) v_store(a + d0 + 2 * VW, v_add(v_load(a + d0 + 2 * VW), r2));
                if (chunks > 3) v_store(a + d0 + 3 * VW, v_add(v_load(a + d0 + 3 * VW), r3));
            }
        }
        return;
    }
#endif
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

/* row[0:n] = exp(row[0:n] - m); returns their sum. */
static inline float exp_shifted(float *row, int n, float m) {
    float sum = 0.f;
    int t = 0;
#if VECTOR_PATH
    vec vsum = v_zero();
    const vec vm = v_set1(m);
    for (; t + VW <= n; t += VW) {
        const vec e = v_exp(v_sub(v_load(row + t), vm));
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

static inline void prefetch_bytes(const void *block, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)block + i, 0, 3);
}

typedef uint32_t __attribute__((may_alias)) u32_alias;

/* dst[0:n] = the float32 values of bf16 src[0:n] (exact: the bf16 bits are the float's top half). */
static inline const float *bf16_to_f32(float *restrict dst, const uint16_t *restrict src, int64_t n) {
    u32_alias *d = (u32_alias *)dst;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) d[i] = (uint32_t)src[i] << 16;
    return dst;
}

/* A block's first n values as float32: in the float32 pool as they are, in the bf16 pool widened into `widened`. */
static inline const float *block_as_f32(const float *f32_pool, const uint16_t *bf16_pool, int64_t offset, int64_t n,
                                        float *widened) {
    return bf16_pool != NULL ? bf16_to_f32(widened, bf16_pool + offset, n) : f32_pool + offset;
}

/* float32 → bf16, round to nearest even (NaN stays NaN), as torch's conversion. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Query tokens of one sequence per work item (at most): each K/V block is read once for all of them. */
#define QUERY_TILE 8
/* Scores scratch per thread, in floats: the tile shrinks for long contexts × many heads to stay within it. */
#define SCORES_BUDGET (1 << 20)

/* PagedAttention for a flat batch of query tokens (decodes and prompt chunks alike): sequence s owns
 * tokens query_start_loc[s] .. query_start_loc[s+1]-1, the last of them at position seq_lens[s] - 1,
 * and token i of its chunk attends causally to the first seq_lens[s] - qlen + i + 1 cached tokens
 * (this step's K/V are already in the cache), read block by block through block_tables[s]:
 * out[t, h*group + g] = softmax(q_t·Kᵀ·scale) V. One work item is a tile of up to QUERY_TILE consecutive
 * query tokens of one sequence (a decode: one token): its blocks are walked once for K and once for V,
 * whole token rows (all KV heads) at a time, the next block prefetched while this one is computed; each
 * K/V block, once loaded, serves every token of the tile and all `group` query heads that share a KV head
 * (GQA). A token's arithmetic does not depend on the tile it is in (same operations, same order), so the
 * result of a token is the same in any batch. With kv_bf16 the caches hold bf16: each block's rows that the
 * tile reads are widened to float32 once per work item into a per-thread buffer, and the float32 code runs
 * on that. Returns 0, or -1 when scratch memory could not be allocated. */
int paged_attention_f32(float *out, int64_t out_token_stride, const float *q, int64_t q_token_stride,
                        const void *key_cache, const void *value_cache, const int32_t *block_tables,
                        int64_t table_stride, const int32_t *seq_lens, const int32_t *query_start_loc,
                        int num_seqs, int num_q_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                        int kv_bf16) {
    const int group = num_q_heads / num_kv_heads;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t block_stride = (int64_t)block_size * token_stride;
    const int64_t block_bytes = block_stride * (kv_bf16 ? 2 : 4);
    const float *kf32 = key_cache, *vf32 = value_cache;
    const uint16_t *kb16 = kv_bf16 ? key_cache : NULL, *vb16 = kv_bf16 ? value_cache : NULL;
    int max_len = 1;
    for (int s = 0; s < num_seqs; ++s)
        if (seq_lens[s] > max_len) max_len = seq_lens[s];
    int64_t tile = SCORES_BUDGET / ((int64_t)num_q_heads * max_len);
    tile = tile < 1 ? 1 : tile > QUERY_TILE ? QUERY_TILE : tile;
    const int qtile = (int)tile;
    /* tile_start[s]: the first work item of sequence s */
    int64_t *tile_start = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (tile_start == NULL) return -1;
    tile_start[0] = 0;
    for (int s = 0; s < num_seqs; ++s) {
        const int qlen = query_start_loc[s + 1] - query_start_loc[s];
        tile_start[s + 1] = tile_start[s] + (qlen + qtile - 1) / qtile;
    }
    const int64_t num_items = tile_start[num_seqs];
    int failed = 0;
    /* One work item (a single-sequence decode) needs no team, no barrier for an idle thread. */
#pragma omp parallel if (num_items > 1)
    {
        /* scores[(i * num_q_heads + qh) * max_len + t] for token i of the tile, query head qh */
        float *scores = malloc(sizeof(float) * (size_t)qtile * (size_t)num_q_heads * (size_t)max_len);
        float *acc = malloc(sizeof(float) * (size_t)qtile * (size_t)num_q_heads * (size_t)head_dim);
        float *widened = kv_bf16 ? malloc(sizeof(float) * (size_t)block_stride) : NULL; /* one bf16 block, as float32 */
        if (scores == NULL || acc == NULL || (kv_bf16 && widened == NULL)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            if (scores == NULL || acc == NULL || (kv_bf16 && widened == NULL)) continue;
            int s = 0, hi = num_seqs - 1; /* the last sequence whose items start at or before this one */
            while (s < hi) {
                const int mid = (s + hi + 1) / 2;
                if (tile_start[mid] <= item) s = mid;
                else hi = mid - 1;
            }
            const int qlen = query_start_loc[s + 1] - query_start_loc[s];
            const int i0 = (int)(item - tile_start[s]) * qtile;
            const int nq = qlen - i0 < qtile ? qlen - i0 : qtile;
            const int64_t first = query_start_loc[s] + i0; /* the tile's first query token */
            const int len0 = seq_lens[s] - qlen + i0 + 1;  /* token i of the tile attends to len0 + i keys */
            const int num_blocks = (len0 + nq - 1 + block_size - 1) / block_size;
            const int32_t *table = block_tables + s * table_stride;
            const int64_t head_rows = (int64_t)num_q_heads * max_len;

            const int last = len0 + nq - 1; /* keys the tile's last token reads */
            for (int b = 0; b < num_blocks; ++b) { /* pass 1: scaled scores */
                const int t0 = b * block_size;
                const int64_t rows = last - t0 < block_size ? last - t0 : block_size;
                const float *kb = block_as_f32(kf32, kb16, table[b] * block_stride, rows * token_stride, widened);
                if (b + 1 < num_blocks)
                    prefetch_bytes((const char *)key_cache + (int64_t)table[b + 1] * block_bytes, block_bytes);
                for (int i = t0 >= len0 ? t0 - len0 + 1 : 0; i < nq; ++i) { /* the tokens that reach block b */
                    const int len = len0 + i;
                    const int n = len - t0 < block_size ? len - t0 : block_size;
                    const float *qs = q + (first + i) * q_token_stride;
                    float *sc = scores + i * head_rows;
                    int j0 = 0; /* runs of VW tokens: one transpose-add tree per query row */
                    for (; VECTOR_PATH && j0 + VW <= n && head_dim % VW == 0; j0 += VW)
                        for (int h = 0; h < num_kv_heads; ++h)
                            run_scores(qs + (int64_t)h * group * head_dim, kb + j0 * token_stride + (int64_t)h * head_dim,
                                       token_stride, group, head_dim, scale,
                                       sc + (int64_t)h * group * max_len + t0 + j0, max_len);
                    for (int j = j0; j < n; ++j)
                        for (int h = 0; h < num_kv_heads; ++h)
                            group_scores(qs + (int64_t)h * group * head_dim, kb + j * token_stride + (int64_t)h * head_dim,
                                         group, head_dim, scale, sc + (int64_t)h * group * max_len + t0 + j, max_len);
                }
            }
            if (num_blocks > 0)
                prefetch_bytes((const char *)value_cache + (int64_t)table[0] * block_bytes, block_bytes);
            for (int i = 0; i < nq; ++i) {
                const int len = len0 + i;
                for (int qh = 0; qh < num_q_heads; ++qh) { /* softmax, normalised in place */
                    float *row = scores + i * head_rows + (int64_t)qh * max_len;
                    const float m = row_max(row, len);
                    const float inv = 1.f / exp_shifted(row, len, m);
                    for (int t = 0; t < len; ++t) row[t] *= inv;
                }
            }
            memset(acc, 0, sizeof(float) * (size_t)nq * num_q_heads * head_dim);
            for (int b = 0; b < num_blocks; ++b) { /* pass 2: probabilities · V */
                const int t0 = b * block_size;
                const int64_t rows = last - t0 < block_size ? last - t0 : block_size;
                const float *vb = block_as_f32(vf32, vb16, table[b] * block_stride, rows * token_stride, widened);
                if (b + 1 < num_blocks)
                    prefetch_bytes((const char *)value_cache + (int64_t)table[b + 1] * block_bytes, block_bytes);
                for (int i = t0 >= len0 ? t0 - len0 + 1 : 0; i < nq; ++i) {
                    const int len = len0 + i;
                    const int n = len - t0 < block_size ? len - t0 : block_size;
                    const float *sc = scores + i * head_rows;
                    float *ac = acc + (int64_t)i * num_q_heads * head_dim;
                    for (int h = 0; h < num_kv_heads; ++h)
                        group_block_axpy(sc + (int64_t)h * group * max_len + t0, max_len, vb + (int64_t)h * head_dim,
                                         token_stride, n, group, head_dim, ac + (int64_t)h * group * head_dim);
                }
            }
            for (int i = 0; i < nq; ++i)
                memcpy(out + (first + i) * out_token_stride, acc + (int64_t)i * num_q_heads * head_dim,
                       sizeof(float) * (size_t)num_q_heads * head_dim);
        }
        free(scores);
        free(acc);
        free(widened);
    }
    free(tile_start);
    return failed ? -1 : 0;
}

/* dst[0:n] = src[0:n] as the pool stores it: float32 as is, or rounded to bf16. */
static inline void store_row(void *dst, const float *src, int64_t n, int bf16) {
    if (!bf16) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
}

/* Write each token's K and V rows (num_kv_heads * head_dim floats, `src_stride` floats apart) into
 * slot slot_mapping[t] of the caches (elements of `elem` bytes: 4 = float32, 2 = bf16); slots < 0 are
 * padding and skipped. */
static void write_kv_rows(const float *key, const float *value, int64_t src_stride, char *key_cache, char *value_cache,
                          const int64_t *slot_mapping, int64_t num_tokens, int64_t row, int elem) {
#pragma omp parallel for schedule(static) if (num_tokens > 64)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        store_row(key_cache + slot * row * elem, key + t * src_stride, row, elem == 2);
        store_row(value_cache + slot * row * elem, value + t * src_stride, row, elem == 2);
    }
}

void reshape_and_cache_f32(const float *key, const float *value, int64_t src_stride, float *key_cache,
                           float *value_cache, const int64_t *slot_mapping, int64_t num_tokens, int64_t row) {
    write_kv_rows(key, value, src_stride, (char *)key_cache, (char *)value_cache, slot_mapping, num_tokens, row, 4);
}

/* The same for a bf16 pool: each float is rounded to the nearest bf16 (ties to even). */
void reshape_and_cache_bf16(const float *key, const float *value, int64_t src_stride, uint16_t *key_cache,
                            uint16_t *value_cache, const int64_t *slot_mapping, int64_t num_tokens, int64_t row) {
    write_kv_rows(key, value, src_stride, (char *)key_cache, (char *)value_cache, slot_mapping, num_tokens, row, 2);
}

/* ---- Fused elementwise ops: the CPU twins of kernels/triton_fused_ops.py (float32) ---- */

static inline int rows_parallel(int64_t rows, int64_t cols) { return rows * cols > 16384; }

/* out[t] = weight * s * rsqrt(mean(s²) + eps) with s = x[t] (+ residual[t], then also stored in
 * residual_out[t]). x and residual rows are `x_stride` / `res_stride` floats apart; outputs are dense. */
void rms_norm_f32(float *out, float *residual_out, const float *x, int64_t x_stride, const float *residual,
                  int64_t res_stride, const float *weight, int64_t num_tokens, int64_t hidden, float eps) {
#pragma omp parallel for schedule(static) if (rows_parallel(num_tokens, hidden))
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *xt = x + t * x_stride;
        float *ot = out + t * hidden;
        const float *src = xt;
        if (residual != NULL) {
            const float *rt = residual + t * res_stride;
            float *st = residual_out + t * hidden;
#pragma omp simd
            for (int64_t i = 0; i < hidden; ++i) st[i] = xt[i] + rt[i];
            src = st;
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < hidden; ++i) ss += src[i] * src[i];
        const float r = 1.f / sqrtf(ss / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) ot[i] = weight[i] * (src[i] * r);
    }
}

/* Rotate-half RoPE in place on `heads` heads of head_dim starting at base[t * stride], using row
 * positions[t] of cos/sin caches [max_pos, head_dim] (each row = [f, f] halves). */
static void rotate_rows(float *base, int64_t stride, int heads, const int64_t *positions, const float *cos_cache,
                        const float *sin_cache, int64_t num_tokens, int head_dim) {
    const int half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows_parallel(num_tokens, (int64_t)heads * head_dim))
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *c = cos_cache + positions[t] * head_dim;
        const float *s = sin_cache + positions[t] * head_dim;
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
                          int64_t num_tokens, int head_dim) {
    rotate_rows(q, q_stride, num_q_heads, positions, cos_cache, sin_cache, num_tokens, head_dim);
    rotate_rows(k, k_stride, num_kv_heads, positions, cos_cache, sin_cache, num_tokens, head_dim);
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
            for (int j = 0; j < n; ++j)
                if (!((bits >> j) & 1u)) row[base + j] = ninf;
        }
    }
}
