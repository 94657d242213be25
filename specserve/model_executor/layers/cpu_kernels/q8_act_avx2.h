/* The int8-activation matmul over GGUF blocks on CPUs with AVX2 but not AVX-512 VNNI (many
 * laptops): Q4_1, Q5_0, Q8_0, Q4_K and Q6_K; other formats take the float32 path.
 *
 * Included by q8_act.h, whose AVX-512 kernel it stands in for (quant_blocks.h calls
 * q8_act_supported and q8_gemm_team, defined by one of the two; HAVE_Q8_ACT says one was). Includes gemm_core.h,
 * ggml_blocks.h (the formats, half_at) and q8_acts.h (the activations' arrays and the driver).
 *
 * Why: the float32 path spends a conversion, a multiply and an add per weight before each row's
 * FMA, about 7 Gweights/s a core with AVX2 (Zen 2); llama.cpp multiplies bytes instead. So does this file,
 * as llama.cpp does without VNNI: per 32-value block, vpmaddubsw of the weight's unsigned bytes by
 * the activation's int8 values (16-bit sums of two products), vpmaddwd by ones (8 int32 sums),
 * one conversion and one FMA by the block's scale times the row's dx.
 *
 *   x row      -> as q8_act.h: per 256 values dx = max|x| / 127, xq = round-half-even(x / dx)
 *                 (the same rounding, in scalar code), and each 32-value block's xq sum (xm)
 *   Q4_1       -> u = the nibbles (0..15): value = d u + m; the min comes in as m dx (xq sum)
 *   Q5_0       -> u = nibble + 16 fifth bit (0..31): value = d (u - 16); -16 d dx (xq sum)
 *   Q8_0       -> q signed: vpmaddubsw(|q|, xq with q's sign), llama.cpp's way past the
 *                 instruction's unsigned operand (|q| <= 128, |xq| <= 127: no 16-bit overflow)
 *   Q4_K, Q6_K -> per sub-block vpmaddwd by its integer scale, int32 sums per super-block
 *                 (q8a_q4_k, q8a_q6_k)
 *
 * A tile is up to 8 rows against one output: each weight vector is unpacked once for the rows.
 *
 * Row-invariant like every kernel here: out[r, j] is the same sequence of operations whatever the
 * row count, the other rows and the thread count (each output's lanes accumulate over the blocks
 * in order, then one fixed horizontal sum, its block terms, the bias). Its results are not the
 * AVX-512 kernel's bits (other sums), as the float32 paths of the two differ.
 */
#ifndef SPECSERVE_Q8_ACT_AVX2_H
#define SPECSERVE_Q8_ACT_AVX2_H

#include "gemm_core.h"
#include "ggml_blocks.h"
#include "q8_acts.h"

#if defined(__F16C__) && defined(__AVX2__) && defined(__FMA__) && \
    !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__))
#define HAVE_Q8_ACT_AVX2 1   /* q8_act.h then defines HAVE_Q8_ACT */

static inline int q8_act_supported(int qtype, int64_t in) {
    return ((qtype == Q4_1 || qtype == Q5_0 || qtype == Q8_0) && in % 32 == 0) ||
           ((qtype == Q4_K || qtype == Q6_K) && in % 256 == 0);
}

/* One row (scalar: rows are few against the matmul): xq, xd, xm and xs as q8_act.h lays them out
 * (xm: lanes 8-15 of each group's 16 hold its 32-value blocks' xq sums; xs its 16-value blocks'),
 * always in the values' own order. xl is not read here. */
static void q8a_quantize_row(const float *x, int64_t in, int8_t *xq, float *xd, int32_t *xl, float *xm, int32_t *xs,
                             int k4_order, float *resid) {
    (void)xl, (void)k4_order;
    const int64_t ngroups = (in + 255) / 256;
    for (int64_t g = 0; g < ngroups; g++) {
        const int64_t v0 = 256 * g, v1 = v0 + 256 < in ? v0 + 256 : in;
        float m = 0.0f;
        for (int64_t v = v0; v < v1; v++) {
            const float a = x[v] < 0.0f ? -x[v] : x[v];
            m = a > m ? a : m;
        }
        const float d = m / 127.0f, id = m > 0.0f ? 127.0f / m : 0.0f;
        float sums[16] = {0};
        int32_t sums16[16] = {0};
        for (int64_t k = v0; k < v1; k++) {
            const int32_t q = _mm_cvtss_si32(_mm_set_ss(x[k] * id));   /* round half to even, |q| <= 127 */
            if (resid)   /* x - d q with one rounding */
                resid[k] = _mm_cvtss_f32(_mm_fnmadd_ss(_mm_set_ss((float)q), _mm_set_ss(d), _mm_set_ss(x[k])));
            xq[k] = (int8_t)q;
            sums16[(k - v0) / 16] += q;
        }
        for (int b = 0; b < 8; b++) sums[8 + b] = (float)(sums16[2 * b] + sums16[2 * b + 1]);
        xd[g] = d;
        memcpy(xm + 16 * g, sums, sizeof sums);
        memcpy(xs + 16 * g, sums16, sizeof sums16);
    }
}

/* Block b of a weight row: its 32 values' bytes (u; Q8_0: the signed quants) and d, m. */
static inline __attribute__((always_inline)) __m256i q8a_block(const int qtype, const uint8_t *row, int64_t b,
                                                               float *d, float *m) {
    switch (qtype) {
    case Q4_1: {
        const uint8_t *blk = row + b * 20;
        *d = half_at(blk), *m = half_at(blk + 2);
        const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 4));
        const __m256i both = _mm256_set_m128i(_mm_srli_epi16(qs, 4), qs);   /* values 16-31: high nibbles */
        return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
    }
    case Q5_0: {
        const uint8_t *blk = row + b * 22;
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
        *d = half_at(blk), *m = 0.0f;
        const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 6));
        const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(0x0f));
        /* byte i gets qh's byte i / 8, then bit i % 8 of it: 0xff where value i's fifth bit is set */
        const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                                   _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                    2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        return _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    default: { /* Q8_0 */
        const uint8_t *blk = row + b * 34;
        *d = half_at(blk), *m = 0.0f;
        return _mm256_loadu_si256((const __m256i *)(blk + 2));
    }
    }
}

/* The 8 int32 sums of a block's 32 products u * xq (pairs, then pairs of pairs). */
static inline __attribute__((always_inline)) __m256i q8a_dot(const int qtype, __m256i u, __m256i xv) {
    const __m256i pairs = qtype == Q8_0 ? _mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(xv, u))
                                        : _mm256_maddubs_epi16(u, xv);
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* Rows a tile: R int32 sums, a weight vector, a row's vector and the constants fit AVX2's 16
 * registers. A tile is one output: on a Zen 2 VM tiles of 4 outputs (each output's weight vector
 * reused across them) ran slower at every row count than one output a tile, which reads one
 * weight row at a time (Qwen2.5-Coder-1.5B, a forward of 1 row 77 -> 61 ms, of 4 rows 225 -> 124). */
#define Q8A_ROWS_MAX 8

/* One Q4_K super-block (blk) of one output against R rows: per sub-block (32 values, the low or
 * high nibbles of qs[32 (s / 2), + 32)) the nibbles are unpacked once for all rows; per row
 * vpmaddubsw by its xq and vpmaddwd by the sub-block's 6-bit scale, summed in int32; then one
 * conversion and FMA by d dx into acc, and the mins against the row's 32-value xq sums into term. */
static inline __attribute__((always_inline)) void q8a_q4_k(const uint8_t *blk, const q8_acts *x, int64_t in,
                                                           int64_t g, __m256 *acc, float *term, const int R) {
    const int64_t ngroups = (in + 255) / 256;
    const __m128i packed = k4_scales_then_mins(blk + 4);   /* bytes 0-7 the scales, 8-15 the mins */
    uint8_t sc[16];
    _mm_storeu_si128((__m128i *)sc, packed);
    __m256i scale[8];   /* each sub-block's scale in every 16-bit lane */
    for (int s = 0; s < 8; s++) scale[s] = _mm256_set1_epi16(sc[s]);
    const __m256 mins_v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8)));
    __m256i isum[Q8A_ROWS_MAX];
    for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
    for (int s = 0; s < 8; s++) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * (s / 2)));
        const __m256i u = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(0x0f));
        for (int r = 0; r < R; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->xq + r * in + 256 * g + 32 * s));
            /* pairs |u xq + u xq| <= 3810, times the 6-bit scale: int32 sums stay exact */
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), scale[s]));
            KEEP_IN_REGISTER(isum[r]);   /* summed as it goes: GCC otherwise spills the products for a tree */
        }
    }
    const float d = half_at(blk), dmin = half_at(blk + 2);
    for (int r = 0; r < R; r++) {
        const float dx = x->xd[r * ngroups + g], *xsum = x->xm + (r * ngroups + g) * 16 + 8;
        /* the mins against the 8 sub-blocks' xq sums: integers below 2^21 (6-bit mins times sums of
         * 32 values of at most 127), so exact in float32 in any order */
        const float mins = lanes_sum((vecf)_mm256_mul_ps(mins_v, _mm256_loadu_ps(xsum)));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * dx), acc[r]);
        term[r] -= (dmin * dx) * mins;
    }
}

/* One Q6_K super-block of one output against R rows: 16 sub-blocks of 16 values, each 32 values'
 * 6-bit quants (q + 32, 0..63) unpacked once for all rows; per row vpmaddubsw by its xq and
 * vpmaddwd by the two sub-blocks' int8 scales, summed in int32, the quants' -32 against the row's
 * 16-value xq sums; then one conversion and FMA by d dx into acc. */
static inline __attribute__((always_inline)) void q8a_q6_k(const uint8_t *blk, const q8_acts *x, int64_t in,
                                                           int64_t g, __m256 *acc, const int R) {
    const int64_t ngroups = (in + 255) / 256;
    const int8_t *sc = (const int8_t *)(blk + 192);
    const __m256i sc_lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc)),
                  sc_hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8)));
    __m256i isum[Q8A_ROWS_MAX];
    for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
    for (int n = 0; n < 2; n++)          /* ggml's halves of 128 values */
        for (int p = 0; p < 4; p++) {    /* values 128 n + 32 p + [0, 32): sub-blocks 8 n + 2 p, + 1 */
            const int a = 8 * n + 2 * p;
            const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32 * (p % 2)));
            const __m256i lo = _mm256_and_si256(p < 2 ? ql : _mm256_srli_epi16(ql, 4), _mm256_set1_epi8(0x0f));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), _mm256_set1_epi8(0x03));
            const __m256i u = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));   /* q + 32, 0..63 */
            const __m256i scales = _mm256_set_m128i(_mm_set1_epi16(sc[a + 1]), _mm_set1_epi16(sc[a]));
            for (int r = 0; r < R; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->xq + r * in + 256 * g + 128 * n + 32 * p));
                /* pairs |u xq + u xq| <= 16002, times an int8 scale: int32 sums stay exact */
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), scales));
                KEEP_IN_REGISTER(isum[r]);
            }
        }
    const float d = half_at(blk + 208);
    for (int r = 0; r < R; r++) {
        const int32_t *xsum16 = x->xs + (r * ngroups + g) * 16;
        /* sum over sub-blocks of scale * (xq sum): the quants' -32 (int32, exact in any order) */
        const __m256i prod = _mm256_add_epi32(_mm256_mullo_epi32(sc_lo, _mm256_loadu_si256((const __m256i *)xsum16)),
                                              _mm256_mullo_epi32(sc_hi, _mm256_loadu_si256((const __m256i *)(xsum16 + 8))));
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(prod), _mm256_extracti128_si256(prod, 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
        const int32_t offset = _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
        const __m256i v = _mm256_sub_epi32(isum[r], _mm256_setr_epi32(32 * offset, 0, 0, 0, 0, 0, 0, 0));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(d * x->xd[r * ngroups + g]), acc[r]);
    }
}

/* R rows x one output (the weight row w). 32-value blocks (Q4_1, Q5_0, Q8_0), per (row, block):
 * one vpmaddubsw, one vpmaddwd, a conversion, an FMA by d dx; the block's min or offset term as
 * a scalar (d or m) dx (xq sum). K-quants, per super-block: q8a_q4_k or q8a_q6_k. The weights
 * are unpacked once for the tile's rows. */
static inline __attribute__((always_inline)) void q8a_tile(const int qtype, const uint8_t *w, int64_t row_bytes,
                                                           int64_t in, const q8_acts *x, const float *bias,
                                                           float *out, int64_t ldo, const int R) {
    const int64_t nb = in / 32, ngroups = (in + 255) / 256, ms = 16 * ngroups, bb = qblock_bytes(qtype);
    /* prefetch into L1 the same place 16 weight rows ahead, at least 1 KB: short rows (576
     * values: 360 bytes of Q4_1) leave a within-row prefetch almost nothing to fetch */
    const int64_t pf_ahead = 16 * row_bytes > 1024 ? 16 * row_bytes : 1024;
    __m256 acc[Q8A_ROWS_MAX];
    float terms[Q8A_ROWS_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), terms[r] = 0.0f;
    if (qtype == Q4_K || qtype == Q6_K) {   /* per 256-value super-block g */
        for (int64_t g = 0; g < ngroups; g++) {
            const uint8_t *blk = w + g * bb;
            for (int64_t k = 0; k < bb; k += 64) prefetch_l1(blk + pf_ahead + k);   /* each line of the block */
            if (qtype == Q4_K) q8a_q4_k(blk, x, in, g, acc, terms, R);
            else q8a_q6_k(blk, x, in, g, acc, R);
        }
    } else {
        for (int64_t b = 0; b < nb; b++) {
            const int64_t g = b / 8;
            float d, m;
            prefetch_l1(w + pf_ahead + b * bb);
            const __m256i u = q8a_block(qtype, w, b, &d, &m);
            for (int r = 0; r < R; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->xq + r * in + 32 * b));
                const float dx = x->xd[r * ngroups + g], xsum = x->xm[r * ms + 16 * g + 8 + b % 8];
                const float s = d * dx;
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8a_dot(qtype, u, xv)), _mm256_set1_ps(s), acc[r]);
                if (qtype == Q4_1) terms[r] += (m * dx) * xsum;
                else if (qtype == Q5_0) terms[r] += s * (-16.0f * xsum);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float v = lanes_sum((vecf)acc[r]) + terms[r];   /* gemm_core.h's fixed tree */
        if (bias) v += *bias;
        out[r * ldo] = v;
    }
}

/* rows x J (<= 4) outputs: for each tile of up to Q8A_ROWS_MAX rows, each output in turn. */
static inline __attribute__((always_inline)) void q8a_tile_rows(const int qtype, const uint8_t *w0, int64_t row_bytes,
                                                                int64_t in, const q8_acts *x, const float *bias,
                                                                float *out, int64_t ldo, int64_t rows, int J) {
    for (int64_t r = 0; r < rows; r += Q8A_ROWS_MAX) {
        const int R = rows - r >= Q8A_ROWS_MAX ? Q8A_ROWS_MAX : (int)(rows - r);
        const q8_acts x_r = q8_acts_row(x, r, in);
        for (int j = 0; j < J; j++) {
            const uint8_t *w = w0 + j * row_bytes;
            const float *bj = bias ? bias + j : NULL;
            float *o = out + r * ldo + j;
            switch (R) {   /* R a constant in each call: its loops unrolled, its sums in registers */
            case 1: q8a_tile(qtype, w, row_bytes, in, &x_r, bj, o, ldo, 1); break;
            case 2: q8a_tile(qtype, w, row_bytes, in, &x_r, bj, o, ldo, 2); break;
            case 3: q8a_tile(qtype, w, row_bytes, in, &x_r, bj, o, ldo, 3); break;
            case 4: q8a_tile(qtype, w, row_bytes, in, &x_r, bj, o, ldo, 4); break;
            case 5: q8a_tile(qtype, w, row_bytes, in, &x_r, bj, o, ldo, 5); break;
            case 6: q8a_tile(qtype, w, row_bytes, in, &x_r, bj, o, ldo, 6); break;
            case 7: q8a_tile(qtype, w, row_bytes, in, &x_r, bj, o, ldo, 7); break;
            default: q8a_tile(qtype, w, row_bytes, in, &x_r, bj, o, ldo, 8); break;
            }
        }
    }
}

#define Q8A_DEFINE_ROWS(name, qt)                                                                          \
    static void name(const uint8_t *w0, int64_t row_bytes, int64_t in, const q8_acts *x, const float *bias, \
                     float *out, int64_t ldo, int64_t rows, int J) {                                        \
        q8a_tile_rows(qt, w0, row_bytes, in, x, bias, out, ldo, rows, J);                                   \
    }
Q8A_DEFINE_ROWS(q8a_rows_q4_1, Q4_1)
Q8A_DEFINE_ROWS(q8a_rows_q5_0, Q5_0)
Q8A_DEFINE_ROWS(q8a_rows_q8_0, Q8_0)
Q8A_DEFINE_ROWS(q8a_rows_q4_k, Q4_K)
Q8A_DEFINE_ROWS(q8a_rows_q6_k, Q6_K)

/* out = x @ w.T (+ bias) with int8 activations on AVX2 (q8_gemm_run's driver). */
static int q8_gemm_team(const float *x, int64_t ldx, int64_t rows, const uint8_t *w, int qtype,
                        int64_t out_features, int64_t in, const float *bias, float *out, int64_t ldo, int pieces) {
    const q8_rows_fn run = qtype == Q4_1 ? q8a_rows_q4_1 : qtype == Q5_0 ? q8a_rows_q5_0
                           : qtype == Q4_K ? q8a_rows_q4_k : qtype == Q6_K ? q8a_rows_q6_k : q8a_rows_q8_0;
    return q8_gemm_run(x, ldx, rows, w, qtype, out_features, in, bias, out, ldo, pieces, q8a_quantize_row, run);
}

#endif /* AVX2 without AVX-512 VNNI */
#endif /* SPECSERVE_Q8_ACT_AVX2_H */
