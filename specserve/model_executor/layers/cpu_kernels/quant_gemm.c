/* Row-invariant matmul of float32 activations with weights kept in GGUF's block formats.
 *
 * Called from specserve/model_executor/layers/quant_gemm.py through ctypes:
 *     out[r, j] = sum_k x[r, k] * w[j, k]   (+ bias[j])
 *   x    [rows, in]  float32, row stride ldx (the last dimension contiguous)
 *   w    [out, row_bytes] uint8: each row is in / block_elems(qtype) GGUF blocks, as in the file
 *   bias [out]       float32, or NULL
 *   out  [rows, out] float32, row stride ldo
 *
 * Why: a batch-1 decode step streams every weight once, so its cost follows the bytes per
 * weight; GGUF's formats hold 4.5-8.5 bits a weight where float16 holds 16. How the blocks are
 * unpacked is in quant_unpack.h and quant_chunks.h, why the results are row-invariant in
 * quant_blocks.h (the matmul, which includes the other kernels' headers).
 *
 * qtype is ggml's type id (GGML_TYPE_Q4_0 = 2, ...); formats this file does not know give
 * specserve_quant_block_elems(qtype) == 0 and the Python side dequantizes them at load.
 */
#include "quant_blocks.h"  /* quant_gemm_team, and first: it includes the headers below in its order */
#include "gemm_core.h"     /* VEC */
#include "ggml_blocks.h"   /* qblock_elems, qblock_bytes */
#include "quant_unpack.h"  /* quant_dequantize */
#include "q8_act.h"        /* q8_act_supported */
#include "amx_tiles.h"     /* amx_packs, amx_bf16_takes, amx_pack, amx_packed_row_bytes, amx_dequantize */
#include "amx_int8.h"      /* HAVE_AMX_I8, AMX_I8_FLAG */

int specserve_quant_block_elems(int qtype) { return qblock_elems(qtype); }

int specserve_quant_block_bytes(int qtype) { return qblock_bytes(qtype); }

/* 1 when qtype | Q8_ACT_FLAG (int8 activations, q8_act.h) runs that kernel for rows of in values. */
int specserve_quant_int8_supported(int qtype, int64_t in) {
#if defined(__F16C__) && defined(HAVE_Q8_ACT)
    return q8_act_supported(qtype, in);
#else
    (void)qtype, (void)in;
    return 0;
#endif
}

/* AMX tiles (amx_tiles.h): 1 when this build, CPU and OS multiply a [out, in] matrix of qtype on
 * them with float32 activations (the matrix packed by specserve_quant_amx_pack into out / 16 rows
 * of specserve_quant_amx_row_bytes each; on bfloat16 tiles, or on int8 tiles where
 * specserve_quant_amx_float_on_int8 says so). */
int specserve_quant_amx_supported(int qtype, int64_t out, int64_t in) {
#if defined(__F16C__) && defined(HAVE_AMX)
#ifdef HAVE_AMX_I8
    return amx_packs(qtype, out, in);
#else
    return amx_packs(qtype, out, in) && amx_bf16_takes(qtype);
#endif
#else
    (void)qtype, (void)out, (void)in;
    return 0;
#endif
}

/* 1 when this build also multiplies the matrices specserve_quant_amx_supported takes on AMX int8
 * tiles (qtype | AMX_PACKED_FLAG | AMX_I8_FLAG: amx_int8.h). */
int specserve_quant_amx_int8_built(void) {
#if defined(__F16C__) && defined(HAVE_AMX_I8)
    return 1;
#else
    return 0;
#endif
}

/* 1 when float32 activations of qtype go to int8 tiles as three int8 pieces (amx_bf16_takes: Q8_0). */
int specserve_quant_amx_float_on_int8(int qtype) {
#if defined(__F16C__) && defined(HAVE_AMX)
    return !amx_bf16_takes(qtype);
#else
    (void)qtype;
    return 0;
#endif
}

int64_t specserve_quant_amx_row_bytes(int qtype, int64_t in) {
#if defined(__F16C__) && defined(HAVE_AMX)
    return amx_packed_row_bytes(qtype, in);
#else
    (void)qtype, (void)in;
    return 0;
#endif
}

/* w [out, file row bytes] -> dst [out / 16, amx row bytes]. Returns 0, or -1 when unsupported. */
int specserve_quant_amx_pack(const uint8_t *w, int qtype, int64_t out, int64_t in, uint8_t *dst, int num_threads) {
#if defined(__F16C__) && defined(HAVE_AMX)
    if (!amx_packs(qtype, out, in)) return -1;
    amx_pack(w, qtype, out, in, dst, num_threads < 1 ? 1 : num_threads);
    return 0;
#else
    (void)w, (void)qtype, (void)out, (void)in, (void)dst, (void)num_threads;
    return -1;
#endif
}

int specserve_quant_vector_width(void) {
#if defined(__F16C__)
    return VEC;
#else
    return 0; /* not built: the Python side dequantizes to float16 at load */
#endif
}

#if defined(__F16C__)

/* Rows ids[0..n) of w -> out [n, in] float32 (the embedding lookup of a quantized table).
 * Returns 0, or -1 for an unknown qtype or an in that is not a whole number of blocks. */
int specserve_quant_dequantize(const uint8_t *w, int qtype, const int64_t *ids, int64_t n, int64_t in,
                               float *out, int num_threads) {
    if (qtype & AMX_PACKED_FLAG) {
#ifdef HAVE_AMX
        amx_dequantize(w, qtype & ~(AMX_PACKED_FLAG | AMX_I8_FLAG | Q8_PIECES_MASK), ids, n, in, out);
        return 0;
#else
        return -1;
#endif
    }
    return quant_dequantize(w, qtype, ids, n, in, out, num_threads);
}

int specserve_quant_gemm(const float *x, int64_t ldx, int64_t rows, const uint8_t *w, int qtype,
                         int64_t out_features, int64_t in, const float *bias, float *out, int64_t ldo,
                         int num_threads) {
    const int64_t blocks = (out_features + 3) / 4;
    if (num_threads > blocks) num_threads = (int)blocks;
    if (num_threads < 1) num_threads = 1;
    int status = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : status)
    status |= quant_gemm_team(x, ldx, rows, w, qtype, out_features, in, bias, out, ldo);
    return status;
}

#else /* no F16C */

int specserve_quant_dequantize(const uint8_t *w, int qtype, const int64_t *ids, int64_t n, int64_t in,
                               float *out, int num_threads) {
    (void)w, (void)qtype, (void)ids, (void)n, (void)in, (void)out, (void)num_threads;
    return -2;
}

int specserve_quant_gemm(const float *x, int64_t ldx, int64_t rows, const uint8_t *w, int qtype,
                         int64_t out_features, int64_t in, const float *bias, float *out, int64_t ldo,
                         int num_threads) {
    (void)x, (void)ldx, (void)rows, (void)w, (void)qtype, (void)out_features, (void)in, (void)bias, (void)out,
        (void)ldo, (void)num_threads;
    return -2;
}

#endif
