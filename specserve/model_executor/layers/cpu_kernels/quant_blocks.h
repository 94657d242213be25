/* GGUF block formats for specserve's CPU kernels: unpacking and the row-invariant matmul over them.
 *
 * Included by quant_gemm.c (the matmul and embedding entry points) and quant_layer.c (a decoder
 * layer's row-wise work in one call). A weight is [out, row_bytes] uint8: each row is
 * in / qblock_elems(qtype) GGUF blocks, as in the file; qtype is ggml's type id.
 *
 * Values: the blocks are unpacked to exactly the values ggml's own dequantize_row_* gives (every
 * product of a block scale and a quant is exact in float32, and the one final addition of Q4_1,
 * Q5_1, Q4_K and Q5_K is rounded as ggml rounds it), then multiplied by gemm_core.h's
 * row-invariant float32 core. So every out[r, j] is the same sequence of operations whatever the
 * row count or the thread count, exactly as in fp16_gemm.c: greedy speculative output stays bit
 * for bit the plain output. Build with -ffp-contract=off.
 */
#ifndef SPECSERVE_QUANT_BLOCKS_H
#define SPECSERVE_QUANT_BLOCKS_H

#include "gemm_core.h"

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static inline int qblock_elems(int qtype) {
    switch (qtype) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return 32;
    case Q4_K: case Q5_K: case Q6_K: return 256;
    default: return 0;
    }
}

static inline int qblock_bytes(int qtype) {
    switch (qtype) {
    case Q4_0: return 18;   /* d, qs[16] */
    case Q4_1: return 20;   /* d, m, qs[16] */
    case Q5_0: return 22;   /* d, qh[4], qs[16] */
    case Q5_1: return 24;   /* d, m, qh[4], qs[16] */
    case Q8_0: return 34;   /* d, qs[32] */
    case Q4_K: return 144;  /* d, dmin, scales[12], qs[128] */
    case Q5_K: return 176;  /* d, dmin, scales[12], qh[32], qs[128] */
    case Q6_K: return 210;  /* ql[128], qh[64], scales[16], d */
    default: return 0;
    }
}

#if defined(__F16C__)

static inline float half_at(const uint8_t *p) { /* a little-endian float16 -> float32, exact */
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* ---- one block -> its block_elems float32 values, in order (ggml's dequantize_row_*) ----
 * Written with GCC vector extensions over VEC lanes (AVX-512 or AVX2 code from one source);
 * every product below is exact in float32, so only the additions of a min round. */

typedef int32_t veci __attribute__((vector_size(VEC * 4)));
typedef uint32_t vecu __attribute__((vector_size(VEC * 4)));

static inline veci load_u8(const uint8_t *p) { /* VEC bytes, zero-extended */
#if VEC == 16
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#endif
    veci v;
    memcpy(&v, &w, sizeof v);
    return v;
}

static inline veci load_i8(const uint8_t *p) { /* VEC bytes, sign-extended */
#if VEC == 16
    const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#endif
    veci v;
    memcpy(&v, &w, sizeof v);
    return v;
}

static inline vecf to_float(veci v) { return __builtin_convertvector(v, vecf); }

static inline void store_f32(float *p, vecf v) { memcpy(p, &v, sizeof v); }

static inline veci lane_index(void) {
    veci v;
    for (int i = 0; i < VEC; i++) v[i] = i;
    return v;
}

static inline __attribute__((always_inline)) void block_q4_0(const uint8_t *b, float *y) {
    const float d = half_at(b);
    for (int v = 0; v < 16; v += VEC) {
        const veci q = load_u8(b + 2 + v);
        store_f32(y + v, to_float((q & 0x0F) - 8) * d);
        store_f32(y + 16 + v, to_float((q >> 4) - 8) * d);
    }
}

static inline __attribute__((always_inline)) void block_q4_1(const uint8_t *b, float *y) {
    const float d = half_at(b), m = half_at(b + 2);
    for (int v = 0; v < 16; v += VEC) {
        const veci q = load_u8(b + 4 + v);
        store_f32(y + v, to_float(q & 0x0F) * d + m);
        store_f32(y + 16 + v, to_float(q >> 4) * d + m);
    }
}

/* The fifth bits of a Q5_0 / Q5_1 block's values v..v+VEC (bit j of qh for value j) and
 * v+16..v+16+VEC (bit j + 16), each as 0 or 16. */
static inline void fifth_bits(uint32_t qh, int v, veci *hi0, veci *hi1) {
    const vecu shift = (vecu)(lane_index() + v);
    const vecu bits = (vecu){0} + qh;
    *hi0 = (veci)(((bits >> shift) & 1) << 4);
    *hi1 = (veci)(((bits >> (shift + 16)) & 1) << 4);
}

static inline __attribute__((always_inline)) void block_q5_0(const uint8_t *b, float *y) {
    const float d = half_at(b);
    uint32_t qh;
    memcpy(&qh, b + 2, sizeof qh);
    for (int v = 0; v < 16; v += VEC) {
        veci hi0, hi1;
        fifth_bits(qh, v, &hi0, &hi1);
        const veci q = load_u8(b + 6 + v);
        store_f32(y + v, to_float(((q & 0x0F) | hi0) - 16) * d);
        store_f32(y + 16 + v, to_float(((q >> 4) | hi1) - 16) * d);
    }
}

static inline __attribute__((always_inline)) void block_q5_1(const uint8_t *b, float *y) {
    const float d = half_at(b), m = half_at(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, sizeof qh);
    for (int v = 0; v < 16; v += VEC) {
        veci hi0, hi1;
        fifth_bits(qh, v, &hi0, &hi1);
        const veci q = load_u8(b + 8 + v);
        store_f32(y + v, to_float((q & 0x0F) | hi0) * d + m);
        store_f32(y + 16 + v, to_float((q >> 4) | hi1) * d + m);
    }
}

static inline __attribute__((always_inline)) void block_q8_0(const uint8_t *b, float *y) {
    const float d = half_at(b);
    for (int v = 0; v < 32; v += VEC) store_f32(y + v, to_float(load_i8(b + 2 + v)) * d);
}

/* The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block. */
static inline void scale_min_k4(int j, const uint8_t *q, float *sc, float *mn) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *mn = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
        *mn = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

static inline __attribute__((always_inline)) void block_q4_k(const uint8_t *b, float *y) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
        float sc, mn;
        scale_min_k4(is, scales, &sc, &mn);
        const float d1 = d * sc, m1 = dmin * mn;
        scale_min_k4(is + 1, scales, &sc, &mn);
        const float d2 = d * sc, m2 = dmin * mn;
        for (int l = 0; l < 32; l += VEC) {
            const veci v = load_u8(q + l);
            store_f32(y + j + l, to_float(v & 0x0F) * d1 - m1);
            store_f32(y + j + 32 + l, to_float(v >> 4) * d2 - m2);
        }
    }
}

static inline __attribute__((always_inline)) void block_q5_k(const uint8_t *b, float *y) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32) {
        float sc, mn;
        scale_min_k4(is, scales, &sc, &mn);
        const float d1 = d * sc, m1 = dmin * mn;
        scale_min_k4(is + 1, scales, &sc, &mn);
        const float d2 = d * sc, m2 = dmin * mn;
        for (int l = 0; l < 32; l += VEC) {
            const veci v = load_u8(ql + l), h = load_u8(qh + l);
            store_f32(y + j + l, to_float((v & 0x0F) + (((h >> is) & 1) << 4)) * d1 - m1);
            store_f32(y + j + 32 + l, to_float((v >> 4) + (((h >> (is + 1)) & 1) << 4)) * d2 - m2);
        }
    }
}

static inline __attribute__((always_inline)) void block_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = half_at(b + 208);
    for (int n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8) {
        for (int l = 0; l < 32; l += VEC) {
            const int is = l / 16;
            const veci a = load_u8(ql + l), c = load_u8(ql + l + 32), h = load_u8(qh + l);
            store_f32(y + n + l, to_float(((a & 0x0F) | ((h & 3) << 4)) - 32) * (d * (float)sc[is]));
            store_f32(y + n + l + 32, to_float(((c & 0x0F) | (((h >> 2) & 3) << 4)) - 32) * (d * (float)sc[is + 2]));
            store_f32(y + n + l + 64, to_float(((a >> 4) | (((h >> 4) & 3) << 4)) - 32) * (d * (float)sc[is + 4]));
            store_f32(y + n + l + 96, to_float(((c >> 4) | (((h >> 6) & 3) << 4)) - 32) * (d * (float)sc[is + 6]));
        }
    }
}

/* One weight row (in values, whole blocks) -> y[0..in); each format's loop is its own code. */
#define EACH_BLOCK(block_fn, elems, bytes)                                    \
    for (int64_t k = 0; k < in; k += (elems), row += (bytes)) {              \
        _mm_prefetch((const char *)(row + 1024), _MM_HINT_T0);               \
        block_fn(row, y + k);                                                \
    }                                                                         \
    break

static void dequantize_row(int qtype, const uint8_t *row, int64_t in, float *y) {
    switch (qtype) {
    case Q4_0: EACH_BLOCK(block_q4_0, 32, 18);
    case Q4_1: EACH_BLOCK(block_q4_1, 32, 20);
    case Q5_0: EACH_BLOCK(block_q5_0, 32, 22);
    case Q5_1: EACH_BLOCK(block_q5_1, 32, 24);
    case Q8_0: EACH_BLOCK(block_q8_0, 32, 34);
    case Q4_K: EACH_BLOCK(block_q4_k, 256, 144);
    case Q5_K: EACH_BLOCK(block_q5_k, 256, 176);
    case Q6_K: EACH_BLOCK(block_q6_k, 256, 210);
    default: break;
    }
}

/* Rows ids[0..n) of w -> out [n, in] float32 (the embedding lookup of a quantized table).
 * Returns 0, or -1 for an unknown qtype or an in that is not a whole number of blocks. */
static int quant_dequantize(const uint8_t *w, int qtype, const int64_t *ids, int64_t n, int64_t in,
                            float *out, int num_threads) {
    const int elems = qblock_elems(qtype), bytes = qblock_bytes(qtype);
    if (!elems || in % elems != 0) return -1;
    const int64_t row_bytes = in / elems * bytes;
    if (num_threads < 1 || n < 16) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < n; i++) dequantize_row(qtype, w + ids[i] * row_bytes, in, out + i * in);
    return 0;
}

/* ---- 32 values of a row straight into registers, for the fused few-row path ----
 * Per output row, a prepass (scales_<fmt>) turns each 32-value chunk's scale and offset into
 * float32 (s0[c], s1[c]); then chunk_<fmt>(row, c, s0[c], s1[c], w) sets w[0 .. 32 / VEC) to
 * values [32 c, 32 c + 32) of the row. The values are exactly block_<fmt>'s: every product of a
 * scale and a quant is exact in float32, so q * d + m rounds once whether computed as a
 * multiply and an add or as one FMA (the table of a chunk's 16 or 32 possible values below).
 * With AVX-512 the 4- and 5-bit formats look their values up in that table (vpermps), which
 * costs one instruction per 16 weights instead of a conversion and two arithmetic ones. */
#define NV (32 / VEC)
/* Bytes ahead of a weight row's read position that the fused path prefetches into L1. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 1024
#endif

#if VEC == 16
static inline __m512 as_m512(vecf v) { __m512 r; memcpy(&r, &v, sizeof r); return r; }
static inline vecf from_m512(__m512 v) { vecf r; memcpy(&r, &v, sizeof r); return r; }
static inline __m512i as_m512i(veci v) { __m512i r; memcpy(&r, &v, sizeof r); return r; }
static const float IOTA[32] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                               16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
/* table[i] = i * d + m for i in [first, first + 16), exactly (i * d is exact). */
static inline __m512 value_table(float first, float d, float m) {
    return _mm512_fmadd_ps(_mm512_add_ps(_mm512_loadu_ps(IOTA), _mm512_set1_ps(first)), _mm512_set1_ps(d),
                           _mm512_set1_ps(m));
}
#endif

/* The float16 at byte offset off of each of n blocks of `bytes` bytes -> dst[0..n) float32. */
static inline void halves_to_float(const uint8_t *row, int64_t n, int bytes, int off, float *dst) {
    uint16_t h[16];
    for (int64_t c0 = 0; c0 < n; c0 += 16) {
        const int64_t m = n - c0 < 16 ? n - c0 : 16;
        for (int64_t i = 0; i < m; i++) memcpy(&h[i], row + (c0 + i) * bytes + off, 2);
        for (int64_t i = m; i < 16; i++) h[i] = 0;
#if VEC == 16
        _mm512_storeu_ps(dst + c0, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h)));
#else
        _mm256_storeu_ps(dst + c0, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)));
        _mm256_storeu_ps(dst + c0 + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8))));
#endif
    }
}

/* 32-value block formats: s0 = d, s1 = m (0 where the format has none). Arrays hold nc
 * rounded up to 16. */
#define SCALES_32(fmt, bytes, has_min)                                                                 \
    static inline void scales_##fmt(const uint8_t *row, int64_t nc, float *s0, float *s1) {           \
        halves_to_float(row, nc, bytes, 0, s0);                                                        \
        if (has_min) halves_to_float(row, nc, bytes, 2, s1);                                           \
    }
SCALES_32(q4_0, 18, 0)
SCALES_32(q4_1, 20, 1)
SCALES_32(q5_0, 22, 0)
SCALES_32(q5_1, 24, 1)
SCALES_32(q8_0, 34, 0)

#if VEC == 16
/* A K-quant super-block's 12 scale bytes -> bytes 0-7 its eight 6-bit scales, bytes 8-15 its
 * eight 6-bit mins (the same bits as scale_min_k4), unpacked four at a time in 32-bit words and
 * built in registers (four 4-byte stores read back as one 16-byte load stall). */
static inline __m128i k4_scales_then_mins(const uint8_t *scales12) {
    uint32_t u[3];
    memcpy(u, scales12, 12);
    return _mm_setr_epi32(
        (int)(u[0] & 0x3f3f3f3fu),                                                /* scales 0-3 */
        (int)((u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4)),          /* scales 4-7 */
        (int)(u[1] & 0x3f3f3f3fu),                                                /* mins 0-3 */
        (int)(((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4)));  /* mins 4-7 */
}
#endif

/* Q4_K / Q5_K: chunk c is sub-block c % 8 of super-block c / 8; s0 = d * scale, s1 = dmin * min.
 * The scales and mins are converted and scaled 16 at a time. */
static inline void scales_k4(const uint8_t *row, int64_t nc, int bytes, float *s0, float *s1) {
    for (int64_t sb = 0; sb < nc / 8; sb++) {
        const uint8_t *b = row + sb * bytes;
        const float d = half_at(b), dmin = half_at(b + 2);
#if VEC == 16
        const __m128i packed = k4_scales_then_mins(b + 4);
        const __m512 mult = _mm512_insertf32x8(_mm512_set1_ps(d), _mm256_set1_ps(dmin), 1);
        const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(packed)), mult);
        _mm256_storeu_ps(s0 + sb * 8, _mm512_castps512_ps256(v));
        _mm256_storeu_ps(s1 + sb * 8, _mm512_extractf32x8_ps(v, 1));
#else
        for (int s = 0; s < 8; s++) {
            float sc, mn;
            scale_min_k4(s, b + 4, &sc, &mn);
            s0[sb * 8 + s] = d * sc;
            s1[sb * 8 + s] = dmin * mn;
        }
#endif
    }
}
static inline void scales_q4_k(const uint8_t *row, int64_t nc, float *s0, float *s1) { scales_k4(row, nc, 144, s0, s1); }
static inline void scales_q5_k(const uint8_t *row, int64_t nc, float *s0, float *s1) { scales_k4(row, nc, 176, s0, s1); }

/* Q6_K: chunk c is group c % 4 of half (c % 8) / 4, i.e. s = c % 8 uses scales 2 s and 2 s + 1:
 * s0, s1 = d * those (each covers 16 values). */
static inline void scales_q6_k(const uint8_t *row, int64_t nc, float *s0, float *s1) {
    for (int64_t sb = 0; sb < nc / 8; sb++) {
        const uint8_t *b = row + sb * 210;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
        float t[16];
#if VEC == 16
        _mm512_storeu_ps(t, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc))),
                                          _mm512_set1_ps(d)));
#else
        for (int i = 0; i < 16; i++) t[i] = d * (float)sc[i];
#endif
        for (int s = 0; s < 8; s++) {
            s0[sb * 8 + s] = t[2 * s];
            s1[sb * 8 + s] = t[2 * s + 1];
        }
    }
}

static inline __attribute__((always_inline)) void chunk_q4_0(const uint8_t *row, int64_t c, float d, float m, vecf *w) {
    (void)m;
    const uint8_t *b = row + c * 18;
#if VEC == 16
    const __m512 tab = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(IOTA), _mm512_set1_ps(8.0f)), _mm512_set1_ps(d));
    const __m512i q = as_m512i(load_u8(b + 2));
    w[0] = from_m512(_mm512_permutexvar_ps(q, tab));   /* uses the index's low 4 bits */
    w[1] = from_m512(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), tab));
#else
    for (int v = 0; v < 16; v += VEC) {
        const veci q = load_u8(b + 2 + v);
        w[v / VEC] = to_float((q & 0x0F) - 8) * d;
        w[(16 + v) / VEC] = to_float((q >> 4) - 8) * d;
    }
#endif
}

static inline __attribute__((always_inline)) void chunk_q4_1(const uint8_t *row, int64_t c, float d, float m, vecf *w) {
    const uint8_t *b = row + c * 20;
#if VEC == 16
    const __m512 tab = value_table(0.0f, d, m);
    const __m512i q = as_m512i(load_u8(b + 4));
    w[0] = from_m512(_mm512_permutexvar_ps(q, tab));
    w[1] = from_m512(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), tab));
#else
    for (int v = 0; v < 16; v += VEC) {
        const veci q = load_u8(b + 4 + v);
        w[v / VEC] = to_float(q & 0x0F) * d + m;
        w[(16 + v) / VEC] = to_float(q >> 4) * d + m;
    }
#endif
}

/* Q5_0 / Q5_1: 5-bit values q = nibble | fifth bit << 4, then (q - 16) * d or q * d + m. */
static inline __attribute__((always_inline)) void chunk_q5(const uint8_t *b, int qs_off, int qh_off, float first,
                                                          float d, float m, vecf *w) {
    uint32_t qh;
    memcpy(&qh, b + qh_off, sizeof qh);
#if VEC == 16
    const __m512 lo = value_table(first, d, m), hi = value_table(first + 16.0f, d, m);
    veci hi0, hi1;
    fifth_bits(qh, 0, &hi0, &hi1);
    const veci q = load_u8(b + qs_off);
    w[0] = from_m512(_mm512_permutex2var_ps(lo, as_m512i((q & 0x0F) | hi0), hi));   /* low 5 bits */
    w[1] = from_m512(_mm512_permutex2var_ps(lo, as_m512i((q >> 4) | hi1), hi));
#else
    for (int v = 0; v < 16; v += VEC) {
        veci hi0, hi1;
        fifth_bits(qh, v, &hi0, &hi1);
        const veci q = load_u8(b + qs_off + v);
        w[v / VEC] = to_float(((q & 0x0F) | hi0) + (int)first) * d + m;
        w[(16 + v) / VEC] = to_float(((q >> 4) | hi1) + (int)first) * d + m;
    }
#endif
}

static inline __attribute__((always_inline)) void chunk_q5_0(const uint8_t *row, int64_t c, float d, float m, vecf *w) {
    (void)m;
    chunk_q5(row + c * 22, 6, 2, -16.0f, d, 0.0f, w);   /* (q - 16) * d + 0: exact, as (q - 16) * d */
}

static inline __attribute__((always_inline)) void chunk_q5_1(const uint8_t *row, int64_t c, float d, float m, vecf *w) {
    chunk_q5(row + c * 24, 8, 4, 0.0f, d, m, w);
}

static inline __attribute__((always_inline)) void chunk_q8_0(const uint8_t *row, int64_t c, float d, float m, vecf *w) {
    (void)m;
    const uint8_t *b = row + c * 34;
    for (int v = 0; v < 32; v += VEC) w[v / VEC] = to_float(load_i8(b + 2 + v)) * d;
}

/* Sub-block s (0..7) of super-block c / 8: its 32 values are the low (s even) or high nibbles of
 * 32 bytes: q * (d * scale_s) - dmin * min_s. */
static inline __attribute__((always_inline)) void chunk_q4_k(const uint8_t *row, int64_t c, float d1, float m1, vecf *w) {
    const int s = (int)(c % 8);
    const uint8_t *q = row + (c / 8) * 144 + 16 + 32 * (s / 2);
#if VEC == 16
    const __m512 tab = value_table(0.0f, d1, -m1);
    for (int l = 0; l < 32; l += 16) {
        const __m512i v = as_m512i(load_u8(q + l));
        w[l / 16] = from_m512(_mm512_permutexvar_ps((s & 1) ? _mm512_srli_epi32(v, 4) : v, tab));
    }
#else
    for (int l = 0; l < 32; l += VEC) {
        const veci v = load_u8(q + l);
        w[l / VEC] = to_float((s & 1) ? v >> 4 : v & 0x0F) * d1 - m1;
    }
#endif
}

static inline __attribute__((always_inline)) void chunk_q5_k(const uint8_t *row, int64_t c, float d1, float m1, vecf *w) {
    const uint8_t *b = row + (c / 8) * 176;
    const int s = (int)(c % 8);
    const uint8_t *ql = b + 48 + 32 * (s / 2), *qh = b + 16;
#if VEC == 16
    const __m512 lo = value_table(0.0f, d1, -m1), hi = value_table(16.0f, d1, -m1);
    for (int l = 0; l < 32; l += 16) {
        const veci v = load_u8(ql + l), h = load_u8(qh + l);
        const veci q = ((s & 1) ? v >> 4 : v & 0x0F) | (((h >> s) & 1) << 4);
        w[l / 16] = from_m512(_mm512_permutex2var_ps(lo, as_m512i(q), hi));
    }
#else
    for (int l = 0; l < 32; l += VEC) {
        const veci v = load_u8(ql + l), h = load_u8(qh + l);
        w[l / VEC] = to_float(((s & 1) ? v >> 4 : v & 0x0F) + (((h >> s) & 1) << 4)) * d1 - m1;
    }
#endif
}

/* Group g (0..3) of half n of super-block c / 8: low (g < 2) or high nibbles of ql bytes
 * [64 n + 32 (g & 1), + 32), bits 2 g and 2 g + 1 of qh[32 n ..] as bits 4 and 5. */
static inline __attribute__((always_inline)) void chunk_q6_k(const uint8_t *row, int64_t c, float ds0, float ds1, vecf *w) {
    const uint8_t *b = row + (c / 8) * 210;
    const int n = (int)(c % 8) / 4, g = (int)(c % 4);
    const uint8_t *ql = b + 64 * n + 32 * (g & 1), *qh = b + 128 + 32 * n;
#if VEC == 16
    /* q = nibble | two high bits << 4: h shifted so its two bits sit at bits 4-5, one bitwise
     * select (vpternlogd) takes bits 0-3 from the nibble and the rest from h, then & 63.
     * (q - 32) * ds == fma(q, ds, -32 ds) exactly: the product is exact in float32. */
    const int shift = 4 - 2 * g;
    for (int l = 0; l < 32; l += 16) {
        __m512i a = as_m512i(load_u8(ql + l)), h = as_m512i(load_u8(qh + l));
        if (g >> 1) a = _mm512_srli_epi32(a, 4);
        h = shift >= 0 ? _mm512_slli_epi32(h, shift) : _mm512_srli_epi32(h, -shift);
        const __m512i q = _mm512_and_si512(_mm512_ternarylogic_epi32(_mm512_set1_epi32(0x0F), a, h, 0xCA),
                                           _mm512_set1_epi32(63));   /* 0xCA: mask ? a : h, bit by bit */
        const float ds = l < 16 ? ds0 : ds1;
        w[l / 16] = from_m512(_mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(ds), _mm512_set1_ps(-32.0f * ds)));
    }
#else
    for (int l = 0; l < 32; l += VEC) {
        const veci a = load_u8(ql + l), h = load_u8(qh + l);
        const veci q = ((g >> 1) ? a >> 4 : a & 0x0F) | (((h >> (2 * g)) & 3) << 4);
        w[l / VEC] = to_float(q - 32) * (l < 16 ? ds0 : ds1);
    }
#endif
}

/* R rows x 4 outputs, weights dequantized 32 values at a time into registers and used by all R
 * rows: for each (row, output) the sum runs over the VEC-lane vectors in order, one FMA each,
 * then lanes_sum4 and the bias, exactly as gemm_block does over a dequantized scratch row.
 * sc: scratch for the prepass, 8 * ceil16(in / 32) floats. */
#define DEFINE_FUSED(fmt)                                                                              \
    static inline __attribute__((always_inline)) void fused_##fmt(                                  \
        const float *x, int64_t ldx, const uint8_t *w0, int64_t row_bytes, int64_t in,                \
        const float *bias, float *out, int64_t ldo, float *sc, const int R) {                         \
        const int64_t nc = in / 32, stride = (nc + 15) / 16 * 16;                                      \
        for (int j = 0; j < 4; j++)                                                                    \
            scales_##fmt(w0 + j * row_bytes, nc, sc + (2 * j) * stride, sc + (2 * j + 1) * stride);    \
        vecf acc[R_MAX][4];                                                                            \
        for (int r = 0; r < R; r++)                                                                    \
            for (int j = 0; j < 4; j++) acc[r][j] = (vecf){0};                                         \
        const int64_t pf_step = row_bytes / nc; /* about a chunk's bytes: prefetch is a hint */        \
        for (int64_t c = 0; c < nc; c++) {                                                             \
            vecf wv[4][NV];                                                                            \
            for (int j = 0; j < 4; j++)                                                                \
                _mm_prefetch((const char *)(w0 + j * row_bytes + c * pf_step + PREFETCH_AHEAD), _MM_HINT_T0); \
            for (int j = 0; j < 4; j++)                                                                \
                chunk_##fmt(w0 + j * row_bytes, c, sc[(2 * j) * stride + c], sc[(2 * j + 1) * stride + c], \
                            wv[j]);                                                                    \
            for (int r = 0; r < R; r++)                                                                \
                for (int v = 0; v < NV; v++) {                                                         \
                    const vecf xv = load_f32(x + r * ldx + c * 32 + v * VEC);                          \
                    for (int j = 0; j < 4; j++) acc[r][j] = fma_vec(xv, wv[j][v], acc[r][j]);         \
                }                                                                                      \
        }                                                                                              \
        for (int r = 0; r < R; r++) lanes_sum4(acc[r], out + r * ldo, bias);                           \
    }                                                                                                  \
    static void fused_rows_##fmt(const float *x, int64_t ldx, int64_t rows, const uint8_t *w0,       \
                                 int64_t row_bytes, int64_t in, const float *bias, float *out,         \
                                 int64_t ldo, float *sc) {                                             \
        switch (rows) {                                                                                \
        case 1: fused_##fmt(x, ldx, w0, row_bytes, in, bias, out, ldo, sc, 1); break;                  \
        case 2: fused_##fmt(x, ldx, w0, row_bytes, in, bias, out, ldo, sc, 2); break;                  \
        case 3: fused_##fmt(x, ldx, w0, row_bytes, in, bias, out, ldo, sc, 3); break;                  \
        FUSED_CASES_4_TO_6(fmt)                                                                        \
        default: break;                                                                                \
        }                                                                                              \
    }

#if R_MAX > 5
#define FUSED_CASES_4_TO_6(fmt)                                                                        \
    case 4: fused_##fmt(x, ldx, w0, row_bytes, in, bias, out, ldo, sc, 4); break;                      \
    case 5: fused_##fmt(x, ldx, w0, row_bytes, in, bias, out, ldo, sc, 5); break;                      \
    case 6: fused_##fmt(x, ldx, w0, row_bytes, in, bias, out, ldo, sc, 6); break;
#else
#define FUSED_CASES_4_TO_6(fmt)
#endif

DEFINE_FUSED(q4_0)
DEFINE_FUSED(q4_1)
DEFINE_FUSED(q5_0)
DEFINE_FUSED(q5_1)
DEFINE_FUSED(q8_0)
DEFINE_FUSED(q4_k)
DEFINE_FUSED(q5_k)
DEFINE_FUSED(q6_k)

typedef void (*fused_fn)(const float *, int64_t, int64_t, const uint8_t *, int64_t, int64_t, const float *, float *,
                         int64_t, float *);

static fused_fn fused_fn_of(int qtype) {
    switch (qtype) {
    case Q4_0: return fused_rows_q4_0;
    case Q4_1: return fused_rows_q4_1;
    case Q5_0: return fused_rows_q5_0;
    case Q5_1: return fused_rows_q5_1;
    case Q8_0: return fused_rows_q8_0;
    case Q4_K: return fused_rows_q4_k;
    case Q5_K: return fused_rows_q5_k;
    case Q6_K: return fused_rows_q6_k;
    default: return NULL;
    }
}

/* A thread's scratch for 4 dequantized weight rows, kept between calls (grown as needed). */
static __thread float *scratch;
static __thread int64_t scratch_len;

static float *scratch_for(int64_t len) {
    if (scratch_len < len) {
        free(scratch);
        scratch = malloc((size_t)len * sizeof(float));
        scratch_len = scratch ? len : 0;
    }
    return scratch;
}

/* out = x @ w.T (+ bias), called by every thread of an enclosing parallel region (an orphaned
 * omp for over 4-output blocks, with its barrier at the end). Rows are taken ROW_TILE at a time
 * so a tile's activations stay in cache while the four dequantized weight rows pass over every
 * tile; few rows (<= R_MAX) dequantize straight into registers instead. Each output is computed
 * whole by one thread. Returns 0; -1 for an unknown qtype or an in that is not a whole number of
 * blocks; -3 when scratch memory could not be allocated (out is then incomplete). Every thread
 * returns the same status for the same arguments except -3, which the caller reduces. */
#define ROW_TILE 48

#include "q8_act.h"

/* ... qtype | Q8_ACT_FLAG: int8 activations (q8_act.h) where this CPU and the format allow,
 * else the float32 path. */
static int quant_gemm_team(const float *x, int64_t ldx, int64_t rows, const uint8_t *w, int qtype,
                           int64_t out_features, int64_t in, const float *bias, float *out, int64_t ldo) {
    if (qtype & Q8_ACT_FLAG) {
        qtype &= ~Q8_ACT_FLAG;
#ifdef HAVE_Q8_ACT
        if (q8_act_supported(qtype, in)) return q8_gemm_team(x, ldx, rows, w, qtype, out_features, in, bias, out, ldo);
#endif
    }
    const int elems = qblock_elems(qtype), bytes = qblock_bytes(qtype);
    if (!elems || in % elems != 0 || in % VEC != 0) return -1;
    const int64_t row_bytes = in / elems * bytes;
    const int64_t blocks = (out_features + 3) / 4;
    const fused_fn fused = fused_fn_of(qtype);
    /* few rows: the 4 weight rows' scales; else the 4 dequantized rows themselves (and scales) */
    float *wf = scratch_for(4 * in + 8 * ((in / 32 + 15) / 16 * 16));
    float *sc = wf ? wf + 4 * in : NULL;
    const int ok = wf != NULL;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        if (!ok) continue;
        const int64_t j = b * 4;
        const int nj = j + 4 <= out_features ? 4 : (int)(out_features - j);
        if (nj == 4 && rows <= R_MAX) {
            fused(x, ldx, rows, w + j * row_bytes, row_bytes, in, bias ? bias + j : NULL, out + j, ldo, sc);
            continue;
        }
        for (int jj = 0; jj < nj; jj++) dequantize_row(qtype, w + (j + jj) * row_bytes, in, wf + jj * in);
        for (int64_t row0 = 0; row0 < rows; row0 += ROW_TILE) {
            const int64_t row1 = row0 + ROW_TILE < rows ? row0 + ROW_TILE : rows;
            if (nj == 4) {
                gemm_rows(x, ldx, row0, row1, NULL, wf, in, bias ? bias + j : NULL, out + j, ldo, 4, 0);
            } else { /* the last outputs, one at a time */
                for (int jj = 0; jj < nj; jj++)
                    gemm_rows(x, ldx, row0, row1, NULL, wf + jj * in, in, bias ? bias + j + jj : NULL, out + j + jj,
                              ldo, 1, 0);
            }
        }
    }
    return ok ? 0 : -3;
}

#endif /* __F16C__ */

#endif /* SPECSERVE_QUANT_BLOCKS_H */
