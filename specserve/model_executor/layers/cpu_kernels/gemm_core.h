/* The row-invariant float32 matmul core shared by specserve's CPU matmul kernels
 * (fp16_gemm.c: float16 weights; quant_gemm.c: GGUF block formats, dequantized to float32).
 *
 * gemm_rows(x, rows, w, out) computes out[r, j] = sum_k x[r, k] * w[j, k] (+ bias[j]) for
 * J <= 4 outputs, reading w as float16 bits (HALF = 1) or float32 (HALF = 0). Every output
 * is the same sequence of operations whatever the row count or the block its row lands in:
 * VEC float32 lanes accumulate over k in order, one FMA each, then a fixed tree adds the
 * lanes (lanes_sum / lanes_sum4), then the bias. Build with -ffp-contract=off.
 *
 * The bottom layer of the kernels' headers: includes only system headers. Included by
 * fp16_gemm.c, quant_gemm.c and the GGUF kernels' headers (quant_unpack.h, quant_chunks.h, q8_act.h,
 * amx_tiles.h, amx_int8.h, quant_blocks.h).
 */
#ifndef SPECSERVE_GEMM_CORE_H
#define SPECSERVE_GEMM_CORE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

/* The share of a matmul's n output blocks a thread takes at a time: its loops over output blocks
 * run schedule(dynamic, work_chunk(n)), CHUNKS_PER_THREAD chunks a thread. Why not a static
 * split: on shared VMs one core often runs slower than the other for minutes (measured 1.6x on an
 * AMX VM), and a static split makes every step wait for the slow core. Why not smaller chunks
 * everywhere: on an AVX2 VM whose two threads share a core, 16 chunks a thread streamed weights
 * from memory 1.2x slower than 4 (Q4_1 rows, float32 and int8 activations alike: each thread's
 * reads are less contiguous). Each block is computed whole, by the same operations, by whichever
 * thread takes it, so no result depends on the schedule. */
#if defined(__AVX512F__)
#define CHUNKS_PER_THREAD 16
#else
#define CHUNKS_PER_THREAD 4
#endif
static inline int64_t work_chunk(int64_t n) {
#ifdef _OPENMP
    const int64_t chunk = n / (CHUNKS_PER_THREAD * (int64_t)omp_get_num_threads());
#else
    const int64_t chunk = n / CHUNKS_PER_THREAD;
#endif
    return chunk > 1 ? chunk : 1;
}

#if defined(__AVX512F__)
#define VEC 16
#define R_MAX 6 /* 4 x 6 accumulators + 4 weight vectors fit AVX-512's 32 registers */
#else
#define VEC 8
/* 4 x 2 accumulators + 4 weight vectors + a row's vector fit AVX2's 16 registers; 3 rows spilled
 * (Zen 2 VM, Qwen2.5-Coder-1.5B, 48 rows a forward: 1,901 ms at 3 rows a tile, 1,260 at 2) */
#define R_MAX 2
#endif
/* Weight prefetch distances, in float16 elements: into L1 4 KB ahead of each weight row's
 * read position, into L2 16 KB ahead. Measured on the default model's 30 layers + LM head
 * streamed from memory (2 threads): per forward 10.9 ms at 1 row and 17.3 at 6 rows with
 * only a 2 KB L1 prefetch, 7.4 and 11.0 with these (fbgemm: 15.2 and 21.5). */
#define PREFETCH_L1 2048
#define PREFETCH_L2 8192

/* Prefetches the compiler keeps. GCC treats _mm_prefetch as removable: a loop of nothing but
 * prefetches (every line of a packed unit, of a block ahead) compiled to one prefetch, or to
 * none; these asm statements are emitted one for one. */
static inline __attribute__((always_inline)) void prefetch_l1(const void *p) {
    __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)p));
}
static inline __attribute__((always_inline)) void prefetch_l2(const void *p) {
    __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)p));
}

typedef float vecf __attribute__((vector_size(VEC * 4)));

#if defined(__F16C__)

static inline vecf load_f32(const float *p) {
    vecf v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

static inline vecf load_f16(const uint16_t *p) { /* float16 -> float32, exact */
#if VEC == 16
    const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#else
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#endif
    vecf v;
    memcpy(&v, &f, sizeof v);
    return v;
}

/* Pins a vector variable to a register: GCC otherwise folds a vector load into every FMA that
 * uses it (a memory operand each), so a value loaded once for four outputs is read four times
 * and the loop is bound by loads instead of FMAs (measured: docs/benchmarks.md, "Row tiles"). */
#define KEEP_IN_REGISTER(v) __asm__("" : "+v"(v))

static inline vecf in_register(vecf v) {
    KEEP_IN_REGISTER(v);
    return v;
}

static inline vecf fma_vec(vecf a, vecf b, vecf acc) { /* acc + a * b, one rounding where the CPU has FMA */
#if VEC == 16
    __m512 x, y, z;
    memcpy(&x, &a, sizeof x), memcpy(&y, &b, sizeof y), memcpy(&z, &acc, sizeof z);
    z = _mm512_fmadd_ps(x, y, z);
    memcpy(&acc, &z, sizeof acc);
    return acc;
#elif defined(__FMA__)
    __m256 x, y, z;
    memcpy(&x, &a, sizeof x), memcpy(&y, &b, sizeof y), memcpy(&z, &acc, sizeof z);
    z = _mm256_fmadd_ps(x, y, z);
    memcpy(&acc, &z, sizeof acc);
    return acc;
#else
    return acc + a * b;
#endif
}

static inline float lanes_sum(vecf v) { /* the fixed tree every output uses (lanes_sum4: four at once) */
#if VEC == 16
    float t[8];
    for (int i = 0; i < 8; i++) t[i] = v[i] + v[i + 8];
    const float s0 = t[0] + t[4], s1 = t[1] + t[5], s2 = t[2] + t[6], s3 = t[3] + t[7];
    return (s0 + s2) + (s1 + s3);
#else /* the same additions in three vector instructions (the AVX2 int8 kernel sums Q4_K's mins with it) */
    __m256 w;
    memcpy(&w, &v, sizeof w);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1));   /* s0..s3 */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                          /* s0 + s2, s1 + s3 */
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#endif
}

/* lanes_sum of 4 accumulators at once, the same additions (a + b == b + a exactly) done
 * 4 outputs per vector instruction; writes dst[0..3] (+ bias[0..3]). */
static inline void lanes_sum4(const vecf acc[4], float *dst, const float *bias) {
#if VEC == 16
    __m512 a, b, c, d;
    memcpy(&a, &acc[0], sizeof a), memcpy(&b, &acc[1], sizeof b);
    memcpy(&c, &acc[2], sizeof c), memcpy(&d, &acc[3], sizeof d);
    /* t = v[0:8] + v[8:16]: P = [t_a, t_b], Q = [t_c, t_d] (128-bit quarters 0-3) */
    const __m512 p = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    /* s = t[0:4] + t[4:8]: S = [s_a, s_b, s_c, s_d] */
    const __m512 sv = _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x88), _mm512_shuffle_f32x4(p, q, 0xDD));
    /* (s0 + s2, s1 + s3), then their sum, in element 0 of each quarter */
    const __m512 u = _mm512_add_ps(sv, _mm512_permute_ps(sv, 0x4E));
    const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
    __m128 r = _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v));
#else
    __m256 a, b, c, d;
    memcpy(&a, &acc[0], sizeof a), memcpy(&b, &acc[1], sizeof b);
    memcpy(&c, &acc[2], sizeof c), memcpy(&d, &acc[3], sizeof d);
    /* s = t[0:4] + t[4:8] (t = v for 8 lanes): [s_a, s_b] and [s_c, s_d] */
    const __m256 sab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    const __m256 scd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
    const __m256 uab = _mm256_add_ps(sab, _mm256_permute_ps(sab, 0x4E));
    const __m256 ucd = _mm256_add_ps(scd, _mm256_permute_ps(scd, 0x4E));
    const __m256 vab = _mm256_add_ps(uab, _mm256_permute_ps(uab, 0xB1));
    const __m256 vcd = _mm256_add_ps(ucd, _mm256_permute_ps(ucd, 0xB1));
    /* the sums are elements 0 and 4 of vab and vcd */
    const __m256 lo = _mm256_unpacklo_ps(vab, vcd); /* [a, c, ., ., b, d, ., .] */
    __m128 r = _mm_unpacklo_ps(_mm256_castps256_ps128(lo), _mm256_extractf128_ps(lo, 1)); /* [a, b, c, d] */
#endif
    if (bias) r = _mm_add_ps(r, _mm_loadu_ps(bias));
    _mm_storeu_ps(dst, r);
}

/* J outputs x R rows (J, R, HALF compile-time constants after inlining). The weights are
 * float16 bits (wh, HALF = 1) or their float32 copy (wf, HALF = 0): the same values. */
static inline __attribute__((always_inline)) void gemm_block(const float *x, int64_t ldx, const uint16_t *wh,
                                                             const float *wf, int64_t in, const float *bias,
                                                             float *out, int64_t ldo, const int J, const int R,
                                                             const int HALF) {
    vecf acc[R_MAX][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) acc[r][j] = (vecf){0};
    for (int64_t k = 0; k < in; k += VEC) {
        vecf wv[4];
        for (int j = 0; j < J; j++) {
            if (HALF) {
                _mm_prefetch((const char *)(wh + j * in + k + PREFETCH_L1), _MM_HINT_T0);
                _mm_prefetch((const char *)(wh + j * in + k + PREFETCH_L2), _MM_HINT_T1);
                wv[j] = in_register(load_f16(wh + j * in + k));
            } else {
                wv[j] = in_register(load_f32(wf + j * in + k));
            }
        }
        for (int r = 0; r < R; r++) {
            const vecf xv = in_register(load_f32(x + r * ldx + k));
            for (int j = 0; j < J; j++) acc[r][j] = fma_vec(xv, wv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < R; r++) {
        if (J == 4) {
            lanes_sum4(acc[r], out + r * ldo, bias);
            continue;
        }
        for (int j = 0; j < J; j++) {
            const float s = lanes_sum(acc[r][j]);
            out[r * ldo + j] = bias ? s + bias[j] : s;
        }
    }
}

/* Rows [row0, row1) against J outputs, R_MAX rows at a time. */
static inline __attribute__((always_inline)) void gemm_rows(const float *x, int64_t ldx, int64_t row0,
                                                            int64_t row1, const uint16_t *wh, const float *wf,
                                                            int64_t in, const float *bias, float *out,
                                                            int64_t ldo, const int J, const int HALF) {
    int64_t r = row0;
    for (; r + R_MAX <= row1; r += R_MAX) gemm_block(x + r * ldx, ldx, wh, wf, in, bias, out + r * ldo, ldo, J, R_MAX, HALF);
    switch (row1 - r) {
#if R_MAX > 5
    case 5: gemm_block(x + r * ldx, ldx, wh, wf, in, bias, out + r * ldo, ldo, J, 5, HALF); break;
    case 4: gemm_block(x + r * ldx, ldx, wh, wf, in, bias, out + r * ldo, ldo, J, 4, HALF); break;
    case 3: gemm_block(x + r * ldx, ldx, wh, wf, in, bias, out + r * ldo, ldo, J, 3, HALF); break;
#endif
    case 2: gemm_block(x + r * ldx, ldx, wh, wf, in, bias, out + r * ldo, ldo, J, 2, HALF); break;
    case 1: gemm_block(x + r * ldx, ldx, wh, wf, in, bias, out + r * ldo, ldo, J, 1, HALF); break;
    default: break;
    }
}

#endif /* __F16C__ */

#endif /* SPECSERVE_GEMM_CORE_H */
