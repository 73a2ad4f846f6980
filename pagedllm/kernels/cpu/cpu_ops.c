/* The CPU path's native kernels (float32): PagedAttention for a flat batch of decodes and prompt
 * chunks, the cache write, and the fused elementwise ops (RMSNorm, RoPE, SiLU·mul) that
 * kernels/triton_fused_ops.py provides on CUDA.
 *
 * Built on first use by pagedllm/kernels/cpu_kernels.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes with raw pointers. The OpenMP runtime it links is libgomp.so.1, which resolves to the
 * copy torch has already loaded, so these loops share torch's thread pool.
 *
 * Cache layout, as everywhere in pagedllm: [num_blocks, block_size, num_kv_heads, head_dim], so token j
 * of block b, head h starts at ((b * block_size + j) * num_kv_heads + h) * head_dim.
 * The torch reference (kernels/reference.py) is the oracle these are tested against.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
__m512 _ZGVeN16v_expf(__m512); /* glibc's libmvec: expf on 16 lanes (≤ 4 ulp) */
#define VECTOR_PATH 1
#else
#define VECTOR_PATH 0
#endif

/* scores[g * stride] = scale * (q_g · k) for the `group` query rows that share one K row. */
static inline void group_scores(const float *restrict q, const float *restrict k, int group, int head_dim,
                                float scale, float *restrict scores, int64_t stride) {
#if defined(__AVX512F__)
    if (head_dim % 16 == 0 && group <= 16) {
        __m512 acc[16];
        for (int g = 0; g < group; ++g) acc[g] = _mm512_setzero_ps();
        for (int d = 0; d < head_dim; d += 16) {
            const __m512 kv = _mm512_loadu_ps(k + d);
            for (int g = 0; g < group; ++g) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * head_dim + d), kv, acc[g]);
        }
        for (int g = 0; g < group; ++g) scores[g * stride] = scale * _mm512_reduce_add_ps(acc[g]);
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

#if defined(__AVX512F__)
/* The 16 horizontal sums of v[0..15], as one vector (lane j = sum of v[j]): a transpose-add tree. */
static inline __m512 hsum16(const __m512 v[16]) {
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
#endif

/* Scores of a run of 16 tokens: out[g * stride + j] = scale * (q_g · k_j), k_j = k + j * row_stride, for the
 * `group` query rows sharing these K rows (AVX-512 with head_dim % 16 == 0 only: see VECTOR_PATH). */
static inline void block16_scores(const float *restrict q, const float *restrict k, int64_t row_stride, int group,
                                  int head_dim, float scale, float *restrict out, int64_t stride) {
#if defined(__AVX512F__)
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int g = 0; g < group; ++g) {
        __m512 acc[16];
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
        for (int d = 0; d < head_dim; d += 16) {
            const __m512 qv = _mm512_loadu_ps(q + g * head_dim + d);
            for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + j * row_stride + d), acc[j]);
        }
        _mm512_storeu_ps(out + g * stride, _mm512_mul_ps(hsum16(acc), vscale));
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
#if defined(__AVX512F__)
    if (head_dim % 16 == 0) {
        for (int g = 0; g < group; ++g) {
            const float *pg = p + g * stride;
            float *a = acc + g * head_dim;
            for (int d0 = 0; d0 < head_dim; d0 += 64) { /* four independent accumulators */
                const int chunks = (head_dim - d0) / 16 < 4 ? (head_dim - d0) / 16 : 4;
                __m512 r0 = _mm512_setzero_ps(), r1 = r0, r2 = r0, r3 = r0;
                for (int j = 0; j < n; ++j) {
                    const __m512 w = _mm512_set1_ps(pg[j]);
                    const float *vj = v + j * row_stride + d0;
                    r0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vj), r0);
                    if (chunks > 1) r1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vj + 16), r1);
                    if (chunks > 2) r2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vj + 32), r2);
                    if (chunks > 3) r3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vj + 48), r3);
                }
                _mm512_storeu_ps(a + d0, _mm512_add_ps(_mm512_loadu_ps(a + d0), r0));
                if (chunks > 1) _mm512_storeu_ps(a + d0 + 16, _mm512_add_ps(_mm512_loadu_ps(a + d0 + 16), r1));
                if (chunks > 2) _mm512_storeu_ps(a + d0 + 32, _mm512_add_ps(_mm512_loadu_ps(a + d0 + 32), r2));
                if (chunks > 3) _mm512_storeu_ps(a + d0 + 48, _mm512_add_ps(_mm512_loadu_ps(a + d0 + 48), r3));
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

/* row[0:n] = exp(row[0:n] - m); returns their sum. */
static inline float exp_shifted(float *row, int n, float m) {
    float sum = 0.f;
    int t = 0;
#if defined(__AVX512F__)
    __m512 vsum = _mm512_setzero_ps();
    const __m512 vm = _mm512_set1_ps(m);
    for (; t + 16 <= n; t += 16) {
        const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_loadu_ps(row + t), vm));
        _mm512_storeu_ps(row + t, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    sum = _mm512_reduce_add_ps(vsum);
#endif
    for (; t < n; ++t) {
        row[t] = expf(row[t] - m);
        sum += row[t];
    }
    return sum;
}

static inline void prefetch_block(const float *block, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(block + i, 0, 3);
}

/* PagedAttention for a flat batch of query tokens (decodes and prompt chunks alike): sequence s owns
 * tokens query_start_loc[s] .. query_start_loc[s+1]-1, the last of them at position seq_lens[s] - 1,
 * and token i of its chunk attends causally to the first seq_lens[s] - qlen + i + 1 cached tokens
 * (this step's K/V are already in the cache), read block by block through block_tables[s]:
 * out[t, h*group + g] = softmax(q_t·Kᵀ·scale) V. One work item is one query token: its blocks are
 * walked once for K and once for V, whole token rows (all KV heads) at a time, the next block
 * prefetched while this one is computed; each K/V row serves all `group` query heads that share it
 * (GQA). Returns 0, or -1 when scratch memory could not be allocated. */
int paged_attention_f32(float *out, int64_t out_token_stride, const float *q, int64_t q_token_stride,
                        const float *key_cache, const float *value_cache, const int32_t *block_tables,
                        int64_t table_stride, const int32_t *seq_lens, const int32_t *query_start_loc,
                        int num_seqs, int num_q_heads, int num_kv_heads, int head_dim, int block_size, float scale) {
    const int group = num_q_heads / num_kv_heads;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t block_stride = (int64_t)block_size * token_stride;
    const int64_t num_tokens = num_seqs > 0 ? query_start_loc[num_seqs] : 0;
    int max_len = 1;
    for (int s = 0; s < num_seqs; ++s)
        if (seq_lens[s] > max_len) max_len = seq_lens[s];
    int failed = 0;
#pragma omp parallel
    {
        /* scores[qh * max_len + t] for the sequence's num_q_heads query heads */
        float *scores = malloc(sizeof(float) * (size_t)num_q_heads * (size_t)max_len);
        float *acc = malloc(sizeof(float) * (size_t)num_q_heads * (size_t)head_dim);
        if (scores == NULL || acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_tokens; ++t) {
            if (scores == NULL || acc == NULL) continue;
            int s = 0, hi = num_seqs - 1; /* the last sequence whose chunk starts at or before t */
            while (s < hi) {
                const int mid = (s + hi + 1) / 2;
                if (query_start_loc[mid] <= t) s = mid;
                else hi = mid - 1;
            }
            const int qlen = query_start_loc[s + 1] - query_start_loc[s];
            const int len = seq_lens[s] - qlen + (int)(t - query_start_loc[s]) + 1;
            const int num_blocks = (len + block_size - 1) / block_size;
            const int32_t *table = block_tables + s * table_stride;
            const float *qs = q + t * q_token_stride;

            for (int b = 0; b < num_blocks; ++b) { /* pass 1: scaled scores */
                const float *kb = key_cache + (int64_t)table[b] * block_stride;
                if (b + 1 < num_blocks) prefetch_block(key_cache + (int64_t)table[b + 1] * block_stride, block_stride);
                const int t0 = b * block_size, n = len - t0 < block_size ? len - t0 : block_size;
                int j0 = 0; /* runs of 16 tokens: one transpose-add tree per query row */
                for (; j0 + 16 <= n && head_dim % 16 == 0 && VECTOR_PATH; j0 += 16)
                    for (int h = 0; h < num_kv_heads; ++h)
                        block16_scores(qs + (int64_t)h * group * head_dim, kb + j0 * token_stride + (int64_t)h * head_dim,
                                       token_stride, group, head_dim, scale,
                                       scores + (int64_t)h * group * max_len + t0 + j0, max_len);
                for (int j = j0; j < n; ++j)
                    for (int h = 0; h < num_kv_heads; ++h)
                        group_scores(qs + (int64_t)h * group * head_dim, kb + j * token_stride + (int64_t)h * head_dim,
                                     group, head_dim, scale, scores + (int64_t)h * group * max_len + t0 + j, max_len);
            }
            if (num_blocks > 0) prefetch_block(value_cache + (int64_t)table[0] * block_stride, block_stride);
            for (int qh = 0; qh < num_q_heads; ++qh) { /* softmax, normalised in place */
                float *row = scores + (int64_t)qh * max_len;
                float m = row[0];
                for (int t = 1; t < len; ++t) m = row[t] > m ? row[t] : m;
                const float inv = 1.f / exp_shifted(row, len, m);
                for (int t = 0; t < len; ++t) row[t] *= inv;
            }
            memset(acc, 0, sizeof(float) * (size_t)num_q_heads * head_dim);
            for (int b = 0; b < num_blocks; ++b) { /* pass 2: probabilities · V */
                const float *vb = value_cache + (int64_t)table[b] * block_stride;
                if (b + 1 < num_blocks) prefetch_block(value_cache + (int64_t)table[b + 1] * block_stride, block_stride);
                const int t0 = b * block_size, n = len - t0 < block_size ? len - t0 : block_size;
                for (int h = 0; h < num_kv_heads; ++h)
                    group_block_axpy(scores + (int64_t)h * group * max_len + t0, max_len, vb + (int64_t)h * head_dim,
                                     token_stride, n, group, head_dim, acc + (int64_t)h * group * head_dim);
            }
            float *os = out + t * out_token_stride;
            memcpy(os, acc, sizeof(float) * (size_t)num_q_heads * head_dim);
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}

/* Write each token's K and V rows (num_kv_heads * head_dim floats, `src_stride` floats apart) into
 * slot slot_mapping[t] of the caches; slots < 0 are padding and skipped. */
void reshape_and_cache_f32(const float *key, const float *value, int64_t src_stride, float *key_cache,
                           float *value_cache, const int64_t *slot_mapping, int64_t num_tokens, int64_t row) {
#pragma omp parallel for schedule(static) if (num_tokens > 64)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy(key_cache + slot * row, key + t * src_stride, sizeof(float) * (size_t)row);
        memcpy(value_cache + slot * row, value + t * src_stride, sizeof(float) * (size_t)row);
    }
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
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.f);
        for (; i + 16 <= inter; i += 16) {
            const __m512 g = _mm512_loadu_ps(gate + i);
            const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
        }
#endif
        for (; i < inter; ++i) o[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
    }
}
