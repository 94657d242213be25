/* What the int8-activation kernels share, whatever the instruction set: the flags on the type id,
 * the quantized activations' arrays (q8_acts) and the matmul's driver (q8_gemm_run), which
 * quantizes a tile of rows (in pieces) and hands it to the instruction set's tiles.
 *
 * Included by q8_act.h (AVX-512 VNNI) and q8_act_avx2.h (AVX2), which each define
 * q8_act_supported and q8_gemm_team on top of it. Includes gemm_core.h (work_chunk) and
 * ggml_blocks.h (the formats' block sizes).
 */
#ifndef SPECSERVE_Q8_ACTS_H
#define SPECSERVE_Q8_ACTS_H

#include "gemm_core.h"
#include "ggml_blocks.h"

#define Q8_ACT_FLAG 256
/* qtype | Q8_ACT_FLAG | ((P - 1) << Q8_PIECES_SHIFT): each activation row is multiplied as P
 * int8 rows ("pieces") whose sum is the row to about 8 P bits of each 256-value group's largest
 * value: piece 0 is the row rounded (per 256 values dx = max|x| / 127, xq = round(x / dx)),
 * piece p + 1 the same rounding of what pieces 0..p left over, and the P results are summed per
 * output (q8_gemm_run). P = 1 is llama.cpp's
 * rounding; P = 3 leaves less than 2^-24 of the group's largest value, float32's own precision
 * (docs/architecture.md, "Numerics"). */
#define Q8_PIECES_SHIFT 10
#define Q8_PIECES_MASK (3 << Q8_PIECES_SHIFT)
#define Q8_MAX_PIECES 4
/* The piece count a type id carries (the VNNI kernel's Q8_ACT_FLAG and the AMX int8 tiles' flag alike). */
static inline int q8_pieces_of(int qtype) { return ((qtype & Q8_PIECES_MASK) >> Q8_PIECES_SHIFT) + 1; }
/* ---- activations: rows x in values -> per row, scaled per group of 256 values (the last group
 * may be shorter) ---- */
typedef struct {
    const int8_t *xq;    /* [rows][in] the rounded values */
    const float *xd;     /* [rows][ngroups] each group's dx */
    const int32_t *xl;   /* [rows][in / 4] each vpdpbusd lane's xq sum (4 values; q8_act.h only) */
    const float *xm;     /* [rows][ngroups][16] lanes 8-15 the xq sums of the group's 32-value blocks, 0-7 zero */
    const int32_t *xs;   /* [rows][ngroups][16] the xq sums of the group's 16-value blocks (q8_act.h only) */
} q8_acts;

static inline q8_acts q8_acts_row(const q8_acts *a, int64_t r, int64_t in) {   /* the same arrays from row r on */
    const int64_t ngroups = (in + 255) / 256;
    const q8_acts out = {a->xq + r * in, a->xd + r * ngroups, a->xl + r * (in / 4), a->xm + r * 16 * ngroups,
                         a->xs + r * 16 * ngroups};
    return out;
}

/* R rows x J outputs of one format: the instruction set's tiles. */
typedef void (*q8_rows_fn)(const uint8_t *, int64_t, int64_t, const q8_acts *, const float *, float *, int64_t,
                           int64_t, int);
/* One row of in values -> its xq, xd, xl, xm and xs (the instruction set's kernel fills what its
 * tiles read); with k4_order, Q4_K's order; with resid, what the rounding left over (x - dx xq). */
typedef void (*q8_quantize_fn)(const float *x, int64_t in, int8_t *xq, float *xd, int32_t *xl, float *xm, int32_t *xs,
                               int k4_order, float *resid);

/* A thread's scratch: a row tile's quantized activations. */
static __thread uint8_t *q8_scratch;
static __thread int64_t q8_scratch_len;

static uint8_t *q8_scratch_for(int64_t len) {
    if (len > q8_scratch_len) {
        free(q8_scratch);
        q8_scratch = (uint8_t *)malloc((size_t)len);
        q8_scratch_len = q8_scratch ? len : 0;
    }
    return q8_scratch;
}

#define Q8_ROW_TILE 64

/* out = x @ w.T (+ bias) with int8 activations, called by every thread of a parallel region
 * (as quant_gemm_team), with an instruction set's row quantizer and tiles. Every thread
 * quantizes the row tile itself (rows x in values: small against the matmul), so no thread waits
 * for another. With pieces P > 1 every row becomes P quantized rows (Q8_PIECES_SHIFT); the tiles
 * multiply them like any rows, and each output is the sum of its P results, smallest first, then
 * the bias. Returns 0, or -3 without scratch memory. */
static int q8_gemm_run(const float *x, int64_t ldx, int64_t rows, const uint8_t *w, int qtype, int64_t out_features,
                       int64_t in, const float *bias, float *out, int64_t ldo, int pieces, q8_quantize_fn quantize,
                       q8_rows_fn run) {
    const int64_t row_bytes = in / qblock_elems(qtype) * qblock_bytes(qtype);
    const int64_t blocks = (out_features + 3) / 4, tile = rows < Q8_ROW_TILE ? rows : Q8_ROW_TILE;
    const int64_t ngroups = (in + 255) / 256, qrows = tile * pieces;
    /* per quantized row: xq (in bytes), xl (in / 4 int32), xd (ngroups floats), xm and xs (16
     * ngroups each); then one row of residuals (in floats) when pieces > 1 */
    uint8_t *buf = q8_scratch_for(qrows * (2 * in + 33 * 4 * ngroups) + (pieces > 1 ? 4 * in : 0) + 64);
    const int ok = buf != NULL;
    int8_t *xq = (int8_t *)buf;
    int32_t *xl = (int32_t *)(buf + qrows * in);
    float *xd = (float *)(xl + qrows * (in / 4)), *xm = xd + qrows * ngroups;
    int32_t *xs = (int32_t *)(xm + qrows * 16 * ngroups);
    float *resid = (float *)(xs + qrows * 16 * ngroups);
    const q8_acts acts = {xq, xd, xl, xm, xs};
    for (int64_t row0 = 0; row0 < rows; row0 += Q8_ROW_TILE) {
        const int64_t n = rows - row0 < Q8_ROW_TILE ? rows - row0 : Q8_ROW_TILE;
        if (ok)
            for (int64_t r = 0; r < n * pieces; r++) {
                const int last = r % pieces == pieces - 1;
                const float *src = r % pieces ? resid : x + (row0 + r / pieces) * ldx;
                quantize(src, in, xq + r * in, xd + r * ngroups, xl + r * (in / 4), xm + r * 16 * ngroups,
                                xs + r * 16 * ngroups, qtype == Q4_K, last ? NULL : resid);
            }
#pragma omp for schedule(dynamic, work_chunk(blocks))
        for (int64_t b = 0; b < blocks; b++) {
            if (!ok) continue;
            const int64_t j = b * 4;
            const int nj = j + 4 <= out_features ? 4 : (int)(out_features - j);
            if (pieces == 1) {
                run(w + j * row_bytes, row_bytes, in, &acts, bias ? bias + j : NULL, out + row0 * ldo + j, ldo, n, nj);
                continue;
            }
            float part[Q8_ROW_TILE * Q8_MAX_PIECES * 4];   /* [n * pieces][4] */
            run(w + j * row_bytes, row_bytes, in, &acts, NULL, part, 4, n * pieces, nj);
            for (int64_t r = 0; r < n; r++)
                for (int jj = 0; jj < nj; jj++) {
                    const float *p = part + r * pieces * 4 + jj;
                    float v = p[4 * (pieces - 1)];
                    for (int k = pieces - 2; k >= 0; k--) v += p[4 * k];
                    if (bias) v += bias[j + jj];
                    out[(row0 + r) * ldo + j + jj] = v;
                }
        }
    }
    return ok ? 0 : -3;
}

#endif /* SPECSERVE_Q8_ACTS_H */
