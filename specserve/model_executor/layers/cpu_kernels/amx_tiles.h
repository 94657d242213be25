/* The float32-activation matmul on AMX tiles (bfloat16 products, float32 sums), over GGUF
 * weights repacked at load into a tile order: the few-row path of CPUs that have AMX.
 *
 * Included by quant_blocks.h, amx_int8.h and quant_gemm.c; quant_gemm_team() calls
 * amx_gemm_team() when the caller sets AMX_PACKED_FLAG (without amx_int8.h's AMX_I8_FLAG) in
 * qtype (QuantizedMatrix.packed_for_tiles) and the weight bytes are this file's packing of the
 * format. amx_int8.h multiplies the same packing on int8 tiles for int8_activations=3; float32
 * activations take this file's path. Includes gemm_core.h (work_chunk, prefetch_l1) and
 * ggml_blocks.h (the formats, half_at, scale_min_k4).
 *
 * Why: with AVX-512 alone every weight costs a table look-up and one FMA per row, so a
 * verification of k + 1 rows costs nearly k + 1 times the FMAs of a decode step. An AMX tile
 * multiply (TDPBF16PS) does 16 x 16 x 32 products per instruction; the per-weight work left is
 * unpacking the quants to bfloat16 once for all rows.
 *
 * Exact arithmetic, not bfloat16 rounding:
 *   - a quant q (the format's small integer: 0..15, 0..63 - 32) is exactly a bfloat16;
 *   - each float32 activation x is split into three bfloat16 pieces, x = p1 + p2 + p3 exactly
 *     (p1 = bf16(x), p2 = bf16(x - p1), p3 = x - p1 - p2, which has at most 8 significant bits);
 *   - every product q * p is exact in float32, and the tile sums them in float32;
 *   - per sub-block s of SB values (one scale a_s, one offset m_s in the format), with
 *     D = sum q * x over the sub-block and S = sum x over it. D comes from the tiles: Q6_K's
 *     three tile multiplies, one a piece, sum into one C tile; Q4_K's, Q4_1's and Q5_0's pieces are three
 *     A rows of one multiply, each piece's sum in its own C row, and D = (D_3 + D_2) + D_1 in
 *     float32 (amx_group_pieces: a third of the tile multiplies of a decode step). Then
 *       out[r, o] = sum over s, in order, of  a_s * D  then  + m_s * S
 *     which is sum_k w_k * x_k for w = a_s * q + m_s, exactly ggml's dequantized value
 *     (Q4_K: a = d * scale, m = -dmin * min; Q4_1: a = d, m = m; Q5_0: a = d, m = -16 d, both
 *     exact; Q6_K: a = d * scale, q - 32). Q8_0 is packed here but multiplied on int8 tiles only
 *     (amx_bf16_takes).
 * So the model computed is the file's, at float32 precision; the rounding differs from the
 * AVX-512 path's (another order of sums), so a matrix uses one path for every row count.
 *
 * Row-invariant: each output element of a tile multiply depends only on its own A row and B
 * column, and every (row, output) runs the same sequence of tile multiplies and float32 adds
 * whatever the row count (rows are taken a pass at a time, each alone in its A rows; Q6_K's
 * passes of up to 8 rows put two sub-blocks in one multiply with zeros in the other's place,
 * which adds exact zeros: amx_lanes) or the thread count (each 16-output group is computed whole
 * by whichever thread takes it).
 *
 * Packing (amx_pack): outputs in groups of 16; each group's row is a run of units of 64 input
 * values, each unit holding the group's scales for those values and its quants in the B-tile
 * order ("VNNI" pairs: tile row p holds, for each of the 16 outputs, the quants of inputs 2p and
 * 2p + 1), two sub-blocks per byte (low and high nibble), tile rows 2c and 2c + 1 interleaved
 * byte by byte in 64 bytes (amx_code_byte). Unit layouts (bytes):
 *   Q4_K  640: d[16] f16 | dmin[16] f16 | scale[2][16] u8 | min[2][16] u8 | nibbles[16][32]
 *   Q4_1  640: d[2][16] f16 | m[2][16] f16 | nibbles[16][32]
 *   Q5_0  704: d[2][16] f16 | fifth[8][2] u64 | nibbles[16][32]
 *   Q8_0 1088: d[2][16] f16 | quants[2][8][64] i8 (the file's signed bytes, in amx_code_byte order)
 *   Q6_K 1120: d[16] f16 | scale[4][16] i8 | quants[4][8][32] u8 (one byte each: 6 bits unpack too
 *              slowly; nibbles and two bit planes as Q5_0's, 864 bytes, ran 10% faster for a head
 *              streamed from memory but 40% slower at 1 row for a matrix in cache)
 * (5.0, 5.0, 5.5, 8.5 and 8.75 bits a weight against the file's 4.5, 5.0, 5.5, 8.5 and 6.56.) Q5_0's codes
 * are 5 bits: the low four as Q4_1's nibbles, the fifth in bit masks laid over the nibble bytes
 * (fifth[c][h], bit b: the code in byte b of the c-th 64 nibble bytes, sub-block h), which
 * one masked move per 64 bytes turns into bit 4 of those bytes (amx_nibble_bytes).
 */
#ifndef SPECSERVE_AMX_TILES_H
#define SPECSERVE_AMX_TILES_H

#include "gemm_core.h"
#include "ggml_blocks.h"

#define AMX_PACKED_FLAG 512

/* F16C: ggml_blocks.h's half_at (every AMX CPU has it) */
#if defined(__F16C__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512BF16__) && defined(__linux__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16       /* rows a tile pass takes: a tile's 16 rows */
#define AMX_UNIT_K 64     /* input values per packed unit */
#ifndef AMX_PREFETCH_UNITS
#define AMX_PREFETCH_UNITS 4   /* how far ahead (in units) the weights are prefetched */
#endif

/* Linux hands out AMX state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA): once
 * a process, from any thread. -1 until asked, then 1 granted or 0 refused. */
static int amx_permission = -1;

static int amx_usable(void) {
    if (amx_permission < 0) {
        const long granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */);
        __atomic_store_n(&amx_permission, granted == 0 ? 1 : 0, __ATOMIC_RELEASE);
    }
    return __atomic_load_n(&amx_permission, __ATOMIC_ACQUIRE) == 1;
}

static inline int amx_unit_bytes(int qtype) {
    switch (qtype) {
    case Q4_K: case Q4_1: return 640;
    case Q5_0: return 704;
    case Q8_0: return 1088;
    case Q6_K: return 1120;
    default: return 0;
    }
}

static inline int amx_sub_block(int qtype) { return qtype == Q6_K ? 16 : 32; }   /* values a scale */

/* Where a unit's nibble bytes start (Q4_K, Q4_1, Q5_0), after its scales (and Q5_0's fifth bits). */
static inline int amx_nibbles_at(int qtype) { return qtype == Q5_0 ? 192 : 128; }

/* Formats that keep a byte a code (Q6_K's 0..63, Q8_0's signed -128..127), and where those bytes
 * start, after the scales. */
static inline int amx_byte_codes(int qtype) { return qtype == Q6_K || qtype == Q8_0; }
static inline int amx_codes_at(int qtype) { return qtype == Q8_0 ? 64 : 96; }

/* Formats with an offset per sub-block (m_s != 0 in "a_s * D + m_s * S"), whose rows need S. */
static inline int amx_has_min(int qtype) { return qtype == Q4_K || qtype == Q4_1 || qtype == Q5_0; }

/* 1 when amx_pack packs a [out, in] matrix of qtype and the OS grants the tiles. */
__attribute__((unused)) static int amx_packs(int qtype, int64_t out, int64_t in) {
    return amx_unit_bytes(qtype) && out % 16 == 0 && in % qblock_elems(qtype) == 0 && in % AMX_UNIT_K == 0 &&
           amx_usable();
}

/* Formats the bfloat16 tiles (this file's matmul) take. Q8_0's 8-bit codes convert to bfloat16
 * too slowly: a 1-row product of the 0.5B draft's Q8_0 LM head took 5.3-5.7 ms that way against
 * 3.9-4.1 on the AVX-512 path, while int8 tiles take its bytes as they are (amx_int8.h: 2.7-3.3
 * ms), so float32 activations of Q8_0 run on int8 tiles as three int8 pieces (float32's precision
 * too; quantized.py's packed_for_tiles). */
static inline int amx_bf16_takes(int qtype) { return qtype != Q8_0; }

static inline int64_t amx_packed_row_bytes(int qtype, int64_t in) { return in / AMX_UNIT_K * amx_unit_bytes(qtype); }

/* Where, among a unit's quant bytes, B-tile pair row `row` keeps its word w = 2 o + j (output o,
 * inputs 2 row + j): rows 2c and 2c + 1 share 64 bytes, 2c in the even bytes and 2c + 1 in the odd
 * ones. Read as 32 words, such 64 bytes hold row 2c's quants in the low bytes and 2c + 1's in the
 * high bytes, so the unpacking takes both rows from one load with shifts and no widening
 * (a third fewer shuffle-port instructions than widening 32 bytes at a time: docs/benchmarks.md,
 * "Quants unpacked without widening"). Rows run 0..15 in each Q4 sub-block's tile, 0..31 over a
 * Q6_K unit. */
static inline int amx_code_byte(int row, int w) { return 64 * (row / 2) + 2 * w + row % 2; }

/* ---- packing (at load; plain C, run once) ---- */

/* The quants (unsigned codes: 0..15, 0..31 or 0..63; Q8_0's signed bytes as they are) of one
 * weight row's inputs [k0, k0 + 64), as block_<fmt> reads them from the file's block. */
static void file_codes(int qtype, const uint8_t *row, int64_t k0, uint8_t codes[AMX_UNIT_K]) {
    if (qtype == Q8_0) {   /* d, qs[32] */
        for (int h = 0; h < 2; h++) memcpy(codes + 32 * h, row + (k0 / 32 + h) * 34 + 2, 32);
    } else if (qtype == Q5_0) {   /* d, qh (bit j: value j's fifth bit), nibbles as Q4_1's */
        for (int h = 0; h < 2; h++) {
            const uint8_t *b = row + (k0 / 32 + h) * 22;
            uint32_t qh;
            memcpy(&qh, b + 2, 4);
            for (int i = 0; i < 16; i++) {
                codes[32 * h + i] = (uint8_t)((b[6 + i] & 0x0F) | ((qh >> i) & 1) << 4);
                codes[32 * h + 16 + i] = (uint8_t)((b[6 + i] >> 4) | ((qh >> (i + 16)) & 1) << 4);
            }
        }
    } else if (qtype == Q4_1) {
        for (int h = 0; h < 2; h++) {
            const uint8_t *q = row + (k0 / 32 + h) * 20 + 4;
            for (int i = 0; i < 16; i++) codes[32 * h + i] = q[i] & 0x0F, codes[32 * h + 16 + i] = q[i] >> 4;
        }
    } else if (qtype == Q4_K) {   /* 64 values: the low then the high nibbles of 32 bytes */
        const uint8_t *q = row + (k0 / 256) * 144 + 16 + 32 * ((k0 % 256) / 64);
        for (int l = 0; l < 32; l++) codes[l] = q[l] & 0x0F, codes[32 + l] = q[l] >> 4;
    } else {   /* Q6_K: 64 values are one quarter of a 128-value half */
        const uint8_t *b = row + (k0 / 256) * 210;
        const int i0 = (int)(k0 % 256), n = i0 / 128, quarter = (i0 % 128) / 32;
        const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
        for (int half = 0; half < 2; half++) {   /* quarters `quarter` and `quarter + 1` */
            const int qq = quarter + half, lo_shift = 4 * (qq / 2), hi_shift = 2 * qq;
            const uint8_t *lo = ql + 32 * (qq % 2);   /* quarters 0 and 2: ql[l]; 1 and 3: ql[l + 32] */
            for (int l = 0; l < 32; l++)
                codes[32 * half + l] = (uint8_t)(((lo[l] >> lo_shift) & 0x0F) | (((qh[l] >> hi_shift) & 3) << 4));
        }
    }
}

/* w [out, file row bytes] -> packed [out / 16][packed row bytes]; amx_packs() must hold. */
__attribute__((unused)) static void amx_pack(const uint8_t *w, int qtype, int64_t out, int64_t in, uint8_t *packed,
                                             int num_threads) {
    const int64_t row_bytes = in / qblock_elems(qtype) * qblock_bytes(qtype), units = in / AMX_UNIT_K;
    const int ub = amx_unit_bytes(qtype);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t g = 0; g < out / 16; g++)
        for (int64_t u = 0; u < units; u++) {
            uint8_t *p = packed + (g * units + u) * ub;
            const int64_t k0 = u * AMX_UNIT_K;
            memset(p, 0, (size_t)ub);
            for (int o = 0; o < 16; o++) {
                const uint8_t *row = w + (g * 16 + o) * row_bytes;
                if (qtype == Q4_K) {
                    const uint8_t *b = row + (k0 / 256) * 144;
                    const int s0 = (int)(k0 % 256) / 32;
                    memcpy(p + 2 * o, b, 2), memcpy(p + 32 + 2 * o, b + 2, 2);
                    for (int h = 0; h < 2; h++) {
                        float sc, mn;
                        scale_min_k4(s0 + h, b + 4, &sc, &mn);
                        p[64 + 16 * h + o] = (uint8_t)sc, p[96 + 16 * h + o] = (uint8_t)mn;
                    }
                } else if (qtype == Q4_1) {
                    for (int h = 0; h < 2; h++) {
                        const uint8_t *b = row + (k0 / 32 + h) * 20;
                        memcpy(p + 32 * h + 2 * o, b, 2), memcpy(p + 64 + 32 * h + 2 * o, b + 2, 2);
                    }
                } else if (qtype == Q5_0 || qtype == Q8_0) {
                    for (int h = 0; h < 2; h++)
                        memcpy(p + 32 * h + 2 * o, row + (k0 / 32 + h) * qblock_bytes(qtype), 2);
                } else { /* Q6_K */
                    const uint8_t *b = row + (k0 / 256) * 210;
                    memcpy(p + 2 * o, b + 208, 2);
                    for (int h = 0; h < 4; h++) p[32 + 16 * h + o] = b[192 + (k0 % 256) / 16 + h];
                }
                uint8_t codes[AMX_UNIT_K];
                file_codes(qtype, row, k0, codes);
                /* amx_code_byte of pair rows 2c, 2c + 1 and words 2o, 2o + 1: four adjacent bytes,
                 * inputs 4c, 4c + 2, 4c + 1, 4c + 3 */
                if (amx_byte_codes(qtype))
                    for (int c = 0; c < 16; c++) {
                        uint8_t *q = p + amx_codes_at(qtype) + amx_code_byte(2 * c, 2 * o);
                        q[0] = codes[4 * c], q[1] = codes[4 * c + 2], q[2] = codes[4 * c + 1], q[3] = codes[4 * c + 3];
                    }
                else                 /* inputs kk and kk + 32 share a byte: low and high nibble */
                    for (int c = 0; c < 8; c++) {
                        uint8_t *q = p + amx_nibbles_at(qtype) + amx_code_byte(2 * c, 2 * o);
                        for (int i = 0; i < 4; i++) {
                            const int kk = 4 * c + (i % 2) * 2 + i / 2;
                            q[i] = (uint8_t)((codes[kk] & 0x0F) | (codes[32 + kk] & 0x0F) << 4);
                            if (qtype == Q5_0)   /* byte 4 o + i of the c-th 64 */
                                for (int h = 0; h < 2; h++) {
                                    uint64_t mask;
                                    memcpy(&mask, p + 64 + 16 * c + 8 * h, 8);
                                    mask |= (uint64_t)(codes[32 * h + kk] >> 4) << (4 * o + i);
                                    memcpy(p + 64 + 16 * c + 8 * h, &mask, 8);
                                }
                        }
                    }
            }
        }
}

/* Packed rows ids[0..n) -> out [n, in] float32: exactly block_<fmt>'s values (an embedding
 * lookup, or checking the packing). */
__attribute__((unused)) static void amx_dequantize(const uint8_t *packed, int qtype, const int64_t *ids, int64_t n, int64_t in, float *out) {
    const int64_t units = in / AMX_UNIT_K;
    const int ub = amx_unit_bytes(qtype);
    for (int64_t i = 0; i < n; i++) {
        const int64_t g = ids[i] / 16;
        const int o = (int)(ids[i] % 16);
        for (int64_t u = 0; u < units; u++) {
            const uint8_t *p = packed + (g * units + u) * ub;
            float *y = out + i * in + u * AMX_UNIT_K;
            for (int kk = 0; kk < AMX_UNIT_K; kk++) {
                const int w = 2 * o + kk % 2;
                if (qtype == Q6_K) {
                    const int sub = kk / 16, q = p[amx_codes_at(qtype) + amx_code_byte(kk / 2, w)];
                    y[kk] = (float)(q - 32) * (half_at(p + 2 * o) * (float)(int8_t)p[32 + 16 * sub + o]);
                } else if (qtype == Q8_0) {
                    y[kk] = (float)(int8_t)p[amx_codes_at(qtype) + amx_code_byte(kk / 2, w)] * half_at(p + 32 * (kk / 32) + 2 * o);
                } else {
                    const int hi = kk / 32, byte = amx_code_byte((kk % 32) / 2, w);
                    int q = (p[amx_nibbles_at(qtype) + byte] >> (4 * hi)) & 0x0F;
                    if (qtype == Q5_0) {
                        uint64_t mask;
                        memcpy(&mask, p + 64 + 16 * (byte / 64) + 8 * hi, 8);
                        q |= (int)((mask >> (byte % 64)) & 1) << 4;
                        y[kk] = (float)(q - 16) * half_at(p + 32 * hi + 2 * o);
                    } else if (qtype == Q4_K) {
                        const float d1 = half_at(p + 2 * o) * (float)p[64 + 16 * hi + o];
                        const float m1 = half_at(p + 32 + 2 * o) * (float)p[96 + 16 * hi + o];
                        y[kk] = (float)q * d1 - m1;
                    } else {
                        y[kk] = (float)q * half_at(p + 32 * hi + 2 * o) + half_at(p + 64 + 32 * hi + 2 * o);
                    }
                }
            }
        }
    }
}

/* ---- the matmul ---- */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;

/* Lanes: how many sub-blocks one tile multiply takes, each in its own A rows. A tile multiply
 * covers at most 32 input values (one B tile: 16 pair rows); Q4_K's, Q4_1's and Q5_0's 32-value sub-block
 * fills it (1 lane). Q6_K's 16-value sub-blocks go two to a multiply for a pass of up to 8 rows
 * (2 lanes): A row 2 r + l holds row r's values of the step's sub-block l and zeros in the
 * other's place, so C rows 2 r and 2 r + 1 are the two sub-blocks' sums, for half the tile
 * multiplies, B loads and C stores of one sub-block a multiply. Adding the zero lane's products
 * (exact zeros) leaves every sum as it is, so both ways give the same bits (the row-invariance
 * tests compare them); more rows take 1 lane, 16 rows a pass, which is faster there. */
static inline int amx_lanes(int qtype, int64_t rows) { return qtype == Q6_K && rows <= AMX_ROWS / 2 ? 2 : 1; }

/* Tiles: 0, 1 sums of two steps (C: lanes x the pass's rows, 16 outputs); 2, 3, 4 the three
 * activation pieces of one step (A: the same rows, kv bfloat16 each); 5, 6 the two steps' quants
 * (B: kv / 2 pair rows of 16 outputs x 2). A step takes kv = lanes x SB input values. */
static void amx_configure(int a_rows, int kv) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 2; t++) cfg.rows[t] = (uint8_t)a_rows, cfg.colsb[t] = 64;
    for (int t = 2; t < 5; t++) cfg.rows[t] = (uint8_t)a_rows, cfg.colsb[t] = (uint16_t)(2 * kv);
    for (int t = 5; t < 7; t++) cfg.rows[t] = (uint8_t)(kv / 2), cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* bfloat16 of small integers: word i is first + i % period (exact: |first + i| <= 32). Q6_K's
 * pair of tables maps i in 0..63 to i - 32; Q4's repeats 0..15 twice, so a word's bit 4 (the
 * next nibble's lowest bit) picks the same value. */
static inline __m512i bf16_table(int first, int period) {
    __attribute__((aligned(64))) uint16_t t[32];
    for (int i = 0; i < 32; i++) {
        const float f = (float)(first + i % period);
        uint32_t u;
        memcpy(&u, &f, 4);
        t[i] = (uint16_t)(u >> 16);
    }
    return _mm512_load_si512(t);
}

/* Sub-block h's codes in the c-th 64 nibble bytes of a packed unit, one a byte (the nibble, and
 * for Q5_0 the fifth bit from its mask as bit 4): both tile arithmetics unpack Q5_0 through it. */
static inline __m512i amx_nibble_bytes(int qtype, const uint8_t *p, int c, int h) {
    const __m512i v = _mm512_loadu_si512(p + amx_nibbles_at(qtype) + 64 * c);
    const __m512i nib = _mm512_and_si512(h ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0F));
    if (qtype != Q5_0) return nib;
    uint64_t mask;
    memcpy(&mask, p + 64 + 16 * c + 8 * h, 8);
    return _mm512_or_si512(nib, _mm512_maskz_mov_epi8(_cvtu64_mask64(mask), _mm512_set1_epi8(0x10)));
}

/* One packed unit's quants -> its B tiles as bfloat16, 2048 bytes: [sub-block][SB / 2][32]. Each
 * 64-byte load is 32 words holding two pair rows' quants (amx_code_byte), which a word permute
 * reads through its index's low bits: the low byte's (shift 0), or the high byte's (shift 8);
 * for nibbles also shifts 4 and 12. */
static inline void amx_unpack_unit(int qtype, const uint8_t *p, uint16_t *b) {
    if (qtype == Q6_K) {   /* bytes 0..63 -> bfloat16 of q - 32, 32 rows of 32 */
        const __m512i lo = bf16_table(-32, 32), hi = bf16_table(0, 32);
        for (int c = 0; c < 16; c++) {
            const __m512i v = _mm512_loadu_si512(p + 96 + 64 * c);
            _mm512_store_si512(b + 2 * c * 32, _mm512_permutex2var_epi16(lo, v, hi));
            _mm512_store_si512(b + (2 * c + 1) * 32, _mm512_permutex2var_epi16(lo, _mm512_srli_epi16(v, 8), hi));
        }
        return;
    }
    if (qtype == Q5_0) {   /* 5-bit codes in bytes (amx_nibble_bytes), a word permute per pair row */
        const __m512i tab = bf16_table(0, 32);
        for (int c = 0; c < 8; c++)
            for (int h = 0; h < 2; h++) {   /* sub-block h's tile: pair rows 2 c (low bytes), 2 c + 1 */
                const __m512i v = amx_nibble_bytes(qtype, p, c, h);
                _mm512_store_si512(b + 512 * h + 2 * c * 32, _mm512_permutexvar_epi16(v, tab));
                _mm512_store_si512(b + 512 * h + (2 * c + 1) * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), tab));
            }
        return;
    }
    const __m512i tab = bf16_table(0, 16);
    for (int c = 0; c < 8; c++) {   /* low nibbles: sub-block 0's tile, high: sub-block 1's */
        const __m512i v = _mm512_loadu_si512(p + 128 + 64 * c);
        _mm512_store_si512(b + 2 * c * 32, _mm512_permutexvar_epi16(v, tab));
        _mm512_store_si512(b + 512 + 2 * c * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), tab));
        _mm512_store_si512(b + (2 * c + 1) * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), tab));
        _mm512_store_si512(b + 512 + (2 * c + 1) * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), tab));
    }
}

/* Every line of a packed unit into L1 ahead of its use (AMX_PREFETCH_UNITS units ahead). */
static inline void amx_prefetch_unit(const uint8_t *unit, int ub) {
    for (int line = 0; line < ub; line += 64) prefetch_l1(unit + line);
}

/* While unit t is multiplied: prefetch a later unit of the group gp, and unpack unit t + 1 into
 * the other half of the two-unit ring. */
static inline void amx_next_unit(int qtype, const uint8_t *gp, int64_t t, int ub, uint16_t *ring) {
    amx_prefetch_unit(gp + (t + AMX_PREFETCH_UNITS) * ub, ub);
    amx_unpack_unit(qtype, gp + (t + 1) * ub, ring + ((t + 1) & 1) * 1024);
}

/* Sub-block h of a unit: the 16 outputs' scale a and offset m (m = 0 for Q6_K). */
static inline void amx_unit_scales(int qtype, const uint8_t *p, int h, __m512 *a, __m512 *m) {
    if (qtype == Q4_K) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
        *a = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 64 + 16 * h)))));
        /* -(dmin * min): the product is exact, so negating it is too */
        *m = _mm512_sub_ps(_mm512_setzero_ps(),
                           _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 96 + 16 * h))))));
    } else if (qtype == Q4_1) {
        *a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32 * h)));
        *m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 64 + 32 * h)));
    } else if (qtype == Q5_0) {   /* w = d (q - 16) = d q + (-16 d); -16 d is exact */
        *a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32 * h)));
        *m = _mm512_mul_ps(*a, _mm512_set1_ps(-16.0f));
    } else if (qtype == Q8_0) {   /* w = d q, q signed */
        *a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32 * h)));
        *m = _mm512_setzero_ps();
    } else {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        *a = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 32 + 16 * h)))));
        *m = _mm512_setzero_ps();
    }
}

static inline __m512 bf16_to_float(__m256bh h) { /* exact: a bfloat16 is a float32's top half */
    __m256i bits;
    memcpy(&bits, &h, sizeof bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* The float32 sum of one sub-block's n activations, in order: S in "a_s * D + m_s * S" (both
 * tile arithmetics take it from here, so their offsets are summed alike). */
static inline float amx_sub_block_sum(const float *x, int n) {
    float t = 0.0f;
    for (int i = 0; i < n; i++) t += x[i];
    return t;
}

/* R <= Rt <= AMX_ROWS / L rows -> xp [3][L Rt][in] bfloat16 pieces (piece-major: A row
 * i L Rt + L r + l is piece i of row r, with the values of lane l's sub-blocks and zeros in the
 * others'; rows past L R zero) and, with sums, S [R][in / sb] the float32 sum of each sub-block
 * (in order). */
static void amx_split_rows(const float *x, int64_t ldx, int R, int Rt, int64_t in, int sb, int L, uint16_t *xp,
                           float *S) {
    const int A = L * Rt;
    for (int a = L * R; a < A; a++)
        for (int i = 0; i < 3; i++) memset(xp + (i * A + a) * in, 0, (size_t)in * 2);
    const __m256i zero = _mm256_setzero_si256();
    for (int r = 0; r < R; r++) {
        const float *xr = x + r * ldx;
        for (int64_t k = 0; k < in; k += 16) {
            const __m512 v = _mm512_loadu_ps(xr + k);
            const __m256bh p1 = _mm512_cvtneps_pbh(v);
            const __m512 r1 = _mm512_sub_ps(v, bf16_to_float(p1));
            const __m256bh p2 = _mm512_cvtneps_pbh(r1);
            const __m512 r2 = _mm512_sub_ps(r1, bf16_to_float(p2));
            const __m256bh p3 = _mm512_cvtneps_pbh(r2);
            const int lane = (int)((k / sb) % L);   /* 16 values lie in one sub-block */
            for (int l = 0; l < L; l++) {
                uint16_t *row = xp + (L * r + l) * in + k;
                if (l == lane) {
                    memcpy(row, &p1, 32), memcpy(row + A * in, &p2, 32), memcpy(row + 2 * A * in, &p3, 32);
                } else {
                    memcpy(row, &zero, 32), memcpy(row + A * in, &zero, 32), memcpy(row + 2 * A * in, &zero, 32);
                }
            }
        }
        if (S)
            for (int64_t s = 0; s < in / sb; s++) S[r * (in / sb) + s] = amx_sub_block_sum(xr + s * sb, sb);
    }
}

/* The 16 outputs of group g for R rows of a tile pass of Rt (amx_split_rows with L lanes):
 * acc[r] over every unit, in order, the group's quants unpacked unit by unit into a ring of two
 * (again for every pass: from L1/L2, measured as fast as unpacking a group once into a buffer
 * for all passes, and 1.2x faster at 11-16 rows, where that buffer leaves L1). */
static void amx_group_rows(int qtype, int L, const uint8_t *gp, int64_t in, const uint16_t *xp, const float *S, int R,
                           int Rt, uint16_t *ring, float *cbuf, float *out, int64_t ldo) {
    const int sb = amx_sub_block(qtype), ub = amx_unit_bytes(qtype), kv = L * sb, steps = AMX_UNIT_K / kv;
    const int64_t units = in / AMX_UNIT_K, ns = in / sb;
    const int64_t piece = (int64_t)L * Rt * in;   /* the pieces' A rows are L Rt apart */
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    amx_unpack_unit(qtype, gp, ring);
    /* unit t's tile multiplies, then unit t - 1's float work (its sums wait in cbuf) */
    for (int64_t t = 0; t <= units; t++) {
        if (t < units) {
            const uint16_t *b = ring + (t & 1) * 1024;
            if (t + 1 < units) amx_next_unit(qtype, gp, t, ub, ring);
            float *c = cbuf + (t & 1) * (steps * 256);
            for (int st = 0; st < steps; st += 2) {   /* steps st and st + 1 into C0 and C1 */
                const int64_t k = t * AMX_UNIT_K + st * kv;
                _tile_zero(0);
                _tile_zero(1);
                _tile_loadd(5, b + st * kv * 16, 64);
                _tile_loadd(6, b + (st + 1) * kv * 16, 64);
                _tile_loadd(2, xp + k, in * 2);
                _tile_loadd(3, xp + piece + k, in * 2);
                _tile_loadd(4, xp + 2 * piece + k, in * 2);
                _tile_dpbf16ps(0, 2, 5);   /* C0 += piece 1, then 2, then 3: the sum of q * x */
                _tile_dpbf16ps(0, 3, 5);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(2, xp + k + kv, in * 2);
                _tile_loadd(3, xp + piece + k + kv, in * 2);
                _tile_loadd(4, xp + 2 * piece + k + kv, in * 2);
                _tile_dpbf16ps(1, 2, 6);
                _tile_dpbf16ps(1, 3, 6);
                _tile_dpbf16ps(1, 4, 6);
                _tile_stored(0, c + st * 256, 64);
                _tile_stored(1, c + (st + 1) * 256, 64);
            }
        }
        if (t > 0) {
            const int64_t u = t - 1;
            const uint8_t *p = gp + u * ub;
            const float *c = cbuf + (u & 1) * (steps * 256);
            for (int h = 0; h < AMX_UNIT_K / sb; h++) {   /* sub-block h: step h / L, lane h % L */
                __m512 a, m;
                amx_unit_scales(qtype, p, h, &a, &m);
                const int64_t s = u * (AMX_UNIT_K / sb) + h;
                const float *ch = c + (h / L) * 256 + (h % L) * 16;
                for (int r = 0; r < R; r++) {
                    acc[r] = _mm512_fmadd_ps(_mm512_load_ps(ch + L * r * 16), a, acc[r]);
                    if (S) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(S[r * ns + s]), m, acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

/* ---- per-piece sums (Q4_K, Q4_1, Q5_0) ----
 * A 32-value sub-block fills a tile multiply, so the 1-lane way above runs three multiplies per
 * sub-block (one a piece) whatever the row count: a 1-row step is bound by them. Here the three
 * pieces of a row are three A ROWS (piece-major: A row i per + r), so one multiply a sub-block
 * gives every piece's sum in its own C row, D = (C_3 + C_2) + C_1 follows in float32, then
 * a_s * D + m_s * S as above: a third of the tile multiplies at 1-5 rows, the same stores (a
 * 1-row Q4_K matrix in 0.6x-0.7x the time; 16-64 rows 1.2x-1.5x, three C rows a row in place of
 * one: docs/benchmarks.md, "AMX tiles: a third of the tile multiplies"). A pass takes up to AMX_PIECE_ROWS rows (15 A
 * rows); two passes share each B tile load. Each piece's sum depends only on its own A row, so
 * rows stay invariant. */
#define AMX_PIECE_ROWS 5

/* Tiles: 0, 1 pass 0's sums of a unit's two sub-blocks, 2, 3 pass 1's (C: 3 per rows of 16
 * outputs); 4, 7 activations (A: 3 per rows of 32 bfloat16); 5, 6 the two sub-blocks' quants. */
static void amx_configure_pieces(int per) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int a_rows = per == 1 ? 6 : 3 * per;   /* one row: a unit's two sub-blocks stacked */
    for (int t = 0; t < 8; t++) cfg.rows[t] = (uint8_t)a_rows, cfg.colsb[t] = 64;
    cfg.rows[5] = cfg.rows[6] = 16;
    _tile_loadconfig(&cfg);
}

/* Float work of one pass of R rows over unit u's sums c (two sub-blocks, 256 floats apart). */
static inline void amx_pieces_float(int qtype, const uint8_t *p, int64_t u, const float *c, int h_stride, int per,
                                    int R, const float *S, int64_t ns, __m512 *acc) {
    for (int h = 0; h < 2; h++) {
        __m512 a, m;
        amx_unit_scales(qtype, p, h, &a, &m);
        const int64_t s = u * 2 + h;
        const float *ch = c + h * h_stride;
        for (int r = 0; r < R; r++) {
            const __m512 d = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(ch + (2 * per + r) * 16),
                                                         _mm512_load_ps(ch + (per + r) * 16)),
                                           _mm512_load_ps(ch + r * 16));
            acc[r] = _mm512_fmadd_ps(d, a, acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(S[r * ns + s]), m, acc[r]);
        }
    }
}

/* The 16 outputs of group g for one or two passes (R0 rows at xp0, R1 >= 0 at xp1; per rows
 * each in the tiles): acc over every unit, in order; pass 1's rows follow pass 0's in out. */
static void amx_group_pieces(int qtype, const uint8_t *gp, int64_t in, const uint16_t *xp0, const uint16_t *xp1,
                             const float *S0, const float *S1, int per, int R0, int R1, uint16_t *ring, float *cbuf,
                             float *out, int64_t ldo) {
    const int ub = amx_unit_bytes(qtype);
    const int64_t units = in / AMX_UNIT_K, ns = in / 32;
    __m512 acc0[AMX_PIECE_ROWS], acc1[AMX_PIECE_ROWS];
    for (int r = 0; r < AMX_PIECE_ROWS; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    amx_unpack_unit(qtype, gp, ring);
    for (int64_t t = 0; t <= units; t++) {
        if (t < units) {
            const uint16_t *b = ring + (t & 1) * 1024;
            if (t + 1 < units) amx_next_unit(qtype, gp, t, ub, ring);
            float *c = cbuf + (t & 1) * 1024;
            const int64_t k = t * AMX_UNIT_K;
            _tile_zero(0);
            _tile_zero(1);
            _tile_loadd(5, b, 64);
            _tile_loadd(6, b + 512, 64);
            _tile_loadd(4, xp0 + k, in * 2);
            _tile_loadd(7, xp0 + k + 32, in * 2);
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 7, 6);
            if (R1) {
                _tile_zero(2);
                _tile_zero(3);
                _tile_loadd(4, xp1 + k, in * 2);
                _tile_loadd(7, xp1 + k + 32, in * 2);
                _tile_dpbf16ps(2, 4, 5);
                _tile_dpbf16ps(3, 7, 6);
            }
            _tile_stored(0, c, 64);
            _tile_stored(1, c + 256, 64);
            if (R1) {
                _tile_stored(2, c + 512, 64);
                _tile_stored(3, c + 768, 64);
            }
        }
        if (t > 0) {
            const int64_t u = t - 1;
            const float *c = cbuf + (u & 1) * 1024;
            amx_pieces_float(qtype, gp + u * ub, u, c, 256, per, R0, S0, ns, acc0);
            if (R1) amx_pieces_float(qtype, gp + u * ub, u, c + 512, 256, per, R1, S1, ns, acc1);
        }
    }
    for (int r = 0; r < R0; r++) _mm512_storeu_ps(out + r * ldo, acc0[r]);
    for (int r = 0; r < R1; r++) _mm512_storeu_ps(out + (per + r) * ldo, acc1[r]);
}

/* One row (a decode step): a unit's two sub-blocks stacked in ONE C tile, sub-block 0's three
 * piece sums in rows 0-2 and sub-block 1's in rows 3-5, so a unit takes one tile store instead of
 * two (a store costs more than a multiply of up to 8 A rows: docs/benchmarks.md, "One tile store
 * a unit"). Each multiply's A tile holds its sub-block's pieces in its own rows and zeros in the
 * other's (xp: three zero rows, the three pieces, three zero rows, each of in values), so every
 * C row gets its own sub-block's products plus exact zeros: the bits of amx_group_pieces. */
static void amx_group_one_row(int qtype, const uint8_t *gp, int64_t in, const uint16_t *xp, const float *S,
                              uint16_t *ring, float *cbuf, float *out) {
    const int ub = amx_unit_bytes(qtype);
    const int64_t units = in / AMX_UNIT_K, ns = in / 32;
    const uint16_t *pieces = xp + 3 * in;   /* A rows: pieces 1-3 then zeros (sub-block 0) */
    __m512 acc = _mm512_setzero_ps();
    amx_unpack_unit(qtype, gp, ring);
    for (int64_t t = 0; t <= units; t++) {
        if (t < units) {
            const uint16_t *b = ring + (t & 1) * 1024;
            if (t + 1 < units) amx_next_unit(qtype, gp, t, ub, ring);
            const int64_t k = t * AMX_UNIT_K;
            _tile_zero(0);
            _tile_loadd(5, b, 64);
            _tile_loadd(6, b + 512, 64);
            _tile_loadd(4, pieces + k, in * 2);
            _tile_loadd(7, xp + k + 32, in * 2);   /* zeros then pieces 1-3 (sub-block 1) */
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(0, 7, 6);
            _tile_stored(0, cbuf + (t & 1) * 96, 64);
        }
        if (t > 0)
            amx_pieces_float(qtype, gp + (t - 1) * ub, t - 1, cbuf + ((t - 1) & 1) * 96, 48, 1, 1, S, ns, &acc);
    }
    _mm512_storeu_ps(out, acc);
}

/* Rows a call takes at once (both tile arithmetics): each 16-output group re-reads the activation
 * pieces of all the call's rows (3 bfloat16 or 3 int8 values a value), so a long prompt's pieces
 * (27 MB for 512 rows of an 8960-wide input) would stream from memory once a group. In chunks whose
 * pieces fit in AMX_CHUNK_BYTES of a core's L2, each chunk runs every group, and the weights stream
 * once a chunk instead. A row's result never depends on its chunk (row-invariance, below). */
#ifndef AMX_CHUNK_BYTES
#define AMX_CHUNK_BYTES (128 * 1024)
#endif
static inline int64_t amx_row_chunk(int64_t in) {
    const int64_t rows = AMX_CHUNK_BYTES / (6 * in);
    return rows < 16 ? 16 : rows;
}

/* A thread's scratch (grown as needed, kept between calls): activation pieces and sums for all
 * rows, a ring of two unpacked units, two units' tile sums. */
static __thread uint8_t *amx_scratch;
static __thread int64_t amx_scratch_len;

static uint8_t *amx_scratch_for(int64_t len) {
    if (amx_scratch_len < len) {
        free(amx_scratch);
        amx_scratch = aligned_alloc(64, (size_t)((len + 63) / 64 * 64));
        amx_scratch_len = amx_scratch ? len : 0;
    }
    return amx_scratch;
}

/* out = x @ w.T (+ bias), w packed by amx_pack; called by every thread of an enclosing parallel
 * region (an orphaned omp for over 16-output groups). Rows go in passes as even as can be (Q6_K:
 * up to amx_lanes' 8 or 16 rows; Q4_K, Q4_1 and Q5_0: up to AMX_PIECE_ROWS, two to a chunk); a chunk's
 * rows are one call of amx_group_rows or amx_group_pieces. Returns 0, or -3 when scratch memory
 * could not be allocated (out is then incomplete). */
static int amx_gemm_team(const float *x, int64_t ldx, int64_t rows, const uint8_t *w, int qtype, int64_t out_features,
                         int64_t in, const float *bias, float *out, int64_t ldo) {
    if (!amx_bf16_takes(qtype)) return -1;
    if (rows <= 0) return 0;   /* nothing to do (and no pass to size) */
    const int sb = amx_sub_block(qtype), pieces = qtype != Q6_K, L = amx_lanes(qtype, rows);
    const int64_t cap = pieces ? AMX_PIECE_ROWS : AMX_ROWS / L;
    const int64_t passes = (rows + cap - 1) / cap, groups = out_features / 16, ns = in / sb;
    /* one tile shape for every pass (a configuration change is slow and clears the tiles): a
     * short pass runs with zero rows, which change no other row's sums */
    const int per = (int)((rows + passes - 1) / passes);
    const int64_t per_chunk = pieces ? 2 : 1, chunks = (passes + per_chunk - 1) / per_chunk;
    const int64_t row_bytes = amx_packed_row_bytes(qtype, in);
    const int one_row = pieces && rows == 1;   /* amx_group_one_row: zero rows around the pieces */
    const int64_t pass_elems = (one_row ? 9 : 3 * (int64_t)L * per) * in;   /* a pass's A rows, bfloat16 */
    const int64_t xp_bytes = passes * pass_elems * 2, s_bytes = (passes * per * ns * 4 + 63) / 64 * 64;
    const int64_t fixed = 2 * 2048 + 2 * 4 * 256 * 4;   /* the ring of two units, two units' sums */
    uint8_t *buf = amx_scratch_for(xp_bytes + s_bytes + fixed);
    const int ok = buf != NULL && amx_usable();
    uint16_t *xp = (uint16_t *)buf;
    float *S = ok && amx_has_min(qtype) ? (float *)(buf + xp_bytes) : NULL;
    uint16_t *ring = ok ? (uint16_t *)(buf + xp_bytes + s_bytes) : NULL;
    float *cbuf = ok ? (float *)(buf + xp_bytes + s_bytes + 2 * 2048) : NULL;
    if (ok && one_row) {   /* rows 0-2 and 6-8 zero, the pieces between */
        memset(xp, 0, (size_t)(3 * in) * 2);
        memset(xp + 6 * in, 0, (size_t)(3 * in) * 2);
        amx_split_rows(x, ldx, 1, 1, in, sb, 1, xp + 3 * in, S);
    } else if (ok)
        for (int64_t ps = 0; ps < passes; ps++) {
            const int R = (int)(rows - ps * per < per ? rows - ps * per : per);
            amx_split_rows(x + ps * per * ldx, ldx, R, per, in, sb, L, xp + ps * pass_elems, S ? S + ps * per * ns : NULL);
        }
    int configured = 0;
#pragma omp for schedule(dynamic, work_chunk(groups))
    for (int64_t g = 0; g < groups; g++) {
        if (!ok) continue;
        const uint8_t *gp = w + g * row_bytes;
        if (!configured) {
            if (pieces) amx_configure_pieces(per);
            else amx_configure(L * per, L * sb);
            configured = 1;
        }
        for (int64_t ch = 0; ch < chunks; ch++) {
            const int64_t p0 = ch * per_chunk, r0 = p0 * per;
            const int R0 = (int)(rows - r0 < per ? rows - r0 : per);
            float *o = out + r0 * ldo + g * 16;
            int R = R0;
            if (one_row) {
                amx_group_one_row(qtype, gp, in, xp, S, ring, cbuf, o);
            } else if (pieces) {
                const int R1 = p0 + 1 < passes ? (int)(rows - r0 - per < per ? rows - r0 - per : per) : 0;
                amx_group_pieces(qtype, gp, in, xp + p0 * pass_elems, xp + (p0 + 1) * pass_elems, S + p0 * per * ns,
                                 S + (p0 + 1) * per * ns, per, R0, R1, ring, cbuf, o, ldo);
                R = R1 ? per + R1 : R0;
            } else {
                amx_group_rows(qtype, L, gp, in, xp + p0 * pass_elems, S ? S + p0 * per * ns : NULL, R0, per, ring,
                               cbuf, o, ldo);
            }
            if (bias) {
                const __m512 bv = _mm512_loadu_ps(bias + g * 16);
                for (int r = 0; r < R; r++) _mm512_storeu_ps(o + r * ldo, _mm512_add_ps(_mm512_loadu_ps(o + r * ldo), bv));
            }
        }
    }
    if (configured) _tile_release();
    return ok ? 0 : -3;
}

#endif /* AMX */
#endif /* SPECSERVE_AMX_TILES_H */
