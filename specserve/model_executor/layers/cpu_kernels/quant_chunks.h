/* GGUF blocks, 32 values at a time straight into registers: the fused few-row path's loaders.
 *
 * Holds scales_<fmt> (a weight row's per-chunk scales and offsets, a prepass) and chunk_<fmt>
 * (32 values of a row into NV vectors), whose values reproduce quant_unpack.h's block_<fmt>
 * exactly; used by quant_blocks.h's DEFINE_FUSED matmul. Split from the unpackers to keep each
 * file to one role: those unpack whole blocks, this one loads chunks.
 *
 * Includes gemm_core.h (VEC, vecf), ggml_blocks.h (half_at, scale_min_k4, k4_scales_then_mins)
 * and quant_unpack.h (the lane helpers: veci, load_u8, load_i8, to_float, fifth_bits).
 */
#ifndef SPECSERVE_QUANT_CHUNKS_H
#define SPECSERVE_QUANT_CHUNKS_H

#include "gemm_core.h"
#include "ggml_blocks.h"
#include "quant_unpack.h"

#if defined(__F16C__)

/* ---- 32 values of a row straight into registers, for the fused few-row path ----
 * Per output row, a prepass (scales_<fmt>) turns each 32-value chunk's scale and offset into
 * float32 (s0[c], s1[c]); then chunk_<fmt>(row, c, s0[c], s1[c], w) sets w[0 .. 32 / VEC) to
 * values [32 c, 32 c + 32) of the row. The values are exactly block_<fmt>'s: every product of a
 * scale and a quant is exact in float32, so q * d + m rounds once whether computed as a
 * multiply and an add or as one FMA (the table of a chunk's 16 or 32 possible values below).
 * With AVX-512 the 4- and 5-bit formats look their values up in that table (vpermps), which
 * costs one instruction per 16 weights instead of a conversion and two arithmetic ones. */
#define NV (32 / VEC)

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
        const __m128i packed = k4_scales_then_mins(b + 4);
        _mm256_storeu_ps(s0 + sb * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(packed)), _mm256_set1_ps(d)));
        _mm256_storeu_ps(s1 + sb * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8))),
                                                    _mm256_set1_ps(dmin)));
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
#if VEC == 16
        float t[16];
        _mm512_storeu_ps(t, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc))),
                                          _mm512_set1_ps(d)));
        for (int s = 0; s < 8; s++) {
            s0[sb * 8 + s] = t[2 * s];
            s1[sb * 8 + s] = t[2 * s + 1];
        }
#else
        const __m128i q = _mm_loadu_si128((const __m128i *)sc);
        const __m256 lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_set1_ps(d)),   /* t[0..8) */
                     hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))),
                                        _mm256_set1_ps(d));                                                 /* t[8..16) */
        /* even and odd scales: per 128-bit lane [t0 t2 t8 t10 | t4 t6 t12 t14], then the 64-bit
         * pairs reordered to t0, t2, ..., t14 (odd: t1, t3, ..., t15) */
        const __m256 even = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)), odd = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
        _mm256_storeu_ps(s0 + sb * 8, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), _MM_SHUFFLE(3, 1, 2, 0))));
        _mm256_storeu_ps(s1 + sb * 8, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), _MM_SHUFFLE(3, 1, 2, 0))));
#endif
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
    /* All 32 values in byte lanes first (one 256-bit op serves 32 weights): h shifted so its
     * two bits sit at bits 4-5 of each byte (16-bit shifts of at most 4 never carry a byte's
     * wanted bits in from its neighbour), one bitwise select (vpternlogd) takes bits 0-3 from
     * the nibble and the rest from h, & 63, - 32; then 16 at a time sign-extended, converted
     * and scaled. (q - 32) * ds is exact in float32, as in block_q6_k. */
    const int shift = 4 - 2 * g;
    __m256i a = _mm256_loadu_si256((const __m256i *)ql), h = _mm256_loadu_si256((const __m256i *)qh);
    if (g >> 1) a = _mm256_srli_epi16(a, 4);
    h = shift >= 0 ? _mm256_slli_epi16(h, (unsigned)shift) : _mm256_srli_epi16(h, (unsigned)-shift);
#if defined(__AVX512VL__)
    const __m256i q6 = _mm256_and_si256(_mm256_ternarylogic_epi32(_mm256_set1_epi8(0x0F), a, h, 0xCA),
                                        _mm256_set1_epi8(63));   /* 0xCA: mask ? a : h, bit by bit */
#else
    const __m256i q6 = _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi8(0x0F)), _mm256_and_si256(h, _mm256_set1_epi8(0x30)));
#endif
    const __m256i q = _mm256_sub_epi8(q6, _mm256_set1_epi8(32));
    w[0] = from_m512(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))),
                                   _mm512_set1_ps(ds0)));
    w[1] = from_m512(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))),
                                   _mm512_set1_ps(ds1)));
#else
    for (int l = 0; l < 32; l += VEC) {
        const veci a = load_u8(ql + l), h = load_u8(qh + l);
        const veci q = ((g >> 1) ? a >> 4 : a & 0x0F) | (((h >> (2 * g)) & 3) << 4);
        w[l / VEC] = to_float(q - 32) * (l < 16 ? ds0 : ds1);
    }
#endif
}

#endif /* __F16C__ */

#endif /* SPECSERVE_QUANT_CHUNKS_H */
