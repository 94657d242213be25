/* Row-invariant matmul of float32 activations with float16 weights, for CPUs with F16C.
 *
 * Called from specserve/model_executor/layers/fp16_gemm.py through ctypes:
 *     out[r, j] = sum_k x[r, k] * w[j, k]   (+ bias[j])
 *   x    [rows, in]  float32, row stride ldx (the last dimension contiguous)
 *   w    [out, in]   float16 bits, contiguous (the layer's weight as stored)
 *   bias [out]       float32, or NULL
 *   out  [rows, out] float32, row stride ldo
 *
 * Why not fbgemm: fbgemm runs a call's rows through 1-, 2- and 3-6-row kernels that
 * sum in different orders, so a row's last bits depended on how many rows shared its
 * call, and greedy speculative output could differ from plain output at a near-tie.
 * Here every out[r, j] is the same sequence of operations whatever the row count,
 * the thread count or the block a row lands in: VEC float32 lanes accumulate
 * x[r, k:k+VEC] * w[j, k:k+VEC] over k in order, one FMA each, then the lanes are
 * added in a fixed tree, then the bias. The blocks below only decide how many such
 * sums run at once (a weight vector converted once for up to R_MAX rows, an activation
 * vector loaded once for 4 outputs); they never change a sum. Built with
 * -ffp-contract=off so the compiler fuses nothing on its own.
 *
 * Speed: a decode step is bound by streaming the weights from memory, so the weights
 * are prefetched ahead of their use (into L1 and, farther ahead, into L2). Calls with
 * many rows (more than 4 row blocks) are compute-bound: they convert each 4-output weight
 * block to float32 once (exact) and reuse it for every row.
 *
 * VEC is 16 with AVX-512, else 8: the sums, and so the bits, are those of this build on
 * this CPU. in must be a multiple of VEC (specserve_fp16_gemm_vector_width); the Python
 * side falls back to fbgemm otherwise.
 */
#include "gemm_core.h"

int specserve_fp16_gemm_vector_width(void) {
#if defined(__F16C__)
    return VEC;
#else
    return 0; /* not built: the Python side uses fbgemm */
#endif
}

#if defined(__F16C__)

/* Rows are taken ROW_TILE at a time so a tile's activations stay in cache while every
 * weight block passes over them; within a tile the 4-output blocks are shared out over
 * the threads, each output computed whole by one thread. Returns 0; -1 when in is not a
 * multiple of VEC; -3 when scratch memory could not be allocated (out is then incomplete). */
#define ROW_TILE 48

int specserve_fp16_gemm(const float *x, int64_t ldx, int64_t rows, const uint16_t *w, int64_t out_features,
                        int64_t in, const float *bias, float *out, int64_t ldo, int num_threads) {
    if (in % VEC != 0) return -1;
    const int64_t blocks = (out_features + 3) / 4;
    if (num_threads > blocks) num_threads = (int)blocks;
    if (num_threads < 1) num_threads = 1;
    /* Up to 4 row blocks read a weight block straight from float16 (it stays in L1 between
     * them); more share one float32 copy. Converting already at 2 blocks made 7-12 rows
     * 1.1-1.4x slower (whole model, AVX-512: 18.0 against 13.1 ms at 7 rows). */
    const int convert = rows > 4 * R_MAX;
    int status = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : status)
    {
        float *wf = convert ? malloc((size_t)(4 * in) * sizeof(float)) : NULL;
        const int ok = !convert || wf != NULL;
        if (!ok) status = -3;
        for (int64_t row0 = 0; row0 < rows; row0 += ROW_TILE) {
            const int64_t row1 = row0 + ROW_TILE < rows ? row0 + ROW_TILE : rows;
#pragma omp for schedule(dynamic, work_chunk(blocks))
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t j = b * 4;
                const uint16_t *wj = w + j * in;
                const float *bj = bias ? bias + j : NULL;
                if (!ok) continue;
                if (j + 4 > out_features) { /* the last outputs, one at a time */
                    for (int64_t jj = j; jj < out_features; jj++)
                        gemm_rows(x, ldx, row0, row1, w + jj * in, NULL, in, bias ? bias + jj : NULL, out + jj, ldo, 1, 1);
                } else if (convert) {
                    for (int64_t i = 0; i < 4 * in; i += VEC) {
                        _mm_prefetch((const char *)(wj + i + PREFETCH_L1), _MM_HINT_T0);
                        _mm_prefetch((const char *)(wj + i + PREFETCH_L2), _MM_HINT_T1);
                        const vecf v = load_f16(wj + i);
                        memcpy(wf + i, &v, sizeof v);
                    }
                    gemm_rows(x, ldx, row0, row1, NULL, wf, in, bj, out + j, ldo, 4, 0);
                } else {
                    gemm_rows(x, ldx, row0, row1, wj, NULL, in, bj, out + j, ldo, 4, 1);
                }
            }
        }
        free(wf);
    }
    return status;
}

#else /* no F16C */

int specserve_fp16_gemm(const float *x, int64_t ldx, int64_t rows, const uint16_t *w, int64_t out_features,
                        int64_t in, const float *bias, float *out, int64_t ldo, int num_threads) {
    (void)x, (void)ldx, (void)rows, (void)w, (void)out_features, (void)in, (void)bias, (void)out, (void)ldo,
        (void)num_threads;
    return -2;
}

#endif
