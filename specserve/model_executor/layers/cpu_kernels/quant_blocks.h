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

#include "quant_chunks.h"   /* chunk_<fmt> and scales_<fmt>: 32 values into registers */

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
        /* a later block's 4 rows (about 4 KB ahead, rows lie one after another) are fetched at     \
         * the pace these are used, a few lines per chunk: they are in cache for its prepass */      \
        const int64_t ahead = (4096 + 4 * row_bytes - 1) / (4 * row_bytes);                            \
        const uint8_t *next = w0 + ahead * 4 * row_bytes;                                              \
        const int64_t pf_step = (4 * row_bytes + nc - 1) / nc;                                         \
        for (int64_t c = 0; c < nc; c++) {                                                             \
            vecf wv[4][NV];                                                                            \
            for (int64_t p = c * pf_step; p < (c + 1) * pf_step; p += 64)                              \
                prefetch_l1(next + p);                                                                 \
            for (int j = 0; j < 4; j++)                                                                \
                chunk_##fmt(w0 + j * row_bytes, c, sc[(2 * j) * stride + c], sc[(2 * j + 1) * stride + c], \
                            wv[j]);                                                                    \
            for (int r = 0; r < R; r++)                                                                \
                for (int v = 0; v < NV; v++) {                                                         \
                    const vecf xv = in_register(load_f32(x + r * ldx + c * 32 + v * VEC));             \
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
#include "amx_tiles.h"
#include "amx_int8.h"

/* ... qtype | Q8_ACT_FLAG: int8 activations (q8_act.h) where this CPU and the format allow,
 * else the float32 path (with Q8_PIECES_SHIFT's bits: the row as that many int8 pieces);
 * qtype | AMX_PACKED_FLAG: w is amx_pack's packing (amx_tiles.h), with AMX_I8_FLAG multiplied
 * on int8 tiles (amx_int8.h). */
static int quant_gemm_team(const float *x, int64_t ldx, int64_t rows, const uint8_t *w, int qtype,
                           int64_t out_features, int64_t in, const float *bias, float *out, int64_t ldo) {
    if (qtype & AMX_PACKED_FLAG) {   /* packed by amx_pack: only that kernel reads these bytes */
#ifdef HAVE_AMX
        if (qtype & AMX_I8_FLAG) {
#ifdef HAVE_AMX_I8
            return amx_i8_gemm_team(x, ldx, rows, w, qtype & ~(AMX_PACKED_FLAG | AMX_I8_FLAG), out_features, in, bias,
                                    out, ldo);
#else
            return -1;
#endif
        }
        return amx_gemm_team(x, ldx, rows, w, qtype & ~AMX_PACKED_FLAG, out_features, in, bias, out, ldo);
#else
        return -1;
#endif
    }
    if (qtype & Q8_ACT_FLAG) {
        const int pieces = ((qtype & Q8_PIECES_MASK) >> Q8_PIECES_SHIFT) + 1;
        qtype &= ~(Q8_ACT_FLAG | Q8_PIECES_MASK);
#ifdef HAVE_Q8_ACT
        if (q8_act_supported(qtype, in))
            return q8_gemm_team(x, ldx, rows, w, qtype, out_features, in, bias, out, ldo, pieces);
#else
        (void)pieces;
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
#pragma omp for schedule(dynamic, work_chunk(blocks))
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
