/* GGUF (ggml) block formats: what a block is, for every kernel that reads the file's blocks.
 *
 * Holds the format ids (ggml's type ids: Q4_0 = 2, ...), each format's values and bytes per block
 * (qblock_elems, qblock_bytes), and the readers of a block's fields that more than one kernel
 * shares: half_at (a float16 field), scale_min_k4 and k4_scales_then_mins (Q4_K / Q5_K's packed
 * 6-bit scales and mins). The bottom layer of the GGUF kernels: includes only system headers.
 * Included by quant_unpack.h, q8_act.h, amx_tiles.h, amx_int8.h, quant_blocks.h, quant_gemm.c.
 */
#ifndef SPECSERVE_GGML_BLOCKS_H
#define SPECSERVE_GGML_BLOCKS_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

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

#if defined(__F16C__)

static inline float half_at(const uint8_t *p) { /* a little-endian float16 -> float32, exact */
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* A K-quant super-block's 12 scale bytes -> bytes 0-7 its eight 6-bit scales, bytes 8-15 its
 * eight 6-bit mins (the same bits as scale_min_k4), unpacked four at a time in 32-bit words and
 * built in registers (four 4-byte stores read back as one 16-byte load stall). */
static inline __m128i k4_scales_then_mins(const uint8_t *scales12) {
    uint32_t u[3];
    memcpy(u, scales12, 12);
    return _mm_setr_epi32(
        (int)(u[0] & 0x3f3f3f3fu),                                                /* scales 0-3 */
        (int)((u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4)),          /* scales 4-7 */
        (int)(u[1] & 0x3f3f3f3fu),                                                /* mins 0-3 */
        (int)(((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4)));  /* mins 4-7 */
}

#endif /* __F16C__ */

#endif /* SPECSERVE_GGML_BLOCKS_H */
