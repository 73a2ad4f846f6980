/* GGUF-quantized linear layers on the CPU (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4), on weights repacked
 * once at load.
 *
 * R16 layout (repack_r16): a weight [N, K] is cut into groups of 16 output rows; per group, per block of 32
 * inputs, the 16 rows' quants are interleaved so that one 64-byte chunk holds 4 consecutive quants of each row
 * (byte 4·r + t of chunk p: row r, inputs 4p + t). Q4 types: 4 chunks, the low nibbles inputs 0-15 and the high
 * nibbles 16-31 of the block; Q8_0: 8 chunks of bytes q + 128 (unsigned, for the u8 × s8 dot product). After
 * the quants come the block's 16 fp16 scales (and the 16 Q4_1 minimums); a Q4_K super-block of 8 blocks
 * starts with its 16 fp16 d and 16 dmin, and each block carries 16 six-bit scales and minimums as bytes. The
 * bytes are those of the GGUF file, rearranged: Q4_0, Q4_1 and Q8_0 take exactly the file's size, Q4_K 1.03×.
 * The 5- and 6-bit types (Q5_0, Q5_1, Q5_K, Q6_K) keep one unsigned byte per weight in Q8_0's chunk order (their
 * values ≤ 63, so AVX2's vpmaddubsw pairs cannot saturate and need no sign trick): Q5_0 / Q5_1 blocks are Q8_0's
 * record with bytes q (and Q5_1's 16 minimums after the scales), 1.55× / 1.5× the file; Q5_K is Q4_K's super-block
 * (16 d, 16 dmin, per block 16 six-bit scales and 16 minimums as bytes) with byte quants, 1.57×; a Q6_K super-block
 * holds its 16 fp16 d (and 32 bytes of padding), then per block of 32 the bytes q (0..63) and the 16 rows' int8
 * scales of each half block of 16 (one scale per 16 weights), 1.30×. MXFP4 is Q4_0's record with the file's nibbles
 * (indices into the E2M1 values, doubled: kvalues) and the 16 rows' E8M0 exponent bytes e instead of fp16 scales
 * (d = 2^(e − 128) leaves fp16's range): 272 bytes per block of 16 rows, exactly the file's size.
 *
 * Every row's contribution of a block is y += d·Σ(q·x) + m·Σx (m: −8d for Q4_0, −16d for Q5_0, the minimum for
 * Q4_1 / Q5_1, −128d for the offset Q8_0 bytes, −dmin·mn for Q4_K / Q5_K; MXFP4: q = kvalue + 12 ≤ 24, a byte shuffle
 * of the nibble, and m = −12d, which overflows to −inf for e ≥ 253 as gguf.quants' 12d does), which two designs
 * compute (both OpenMP over groups of rows). Q6_K (value d·sc·(q − 32), a scale per 16) instead takes one integer
 * per block and row, sc₀·(Σ₀ q·x − 32·Σ₀ x) + sc₁·(Σ₁ q·x − 32·Σ₁ x) over its two halves (the activation's
 * half-block sums Σ x are computed once per call), and y += d·dx·that (no correction term):
 *  (a) "int8": x is quantized per row into blocks of 32 int8 with one fp32 scale dx and s = dx·Σq (llama.cpp's
 *      Q8_1). One vector lane per weight row: a chunk of the group times the broadcast 4 activation bytes is
 *      one u8 × s8 dot-product instruction (AVX-512 VNNI vpdpbusd, AVX-VNNI, or AVX2/AVX-512BW vpmaddubsw +
 *      vpmaddwd) for all 16 (or 8) rows; the scales are applied once per block per row, as vectors. The float
 *      operations per row do not depend on the lane width, the batch, or the thread: every ISA build and every
 *      batch size gives a row the same bits (the portable build does the same operations in scalar code).
 *      With AMX-INT8 turned on (quant_amx_configure; off by default, see "AMX-INT8 tiles" below) every whole 16
 *      rows of a large batch take tiles instead: the same int32 sums and the same float epilogue, the same bits.
 *  (b) "dequant": a group's 16 rows are dequantized into fp32 and multiplied by fp32 x with FMAs (a 4×4
 *      register block of dot products): activations are not rounded.
 * dequantize_rows() is the plain reference dequantization (bit-exact with gguf.quants; used for the embedding
 * lookup and the tests).
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum {
    T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_MXFP4 = 39
};
/* A weight of row segments, each in its own type (a fused layer whose parts the file stores in different types, as
 * Q4_K_M's q | k | v: Q4_K, Q4_K, Q6_K): SEG_HDR bytes (int64 count, then type, rows and byte offset of each
 * segment, at most SEG_MAX), then each segment's R16 weight. Each segment is its own GEMM into a scratch matrix whose
 * rows are copied into its columns of y: a row gets the bits it gets from the segment's type alone. */
#define T_SEGMENTS 1000
#define SEG_HDR 256
#define SEG_MAX 10
#define QK 32
#define QK_K 256
#define GR 16 /* output rows per group */
#ifndef PF_AHEAD
#define PF_AHEAD 2048
#endif
/* Tiles of at most PF_FEW_ROWS activation rows prefetch the weights PF_AHEAD_FEW_ROWS bytes ahead: their arithmetic
 * per weight byte is small, so the stream needs a longer lead (one row: 1.04-1.09x the int8 linears' speed on an
 * AVX2 Zen 3; at 16-64 rows the longer lead cost 1-9 %, BENCHMARKS.md §45.2 and §47.3). */
#ifndef PF_AHEAD_FEW_ROWS
#define PF_AHEAD_FEW_ROWS 8192
#endif
#define PF_FEW_ROWS 2

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
/* MXFP4's values (E2M1 doubled) by nibble, and the same + 12: unsigned for the u8 × s8 dot products */
#define MXFP4_K_BYTES 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12
#define MXFP4_U_BYTES 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0
static const int8_t mxfp4_k[16] = {MXFP4_K_BYTES};
/* 2^(e − 128) from an E8M0 byte, built as ggml_e8m0_to_fp32_half does (e = 0, 1: subnormals). */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
/* Types whose R16 quants are one unsigned byte per weight, in Q8_0's chunk order. */
static inline int byte_quants(int type) {
    return type == T_Q8_0 || type == T_Q5_0 || type == T_Q5_1 || type == T_Q5_K || type == T_Q6_K;
}
/* ... of at most 6 bits: AVX2's u8 × s8 pairs (2·63·127) cannot saturate, and two of them fit int16. */
static inline int small_bytes(int type) {
    return type == T_Q5_0 || type == T_Q5_1 || type == T_Q5_K || type == T_Q6_K;
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

int64_t quant_row_bytes(int type, int64_t K) {
    switch (type) {
        case T_Q4_0: return K % QK ? 0 : K / QK * 18;
        case T_Q4_1: return K % QK ? 0 : K / QK * 20;
        case T_Q8_0: return K % QK ? 0 : K / QK * 34;
        case T_Q5_0: return K % QK ? 0 : K / QK * 22;
        case T_Q5_1: return K % QK ? 0 : K / QK * 24;
        case T_Q4_K: return K % QK_K ? 0 : K / QK_K * 144;
        case T_Q5_K: return K % QK_K ? 0 : K / QK_K * 176;
        case T_Q6_K: return K % QK_K ? 0 : K / QK_K * 210;
        case T_MXFP4: return K % QK ? 0 : K / QK * 17;
        default: return 0;
    }
}

/* ---- R16 layout -------------------------------------------------------------------------------------- */
#define Q4K_HDR 64
#define Q4K_SUB 288
#define Q4K_SUPER (Q4K_HDR + 8 * Q4K_SUB)
/* Q5_K / Q6_K: the header of Q4_K, blocks of 512 quant bytes and 32 bytes of scales */
#define KB_SUB 544
#define KB_SUPER (Q4K_HDR + 8 * KB_SUB)

static inline int64_t r16_block_bytes(int type) {
    return type == T_Q4_0 ? 288 : type == T_Q4_1 ? 320 : type == T_Q8_0 || type == T_Q5_0 ? 544
         : type == T_Q5_1 ? 576 : type == T_MXFP4 ? 272 : 0;
}

/* Bytes of one group of 16 rows; 0 for an unsupported type or K. */
int64_t r16_group_bytes(int type, int64_t K) {
    if (quant_row_bytes(type, K) == 0) return 0;
    return type == T_Q4_K ? K / QK_K * Q4K_SUPER
         : type == T_Q5_K || type == T_Q6_K ? K / QK_K * KB_SUPER : K / QK * r16_block_bytes(type);
}

int64_t r16_bytes(int type, int64_t N, int64_t K) { return (N + GR - 1) / GR * r16_group_bytes(type, K); }

/* The 32 quants of block b of one GGUF row as unsigned integers, plus the block's raw parameters (Q6_K: sc and mn
 * are the int8 scales of the block's two halves, as bytes; MXFP4: d is the exponent byte, q the nibbles). */
static void gguf_block(int type, const uint8_t *row, int64_t b, uint8_t q[32], uint16_t *d, uint16_t *m,
                       uint8_t *sc, uint8_t *mn) {
    if (type == T_Q6_K) { /* ql[128], qh[64], scales[16], d: values 128h + 64s + l: ql[64h + l] >> 4s, qh 2 bits */
        const uint8_t *sb = row + (b / 8) * 210;
        const int j = (int)(b % 8);
        *d = rd16(sb + 208);
        *sc = sb[192 + 2 * j];
        *mn = sb[192 + 2 * j + 1];
        for (int l = 0; l < 32; ++l) {
            const int e = 32 * j + l, h = e / 128, r = e % 128;
            const int lo = (sb[64 * h + r % 64] >> (4 * (r / 64))) & 0xF;
            const int hi = (sb[128 + 32 * h + r % 32] >> (2 * (r / 32))) & 3;
            q[l] = (uint8_t)(lo | hi << 4);
        }
        return;
    }
    if (type == T_Q5_K) { /* d, dmin, scales[12], qh[32], qs[128] */
        const uint8_t *sb = row + (b / 8) * 176;
        const int j = (int)(b % 8), pair = j / 2, hi = j % 2;
        *d = rd16(sb);
        *m = rd16(sb + 2);
        q4k_scale_min(j, sb + 4, sc, mn);
        for (int l = 0; l < 32; ++l) {
            const uint8_t v = sb[48 + 32 * pair + l];
            q[l] = (uint8_t)((hi ? v >> 4 : v & 0xF) | ((sb[16 + l] >> j) & 1) << 4);
        }
        return;
    }
    if (type == T_Q5_0 || type == T_Q5_1) { /* d, (m), qh[4] (bit l: value l's fifth bit), qs[16] */
        const int q51 = type == T_Q5_1;
        const uint8_t *blk = row + b * (q51 ? 24 : 22), *qh = blk + (q51 ? 4 : 2), *qs = qh + 4;
        *d = rd16(blk);
        if (q51) *m = rd16(blk + 2);
        uint32_t h;
        memcpy(&h, qh, 4);
        for (int l = 0; l < 16; ++l) {
            q[l] = (uint8_t)((qs[l] & 0xF) | ((h >> l) & 1) << 4);
            q[l + 16] = (uint8_t)((qs[l] >> 4) | ((h >> (l + 16)) & 1) << 4);
        }
        return;
    }
    if (type == T_Q4_K) {
        const uint8_t *sb = row + (b / 8) * 144;
        const int j = (int)(b % 8), pair = j / 2, hi = j % 2;
        *d = rd16(sb);
        *m = rd16(sb + 2);
        q4k_scale_min(j, sb + 4, sc, mn);
        for (int l = 0; l < 32; ++l) {
            const uint8_t v = sb[16 + 32 * pair + l];
            q[l] = hi ? v >> 4 : v & 0xF;
        }
        return;
    }
    if (type == T_Q8_0) {
        const uint8_t *blk = row + b * 34;
        *d = rd16(blk);
        for (int l = 0; l < 32; ++l) q[l] = (uint8_t)((int)(int8_t)blk[2 + l] + 128);
        return;
    }
    if (type == T_MXFP4) { /* e, qs[16] */
        const uint8_t *blk = row + b * 17;
        *d = blk[0];
        for (int l = 0; l < 16; ++l) {
            q[l] = blk[1 + l] & 0xF;
            q[l + 16] = blk[1 + l] >> 4;
        }
        return;
    }
    const int q41 = type == T_Q4_1;
    const uint8_t *blk = row + b * (q41 ? 20 : 18), *qs = blk + (q41 ? 4 : 2);
    *d = rd16(blk);
    if (q41) *m = rd16(blk + 2);
    for (int l = 0; l < 16; ++l) {
        q[l] = qs[l] & 0xF;
        q[l + 16] = qs[l] >> 4;
    }
}

/* Byte offset inside a block's quants of element e of group row r, and whether it is the high nibble. */
static inline int r16_q4_pos(int r, int e, int *hi) {
    *hi = e >= 16;
    const int ee = e & 15;
    return 64 * (ee >> 2) + 4 * r + (ee & 3);
}
static inline int r16_q8_pos(int r, int e) { return 64 * (e >> 2) + 4 * r + (e & 3); }

/* Repack GGUF rows [N, row_bytes] into R16; rows past N (the last group's padding) are zero. 0 or -1. */
int repack_r16(int type, const uint8_t *src, int64_t N, int64_t K, uint8_t *dst) {
    const int64_t rb = quant_row_bytes(type, K), gb = r16_group_bytes(type, K), nb = K / QK;
    if (rb == 0 || gb == 0) return -1;
    const int64_t G = (N + GR - 1) / GR;
    memset(dst, 0, (size_t)(G * gb));
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < G; ++g) {
        uint8_t *gp = dst + g * gb;
        for (int r = 0; r < GR && g * GR + r < N; ++r) {
            const uint8_t *row = src + (g * GR + r) * rb;
            for (int64_t b = 0; b < nb; ++b) {
                uint8_t q[32], sc = 0, mn = 0;
                uint16_t d = 0, m = 0;
                gguf_block(type, row, b, q, &d, &m, &sc, &mn);
                uint8_t *blk;
                const int qb = byte_quants(type) ? 512 : 256; /* the quants' bytes per block record */
                if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) {
                    const int q4k = type == T_Q4_K;
                    uint8_t *base = gp + (b / 8) * (q4k ? Q4K_SUPER : KB_SUPER);
                    memcpy(base + 2 * r, &d, 2);
                    if (type != T_Q6_K) memcpy(base + 32 + 2 * r, &m, 2);
                    blk = base + Q4K_HDR + (b % 8) * (q4k ? Q4K_SUB : KB_SUB);
                    blk[qb + r] = sc;
                    blk[qb + 16 + r] = mn;
                } else {
                    blk = gp + b * r16_block_bytes(type);
                    if (type == T_MXFP4) blk[qb + r] = (uint8_t)d;
                    else memcpy(blk + qb + 2 * r, &d, 2);
                    if (type == T_Q4_1 || type == T_Q5_1) memcpy(blk + qb + 32 + 2 * r, &m, 2);
                }
                for (int e = 0; e < 32; ++e) {
                    if (byte_quants(type)) {
                        blk[r16_q8_pos(r, e)] = q[e];
                    } else {
                        int hi;
                        const int pos = r16_q4_pos(r, e, &hi);
                        blk[pos] |= (uint8_t)(hi ? q[e] << 4 : q[e]);
                    }
                }
            }
        }
    }
    return 0;
}

/* Scalar per-block parameters of group row r: y = d·Σq·x + m·Σx over the block (Q6_K: d is the super-block's,
 * m = 0; its scales are q6k_scale's). */
static inline void r16_params(int type, const uint8_t *gp, int64_t b, int r, const uint8_t **qs, float *d, float *m) {
    if (type == T_Q4_K || type == T_Q5_K) {
        const int q4k = type == T_Q4_K, qb = q4k ? 256 : 512;
        const uint8_t *base = gp + (b / 8) * (q4k ? Q4K_SUPER : KB_SUPER);
        const uint8_t *blk = base + Q4K_HDR + (b % 8) * (q4k ? Q4K_SUB : KB_SUB);
        *qs = blk;
        *d = h2f(rd16(base + 2 * r)) * (float)blk[qb + r];
        *m = -(h2f(rd16(base + 32 + 2 * r)) * (float)blk[qb + 16 + r]);
        return;
    }
    if (type == T_Q6_K) {
        const uint8_t *base = gp + (b / 8) * KB_SUPER;
        *qs = base + Q4K_HDR + (b % 8) * KB_SUB;
        *d = h2f(rd16(base + 2 * r));
        *m = 0.0f;
        return;
    }
    const uint8_t *blk = gp + b * r16_block_bytes(type);
    const int qb = byte_quants(type) ? 512 : 256;
    *qs = blk;
    if (type == T_MXFP4) {
        *d = e8m0_half(blk[qb + r]);
        *m = *d * -12.0f;
        return;
    }
    *d = h2f(rd16(blk + qb + 2 * r));
    *m = type == T_Q4_1 || type == T_Q5_1 ? h2f(rd16(blk + qb + 32 + 2 * r))
       : *d * (type == T_Q8_0 ? -128.0f : type == T_Q5_0 ? -16.0f : -8.0f);
}

/* Q6_K: the int8 scale of half h (values 16h..16h+15) of group row r in a block record qs. */
static inline int q6k_scale(const uint8_t *qs, int r, int h) { return (int8_t)qs[512 + 16 * h + r]; }

static inline int r16_quant(int type, const uint8_t *qs, int r, int e) {
    if (byte_quants(type)) return qs[r16_q8_pos(r, e)];
    int hi;
    const uint8_t v = qs[r16_q4_pos(r, e, &hi)];
    const int n = hi ? v >> 4 : v & 0xF;
    return type == T_MXFP4 ? mxfp4_k[n] + 12 : n;
}

typedef struct {
    int64_t type, rows, offset;
} seg_t;

/* The segments of a T_SEGMENTS weight of N rows of K inputs: their count, or 0 when the header is not valid. */
static int seg_read(const uint8_t *w, int64_t N, int64_t K, seg_t *seg) {
    int64_t n, rows = 0;
    memcpy(&n, w, 8);
    if (n < 1 || n > SEG_MAX) return 0;
    memcpy(seg, w + 8, (size_t)n * sizeof(seg_t));
    for (int i = 0; i < n; ++i) {
        if (seg[i].type == T_SEGMENTS || r16_group_bytes((int)seg[i].type, K) == 0 || seg[i].rows < 1 ||
            seg[i].offset < SEG_HDR)
            return 0;
        rows += seg[i].rows;
    }
    return rows == N ? (int)n : 0;
}

int dequantize_rows(int type, const uint8_t *w, int64_t K, const int64_t *ids, int64_t n, float *out);

/* dequantize_rows of a T_SEGMENTS weight (N: its rows), a row at a time from its segment. */
int dequantize_rows_segments(const uint8_t *w, int64_t N, int64_t K, const int64_t *ids, int64_t n, float *out) {
    seg_t seg[SEG_MAX];
    const int ns = seg_read(w, N, K, seg);
    if (!ns) return -1;
    for (int64_t i = 0; i < n; ++i) {
        int64_t id = ids[i];
        int j = 0;
        while (j < ns - 1 && id >= seg[j].rows) id -= seg[j++].rows;
        if (id >= seg[j].rows || dequantize_rows((int)seg[j].type, w + seg[j].offset, K, &id, 1, out + i * K))
            return -1;
    }
    return 0;
}

/* out[i, :] = row ids[i] dequantized, bit-exact with gguf.quants (same float operations). */
int dequantize_rows(int type, const uint8_t *w, int64_t K, const int64_t *ids, int64_t n, float *out) {
    const int64_t gb = r16_group_bytes(type, K), nb = K / QK;
    if (gb == 0) return -1;
#pragma omp parallel for schedule(static) if (n * K >= (1 << 16))
    for (int64_t i = 0; i < n; ++i) {
        const uint8_t *gp = w + ids[i] / GR * gb;
        const int r = (int)(ids[i] % GR);
        float *y = out + i * K;
        for (int64_t b = 0; b < nb; ++b, y += QK) {
            const uint8_t *qs;
            float d, m;
            r16_params(type, gp, b, r, &qs, &d, &m);
            for (int e = 0; e < QK; ++e) {
                const int q = r16_quant(type, qs, r, e);
                if (type == T_Q8_0) y[e] = (float)(q - 128) * d;
                else if (type == T_Q4_0) y[e] = d * (float)(q - 8);
                else if (type == T_Q5_0) y[e] = d * (float)(q - 16);
                else if (type == T_Q6_K) y[e] = d * (float)q6k_scale(qs, r, e >= 16) * (float)(q - 32);
                else if (type == T_MXFP4) y[e] = d * (float)(q - 12);
                else y[e] = d * (float)q + m; /* Q4_1, Q5_1: d·q + m; Q4_K, Q5_K: d1·q − dm1 */
            }
        }
    }
    return 0;
}

/* x [M, K] → int8 blocks of 32 (q), their scales d, s = d·Σq, and the integer sums Σq (qsum). */
void quantize_rows_q8(const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *s, int32_t *qsum) {
    const int64_t nb = K / QK;
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t i = 0; i < M * nb; ++i) {
        const float *xb = x + i * QK;
        int8_t *qb = q + i * QK;
        float amax = 0.0f;
        for (int l = 0; l < QK; ++l) { /* a compare, not fmaxf: gcc calls libm's fmaxf per element */
            const float a = fabsf(xb[l]);
            amax = a > amax ? a : amax;
        }
        const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        int sum = 0;
        for (int l = 0; l < QK; ++l) {
            const int v = (int)nearbyintf(xb[l] * id);
            qb[l] = (int8_t)v;
            sum += v;
        }
        d[i] = db;
        s[i] = db * (float)sum;
        qsum[i] = sum;
    }
}

/* Q6_K: xh[i·2nb + 2b + h] = 32 · Σ of the 16 int8 activations of half h of block b of row i (shared by every weight
 * row: its −32 offset is 32·Σx per half block, taken out of the integer sums). */
void half_sums_q8(const int8_t *q, int64_t M, int64_t K, int32_t *xh) {
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t i = 0; i < M * K / 16; ++i) {
        int sum = 0;
        for (int l = 0; l < 16; ++l) sum += q[16 * i + l];
        xh[i] = 32 * sum;
    }
}

/* ---- int8 GEMM on R16 --------------------------------------------------------------------------------- */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LANES 16
#define MR 8 /* activation rows per register tile (BENCHMARKS.md §28: 4, 6, 8 within 5 %; 8 best at 16-20 rows) */
typedef __m512i vi;
typedef __m512 vf;
#define VI_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define VI_AND _mm512_and_si512
#define VI_SRL4(a) _mm512_srli_epi16((a), 4)
#define VI_SET8 _mm512_set1_epi8
#define VI_SET16 _mm512_set1_epi16
#define VI_SET32 _mm512_set1_epi32
#define VI_ZERO _mm512_setzero_si512
#define VI_ADD32 _mm512_add_epi32
#define VI_ADD16 _mm512_add_epi16
#define VI_MADDUBS _mm512_maddubs_epi16
#define VI_MADD16 _mm512_madd_epi16
#define VI_SLL32_4(a) _mm512_slli_epi32((a), 4)
#define VI_SUB32 _mm512_sub_epi32
#define VI_MULLO32 _mm512_mullo_epi32
#define VI_LOAD_I8(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define VF_CVT _mm512_cvtepi32_ps
#define VF_SET1 _mm512_set1_ps
#define VF_MUL _mm512_mul_ps
#define VF_SUB _mm512_sub_ps
#define VF_FMA _mm512_fmadd_ps
#define VF_ADD _mm512_add_ps
#define VF_ZERO _mm512_setzero_ps
#define VF_STORE _mm512_storeu_ps
#define VF_LOAD_PH(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VF_LOAD_U8(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VI_LOAD_U8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define VI_LUT16(...) _mm512_broadcast_i32x4(_mm_setr_epi8(__VA_ARGS__))
#define VI_SHUF8 _mm512_shuffle_epi8
#define VI_SLL32(a, n) _mm512_slli_epi32((a), (n))
#define VI_SLLV32 _mm512_sllv_epi32
#define VI_MAX32 _mm512_max_epi32
#define VI_MINU32 _mm512_min_epu32
#define VF_CAST _mm512_castsi512_ps
#if defined(__AVX512VNNI__)
#define VDOT(acc, u, s) _mm512_dpbusd_epi32((acc), (u), (s))
#define HAVE_VDOT 1
#endif
#elif defined(__AVX2__)
#define LANES 8
#define MR 4 /* 16 ymm: some spill, still faster than 2 or 3 (BENCHMARKS.md §28) */
typedef __m256i vi;
typedef __m256 vf;
#define VI_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VI_AND _mm256_and_si256
#define VI_SRL4(a) _mm256_srli_epi16((a), 4)
#define VI_SET8 _mm256_set1_epi8
#define VI_SET16 _mm256_set1_epi16
#define VI_SET32 _mm256_set1_epi32
#define VI_ZERO _mm256_setzero_si256
#define VI_ADD32 _mm256_add_epi32
#define VI_ADD16 _mm256_add_epi16
#define VI_MADDUBS _mm256_maddubs_epi16
#define VI_MADD16 _mm256_madd_epi16
#define VI_SLL32_4(a) _mm256_slli_epi32((a), 4)
#define VI_SUB32 _mm256_sub_epi32
#define VI_MULLO32 _mm256_mullo_epi32
#define VI_LOAD_I8(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define VF_CVT _mm256_cvtepi32_ps
#define VF_SET1 _mm256_set1_ps
#define VF_MUL _mm256_mul_ps
#define VF_SUB _mm256_sub_ps
#define VF_FMA _mm256_fmadd_ps
#define VF_ADD _mm256_add_ps
#define VF_ZERO _mm256_setzero_ps
#define VF_STORE _mm256_storeu_ps
#define VF_LOAD_PH(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VF_LOAD_U8(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define VI_LOAD_U8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define VI_LUT16(...) _mm256_broadcastsi128_si256(_mm_setr_epi8(__VA_ARGS__))
#define VI_SHUF8 _mm256_shuffle_epi8
#define VI_SLL32(a, n) _mm256_slli_epi32((a), (n))
#define VI_SLLV32 _mm256_sllv_epi32
#define VI_MAX32 _mm256_max_epi32
#define VI_MINU32 _mm256_min_epu32
#define VF_CAST _mm256_castsi256_ps
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VDOT(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#define HAVE_VDOT 1
#elif defined(__AVXVNNI__)
#define VDOT(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#define HAVE_VDOT 1
#endif
#endif

#if defined(LANES)
static inline int32_t ld32(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }

/* e8m0_half of the exponent bytes at p, one per lane: max takes (e − 1) << 23 for e ≥ 2, 0x200000 << e below. */
static inline __attribute__((always_inline)) vf vf_e8m0_half(const uint8_t *p) {
    const vi e = VI_LOAD_U8(p);
    return VF_CAST(VI_MAX32(VI_SLL32(VI_SUB32(e, VI_SET32(1)), 23),
                            VI_SLLV32(VI_SET32(0x00200000), VI_MINU32(e, VI_SET32(2)))));
}

#if !defined(HAVE_VDOT)
/* Σ_p u[p]·x[p] over a block's 8 chunks of nibbles u (≤ 15) and int8 activations x, as 32-bit lanes, without a
 * dot-product instruction: maddubs's 16-bit pair sums cannot saturate (2·15·128), and the 8 of them are summed in
 * 16-bit lanes (|sum| ≤ 8·2·15·128 = 30 720 < 2^15, so no lane wraps) and widened once: 17 instructions where
 * widening each (maddubs, madd, add) took 24. The integers are exact either way, so every bit after them is the
 * same. */
static inline __attribute__((always_inline)) vi nibble_block_dot(const vi u[8], const int8_t *xb) {
    vi a0 = VI_MADDUBS(u[0], VI_SET32(ld32(xb))), a1 = VI_MADDUBS(u[1], VI_SET32(ld32(xb + 4)));
    for (int p = 2; p < 8; p += 2) {
        a0 = VI_ADD16(a0, VI_MADDUBS(u[p], VI_SET32(ld32(xb + 4 * p))));
        a1 = VI_ADD16(a1, VI_MADDUBS(u[p + 1], VI_SET32(ld32(xb + 4 * p + 4))));
    }
    return VI_MADD16(VI_ADD16(a0, a1), VI_SET16(1));
}

/* Σ over 16 inputs (4 chunks u of bytes ≤ 63) of u·x as 32-bit lanes: two vpmaddubsw summed in int16
 * (2·2·63·127 = 32 004 < 2^15) are widened, twice. */
static inline __attribute__((always_inline)) vi small_half_dot(const vi u[4], const int8_t *xb) {
    const vi ones = VI_SET16(1);
    const vi a = VI_ADD16(VI_MADDUBS(u[0], VI_SET32(ld32(xb))), VI_MADDUBS(u[1], VI_SET32(ld32(xb + 4))));
    const vi c = VI_ADD16(VI_MADDUBS(u[2], VI_SET32(ld32(xb + 8))), VI_MADDUBS(u[3], VI_SET32(ld32(xb + 12))));
    return VI_ADD32(VI_MADD16(a, ones), VI_MADD16(c, ones));
}
#endif

/* Q6_K: a block's integer per lane, sc₀·(s₀ − 32Σ₀x) + sc₁·(s₁ − 32Σ₁x) (xh: the two 32·Σx; exact in int32:
 * |each half| ≤ 16·32·127, |sc| ≤ 128). */
static inline __attribute__((always_inline)) vi q6k_combine(const vi s0, const vi s1, const vi sc0, const vi sc1,
                                                            const int32_t *xh) {
    return VI_ADD32(VI_MULLO32(sc0, VI_SUB32(s0, VI_SET32(xh[0]))), VI_MULLO32(sc1, VI_SUB32(s1, VI_SET32(xh[1]))));
}

/* Block b of a group: its quants, and the scale vectors of lanes sr.. (y += dv·dx·Σq·x + mv·s). */
static inline __attribute__((always_inline)) const uint8_t *r16_block_scales(const int type, const uint8_t *gp,
                                                                             const int64_t b, const int sr, vf *dv,
                                                                             vf *mv) {
    if (type == T_Q4_K || type == T_Q5_K) {
        const int q4k = type == T_Q4_K, qb = q4k ? 256 : 512;
        const uint8_t *base = gp + (b >> 3) * (q4k ? Q4K_SUPER : KB_SUPER);
        const uint8_t *blk = base + Q4K_HDR + (b & 7) * (q4k ? Q4K_SUB : KB_SUB);
        *dv = VF_MUL(VF_LOAD_PH(base + 2 * sr), VF_LOAD_U8(blk + qb + sr));
        *mv = VF_SUB(VF_ZERO(), VF_MUL(VF_LOAD_PH(base + 32 + 2 * sr), VF_LOAD_U8(blk + qb + 16 + sr)));
        return blk;
    }
    if (type == T_Q6_K) { /* the super-block's d; the scales are integers (q6k_combine) */
        const uint8_t *base = gp + (b >> 3) * KB_SUPER;
        *dv = VF_LOAD_PH(base + 2 * sr);
        *mv = VF_ZERO();
        return base + Q4K_HDR + (b & 7) * KB_SUB;
    }
    const int64_t rec = r16_block_bytes(type);
    const int qb = byte_quants(type) ? 512 : 256;
    const uint8_t *qs = gp + b * rec;
    if (type == T_MXFP4) {
        *dv = vf_e8m0_half(qs + qb + sr);
        *mv = VF_MUL(*dv, VF_SET1(-12.0f));
        return qs;
    }
    *dv = VF_LOAD_PH(qs + qb + 2 * sr);
    *mv = type == T_Q4_1 || type == T_Q5_1 ? VF_LOAD_PH(qs + qb + 32 + 2 * sr)
        : VF_MUL(*dv, VF_SET1(type == T_Q8_0 ? -128.0f : type == T_Q5_0 ? -16.0f : -8.0f));
    return qs;
}

/* Ask for the weight bytes a block record ahead of qs (the record's quants and scales). */
static inline __attribute__((always_inline)) void prefetch_block(const int type, const uint8_t *qs, const int mc) {
    const char *pf = (const char *)qs + (mc <= PF_FEW_ROWS ? PF_AHEAD_FEW_ROWS : PF_AHEAD);
    _mm_prefetch(pf, _MM_HINT_T0);
    _mm_prefetch(pf + 64, _MM_HINT_T0);
    _mm_prefetch(pf + 128, _MM_HINT_T0);
    _mm_prefetch(pf + 192, _MM_HINT_T0);
    _mm_prefetch(pf + 256, _MM_HINT_T0);
    if (byte_quants(type)) {
        _mm_prefetch(pf + 320, _MM_HINT_T0);
        _mm_prefetch(pf + 384, _MM_HINT_T0);
        _mm_prefetch(pf + 448, _MM_HINT_T0);
        _mm_prefetch(pf + 512, _MM_HINT_T0);
    }
}

/* y[m, row0 + 0..LANES) for rows m < mc of one subgroup (LANES rows of a group); xh: Q6_K's half-block sums
 * (half_sums_q8), unused by the other types. */
static inline __attribute__((always_inline)) void r16_tile(
    const int type, const uint8_t *gp, const int sub, const int64_t nb, const int64_t K, const int8_t *xq,
    const float *xd, const float *xs, const int32_t *xh, const int mc, float *y, const int64_t ldy,
    const int nvalid) {
    vf acc[MR], corr[MR];
    for (int m = 0; m < MR; ++m) { acc[m] = VF_ZERO(); corr[m] = VF_ZERO(); }
    const int so = sub * LANES * 4, sr = sub * LANES;
    const vi lo4 = VI_SET8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
        vf dv, mv;
        const uint8_t *qs = r16_block_scales(type, gp, b, sr, &dv, &mv);
        prefetch_block(type, qs, mc);
        vi w[8], sc0 = VI_ZERO(), sc1 = VI_ZERO();
        if (type == T_Q6_K) {
            sc0 = VI_LOAD_I8(qs + 512 + sr);
            sc1 = VI_LOAD_I8(qs + 528 + sr);
        }
        if (byte_quants(type)) {
            for (int p = 0; p < 8; ++p) w[p] = VI_LOAD(qs + 64 * p + so);
        } else {
            for (int p = 0; p < 4; ++p) {
                const vi c = VI_LOAD(qs + 64 * p + so);
                w[p] = VI_AND(c, lo4);
                w[4 + p] = VI_AND(VI_SRL4(c), lo4);
            }
            if (type == T_MXFP4)
                for (int p = 0; p < 8; ++p) w[p] = VI_SHUF8(VI_LUT16(MXFP4_U_BYTES), w[p]);
        }
        for (int m = 0; m < mc; ++m) {
            const int8_t *xb = xq + m * K + b * QK;
#if !defined(HAVE_VDOT)
            vi sum;
            if (type == T_Q8_0) { /* bytes up to 255: two nibble planes, the high one weighted 16 */
                vi lo[8], hi[8];
                for (int p = 0; p < 8; ++p) {
                    lo[p] = VI_AND(w[p], lo4);
                    hi[p] = VI_AND(VI_SRL4(w[p]), lo4);
                }
                sum = VI_ADD32(nibble_block_dot(lo, xb), VI_SLL32_4(nibble_block_dot(hi, xb)));
            } else if (small_bytes(type) || type == T_MXFP4) { /* MXFP4's bytes ≤ 24 would overflow nibble_block_dot */
                const vi h0 = small_half_dot(w, xb), h1 = small_half_dot(w + 4, xb + 16);
                sum = type == T_Q6_K ? q6k_combine(h0, h1, sc0, sc1, xh + m * 2 * nb + 2 * b) : VI_ADD32(h0, h1);
            } else {
                sum = nibble_block_dot(w, xb);
            }
            const vf isum = VF_CVT(sum);
#else
            vi s0 = VI_ZERO(), s1 = VI_ZERO();
            if (type == T_Q6_K) { /* the two halves apart: chunks 0-3 are inputs 0-15 */
                for (int p = 0; p < 4; ++p) {
                    s0 = VDOT(s0, w[p], VI_SET32(ld32(xb + 4 * p)));
                    s1 = VDOT(s1, w[p + 4], VI_SET32(ld32(xb + 16 + 4 * p)));
                }
                s0 = q6k_combine(s0, s1, sc0, sc1, xh + m * 2 * nb + 2 * b);
                s1 = VI_ZERO();
            } else {
                for (int p = 0; p < 8; p += 2) {
                    s0 = VDOT(s0, w[p], VI_SET32(ld32(xb + 4 * p)));
                    s1 = VDOT(s1, w[p + 1], VI_SET32(ld32(xb + 4 * p + 4)));
                }
            }
            const vf isum = VF_CVT(VI_ADD32(s0, s1));
#endif
            acc[m] = VF_FMA(isum, VF_MUL(dv, VF_SET1(xd[m * nb + b])), acc[m]);
            if (type != T_Q6_K) corr[m] = VF_FMA(mv, VF_SET1(xs[m * nb + b]), corr[m]);
        }
    }
    for (int m = 0; m < mc; ++m) {
        const vf v = VF_ADD(acc[m], corr[m]);
        if (nvalid >= LANES) {
            VF_STORE(y + m * ldy, v);
        } else {
            float tmp[LANES];
            VF_STORE(tmp, v);
            memcpy(y + m * ldy, tmp, (size_t)nvalid * sizeof(float));
        }
    }
}
#endif

#if defined(LANES) && LANES == 8 && !defined(HAVE_VDOT)
#define PAIR_TILE 1
#define PAIR_ROWS 4 /* activation rows per pass: 8 sums, 2-4 weight vectors, a broadcast, constants */
/* Pins a running sum to a register at this point: without it gcc reassociates a block's 8 int16 adds into a tree
 * that first computes (and spills) every product. */
#define PIN(v) __asm__("" : "+x"(v))
/* AVX2 without a dot-product instruction (16 ymm registers): a group's two subgroups (all 16 weight rows) times
 * mc ≤ PAIR_ROWS activation rows in one pass. r16_tile took one subgroup at a time and kept a whole block's 8
 * weight vectors live, so its sums spilled to the stack and every 4-byte activation broadcast fed one vpmaddubsw
 * (BENCHMARKS.md §58.4: load/store-bound), and Q8_0 took two nibble planes (two vpmaddubsw per 32 products).
 * Here a chunk's two weight vectors are unpacked and used at once, each broadcast feeds two vpmaddubsw, a block's
 * sums stay in registers, Q8_0 takes one vpmaddubsw per 32 products (sign trick, below), and the correction sums
 * Σ m·s run in a second pass over the scales alone. The integers and every lane's float operations, in their
 * order, are those of r16_tile: the same bits (BENCHMARKS.md §59.1). */
static inline __attribute__((always_inline)) void r16_pair_tile(
    const int type, const uint8_t *gp, const int64_t nb, const int64_t K, const int8_t *xq, const float *xd,
    const float *xs, const int32_t *xsum, const int32_t *xh, const int mc, float *y, const int64_t ldy,
    const int nvalid) {
    vf acc[PAIR_ROWS][2];
    for (int m = 0; m < mc; ++m) acc[m][0] = acc[m][1] = VF_ZERO();
    const vi lo4 = VI_SET8(0x0F), ones = VI_SET16(1);
    for (int64_t b = 0; b < nb; ++b) {
        vf dv[2], mv[2];
        const uint8_t *qs = r16_block_scales(type, gp, b, 0, &dv[0], &mv[0]);
        r16_block_scales(type, gp, b, LANES, &dv[1], &mv[1]);
        prefetch_block(type, qs, mc);
        const int8_t *xb = xq + b * QK;
        vi lo[PAIR_ROWS][2]; /* int16 sums (Q4: |sum| ≤ 8·2·15·128 < 2^15, no lane wraps); Q8_0, MXFP4: int32 */
        if (type == T_Q8_0) {
            /* Byte u = q + 128. |q| · sign(x, q) = q·x, and a pair of those stays within int16 (2·128·127), so
             * each vpmaddubsw is widened at once; starting from 128·Σx makes the sum Σ u·x, the integer the
             * other builds take (their scales and corrections are the offset bytes'). No nibble planes: one
             * vpmaddubsw per 32 products, and 4 rows fit the registers. */
            const vi flip = VI_SET8((char)0x80);
            for (int m = 0; m < mc; ++m) lo[m][0] = lo[m][1] = VI_SET32(128 * xsum[m * nb + b]);
            for (int p = 0; p < 8; ++p) {
                const vi q0 = _mm256_xor_si256(VI_LOAD(qs + 64 * p), flip);
                const vi q1 = _mm256_xor_si256(VI_LOAD(qs + 64 * p + 32), flip);
                const vi a0 = _mm256_abs_epi8(q0), a1 = _mm256_abs_epi8(q1);
                for (int m = 0; m < mc; ++m) {
                    const vi x = VI_SET32(ld32(xb + m * K + 4 * p));
                    lo[m][0] = VI_ADD32(lo[m][0], VI_MADD16(VI_MADDUBS(a0, _mm256_sign_epi8(x, q0)), ones));
                    lo[m][1] = VI_ADD32(lo[m][1], VI_MADD16(VI_MADDUBS(a1, _mm256_sign_epi8(x, q1)), ones));
                    PIN(lo[m][0]);
                    PIN(lo[m][1]);
                }
            }
        } else if (small_bytes(type)) {
            /* Bytes ≤ 63: two chunks' vpmaddubsw summed in int16 (2·2·63·127 < 2^15), widened once per pair. Per half
             * block (chunks 4h..4h+3) the sums are widened into hs; Q6_K combines each half with its scales. */
            for (int h = 0; h < 2; ++h) {
                vi hs[PAIR_ROWS][2];
                for (int pp = 0; pp < 2; ++pp) {
                    const int p = 4 * h + 2 * pp;
                    const vi c00 = VI_LOAD(qs + 64 * p), c01 = VI_LOAD(qs + 64 * p + 32);
                    const vi c10 = VI_LOAD(qs + 64 * p + 64), c11 = VI_LOAD(qs + 64 * p + 96);
                    for (int m = 0; m < mc; ++m) {
                        const vi x0 = VI_SET32(ld32(xb + m * K + 4 * p)), x1 = VI_SET32(ld32(xb + m * K + 4 * p + 4));
                        const vi a0 = VI_MADD16(VI_ADD16(VI_MADDUBS(c00, x0), VI_MADDUBS(c10, x1)), ones);
                        const vi a1 = VI_MADD16(VI_ADD16(VI_MADDUBS(c01, x0), VI_MADDUBS(c11, x1)), ones);
                        hs[m][0] = pp ? VI_ADD32(hs[m][0], a0) : a0;
                        hs[m][1] = pp ? VI_ADD32(hs[m][1], a1) : a1;
                        PIN(hs[m][0]);
                        PIN(hs[m][1]);
                    }
                }
                for (int m = 0; m < mc; ++m)
                    for (int g = 0; g < 2; ++g) {
                        vi v = hs[m][g];
                        if (type == T_Q6_K)
                            v = VI_MULLO32(VI_LOAD_I8(qs + 512 + 16 * h + LANES * g),
                                           VI_SUB32(v, VI_SET32(xh[m * 2 * nb + 2 * b + h])));
                        lo[m][g] = h ? VI_ADD32(lo[m][g], v) : v;
                    }
            }
        } else if (type == T_MXFP4) {
            /* Bytes ≤ 24: a half block's four vpmaddubsw summed in int16 (4·2·24·128 < 2^15; eight would wrap), widened
             * per half: first the low nibbles (inputs 0-15), then the high ones. */
            const vi lut = VI_LUT16(MXFP4_U_BYTES);
            for (int hf = 0; hf < 2; ++hf) {
                vi hs[PAIR_ROWS][2];
                for (int p = 0; p < 4; ++p) {
                    vi c0 = VI_LOAD(qs + 64 * p), c1 = VI_LOAD(qs + 64 * p + 32);
                    if (hf) {
                        c0 = VI_SRL4(c0);
                        c1 = VI_SRL4(c1);
                    }
                    const vi u0 = VI_SHUF8(lut, VI_AND(c0, lo4)), u1 = VI_SHUF8(lut, VI_AND(c1, lo4));
                    for (int m = 0; m < mc; ++m) {
                        const vi x = VI_SET32(ld32(xb + m * K + 16 * hf + 4 * p));
                        const vi a = VI_MADDUBS(u0, x), c = VI_MADDUBS(u1, x);
                        hs[m][0] = p ? VI_ADD16(hs[m][0], a) : a;
                        hs[m][1] = p ? VI_ADD16(hs[m][1], c) : c;
                        PIN(hs[m][0]);
                        PIN(hs[m][1]);
                    }
                }
                for (int m = 0; m < mc; ++m)
                    for (int g = 0; g < 2; ++g) {
                        const vi v = VI_MADD16(hs[m][g], ones);
                        lo[m][g] = hf ? VI_ADD32(lo[m][g], v) : v;
                    }
            }
        } else { /* chunk p: low nibbles are inputs 4p.., high nibbles 16 + 4p.. */
            for (int p = 0; p < 4; ++p) {
                const vi c0 = VI_LOAD(qs + 64 * p), c1 = VI_LOAD(qs + 64 * p + 32);
                const vi l0 = VI_AND(c0, lo4), l1 = VI_AND(c1, lo4);
                for (int m = 0; m < mc; ++m) {
                    const vi x = VI_SET32(ld32(xb + m * K + 4 * p));
                    const vi a = VI_MADDUBS(l0, x), c = VI_MADDUBS(l1, x);
                    lo[m][0] = p ? VI_ADD16(lo[m][0], a) : a;
                    lo[m][1] = p ? VI_ADD16(lo[m][1], c) : c;
                    PIN(lo[m][0]);
                    PIN(lo[m][1]);
                }
                const vi h0 = VI_AND(VI_SRL4(c0), lo4), h1 = VI_AND(VI_SRL4(c1), lo4);
                for (int m = 0; m < mc; ++m) {
                    const vi x = VI_SET32(ld32(xb + m * K + 16 + 4 * p));
                    lo[m][0] = VI_ADD16(lo[m][0], VI_MADDUBS(h0, x));
                    lo[m][1] = VI_ADD16(lo[m][1], VI_MADDUBS(h1, x));
                    PIN(lo[m][0]);
                    PIN(lo[m][1]);
                }
            }
        }
        for (int m = 0; m < mc; ++m) {
            const vf xdm = VF_SET1(xd[m * nb + b]);
            for (int h = 0; h < 2; ++h) {
                const vi sum = byte_quants(type) || type == T_MXFP4 ? lo[m][h] : VI_MADD16(lo[m][h], ones);
                acc[m][h] = VF_FMA(VF_CVT(sum), VF_MUL(dv[h], xdm), acc[m][h]);
            }
        }
    }
    vf corr[PAIR_ROWS][2];
    for (int m = 0; m < mc; ++m) corr[m][0] = corr[m][1] = VF_ZERO();
    for (int64_t b = 0; b < (type == T_Q6_K ? 0 : nb); ++b) { /* Q6_K: no correction term */
        vf dv[2], mv[2];
        r16_block_scales(type, gp, b, 0, &dv[0], &mv[0]);
        r16_block_scales(type, gp, b, LANES, &dv[1], &mv[1]);
        for (int m = 0; m < mc; ++m) {
            const vf xsm = VF_SET1(xs[m * nb + b]);
            corr[m][0] = VF_FMA(mv[0], xsm, corr[m][0]);
            corr[m][1] = VF_FMA(mv[1], xsm, corr[m][1]);
        }
    }
    for (int m = 0; m < mc; ++m)
        for (int h = 0; h < 2; ++h) {
            const int nv = nvalid - h * LANES;
            if (nv <= 0) break;
            const vf v = VF_ADD(acc[m][h], corr[m][h]);
            if (nv >= LANES) {
                VF_STORE(y + m * ldy + h * LANES, v);
            } else {
                float tmp[LANES];
                VF_STORE(tmp, v);
                memcpy(y + m * ldy + h * LANES, tmp, (size_t)nv * sizeof(float));
            }
        }
}
#endif

#if !defined(LANES)
/* The portable build: the vector tile's float operations per lane, in scalar code (the same bits). */
static void r16_rows_scalar(int type, const uint8_t *gp, int64_t nb, int64_t K, const int8_t *xq, const float *xd,
                            const float *xs, const int32_t *xh, int64_t M, float *y, int64_t ldy, int nvalid) {
    for (int64_t m = 0; m < M; ++m)
        for (int r = 0; r < nvalid; ++r) {
            float acc = 0.0f, corr = 0.0f;
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t *qs;
                float d, mm;
                r16_params(type, gp, b, r, &qs, &d, &mm);
                const int8_t *xb = xq + m * K + b * QK;
                int32_t isum = 0;
                if (type == T_Q6_K) {
                    int32_t s[2] = {0, 0};
                    for (int e = 0; e < QK; ++e) s[e >= 16] += r16_quant(type, qs, r, e) * xb[e];
                    const int32_t *xhb = xh + m * 2 * nb + 2 * b;
                    isum = q6k_scale(qs, r, 0) * (s[0] - xhb[0]) + q6k_scale(qs, r, 1) * (s[1] - xhb[1]);
                } else {
                    for (int e = 0; e < QK; ++e) isum += r16_quant(type, qs, r, e) * xb[e];
                }
                acc = fmaf((float)isum, d * xd[m * nb + b], acc);
                if (type != T_Q6_K) corr = fmaf(mm, xs[m * nb + b], corr);
            }
            y[m * ldy + r] = acc + corr;
        }
}
#endif

static inline __attribute__((always_inline)) void r16_group(const int type, const uint8_t *gp, int64_t nb, int64_t K,
                                                            const int8_t *xq, const float *xd, const float *xs,
                                                            const int32_t *xsum, const int32_t *xh, int64_t M,
                                                            float *y, int64_t N, int64_t row0) {
    const int nvalid = (int)(N - row0 < GR ? N - row0 : GR);
#if defined(PAIR_TILE)
    for (int64_t m0 = 0; m0 < M; m0 += PAIR_ROWS) {
        const int mc = (int)(M - m0 < PAIR_ROWS ? M - m0 : PAIR_ROWS);
        const int8_t *xm = xq + m0 * K;
        float *ym = y + m0 * N + row0;
        const float *xdm = xd + m0 * nb, *xsm = xs + m0 * nb;
        const int32_t *xum = xsum + m0 * nb, *xhm = xh ? xh + m0 * 2 * nb : xh;
        switch (mc) { /* constant row counts: the compiler unrolls the rows and keeps the sums in registers */
            case 4: r16_pair_tile(type, gp, nb, K, xm, xdm, xsm, xum, xhm, 4, ym, N, nvalid); break;
            case 3: r16_pair_tile(type, gp, nb, K, xm, xdm, xsm, xum, xhm, 3, ym, N, nvalid); break;
            case 2: r16_pair_tile(type, gp, nb, K, xm, xdm, xsm, xum, xhm, 2, ym, N, nvalid); break;
            default: r16_pair_tile(type, gp, nb, K, xm, xdm, xsm, xum, xhm, 1, ym, N, nvalid); break;
        }
    }
#elif defined(LANES)
    for (int sub = 0; sub < GR / LANES; ++sub) {
        const int nv = nvalid - sub * LANES;
        if (nv <= 0) break;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mc = (int)(M - m0 < MR ? M - m0 : MR);
            const int32_t *xhm = xh ? xh + m0 * 2 * nb : xh;
            if (mc == MR) /* a constant row count: the compiler unrolls the rows and keeps acc in registers */
                r16_tile(type, gp, sub, nb, K, xq + m0 * K, xd + m0 * nb, xs + m0 * nb, xhm, MR,
                         y + m0 * N + row0 + sub * LANES, N, nv);
            else
                r16_tile(type, gp, sub, nb, K, xq + m0 * K, xd + m0 * nb, xs + m0 * nb, xhm, mc,
                         y + m0 * N + row0 + sub * LANES, N, nv);
        }
    }
#else
    r16_rows_scalar(type, gp, nb, K, xq, xd, xs, xh, M, y + row0, N, nvalid);
#endif
}

/* ---- AMX-INT8 tiles for the int8 design --------------------------------------------------------------------
 * An R16 block of 32 inputs is an AMX B tile as it stands (8 rows of 64 bytes; row k: inputs 4k..4k+3 of the 16
 * weight rows, unsigned): Q8_0, Q5_0, Q5_1 and Q5_K tiles load straight from the weights, Q4 types and MXFP4 unpack
 * their nibbles into 512 bytes first (MXFP4's through the vector path's byte shuffle); Q6_K (two scales per block,
 * which K = 32 would mix) stays on the vector path.
 * One TDPBSUD per block and per 16 activation rows (A: the rows' 32 int8 of the block; K = 32 keeps each block's
 * int32 sums apart for the block's own scales) gives exactly the integers Σ(q·x) of the vector path; the C tile
 * is stored, and amx_epilogue applies r16_tile's float operations per row and block in the same order: the same
 * bits as every other build, whichever rows take tiles.
 * Measured on a Sapphire Rapids-class Xeon (all linears of the bundled model), the per-block C tile store (the
 * per-block scales need every block's sums) makes a tile pass (load A and B, TDPBSUD, store C) cost about what
 * the vector path spends on 6-8 rows, and it does not overlap the float epilogue, which alone costs a quarter
 * of the vector path. Medians of three runs, 1 and 2 threads: with tiles for every row, 0.55-0.85× of VNNI up
 * to 32 rows; with tiles for the whole 16-row sets only, 0.97-1.0× at 16 rows, 0.9× at 20, 1.02-1.05× at 32,
 * 1.05-1.09× at 64 and 1.16× at 128. So tiles take only the whole sets of AMX_ROWS rows of batches of at least
 * amx_min_rows (the rest of the rows stay on the vector path), and only when asked for (quant_amx_configure;
 * PAGEDLLM_CPU_AMX=1 in kernels/cpu_quant.py).
 * Tile data needs Linux's permission (arch_prctl), asked once per process by quant_amx_configure; each OpenMP
 * thread loads its tile configuration and releases it after. */
#if defined(LANES) && LANES == 16 && defined(__x86_64__) && defined(__linux__) && \
    (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define HAVE_AMX 1
#endif

#define AMX_ROWS 16         /* activation rows per tile pass */
#define AMX_MIN_ROWS 64     /* the smallest batch that takes tiles by default (the measurement above) */
static int amx_on = 0, amx_min_rows = AMX_MIN_ROWS;

/* One group on the vector path, activation rows [0, M) (the type dispatched to constants for r16_group). */
static inline void int8_group_vec(int type, const uint8_t *gp, int64_t nb, int64_t K, const int8_t *xq,
                                  const float *xd, const float *xs, const int32_t *xsum, const int32_t *xh, int64_t M,
                                  float *y, int64_t N, int64_t row0) {
    switch (type) {
        case T_Q4_0: r16_group(T_Q4_0, gp, nb, K, xq, xd, xs, xsum, xh, M, y, N, row0); break;
        case T_Q4_1: r16_group(T_Q4_1, gp, nb, K, xq, xd, xs, xsum, xh, M, y, N, row0); break;
        case T_Q5_0: r16_group(T_Q5_0, gp, nb, K, xq, xd, xs, xsum, xh, M, y, N, row0); break;
        case T_Q5_1: r16_group(T_Q5_1, gp, nb, K, xq, xd, xs, xsum, xh, M, y, N, row0); break;
        case T_Q8_0: r16_group(T_Q8_0, gp, nb, K, xq, xd, xs, xsum, xh, M, y, N, row0); break;
        case T_Q5_K: r16_group(T_Q5_K, gp, nb, K, xq, xd, xs, xsum, xh, M, y, N, row0); break;
        case T_Q6_K: r16_group(T_Q6_K, gp, nb, K, xq, xd, xs, xsum, xh, M, y, N, row0); break;
        case T_MXFP4: r16_group(T_MXFP4, gp, nb, K, xq, xd, xs, xsum, xh, M, y, N, row0); break;
        default: r16_group(T_Q4_K, gp, nb, K, xq, xd, xs, xsum, xh, M, y, N, row0); break;
    }
}

#if defined(HAVE_AMX)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw")))
/* The tile intrinsics are asm statements without a memory clobber: fence the buffers they read and write. */
#define AMX_FENCE() __asm__ volatile("" ::: "memory")
#define AMX_NB 8 /* blocks whose C tiles are stored before one epilogue pass reads them */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* CPUID says AMX-TILE and AMX-INT8, and the OS saves tile state (XCR0 bits 17 and 18). */
static int amx_cpu(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE: xgetbv is allowed */
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & (3u << 17)) == (3u << 17);
}

/* Linux hands out the 8 KiB of tile data state per process on request (ARCH_REQ_XCOMP_PERM, XTILEDATA). */
static int amx_permission(void) {
    static int granted = 0; /* 0: not asked yet, 1: granted, -1: refused */
    if (!granted) granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return granted > 0;
}

/* Tiles 0/1: A (16 rows × 32 bytes), 2/3: B (8 × 64), 4/5: C (16 × 16 int32); two sets alternate. */
AMX_TARGET static void amx_thread_begin(void) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 6; ++t) {
        cfg.rows[t] = t == 2 || t == 3 ? 8 : 16;
        cfg.colsb[t] = t < 2 ? 32 : 64;
    }
    AMX_FENCE();
    _tile_loadconfig(&cfg);
}

AMX_TARGET static void amx_thread_end(void) { _tile_release(); }

/* Block b's B tile (the weights, or the nibbles unpacked into ub[512]) and its scale vectors; prefetches the
 * block one batch ahead (tile loads that miss the cache stall the tile unit). */
static inline const uint8_t *amx_block(int type, const uint8_t *gp, int64_t b, uint8_t *ub, vf *dv, vf *mv) {
    const uint8_t *qs = r16_block_scales(type, gp, b, 0, dv, mv);
    const int rec = type == T_Q4_K ? Q4K_SUB : type == T_Q5_K ? KB_SUB : (int)r16_block_bytes(type);
    for (int l = 0; l < rec; l += 64) _mm_prefetch((const char *)qs + AMX_NB * rec + l, _MM_HINT_T0);
    if (byte_quants(type)) return qs; /* Q8_0, Q5_0, Q5_1, Q5_K: the bytes are the tile (Q6_K takes no tiles) */
    const vi lo4 = VI_SET8(0x0F);
    for (int p = 0; p < 4; ++p) {
        const vi c = VI_LOAD(qs + 64 * p);
        vi l = VI_AND(c, lo4), h = VI_AND(VI_SRL4(c), lo4);
        if (type == T_MXFP4) {
            l = VI_SHUF8(VI_LUT16(MXFP4_U_BYTES), l);
            h = VI_SHUF8(VI_LUT16(MXFP4_U_BYTES), h);
        }
        _mm512_store_si512((void *)(ub + 64 * p), l);
        _mm512_store_si512((void *)(ub + 256 + 64 * p), h);
    }
    return ub;
}

/* c[i] (16 × 16 int32) = Σ over block i of rows xa[0..16) × bt[i], i < nbc. */
AMX_TARGET static void amx_dots(const uint8_t *const *bt, int nbc, const int8_t *xa, int64_t K, int32_t *c) {
    AMX_FENCE();
    int i = 0;
    for (; i + 1 < nbc; i += 2) {
        _tile_loadd(2, bt[i], 64);
        _tile_loadd(0, xa + i * QK, K);
        _tile_zero(4);
        _tile_loadd(3, bt[i + 1], 64);
        _tile_loadd(1, xa + (i + 1) * QK, K);
        _tile_zero(5);
        _tile_dpbsud(4, 0, 2);
        _tile_dpbsud(5, 1, 3);
        _tile_stored(4, c + i * 256, 64);
        _tile_stored(5, c + (i + 1) * 256, 64);
    }
    if (i < nbc) {
        _tile_loadd(2, bt[i], 64);
        _tile_loadd(0, xa + i * QK, K);
        _tile_zero(4);
        _tile_dpbsud(4, 0, 2);
        _tile_stored(4, c + i * 256, 64);
    }
    AMX_FENCE();
}

/* r16_tile's float operations on the stored sums of nbc blocks for 16 rows: acc and corr (16 floats each, row m
 * at acc + 32·m, kept in memory between batches of blocks) accumulate in block order, as r16_tile's registers
 * do. A constant nbc unrolls the blocks and keeps their scale vectors in registers. */
static inline __attribute__((always_inline)) void amx_epilogue_n(const int nbc, const int32_t *c, const vf *dvp,
                                                                 const vf *mvp, const float *xd, const float *xs,
                                                                 int64_t nb, float *acc) {
    vf dv[AMX_NB], mv[AMX_NB];
    for (int i = 0; i < nbc; ++i) {
        dv[i] = dvp[i];
        mv[i] = mvp[i];
    }
    for (int m = 0; m < AMX_ROWS; ++m) {
        vf a = _mm512_load_ps(acc + 32 * m), s = _mm512_load_ps(acc + 32 * m + 16);
        for (int i = 0; i < nbc; ++i) {
            const vf isum = VF_CVT(_mm512_load_si512((const void *)(c + i * 256 + 16 * m)));
            a = VF_FMA(isum, VF_MUL(dv[i], VF_SET1(xd[m * nb + i])), a);
            s = VF_FMA(mv[i], VF_SET1(xs[m * nb + i]), s);
        }
        _mm512_store_ps(acc + 32 * m, a);
        _mm512_store_ps(acc + 32 * m + 16, s);
    }
}

static void amx_epilogue(const int32_t *c, int nbc, const vf *dv, const vf *mv, const float *xd, const float *xs,
                         int64_t nb, float *acc) {
    if (nbc == AMX_NB) amx_epilogue_n(AMX_NB, c, dv, mv, xd, xs, nb, acc);
    else amx_epilogue_n(nbc, c, dv, mv, xd, xs, nb, acc);
}

/* One group of 16 weight rows for activation rows [0, M), M a multiple of 16; acc: 32·M floats of scratch,
 * 64-byte aligned. */
AMX_TARGET static void amx_group(int type, const uint8_t *gp, int64_t nb, int64_t K, const int8_t *xq,
                                 const float *xd, const float *xs, int64_t M, float *y, int64_t N, int64_t row0,
                                 float *acc) {
    _Alignas(64) uint8_t ub[AMX_NB * 512];
    _Alignas(64) int32_t c[AMX_NB * 256];
    const uint8_t *bt[AMX_NB];
    vf dv[AMX_NB], mv[AMX_NB];
    memset(acc, 0, (size_t)(32 * M) * sizeof(float));
    for (int64_t b0 = 0; b0 < nb; b0 += AMX_NB) {
        const int nbc = (int)(nb - b0 < AMX_NB ? nb - b0 : AMX_NB);
        for (int i = 0; i < nbc; ++i) bt[i] = amx_block(type, gp, b0 + i, ub + 512 * i, &dv[i], &mv[i]);
        for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS) {
            amx_dots(bt, nbc, xq + m0 * K + b0 * QK, K, c);
            amx_epilogue(c, nbc, dv, mv, xd + m0 * nb + b0, xs + m0 * nb + b0, nb, acc + 32 * m0);
        }
    }
    const int nvalid = (int)(N - row0 < GR ? N - row0 : GR);
    for (int64_t m = 0; m < M; ++m) {
        const vf v = VF_ADD(_mm512_load_ps(acc + 32 * m), _mm512_load_ps(acc + 32 * m + 16));
        if (nvalid == GR) {
            VF_STORE(y + m * N + row0, v);
        } else {
            _Alignas(64) float tmp[16];
            _mm512_store_ps(tmp, v);
            memcpy(y + m * N + row0, tmp, (size_t)nvalid * sizeof(float));
        }
    }
}

/* The int8 GEMM with tiles for rows [0, M − M % 16) and the vector path for the rest, x already quantized;
 * OpenMP over groups as linear_int8_vec (a group's rows of both kinds in one thread, its weights in cache). */
static int linear_amx(int type, const uint8_t *w, int64_t gb, int64_t N, int64_t K, const int8_t *xq,
                      const float *xd, const float *xs, const int32_t *xsum, int64_t M, float *y) {
    const int64_t nb = K / QK, G = (N + GR - 1) / GR, mt = M / AMX_ROWS * AMX_ROWS;
    int status = 0;
#pragma omp parallel
    {
        float *acc = aligned_alloc(64, (size_t)(32 * mt) * sizeof(float));
        if (!acc) {
#pragma omp atomic write
            status = -2;
        } else {
            amx_thread_begin();
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < G; ++g) {
            if (!acc) continue;
            amx_group(type, w + g * gb, nb, K, xq, xd, xs, mt, y, N, g * GR, acc);
            if (mt < M)
                int8_group_vec(type, w + g * gb, nb, K, xq + mt * K, xd + mt * nb, xs + mt * nb, xsum + mt * nb,
                               NULL, M - mt, y + mt * N, N, g * GR);
        }
        if (acc) amx_thread_end();
        free(acc);
    }
    return status;
}
#endif

/* AMX on (enable 1) or off for this library, for batches of at least min_rows rows (≤ 0: AMX_MIN_ROWS; at least
 * AMX_ROWS). Returns 1 when on, 0 when off as asked, -1 when this build has no AMX code, -2 when the CPU or its
 * OS lacks AMX-INT8, -3 when Linux refused tile data permission. */
int quant_amx_configure(int enable, int min_rows) {
    amx_min_rows = min_rows <= 0 ? AMX_MIN_ROWS : min_rows < AMX_ROWS ? AMX_ROWS : min_rows;
    amx_on = 0;
    if (!enable) return 0;
#if defined(HAVE_AMX)
    if (!amx_cpu()) return -2;
    if (!amx_permission()) return -3;
    amx_on = 1;
    return 1;
#else
    return -1;
#endif
}

/* The smallest batch that takes tiles (then every whole AMX_ROWS of its rows). */
int quant_amx_min_rows(void) { return amx_min_rows; }

/* The vector int8 GEMM, x already quantized: OpenMP over groups of 16 rows. */
static void linear_int8_vec(int type, const uint8_t *w, int64_t gb, int64_t N, int64_t K, const int8_t *xq,
                            const float *xd, const float *xs, const int32_t *xsum, const int32_t *xh, int64_t M,
                            float *y) {
    const int64_t G = (N + GR - 1) / GR, nb = K / QK;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < G; ++g) int8_group_vec(type, w + g * gb, nb, K, xq, xd, xs, xsum, xh, M, y, N, g * GR);
}

static int linear_int8(int type, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y) {
    const int64_t gb = r16_group_bytes(type, K), nb = K / QK;
    if (gb == 0) return -1;
    int8_t *xq = malloc((size_t)(M * K));
    float *xd = malloc((size_t)(M * nb) * sizeof(float)), *xs = malloc((size_t)(M * nb) * sizeof(float));
    int32_t *xsum = malloc((size_t)(M * nb) * sizeof(int32_t));
    int32_t *xh = type == T_Q6_K ? malloc((size_t)(M * 2 * nb) * sizeof(int32_t)) : NULL;
    int status = 0;
    if (!xq || !xd || !xs || !xsum || (type == T_Q6_K && !xh)) {
        status = -2;
    } else {
        quantize_rows_q8(x, M, K, xq, xd, xs, xsum);
        if (xh) half_sums_q8(xq, M, K, xh);
#if defined(HAVE_AMX)
        /* Q6_K's two scales per block would need tiles of 16 inputs: it stays on the vector path (same bits) */
        if (amx_on && M >= amx_min_rows && type != T_Q6_K)
            status = linear_amx(type, w, gb, N, K, xq, xd, xs, xsum, M, y);
        else
#endif
            linear_int8_vec(type, w, gb, N, K, xq, xd, xs, xsum, xh, M, y);
    }
    free(xh);
    free(xq);
    free(xd);
    free(xs);
    free(xsum);
    return status;
}

/* ---------------------------------------------------------------------------------------------------------
 * Design (b): dequantize a group's rows into fp32, then a 4×4 block of fp32 dot products with FMAs. */

#if defined(__AVX512F__)
#define DW 16
typedef __m512 df;
#define D_ZERO() _mm512_setzero_ps()
#define D_LOAD(p) _mm512_loadu_ps(p)
#define D_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define D_HSUM(v) _mm512_reduce_add_ps(v)
#elif defined(__AVX2__)
#define DW 8
typedef __m256 df;
#define D_ZERO() _mm256_setzero_ps()
#define D_LOAD(p) _mm256_loadu_ps(p)
#define D_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
static inline float d_hsum256(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}
#define D_HSUM(v) d_hsum256(v)
#endif

#if defined(DW)
/* 16 unsigned quants → y[0..16) = q · d + off (FMAs: not bit-exact, the GEMM only). */
static inline void store16(float *y, __m128i q, float d, float off) {
#if defined(__AVX512F__)
    _mm512_storeu_ps(y, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), _mm512_set1_ps(d),
                                        _mm512_set1_ps(off)));
#else
    const __m256 vd = _mm256_set1_ps(d), vo = _mm256_set1_ps(off);
    _mm256_storeu_ps(y, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), vd, vo));
    _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))), vd, vo));
#endif
}

/* 16 int8 values → y[0..16) = k · d (MXFP4: exact products, gguf.quants' bits). */
static inline void store16k(float *y, __m128i k, float d) {
#if defined(__AVX512F__)
    _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(k)), _mm512_set1_ps(d)));
#else
    const __m256 vd = _mm256_set1_ps(d);
    _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(k)), vd));
    _mm256_storeu_ps(y + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(k, 8))), vd));
#endif
}

/* The 16 bytes of group row r in chunks p0 .. p0+3 (4 bytes each): a row's inputs in order. */
static inline __m128i row_bytes16(const uint8_t *qs, int p0, int r) {
    int32_t v[4];
    for (int i = 0; i < 4; ++i) memcpy(&v[i], qs + 64 * (p0 + i) + 4 * r, 4);
    return _mm_loadu_si128((const __m128i *)v);
}

/* Rows [0, nvalid) of a group into tile[r * K ...]: y = d·q + m (the offset Q8_0 bytes: m = −128d). */
static void dequant_group(int type, const uint8_t *gp, int64_t K, int nvalid, float *tile) {
    const int64_t nb = K / QK;
    const __m128i lo4 = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b)
        for (int r = 0; r < nvalid; ++r) {
            const uint8_t *qs;
            float d, m;
            r16_params(type, gp, b, r, &qs, &d, &m);
            float *y = tile + r * K + b * QK;
            if (type == T_Q6_K) { /* per half: (d·sc)·q − 32·d·sc */
                const float d0 = d * (float)q6k_scale(qs, r, 0), d1 = d * (float)q6k_scale(qs, r, 1);
                store16(y, row_bytes16(qs, 0, r), d0, -32.0f * d0);
                store16(y + 16, row_bytes16(qs, 4, r), d1, -32.0f * d1);
            } else if (byte_quants(type)) {
                store16(y, row_bytes16(qs, 0, r), d, m);
                store16(y + 16, row_bytes16(qs, 4, r), d, m);
            } else if (type == T_MXFP4) {
                const __m128i v = row_bytes16(qs, 0, r), lut = _mm_setr_epi8(MXFP4_K_BYTES);
                store16k(y, _mm_shuffle_epi8(lut, _mm_and_si128(v, lo4)), d);
                store16k(y + 16, _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(v, 4), lo4)), d);
            } else {
                const __m128i v = row_bytes16(qs, 0, r);
                store16(y, _mm_and_si128(v, lo4), d, m);
                store16(y + 16, _mm_and_si128(_mm_srli_epi16(v, 4), lo4), d, m);
            }
        }
}
#else
static void dequant_group(int type, const uint8_t *gp, int64_t K, int nvalid, float *tile) {
    const int64_t nb = K / QK;
    for (int r = 0; r < nvalid; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *qs;
            float d, m;
            r16_params(type, gp, b, r, &qs, &d, &m);
            for (int e = 0; e < QK; ++e) {
                float de = d, me = m;
                if (type == T_Q6_K) { /* per half: (d·sc)·q − 32·d·sc */
                    de = d * (float)q6k_scale(qs, r, e >= 16);
                    me = -32.0f * de;
                }
                const int q = r16_quant(type, qs, r, e);
                tile[r * K + b * QK + e] = type == T_MXFP4 ? d * (float)(q - 12) : de * (float)q + me;
            }
        }
}
#endif

static void dequant_group_gemm(const float *tile, int nvalid, int64_t K, const float *x, int64_t M, float *y,
                               int64_t N) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int mc = (int)(M - m0 < 4 ? M - m0 : 4);
        for (int r0 = 0; r0 < nvalid; r0 += 4) {
            const int rc = nvalid - r0 < 4 ? nvalid - r0 : 4;
#if defined(DW)
            if (mc == 4 && rc == 4) {
                df acc[4][4];
                for (int i = 0; i < 4; ++i)
                    for (int j = 0; j < 4; ++j) acc[i][j] = D_ZERO();
                for (int64_t k = 0; k < K; k += DW) {
                    df xv[4], wv[4];
                    for (int i = 0; i < 4; ++i) xv[i] = D_LOAD(x + (m0 + i) * K + k);
                    for (int j = 0; j < 4; ++j) wv[j] = D_LOAD(tile + (r0 + j) * K + k);
                    for (int i = 0; i < 4; ++i)
                        for (int j = 0; j < 4; ++j) acc[i][j] = D_FMA(xv[i], wv[j], acc[i][j]);
                }
                for (int i = 0; i < 4; ++i)
                    for (int j = 0; j < 4; ++j) y[(m0 + i) * N + r0 + j] = D_HSUM(acc[i][j]);
                continue;
            }
            for (int i = 0; i < mc; ++i)
                for (int j = 0; j < rc; ++j) {
                    df acc = D_ZERO();
                    for (int64_t k = 0; k < K; k += DW)
                        acc = D_FMA(D_LOAD(x + (m0 + i) * K + k), D_LOAD(tile + (r0 + j) * K + k), acc);
                    y[(m0 + i) * N + r0 + j] = D_HSUM(acc);
                }
#else
            for (int i = 0; i < mc; ++i)
                for (int j = 0; j < rc; ++j) {
                    float acc = 0.0f;
                    for (int64_t k = 0; k < K; ++k) acc += x[(m0 + i) * K + k] * tile[(r0 + j) * K + k];
                    y[(m0 + i) * N + r0 + j] = acc;
                }
#endif
        }
    }
}

static int linear_dequant(int type, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y) {
    const int64_t gb = r16_group_bytes(type, K), G = (N + GR - 1) / GR;
    int status = 0;
#pragma omp parallel
    {
        float *tile = malloc((size_t)(GR * K) * sizeof(float));
        if (!tile) {
#pragma omp atomic write
            status = -2;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < G; ++g) {
            if (!tile) continue;
            const int nvalid = (int)(N - g * GR < GR ? N - g * GR : GR);
            dequant_group(type, w + g * gb, K, nvalid, tile);
            dequant_group_gemm(tile, nvalid, K, x, M, y + g * GR, N);
        }
        free(tile);
    }
    return status;
}

/* ---------------------------------------------------------------------------------------------------------
 * Entry point: y[M,N] = x[M,K] · Wᵀ, W in R16 (repack_r16). method 0: int8 dot products (a), 1: dequant (b).
 * Returns 0, -1 for a bad type/K, -2 when out of memory. */

const char *quant_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return amx_on ? "avx512_vnni+amx_int8" : "avx512_vnni";
#elif defined(__AVX512BW__)
    return amx_on ? "avx512bw+amx_int8" : "avx512bw";
#elif defined(__AVXVNNI__)
    return "avx_vnni";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "scalar";
#endif
}

/* quant_linear of a T_SEGMENTS weight: each segment into scratch, copied into its columns of y. */
static int linear_segments(const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y, int method) {
    seg_t seg[SEG_MAX];
    const int ns = seg_read(w, N, K, seg);
    if (!ns) return -1;
    if (M == 0) return 0;
    int64_t widest = 0, r0 = 0;
    for (int i = 0; i < ns; ++i) widest = seg[i].rows > widest ? seg[i].rows : widest;
    float *tmp = malloc((size_t)(M * widest) * sizeof(float));
    if (!tmp) return -2;
    int status = 0;
    for (int i = 0; i < ns && !status; ++i) {
        const int t = (int)seg[i].type;
        const int64_t rows = seg[i].rows;
        status = method == 0 ? linear_int8(t, w + seg[i].offset, rows, K, x, M, tmp)
                             : linear_dequant(t, w + seg[i].offset, rows, K, x, M, tmp);
        for (int64_t m = 0; m < M && !status; ++m)
            memcpy(y + m * N + r0, tmp + m * rows, (size_t)rows * sizeof(float));
        r0 += rows;
    }
    free(tmp);
    return status;
}

int quant_linear(int type, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y, int method) {
    if (type == T_SEGMENTS) return linear_segments(w, N, K, x, M, y, method);
    if (r16_group_bytes(type, K) == 0) return -1;
    if (M == 0) return 0;
    return method == 0 ? linear_int8(type, w, N, K, x, M, y) : linear_dequant(type, w, N, K, x, M, y);
}
