/* GGUF blocks unpacked whole: one block -> its float32 values, exactly ggml's dequantize_row_*.
 *
 * Holds the integer lane helpers over VEC lanes (veci, load_u8, load_i8, to_float, fifth_bits,
 * ...), block_<fmt> for every format, dequantize_row (a weight row) and quant_dequantize (the
 * embedding lookup of a quantized table). Every product of a block scale and a quant is exact
 * in float32, and the one final addition of Q4_1, Q5_1, Q4_K and Q5_K is rounded as ggml rounds
 * it, so the values are ggml's own. Build with -ffp-contract=off.
 *
 * Includes gemm_core.h (VEC, vecf) and ggml_blocks.h (the formats and their field readers).
 * Included by quant_chunks.h (which reuses the lane helpers) and quant_blocks.h (the matmul).
 */
#ifndef SPECSERVE_QUANT_UNPACK_H
#define SPECSERVE_QUANT_UNPACK_H

#include "gemm_core.h"
#include "ggml_blocks.h"

#if defined(__F16C__)

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

#endif /* __F16C__ */

#endif /* SPECSERVE_QUANT_UNPACK_H */
