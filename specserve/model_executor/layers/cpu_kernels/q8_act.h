/* The int8-activation matmul over GGUF blocks (AVX-512 VNNI; q8_act_avx2.h for AVX2): an opt-in kernel for CPUs.
 *
 * Included by quant_blocks.h (and quant_gemm.c); quant_gemm_team() calls q8_gemm_team() when the
 * caller sets Q8_ACT_FLAG in qtype (QuantizedMatrix.int8_activations) and this file knows the
 * format. Includes gemm_core.h (work_chunk, KEEP_IN_REGISTER, prefetch_l2), ggml_blocks.h (the
 * formats, half_at, k4_scales_then_mins), q8_acts.h (the flags, the activations' arrays, the
 * driver q8_gemm_run) and q8_act_avx2.h (the kernel for CPUs with AVX2 but not AVX-512 VNNI).
 *
 * Why: with float32 activations every weight costs a table look-up or a conversion plus one
 * FMA per row, so batch-1 decoding is bound by arithmetic (~10 Gweights/s a core), not by the
 * bytes streamed. llama.cpp quantizes activations to 8 bits and multiplies bytes with VNNI's
 * vpdpbusd (64 products a instruction); this file does the same, in specserve's own layout:
 *
 *   x row      -> per 256 values: dx = max|x| / 127, xq = round(x / dx) (int8): x is read as
 *                 xhat = dx * xq (llama.cpp's q8_K grouping)
 *   weight row -> per value: u, the unsigned quant byte as stored (0..15, 0..31, 0..63, or the
 *                 int8 quant + 128), with value = ws * (u - k) + min: ws per 16 or 32 values,
 *                 exactly ggml's dequantized value (ws and min computed as ggml computes them)
 *   out[r, j]  = sum over 64-value chunks of lanes(ws * dx * (u . xq - k * sum xq) + min * xhat)
 *              = dequantize(w[j]) . xhat[r], up to float32 rounding of the sums
 *
 * 32-value block formats (Q4_1, Q5_0, Q8_0, q8_tile): scales are read in groups of 256 values
 * into one 16-float vector per weight row, and each 64-value chunk takes its lanes' scales
 * from it with one permute (no scratch prepass). K-quants (Q4_K, Q6_K, q8k_tile): their
 * integer sub-block scales multiply the byte products in int32, and the float work comes once
 * per 256-value super-block, so extra rows (verifying k + 1 tokens) cost less each.
 *
 * The weights are the file's values; only the activations are rounded (to 8 bits per 256
 * values), as llama.cpp rounds them. Row-invariant like the float kernel: out[r, j] is the
 * same sequence of operations whatever the row count or the thread count, so greedy
 * speculative output stays bit for bit the plain output of the same kernel.
 */
#ifndef SPECSERVE_Q8_ACT_H
#define SPECSERVE_Q8_ACT_H

#include "gemm_core.h"
#include "ggml_blocks.h"
#include "q8_acts.h"
#include "q8_act_avx2.h"

/* Weight prefetch: into L2, the same position 16 rows (4 blocks of 4 outputs) ahead (at least
 * 1 KB). Short rows (the 1536-value rows of Qwen2.5-Coder-1.5B's
 * gate/up and LM head: 864 and 1260 bytes) are the case that needs it: prefetching within the
 * row only touched the rows being read; 16 rows ahead raised those matrices from ~14 to
 * ~20 GB/s streamed from memory (noisy machine; docs/benchmarks.md). */
#define Q8_PF_ROWS 16

#ifdef HAVE_Q8_ACT_AVX2   /* AVX2 without AVX-512 VNNI: q8_act_avx2.h's kernel */
#define HAVE_Q8_ACT 1
#endif

/* F16C: ggml_blocks.h's half_at (every AVX-512 CPU has it) */
#if defined(__F16C__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_Q8_ACT 1

static inline int q8_act_supported(int qtype, int64_t in) {
    switch (qtype) {
    case Q4_1: case Q5_0: case Q8_0: return in % 64 == 0;
    case Q4_K: case Q6_K: return in % 256 == 0;
    default: return 0;
    }
}

/* Q4_K's order of a 256-value group (q8k_tile): its 16 pieces of 16 values as a 4 x 4
 * transpose, piece p at place 4 (p % 4) + p / 4, so that 64 stored values are pieces a, a + 4,
 * a + 8, a + 12 (the same values of the sub-blocks 0/1, 2/3, 4/5, 6/7). */
static inline int64_t q8_k4_place(int64_t piece) { return 4 * (piece % 4) + piece / 4; }

/* One row; with k4_order (Q4_K) xq is stored in q8_k4_place's order (xl then follows it). With
 * resid (which may be x itself), resid = x - dx * xq, what the rounding left over, in x's order. */
static void q8_quantize_row(const float *x, int64_t in, int8_t *xq, float *xd, int32_t *xl, float *xm, int32_t *xs,
                            int k4_order, float *resid) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const int64_t ngroups = (in + 255) / 256;
    for (int64_t g = 0; g < ngroups; g++) {
        const int64_t v0 = 256 * g, v1 = v0 + 256 < in ? v0 + 256 : in;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t v = v0; v < v1; v += 16) amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, _mm512_loadu_ps(x + v)));
        const float m = _mm512_reduce_max_ps(amax);
        const float d = m / 127.0f, id = m > 0.0f ? 127.0f / m : 0.0f;
        float sums[16] = {0};
        int32_t sums16[16] = {0};
        for (int64_t v = v0; v < v1; v += 32) {
            const __m512 xa = _mm512_loadu_ps(x + v), xe = _mm512_loadu_ps(x + v + 16);
            const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(xa, _mm512_set1_ps(id)));
            const __m512i qe = _mm512_cvtps_epi32(_mm512_mul_ps(xe, _mm512_set1_ps(id)));
            if (resid) {   /* |x id| <= 127, so qa and qe are the stored bytes' values */
                _mm512_storeu_ps(resid + v, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qa), _mm512_set1_ps(d), xa));
                _mm512_storeu_ps(resid + v + 16, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qe), _mm512_set1_ps(d), xe));
            }
            const int64_t piece = (v - v0) / 16;
            const int64_t at_a = v0 + 16 * (k4_order ? q8_k4_place(piece) : piece);
            const int64_t at_e = v0 + 16 * (k4_order ? q8_k4_place(piece + 1) : piece + 1);
            _mm_storeu_si128((__m128i *)(xq + at_a), _mm512_cvtsepi32_epi8(qa));   /* round to nearest even */
            _mm_storeu_si128((__m128i *)(xq + at_e), _mm512_cvtsepi32_epi8(qe));
            sums16[(v - v0) / 16] = _mm512_reduce_add_epi32(qa);
            sums16[(v - v0) / 16 + 1] = _mm512_reduce_add_epi32(qe);
            sums[8 + (v - v0) / 32] = (float)(sums16[(v - v0) / 16] + sums16[(v - v0) / 16 + 1]);
        }
        for (int64_t v = v0; v < v1; v += 64) {
            const __m512i q = _mm512_loadu_si512((const void *)(xq + v));
            _mm512_storeu_si512((void *)(xl + v / 4), _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), q));
        }
        xd[g] = d;
        memcpy(xm + 16 * g, sums, sizeof sums);
        memcpy(xs + 16 * g, sums16, sizeof sums16);
    }
}

/* ---- weights: per group of 256 values, a vector of 16 floats with the group's scales (and
 * mins); each 64-value chunk then picks its 16 lanes' scales with one permute ---- */

/* Formats of 32-value blocks (Q4_1, Q5_0, Q8_0): lanes 0-7 the d of blocks 8 g .. 8 g + 7,
 * lanes 8-15 their m (Q4_1's min; 0 for the others); nb < 8 blocks in a last group. One
 * gather of each block's first 4 bytes (d, then m or the first quants) instead of 16 scalar
 * stores read back as a vector (a store-forwarding stall). */
static inline __m512 q8_group_32(const uint8_t *row, int bytes, int has_min, int64_t g, int nb) {
    const __m256i offsets = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bytes));
    const __mmask8 valid = nb >= 8 ? (__mmask8)0xff : (__mmask8)((1u << nb) - 1);
    const __m256i words = _mm256_mmask_i32gather_epi32(_mm256_setzero_si256(), valid, offsets,
                                                       (const void *)(row + 8 * g * bytes), 1);
    const __m512 halves = _mm512_cvtph_ps(words);   /* d0, m0, d1, m1, ... */
    const __m512i even_then_odd = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m512 v = _mm512_permutexvar_ps(even_then_odd, halves);
    return has_min ? v : _mm512_maskz_mov_ps((__mmask16)0x00ff, v);
}

static inline __m512i q8_nibbles_of_two_16(const uint8_t *a, const uint8_t *b) {
    /* 16 bytes of block a, 16 of block b -> a's low, a's high, b's low, b's high nibbles */
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)a))),
                                         _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)b)), 1);
    const __m512i shift = _mm512_set_epi64(0x0004000400040004LL, 0x0004000400040004LL, 0, 0,
                                           0x0004000400040004LL, 0x0004000400040004LL, 0, 0);
    return _mm512_and_si512(_mm512_srlv_epi16(v, shift), _mm512_set1_epi8(0x0f));
}

/* Values [64 c, 64 c + 64) of a row as unsigned bytes u, in order (Q4_K: q8k_tile unpacks its own order). */
static inline __attribute__((always_inline)) __m512i q8_chunk(const int qtype, const uint8_t *row, int64_t c) {
    switch (qtype) {
    case Q4_1: {
        const uint8_t *a = row + 2 * c * 20, *b = a + 20;
        return q8_nibbles_of_two_16(a + 4, b + 4);
    }
    case Q5_0: {
        const uint8_t *a = row + 2 * c * 22, *b = a + 22;
        uint32_t ha, hb;
        memcpy(&ha, a + 2, 4), memcpy(&hb, b + 2, 4);
        const __m512i nib = q8_nibbles_of_two_16(a + 6, b + 6);
        const __mmask64 fifth = (__mmask64)ha | ((__mmask64)hb << 32);   /* bit i: value i's fifth bit */
        return _mm512_mask_add_epi8(nib, fifth, nib, _mm512_set1_epi8(16));
    }
    case Q8_0: {
        const uint8_t *a = row + 2 * c * 34, *b = a + 34;
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a + 2))),
                                             _mm256_loadu_si256((const __m256i *)(b + 2)), 1);
        return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));        /* int8 q -> q + 128 */
    }
    case Q6_K: {
        /* chunk p of half n: values 128 n + 64 p + [0, 64): low (p = 0) or high nibbles of
         * ql[64 n, 64 n + 64), with two bits of qh[32 n + l] (shifts 0, 2 or 4, 6) above them */
        const uint8_t *blk = row + (c / 4) * 210;
        const int n = (int)(c % 4) / 2, p = (int)(c % 2);
        const __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * n));
        const __m512i lo = p ? _mm512_srli_epi16(ql, 4) : ql;
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n)));
        const __m512i shift = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)(4 * p))),
                                                 _mm256_set1_epi16((short)(4 * p + 2)), 1);
        const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(qh, shift), _mm512_set1_epi8(0x03));
        return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi8(0x0f)), _mm512_slli_epi16(hi, 4));
    }
    default: return _mm512_setzero_si512();
    }
}

/* 32-value block formats (q8_tile): the offset every u carries, when it is a multiple of the
 * scale (value = ws * (u - k)), folded into the integer dot as - k * (the lane's xq sum); 0 for
 * Q4_1, which has a min instead. (q8k_tile handles Q6_K's offset and Q4_K's mins itself.) */
static inline int q8_u_offset(const int qtype) { return qtype == Q8_0 ? 128 : qtype == Q5_0 ? 16 : 0; }
static inline int q8_has_min(const int qtype) { return qtype == Q4_1; }

/* How far ahead of a weight row's read position the tiles prefetch: Q8_PF_ROWS rows, at least 1 KB. */
static inline int64_t q8_prefetch_ahead(int64_t row_bytes) {
    return Q8_PF_ROWS * row_bytes > 1024 ? Q8_PF_ROWS * row_bytes : 1024;
}

/* ---- 32-value block formats (Q4_1, Q5_0, Q8_0), R rows x J outputs. Per (row, output,
 * 256-value group): the blocks' scales times the row's dx, and the mins against the blocks' xq
 * sums; per (row, output, 64-value chunk): one vpdpbusd, its lanes' scales picked by one
 * permute, one FMA. Each output's operations do not depend on R or J. ---- */
static inline __attribute__((always_inline)) void q8_tile(const int qtype, const uint8_t *w0, int64_t row_bytes,
                                                          int64_t in, const q8_acts *x, const float *bias,
                                                          float *out, int64_t ldo, const int R, const int J) {
    const int64_t nc = in / 64, ngroups = (nc + 3) / 4, ls = in / 4, ms = 16 * ngroups;
    const int k_off = q8_u_offset(qtype), has_min = q8_has_min(qtype);
    const int shift_off = k_off == 128 ? 7 : 4;
    const int64_t pf_step = row_bytes / nc;   /* about a chunk's bytes: prefetch is a hint */
    const int64_t pf_ahead = q8_prefetch_ahead(row_bytes);   /* bytes */
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    /* lane l of a chunk holds values 4 l .. 4 l + 3: its scale is group lane 2 cc + l / 8, cc the
     * chunk in the group */
    const __m512i lane_group = _mm512_srli_epi32(lane, 3);
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ngroups; g++) {
        __m512 gs[4];
        for (int j = 0; j < J; j++) {
            const int64_t nb = in / 32 - 8 * g;
            gs[j] = q8_group_32(w0 + j * row_bytes, qblock_bytes(qtype), has_min, g, nb < 8 ? (int)nb : 8);
        }
        __m512 gsx[4][4];   /* [r][j]: the group's scales (and mins) times the row's dx */
        for (int r = 0; r < R; r++) {
            const __m512 dx = _mm512_set1_ps(x->xd[r * ngroups + g]);
            for (int j = 0; j < J; j++) {
                gsx[r][j] = _mm512_mul_ps(gs[j], dx);
                if (has_min)   /* Q4_1: value = d u + m (lanes 8-15 of gs) */
                    acc[r][j] = _mm512_fmadd_ps(gsx[r][j], _mm512_loadu_ps(x->xm + r * ms + 16 * g), acc[r][j]);
            }
        }
        const int64_t c_end = 4 * g + 4 < nc ? 4 * g + 4 : nc;
        for (int64_t c = 4 * g; c < c_end; c++) {
            const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(2 * (int)(c - 4 * g)), lane_group);
            __m512i u[4];
            for (int j = 0; j < J; j++) {
                _mm_prefetch((const char *)(w0 + j * row_bytes + c * pf_step + pf_ahead), _MM_HINT_T1);
                u[j] = q8_chunk(qtype, w0 + j * row_bytes, c);
            }
            for (int r = 0; r < R; r++) {
                __m512i xv = _mm512_loadu_si512((const void *)(x->xq + r * in + 64 * c));
                KEEP_IN_REGISTER(xv); /* one load for J outputs */
                const __m512i init = k_off ? _mm512_sub_epi32(_mm512_setzero_si512(),
                                                              _mm512_slli_epi32(_mm512_loadu_si512((const void *)(x->xl + r * ls + 16 * c)), shift_off))
                                           : _mm512_setzero_si512();
                for (int j = 0; j < J; j++) {
                    const __m512i dot = _mm512_dpbusd_epi32(init, u[j], xv);
                    acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, gsx[r][j]), acc[r][j]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) {
            float v = _mm512_reduce_add_ps(acc[r][j]);
            if (bias) v += bias[j];
            out[r * ldo + j] = v;
        }
}

/* rows x J (<= 4) outputs in tiles of up to 4 rows; outputs of a J < 4 tail one at a time
 * (each output's operations are the same either way). */
static inline __attribute__((always_inline)) void q8_tile_rows(const int qtype, const uint8_t *w0, int64_t row_bytes,
                                                               int64_t in, const q8_acts *x, const float *bias,
                                                               float *out, int64_t ldo, int64_t rows, int J) {
    for (int64_t r = 0; r < rows;) {
        const int R = rows - r >= 4 ? 4 : (int)(rows - r);
        const q8_acts x_r = q8_acts_row(x, r, in);
        float *out_r = out + r * ldo;
#define Q8_T(R_, J_, w_, b_, o_) q8_tile(qtype, w_, row_bytes, in, &x_r, b_, o_, ldo, R_, J_)
        if (J == 4) {
            switch (R) {
            case 4: Q8_T(4, 4, w0, bias, out_r); break;
            case 3: Q8_T(3, 4, w0, bias, out_r); break;
            case 2: Q8_T(2, 4, w0, bias, out_r); break;
            default: Q8_T(1, 4, w0, bias, out_r); break;
            }
        } else {
            for (int j = 0; j < J; j++) {
                const uint8_t *wj = w0 + j * row_bytes;
                const float *bj = bias ? bias + j : NULL;
                switch (R) {
                case 4: Q8_T(4, 1, wj, bj, out_r + j); break;
                case 3: Q8_T(3, 1, wj, bj, out_r + j); break;
                case 2: Q8_T(2, 1, wj, bj, out_r + j); break;
                default: Q8_T(1, 1, wj, bj, out_r + j); break;
                }
            }
        }
#undef Q8_T
        r += R;
    }
}

/* ---- K-quants (Q4_K, Q6_K): integer sums over a whole 256-value super-block, one output and
 * up to 8 rows at a time. Their sub-block scales are small integers (Q4_K 6 bits, Q6_K int8),
 * so each chunk's vpdpbusd lanes (|dot| < 2^15: 4 products of u <= 63 and |xq| <= 128) are
 * multiplied by their lane's scale and summed in int32 by one vpdpwssd (a scale vector whose
 * high words are 0 reads the dot's low word only: lo(dot) * scale + hi(dot) * 0). The float
 * work, a conversion and the super-block's d times the row's dx, comes once per super-block:
 * per (row, output, super-block) 4 vpdpbusd, 4 vpdpwssd (Q6_K) or 2 (Q4_K, whose lanes are
 * ordered so that two chunks share their scales) and 3-5 other operations, where q8_tile spends
 * 4 x (vpdpbusd, conversion, scale permute, FMA) + 2. The chunks' bytes and scale
 * vectors are built once per output and super-block and shared by the tile's rows. The sums are
 * exact integers until the conversion, and each output's operations do not depend on how many
 * rows share the tile or on the thread count: row-invariant like q8_tile. ---- */
#define Q8K_MAX_ROWS 8

static inline __attribute__((always_inline)) void q8k_tile(const int qtype, const uint8_t *wrow, int64_t row_bytes,
                                                           int64_t in, const q8_acts *x, const float *bias,
                                                           float *out, int64_t ldo, const int R) {
    const int64_t ngroups = in / 256, ms = 16 * ngroups, blk_bytes = qtype == Q4_K ? 144 : 210;
    const int64_t pf_ahead = q8_prefetch_ahead(row_bytes);   /* bytes */
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i low_words = _mm512_set1_epi32(0xffff);
    __m512 acc[Q8K_MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ngroups; g++) {
        const uint8_t *blk = wrow + g * blk_bytes;
        for (int64_t b = 0; b < blk_bytes; b += 64) prefetch_l2(blk + pf_ahead + b);
        __m512i sc32, u[4], s[4];   /* sc32: one scale (or min) per int32 lane, high words 0 */
        __m512 d, mins = _mm512_setzero_ps();
        if (qtype == Q4_K) {   /* lanes 0-7 the 6-bit scales, 8-15 the mins; y = d * sc * q - dmin * m */
            sc32 = _mm512_cvtepu8_epi32(k4_scales_then_mins(blk + 4));
            d = _mm512_set1_ps(half_at(blk));
            mins = _mm512_maskz_mul_ps((__mmask16)0xff00, _mm512_cvtepi32_ps(sc32), _mm512_set1_ps(-half_at(blk + 2)));
            /* qs bytes 32 p + i hold value i of sub-block 2 p (low nibble) and 2 p + 1 (high). Two
             * qword permutes gather bytes 0-15 (u[0], u[2]) and 16-31 (u[1], u[3]) of each 32-byte
             * piece, so the lanes' sub-blocks are the same in u[0] and u[1] (0, 2, 4, 6, four lanes
             * each) and in u[2] and u[3] (1, 3, 5, 7): two vpdpbusd add up in one int32 vector
             * before one scale vector multiplies it (xq is stored in the same order) */
            const __m512i r0 = _mm512_loadu_si512((const void *)(blk + 16)), r1 = _mm512_loadu_si512((const void *)(blk + 80));
            const __m512i m0 = _mm512_permutex2var_epi64(r0, _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), r1);
            const __m512i m1 = _mm512_permutex2var_epi64(r0, _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15), r1);
            const __m512i nib = _mm512_set1_epi8(0x0f);
            u[0] = _mm512_and_si512(m0, nib), u[1] = _mm512_and_si512(m1, nib);
            u[2] = _mm512_and_si512(_mm512_srli_epi16(m0, 4), nib), u[3] = _mm512_and_si512(_mm512_srli_epi16(m1, 4), nib);
            const __m512i even = _mm512_slli_epi32(_mm512_srli_epi32(lane, 2), 1);   /* 2 (l / 4) */
            s[0] = _mm512_permutexvar_epi32(even, sc32);
            s[1] = _mm512_permutexvar_epi32(_mm512_add_epi32(even, _mm512_set1_epi32(1)), sc32);
        } else {   /* Q6_K: the 16 int8 scales; y = d * sc * (u - 32) */
            sc32 = _mm512_and_si512(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192))), low_words);
            d = _mm512_set1_ps(half_at(blk + 208));
            /* chunk c's lane l holds values 64 c + 4 l .. + 3, sub-block 4 c + l / 4 */
            for (int c = 0; c < 4; c++) {
                u[c] = q8_chunk(qtype, wrow, 4 * g + c);
                s[c] = _mm512_permutexvar_epi32(_mm512_add_epi32(_mm512_set1_epi32(4 * c), _mm512_srli_epi32(lane, 2)), sc32);
            }
        }
        for (int r = 0; r < R; r++) {
            const int8_t *xq = x->xq + r * in + 256 * g;
            /* Q6_K: the offset, -32 * sum over blocks of sc * (the block's xq sum); |xq sum| < 2^15 */
            __m512i sum = qtype == Q6_K
                ? _mm512_slli_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), sc32,
                                                        _mm512_sub_epi32(_mm512_setzero_si512(),
                                                                         _mm512_loadu_si512((const void *)(x->xs + r * ms + 16 * g)))), 5)
                : _mm512_setzero_si512();
            if (qtype == Q4_K) {   /* |dot| <= 8 x 15 x 128 < 2^15 */
                for (int h = 0; h < 2; h++) {
                    __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[2 * h], _mm512_loadu_si512((const void *)(xq + 128 * h)));
                    dot = _mm512_dpbusd_epi32(dot, u[2 * h + 1], _mm512_loadu_si512((const void *)(xq + 128 * h + 64)));
                    sum = _mm512_dpwssd_epi32(sum, dot, s[h]);
                }
            } else {
                for (int c = 0; c < 4; c++) {
                    const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[c], _mm512_loadu_si512((const void *)(xq + 64 * c)));
                    sum = _mm512_dpwssd_epi32(sum, dot, s[c]);
                }
            }
            __m512 t = _mm512_cvtepi32_ps(sum);
            t = qtype == Q4_K ? _mm512_fmadd_ps(t, d, _mm512_mul_ps(mins, _mm512_loadu_ps(x->xm + r * ms + 16 * g)))
                              : _mm512_mul_ps(t, d);
            acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(x->xd[r * ngroups + g]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float v = _mm512_reduce_add_ps(acc[r]);
        if (bias) v += bias[0];
        out[r * ldo] = v;
    }
}

/* rows x J (<= 4) outputs of a K-quant: each output in tiles of up to 8 rows. */
static inline __attribute__((always_inline)) void q8k_tile_rows(const int qtype, const uint8_t *w0, int64_t row_bytes,
                                                                int64_t in, const q8_acts *x, const float *bias,
                                                                float *out, int64_t ldo, int64_t rows, int J) {
    for (int j = 0; j < J; j++) {
        const uint8_t *wj = w0 + j * row_bytes;
        const float *bj = bias ? bias + j : NULL;
        for (int64_t r = 0; r < rows;) {
            const int R = rows - r >= Q8K_MAX_ROWS ? Q8K_MAX_ROWS : (int)(rows - r);
            const q8_acts x_r = q8_acts_row(x, r, in);
            float *o = out + r * ldo + j;
#define Q8K_T(R_) q8k_tile(qtype, wj, row_bytes, in, &x_r, bj, o, ldo, R_)
            switch (R) {
            case 8: Q8K_T(8); break;
            case 7: Q8K_T(7); break;
            case 6: Q8K_T(6); break;
            case 5: Q8K_T(5); break;
            case 4: Q8K_T(4); break;
            case 3: Q8K_T(3); break;
            case 2: Q8K_T(2); break;
            default: Q8K_T(1); break;
            }
#undef Q8K_T
            r += R;
        }
    }
}

/* One copy of the tile loop per format, so the chunk unpacking is inlined without a switch. */
#define Q8_DEFINE_ROWS(name, qt, tiles)                                                                    \
    static void name(const uint8_t *w0, int64_t row_bytes, int64_t in, const q8_acts *x, const float *bias, \
                     float *out, int64_t ldo, int64_t rows, int J) {                                        \
        tiles(qt, w0, row_bytes, in, x, bias, out, ldo, rows, J);                                           \
    }
Q8_DEFINE_ROWS(q8_rows_q4_1, Q4_1, q8_tile_rows)
Q8_DEFINE_ROWS(q8_rows_q5_0, Q5_0, q8_tile_rows)
Q8_DEFINE_ROWS(q8_rows_q8_0, Q8_0, q8_tile_rows)
Q8_DEFINE_ROWS(q8_rows_q4_k, Q4_K, q8k_tile_rows)
Q8_DEFINE_ROWS(q8_rows_q6_k, Q6_K, q8k_tile_rows)

static q8_rows_fn q8_rows_of(int qtype) {
    switch (qtype) {
    case Q4_1: return q8_rows_q4_1;
    case Q5_0: return q8_rows_q5_0;
    case Q8_0: return q8_rows_q8_0;
    case Q4_K: return q8_rows_q4_k;
    case Q6_K: return q8_rows_q6_k;
    default: return NULL;
    }
}

/* out = x @ w.T (+ bias) with int8 activations on AVX-512 VNNI (q8_gemm_run's driver). */
static int q8_gemm_team(const float *x, int64_t ldx, int64_t rows, const uint8_t *w, int qtype,
                        int64_t out_features, int64_t in, const float *bias, float *out, int64_t ldo, int pieces) {
    return q8_gemm_run(x, ldx, rows, w, qtype, out_features, in, bias, out, ldo, pieces, q8_quantize_row,
                       q8_rows_of(qtype));
}

#endif /* AVX-512 VNNI */
#endif /* SPECSERVE_Q8_ACT_H */
