/* The row-invariant matmul of float32 activations with weights in GGUF block formats.
 *
 * Included by quant_gemm.c (the matmul and embedding entry points) and quant_layer.c (a decoder
 * layer's row-wise work in one call). A weight is [out, row_bytes] uint8: each row is
 * in / qblock_elems(qtype) GGUF blocks, as in the file; qtype is ggml's type id.
 *
 * Holds quant_gemm_team, the one matmul entry point: the float32 path (few rows: fused_<fmt>,
 * weights unpacked 32 values at a time into registers; more rows: whole rows unpacked by
 * dequantize_row into scratch and multiplied by gemm_core.h's gemm_rows), and the dispatch, by
 * flags in qtype, to the int8-activation kernel (q8_act.h) and the AMX tile kernels
 * (amx_tiles.h, amx_int8.h).
 *
 * Values: the blocks are unpacked to exactly the values ggml's own dequantize_row_* gives
 * (quant_unpack.h, quant_chunks.h), then multiplied by gemm_core.h's row-invariant float32
 * core. So every out[r, j] is the same sequence of operations whatever the row count or the
 * thread count, exactly as in fp16_gemm.c: greedy speculative output stays bit for bit the
 * plain output. Build with -ffp-contract=off.
 *
 * Includes everything it uses, at the top (the top of the GGUF kernels' headers): gemm_core.h,
 * ggml_blocks.h, quant_unpack.h, quant_chunks.h, q8_act.h, amx_tiles.h, amx_int8.h.
 */
#ifndef SPECSERVE_QUANT_BLOCKS_H
#define SPECSERVE_QUANT_BLOCKS_H

#include "gemm_core.h"
#include "ggml_blocks.h"
#include "quant_unpack.h"
#include "quant_chunks.h"   /* chunk_<fmt> and scales_<fmt>: 32 values into registers */
#include "q8_act.h"
#include "amx_tiles.h"
#include "amx_int8.h"

#if defined(__F16C__)

/* How many of a 4-output block's outputs one pass of the fused path computes, by row count R:
 * its R x J accumulators, the unpacking's temporaries (about 4 vectors) and a row's vector must
 * fit the register file. AVX-512 (32 registers): J = 4 up to 6 rows. AVX2 (16): J = 2 up to 5
 * rows, J = 1 for 6 and 7; the block then takes 4 / J passes, each unpacking only its own
 * outputs' weights, so the unpacking work does not grow. More rows go through dequantized scratch
 * rows (gemm_rows). Measured on a Zen 2 VM, Qwen2.5-Coder-1.5B, ms a forward by row count
 * (1 row: 137): fused 4 rows 206, 6 rows 259, 7 rows 296, 8 rows 339; through scratch rows of 2 a
 * tile 6 rows 277, 7 rows 351, 8 rows 322 (of 3 a tile, 4 rows 318); J = 2 at 6 rows and J = 1 at
 * 12 spilled registers (296 and 669 ms). */
#if R_MAX > 5
#define FUSED_ROWS_MAX 6
#define FUSED_J(R) 4
#else
#define FUSED_ROWS_MAX 7
#define FUSED_J(R) ((R) <= 5 ? 2 : 1)
#endif

/* R rows x J outputs (J = 4, 2 or 1), weights dequantized 32 values at a time into registers
 * and used by all R rows: for each (row, output) the sum runs over the VEC-lane vectors in order,
 * one FMA each, then the fixed lane tree (lanes_sum4 or lanes_sum: the same additions) and the
 * bias, exactly as gemm_block does over a dequantized scratch row. So an output's bits do not
 * depend on R or J. sc: scratch for the prepass, 8 * ceil16(in / 32) floats. */
#define DEFINE_FUSED(fmt)                                                                              \
    static inline __attribute__((always_inline)) void fused_##fmt(                                  \
        const float *x, int64_t ldx, const uint8_t *w0, int64_t row_bytes, int64_t in,                \
        const float *bias, float *out, int64_t ldo, float *sc, const int R, const int J) {            \
        const int64_t nc = in / 32, stride = (nc + 15) / 16 * 16;                                      \
        for (int j = 0; j < J; j++)                                                                    \
            scales_##fmt(w0 + j * row_bytes, nc, sc + (2 * j) * stride, sc + (2 * j + 1) * stride);    \
        vecf acc[FUSED_ROWS_MAX][4];                                                                   \
        for (int r = 0; r < R; r++)                                                                    \
            for (int j = 0; j < J; j++) acc[r][j] = (vecf){0};                                         \
        /* a later block's rows (about 4 KB ahead, rows lie one after another) are fetched at the   \
         * pace these are used, a few lines per chunk: they are in cache for its prepass */          \
        const int64_t ahead = (4096 + 4 * row_bytes - 1) / (4 * row_bytes);                            \
        const uint8_t *next = w0 + ahead * 4 * row_bytes;                                              \
        const int64_t pf_step = (J * row_bytes + nc - 1) / nc;                                         \
        for (int64_t c = 0; c < nc; c++) {                                                             \
            vecf wv[4][NV];                                                                            \
            for (int64_t p = c * pf_step; p < (c + 1) * pf_step; p += 64)                              \
                prefetch_l1(next + p);                                                                 \
            for (int j = 0; j < J; j++)                                                                \
                chunk_##fmt(w0 + j * row_bytes, c, sc[(2 * j) * stride + c], sc[(2 * j + 1) * stride + c], \
                            wv[j]);                                                                    \
            if (J == 4) { /* 32 registers: rows outside, the 4 outputs' vectors reread */              \
                for (int r = 0; r < R; r++)                                                            \
                    for (int v = 0; v < NV; v++) {                                                     \
                        const vecf xv = in_register(load_f32(x + r * ldx + c * 32 + v * VEC));         \
                        for (int j = 0; j < 4; j++) acc[r][j] = fma_vec(xv, wv[j][v], acc[r][j]);     \
                    }                                                                                  \
            } else { /* the J outputs' vectors held in registers while every row passes */             \
                for (int v = 0; v < NV; v++) {                                                         \
                    vecf wr[2];                                                                        \
                    for (int j = 0; j < J; j++) wr[j] = in_register(wv[j][v]);                         \
                    for (int r = 0; r < R; r++) {                                                      \
                        const vecf xv = in_register(load_f32(x + r * ldx + c * 32 + v * VEC));         \
                        for (int j = 0; j < J; j++) acc[r][j] = fma_vec(xv, wr[j], acc[r][j]);        \
                    }                                                                                  \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++) {                                                                  \
            if (J == 4) {                                                                              \
                lanes_sum4(acc[r], out + r * ldo, bias);                                               \
                continue;                                                                              \
            }                                                                                          \
            for (int j = 0; j < J; j++) {                                                              \
                const float s = lanes_sum(acc[r][j]);                                                  \
                out[r * ldo + j] = bias ? s + bias[j] : s;                                             \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    /* rows (1 .. FUSED_ROWS_MAX) x 4 outputs, in 4 / FUSED_J(rows) passes */                        \
    static void fused_rows_##fmt(const float *x, int64_t ldx, int64_t rows, const uint8_t *w0,       \
                                 int64_t row_bytes, int64_t in, const float *bias, float *out,         \
                                 int64_t ldo, float *sc) {                                             \
        switch (rows) {                                                                                \
        FUSED_CASES(fmt)                                                                               \
        default: break;                                                                                \
        }                                                                                              \
    }

/* One row count's passes (R and J constants, so each case compiles to its own loops). */
#define FUSED_CASE(fmt, R)                                                                             \
    case R:                                                                                            \
        for (int h = 0; h < 4; h += FUSED_J(R))                                                        \
            fused_##fmt(x, ldx, w0 + h * row_bytes, row_bytes, in, bias ? bias + h : NULL, out + h, ldo, sc, R, \
                        FUSED_J(R));                                                                   \
        break;
#if FUSED_ROWS_MAX > 6
#define FUSED_CASE_7(fmt) FUSED_CASE(fmt, 7)
#else
#define FUSED_CASE_7(fmt)
#endif
#define FUSED_CASES(fmt)                                                                               \
    FUSED_CASE(fmt, 1) FUSED_CASE(fmt, 2) FUSED_CASE(fmt, 3) FUSED_CASE(fmt, 4) FUSED_CASE(fmt, 5)     \
    FUSED_CASE(fmt, 6) FUSED_CASE_7(fmt)

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
 * tile; few rows (<= FUSED_ROWS_MAX) dequantize straight into registers instead. Each output is computed
 * whole by one thread. Returns 0; -1 for an unknown qtype or an in that is not a whole number of
 * blocks; -3 when scratch memory could not be allocated (out is then incomplete). Every thread
 * returns the same status for the same arguments except -3, which the caller reduces. */
#define ROW_TILE 48

/* ... qtype | Q8_ACT_FLAG: int8 activations (q8_act.h) where this CPU and the format allow,
 * else the float32 path (with Q8_PIECES_SHIFT's bits: the row as that many int8 pieces);
 * qtype | AMX_PACKED_FLAG: w is amx_pack's packing (amx_tiles.h), with AMX_I8_FLAG multiplied
 * on int8 tiles (amx_int8.h), each activation row as Q8_PIECES_SHIFT's count of int8 pieces. */
static int quant_gemm_team(const float *x, int64_t ldx, int64_t rows, const uint8_t *w, int qtype,
                           int64_t out_features, int64_t in, const float *bias, float *out, int64_t ldo) {
    if (qtype & AMX_PACKED_FLAG) {   /* packed by amx_pack: only that kernel reads these bytes */
#ifdef HAVE_AMX
#ifndef HAVE_AMX_I8
        if (qtype & AMX_I8_FLAG) return -1;
#endif
        /* Rows in chunks (amx_row_chunk), every chunk through every output group before the next.
         * Every thread runs every chunk, whatever its status, so all meet each chunk's omp for. */
        const int64_t chunk = amx_row_chunk(in);
        int status = 0;
        for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
            const int64_t n = rows - r0 < chunk ? rows - r0 : chunk;
            int s;
#ifdef HAVE_AMX_I8
            if (qtype & AMX_I8_FLAG)
                s = amx_i8_gemm_team(x + r0 * ldx, ldx, n, w, qtype & ~(AMX_PACKED_FLAG | AMX_I8_FLAG | Q8_PIECES_MASK),
                                     q8_pieces_of(qtype), out_features, in, bias,
                                     out + r0 * ldo, ldo);
            else
#endif
                s = amx_gemm_team(x + r0 * ldx, ldx, n, w, qtype & ~AMX_PACKED_FLAG, out_features, in, bias,
                                  out + r0 * ldo, ldo);
            if (s) status = s;
        }
        return status;
#else
        return -1;
#endif
    }
    if (qtype & Q8_ACT_FLAG) {
        const int pieces = q8_pieces_of(qtype);
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
        if (nj == 4 && rows <= FUSED_ROWS_MAX) {
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
