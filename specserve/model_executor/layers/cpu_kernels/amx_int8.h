/* The matmul on AMX int8 tiles: each activation row as P int8 pieces (P = 1-4), byte products
 * (TDPBSUD) over the same packed weights as amx_tiles.h.
 *
 * Included by quant_blocks.h (and quant_gemm.c); quant_gemm_team() calls amx_i8_gemm_team() when
 * the caller sets AMX_PACKED_FLAG | AMX_I8_FLAG in qtype, the piece count in Q8_PIECES_SHIFT's
 * bits (QuantizedMatrix.packed_for_tiles: int8_activations=P on CPUs with AMX, True being 1 piece,
 * and float32 activations of Q8_0 as 3). P = 3 carries float32's precision (below); P = 1 is
 * llama.cpp's kind of int8 activations, rounded per sub-block (q8_act.h rounds per 256 values).
 * Includes amx_tiles.h (HAVE_AMX, the packing, the tile configuration and scratch,
 * amx_unit_scales, ...), gemm_core.h (work_chunk) and ggml_blocks.h (the formats).
 *
 * Why: a quant stays a byte (a nibble mask, no table), and the P pieces of a row are P A-tile
 * ROWS, so one tile multiply per sub-block serves up to 16 / P rows with all their pieces: a
 * decode step and a verification of up to 16 rows (1 piece) or 5 (3 pieces) cost the same tile
 * work. Where a pass's pieces fit a tile twice (2 P R <= 16: 1 piece up to 8 rows, 3 pieces up to
 * 2), two lanes put a step's two sub-blocks in ONE multiply (amx_i8_lanes), which halves the
 * tile loads, multiplies and stores of a decode step (a 1-piece Q4_K matrix at 1 row: 0.8 ms
 * without lanes, 0.35 with).
 *
 * Cost, 1 piece (`specserve bench kernels --parts matmul --formats Q4_K,Q4_1,Q5_0,Q8_0,Q6_K
 * --out 8960 --in 1536 --rows 1,5,9,16,64 --tiles --int8-activations on`, docs/benchmarks.md
 * "CPU kernels"): against q8_act.h's VNNI kernel on the same matrix, 1.03x-1.12x at 1 row,
 * 1.8x-2.5x at 5 rows, 2.2x-3.3x at 9, 2.2x-3.8x at 16 and 3.0x-3.9x at 64. Q6_K's packing (a
 * byte a code, 8.75 bits a weight) streams a third more than its file at 1 row, so with 1-2
 * pieces Q6_K keeps the VNNI kernel (quant_gemm.Q6_K_INT8_TILES_FROM_PIECES). 3 pieces: a
 * 1-row Qwen2.5-Coder-1.5B forward took 0.77x-0.98x the bfloat16 tiles' time and 4-5 rows
 * 0.97x-1.45x, but 6 rows and more 1.2x-1.9x (three int32 tile rows to store per row and
 * sub-block against bfloat16's one; measured before lanes), so float32 activations take the
 * bfloat16 tiles except Q8_0's. Tried and dropped: the pieces of up to 16 rows in three separate
 * A tiles (six C tiles a step; the same bits, since the sums are exact) stored as much and ran 16
 * rows at 2x bfloat16's time; unpacking a group once for all its passes measured no faster. The C
 * tiles' double buffering below measured no faster than storing each step at once either; it is
 * kept because it costs nothing.
 *
 * Arithmetic (sub-block s of SB values: 32 for Q4_K, Q4_1, Q5_0 and Q8_0, 16 for Q6_K; row r):
 *   - pieces: c_0 = x; for i = 0 .. P - 1: d_i = max|c_i| / 127 over the sub-block, p_i =
 *     round(c_i / d_i) (int8), c_{i+1} = c_i - d_i p_i. So x = sum_i d_i p_i + c_P with
 *     |c_P| <= max|x| / (2 * 127 * 254^(P - 1)): for P = 3 under 2^-24 max|x|, float32's
 *     precision for the sub-block's largest value (docs/architecture.md, "Numerics");
 *   - one TDPBSUD per sub-block (or per two, with lanes): C[P r + i][o] = sum p_i * q (signed
 *     bytes times the unsigned quant codes), an exact int32 (|C| < 2^21);
 *   - D = d_{P-1} C_{P-1} + ... + d_0 C_0 (smallest first; Q6_K's codes are q + 32 and Q8_0's
 *     q + 128, so each C_i first loses 32 or 128 times sum p_i, exactly, in int32);
 *   - out[r, o] = sum over s, in order, of  a_s * D  then  + m_s * S, S the float32 sum of x over
 *     the sub-block: the file's values w = a_s * q + m_s as in amx_tiles.h.
 * Not bit-identical to the bfloat16 path or to the AVX-512 kernel (other roundings), so a
 * matrix uses one path for every row count.
 *
 * Row-invariant: a row's pieces depend on that row alone; each output element of a tile
 * multiply depends only on its own A row and B column (with lanes, the other sub-block's
 * columns hold zeros, which add exact zeros to the int32 sums); rows are taken at most
 * amx_i8_rows(P) a pass, each in its own A rows; each 16-output group is computed whole by one
 * thread. So a row's result never depends on the row count or thread count.
 */
#ifndef SPECSERVE_AMX_INT8_H
#define SPECSERVE_AMX_INT8_H

#include "gemm_core.h"
#include "ggml_blocks.h"
#include "amx_tiles.h"

#define AMX_I8_FLAG 4096

#if defined(HAVE_AMX) && defined(__AMX_INT8__)
#define HAVE_AMX_I8 1

#define AMX_I8_MAX_PIECES 4
static inline int amx_i8_rows(int np) { return AMX_ROWS / np; }   /* activation rows a tile pass: 16, 8, 5, 4 */
/* Lanes of a pass of per rows: 2 where its pieces fit a tile twice. A step's two sub-blocks then
 * take ONE multiply (K = 2 SB): each piece has two A rows, lane 0 with sub-block 0's values and
 * zeros in sub-block 1's place, lane 1 the other way round, so each C row holds one sub-block's
 * sum plus exact zeros (int32: the same bits as two multiplies) in half the tile work. */
static inline int amx_i8_lanes(int np, int per) { return 2 * np * per <= AMX_ROWS ? 2 : 1; }

/* Rows x[0..R) of a pass -> xa [L Rt][in] int8 (A row L (np r + i) + l is piece i of row r, with
 * the values of lane l's sub-blocks, s % L == l, and zeros in the others'; rows past L np R zero),
 * xd [Rt][in / sb] each piece's scale per sub-block, and per row and sub-block S (the float32 sum
 * of x, formats with an offset) or P [Rt][in / sb] each piece's sum (Q6_K, Q8_0). Only the first
 * np R rows of xd and P are written: the sums of the zero rows are never read. */
static void amx_i8_split_rows(const float *x, int64_t ldx, int R, int Rt, int np, int L, int64_t in, int sb,
                              int8_t *xa, float *xd, float *S, int32_t *P) {
    const int64_t ns = in / sb;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const int nv = sb / 16;   /* vectors a sub-block: 1 or 2 */
    if (L == 1) memset(xa + np * R * in, 0, (size_t)((Rt - np * R) * in));
    else memset(xa, 0, (size_t)(L * Rt * in));
    for (int r = 0; r < R; r++) {
        const float *xr = x + r * ldx;
        for (int64_t s = 0; s < ns; s++) {
            __m512 c[2];
            for (int v = 0; v < nv; v++) c[v] = _mm512_loadu_ps(xr + s * sb + 16 * v);
            if (S) S[r * ns + s] = amx_sub_block_sum(xr + s * sb, sb);
            for (int piece = 0; piece < np; piece++) {
                __m512 amax = _mm512_andnot_ps(sign, c[0]);
                if (nv == 2) amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, c[1]));
                const float m = _mm512_reduce_max_ps(amax);
                const float d = m / 127.0f, id = m > 0.0f ? 127.0f / m : 0.0f;
                const int64_t arow = np * r + piece, lane_row = L * arow + s % L;
                int32_t psum = 0;
                for (int v = 0; v < nv; v++) {
                    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(c[v], _mm512_set1_ps(id)));   /* |q| <= 127 */
                    _mm_storeu_si128((__m128i *)(xa + lane_row * in + s * sb + 16 * v), _mm512_cvtsepi32_epi8(q));
                    c[v] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(d), c[v]);
                    psum += _mm512_reduce_add_epi32(q);
                }
                xd[arow * ns + s] = d;
                if (P) P[arow * ns + s] = psum;
            }
        }
    }
}

/* What a format's unsigned B-tile code adds to its quant: Q6_K's codes are q + 32, Q8_0's q + 128
 * (amx_i8_unpack_unit); each C_i then loses offset * (the piece's sum over the sub-block), P. */
static inline int32_t amx_i8_code_offset(int qtype) { return qtype == Q6_K ? 32 : qtype == Q8_0 ? 128 : 0; }

/* One packed unit's quants -> its B tiles as bytes in TDPBSUD's order, [sub-block][SB / 4][64]
 * (1024 bytes): row j of a sub-block holds, per output o, its codes of inputs 4 j .. 4 j + 3.
 * The packing's pair rows 2 j and 2 j + 1 share 64 bytes (amx_code_byte), per output o the bytes
 * 4 o .. 4 o + 3 holding inputs 4 j, 4 j + 2, 4 j + 1, 4 j + 3, so one byte shuffle orders them. */
static inline void amx_i8_unpack_unit(int qtype, const uint8_t *p, uint8_t *b) {
    const __m512i quads = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15));
    if (amx_byte_codes(qtype)) {   /* a byte a code: Q6_K 4 sub-blocks x 4 rows, Q8_0 2 x 8 */
        /* Q8_0's signed codes q -> q + 128 (flipping the top bit), unsigned as TDPBSUD takes them */
        const __m512i flip = _mm512_set1_epi8(qtype == Q8_0 ? (char)0x80 : 0);
        for (int j = 0; j < 16; j++)
            _mm512_store_si512(b + 64 * j, _mm512_xor_si512(_mm512_shuffle_epi8(
                                               _mm512_loadu_si512(p + amx_codes_at(qtype) + 64 * j), quads), flip));
        return;
    }
    if (qtype == Q5_0) {   /* 5-bit codes, one a byte, then ordered as the nibbles below */
        for (int j = 0; j < 8; j++)
            for (int h = 0; h < 2; h++)
                _mm512_store_si512(b + 512 * h + 64 * j, _mm512_shuffle_epi8(amx_nibble_bytes(qtype, p, j, h), quads));
        return;
    }
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 8; j++) {   /* low nibbles: sub-block 0, high: sub-block 1 */
        const __m512i v = _mm512_shuffle_epi8(_mm512_loadu_si512(p + 128 + 64 * j), quads);
        _mm512_store_si512(b + 64 * j, _mm512_and_si512(v, m4));
        _mm512_store_si512(b + 512 + 64 * j, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
    }
}

/* Tiles: 0-3 the sums of a unit's sub-blocks (C: L Rt rows of 16 int32); 4, 5 activations (A: L Rt
 * rows of L SB bytes); 6, 7 quants (B: L SB / 4 rows of 64 bytes). */
static void amx_i8_configure(int Rt, int sb, int L) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) cfg.rows[t] = (uint8_t)(L * Rt), cfg.colsb[t] = 64;
    for (int t = 4; t < 6; t++) cfg.rows[t] = (uint8_t)(L * Rt), cfg.colsb[t] = (uint16_t)(L * sb);
    for (int t = 6; t < 8; t++) cfg.rows[t] = (uint8_t)(L * sb / 4), cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* Step n's two sub-blocks (h0, h0 + 1) into C tiles 2 (n & 1) and 2 (n & 1) + 1, or with two
 * lanes into C tile 2 (n & 1) alone; tile ids must be constants, hence the cases. */
static inline void amx_i8_step_tiles(int parity, int L, int sb, const int8_t *xa, int64_t in, const uint8_t *b) {
#define AMX_I8_SUB(C, A, B, hh)                              \
    _tile_zero(C);                                           \
    _tile_loadd(A, xa + (hh) * sb, in);                      \
    _tile_loadd(B, b + (hh) * sb * 16, 64);                  \
    _tile_dpbsud(C, A, B);
    if (L == 2) {   /* A rows of 2 SB bytes from column 0; B: the two sub-blocks' rows */
        if (parity) {
            AMX_I8_SUB(2, 4, 6, 0)
        } else {
            AMX_I8_SUB(0, 4, 6, 0)
        }
    } else if (parity) {
        AMX_I8_SUB(2, 4, 6, 0)
        AMX_I8_SUB(3, 5, 7, 1)
    } else {
        AMX_I8_SUB(0, 4, 6, 0)
        AMX_I8_SUB(1, 5, 7, 1)
    }
#undef AMX_I8_SUB
}

static inline void amx_i8_step_store(int parity, int L, int32_t *c) {   /* c [2][16][16] int32 */
    if (L == 2) {
        if (parity) _tile_stored(2, c, 64);
        else _tile_stored(0, c, 64);
    } else if (parity) {
        _tile_stored(2, c, 64);
        _tile_stored(3, c + 256, 64);
    } else {
        _tile_stored(0, c, 64);
        _tile_stored(1, c + 256, 64);
    }
}

/* The 16 outputs of group g for R rows of a pass (amx_i8_split_rows's xa, xd, S or P): acc[r]
 * over every sub-block, in order. Work goes in steps of two sub-blocks (a unit of Q4_K, Q4_1 or Q5_0,
 * half a unit of Q6_K); a step's tile sums are stored one step later, when the multiplies are
 * done, so the tiles never wait for each other's latency, and its float work follows. Inlined
 * into amx_i8_group_rows_for with constant np and L, so the piece loop unrolls as it did when the
 * count was fixed at three (a variable count measured no slower within this VM's noise). */
static inline __attribute__((always_inline)) void
amx_i8_group_rows(int qtype, int np, int L, const uint8_t *gp, int64_t in, const int8_t *xa, const float *xd,
                  const float *S, const int32_t *P, int R, uint8_t *ring, int32_t *cbuf, float *out, int64_t ldo) {
    const int sb = amx_sub_block(qtype), ub = amx_unit_bytes(qtype), per_unit = AMX_UNIT_K / sb / 2;
    const int64_t units = in / AMX_UNIT_K, ns = in / sb, steps = units * per_unit;
    const int32_t offset = amx_i8_code_offset(qtype);
    /* where sub-block hh of a step and piece row arow sit in its C sums */
    const int h_stride = L == 2 ? 16 : 256, row_stride = L == 2 ? 32 : 16;
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    amx_i8_unpack_unit(qtype, gp, ring);
    for (int64_t n = 0; n <= steps; n++) {
        if (n < steps) {
            const int64_t t = n / per_unit;
            const int half = (int)(n % per_unit);
            const uint8_t *b = ring + (t & 1) * 1024;
            if (half == 0 && t + 1 < units) {
                amx_prefetch_unit(gp + (t + AMX_PREFETCH_UNITS) * ub, ub);
                amx_i8_unpack_unit(qtype, gp + (t + 1) * ub, ring + ((t + 1) & 1) * 1024);
            }
            amx_i8_step_tiles((int)(n & 1), L, sb, xa + t * AMX_UNIT_K + half * 2 * sb, in, b + half * 2 * sb * 16);
        }
        if (n > 0) {
            const int64_t m1 = n - 1, u = m1 / per_unit;
            const int h0 = 2 * (int)(m1 % per_unit);
            int32_t *c = cbuf + (m1 & 1) * 512;
            amx_i8_step_store((int)(m1 & 1), L, c);
            const uint8_t *p = gp + u * ub;
            for (int hh = 0; hh < 2; hh++) {
                __m512 a, m;
                amx_unit_scales(qtype, p, h0 + hh, &a, &m);
                const int64_t s = u * (AMX_UNIT_K / sb) + h0 + hh;
                for (int r = 0; r < R; r++) {
                    __m512 d = _mm512_setzero_ps();
                    for (int i = np - 1; i >= 0; i--) {
                        const int64_t arow = np * r + i;
                        __m512i ci = _mm512_load_si512(c + hh * h_stride + arow * row_stride);
                        if (P) ci = _mm512_sub_epi32(ci, _mm512_set1_epi32(offset * P[arow * ns + s]));
                        d = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ci), _mm512_set1_ps(xd[arow * ns + s]), d);
                    }
                    acc[r] = _mm512_fmadd_ps(d, a, acc[r]);
                    if (S) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(S[r * ns + s]), m, acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

/* amx_i8_group_rows compiled once per piece count and lane count. */
static void amx_i8_group_rows_for(int qtype, int np, int L, const uint8_t *gp, int64_t in, const int8_t *xa,
                                  const float *xd, const float *S, const int32_t *P, int R, uint8_t *ring,
                                  int32_t *cbuf, float *out, int64_t ldo) {
#define AMX_I8_GROUP(NP, LL) amx_i8_group_rows(qtype, NP, LL, gp, in, xa, xd, S, P, R, ring, cbuf, out, ldo)
    switch (2 * np + L - 3) {
    case 0: AMX_I8_GROUP(1, 1); break;
    case 1: AMX_I8_GROUP(1, 2); break;
    case 2: AMX_I8_GROUP(2, 1); break;
    case 3: AMX_I8_GROUP(2, 2); break;
    case 4: AMX_I8_GROUP(3, 1); break;
    case 5: AMX_I8_GROUP(3, 2); break;
    case 6: AMX_I8_GROUP(4, 1); break;
    default: AMX_I8_GROUP(4, 2); break;
    }
#undef AMX_I8_GROUP
}

/* out = x @ w.T (+ bias), w packed by amx_pack; called by every thread of an enclosing parallel
 * region, like amx_gemm_team. Each pass of amx_i8_rows(np) rows unpacks the group's quants again
 * (from L1/L2: measured faster than unpacking a group once into a buffer for all passes).
 * Returns 0, or -3 without scratch memory. */
static int amx_i8_gemm_team(const float *x, int64_t ldx, int64_t rows, const uint8_t *w, int qtype, int np,
                            int64_t out_features, int64_t in, const float *bias, float *out, int64_t ldo) {
    if (np < 1 || np > AMX_I8_MAX_PIECES) return -1;
    if (rows <= 0) return 0;   /* nothing to do (and no pass to size) */
    const int sb = amx_sub_block(qtype), cap = amx_i8_rows(np);
    const int64_t passes = (rows + cap - 1) / cap, groups = out_features / 16, ns = in / sb;
    /* rows shared evenly among the passes (7 rows: 4 + 3, not 5 + 2), all with one tile shape
     * (a short pass leaves its extra A rows zero): tile loads and stores cost by the tile's rows */
    const int per = (int)((rows + passes - 1) / passes), Rt = np * per, L = amx_i8_lanes(np, per);
    const int64_t row_bytes = amx_packed_row_bytes(qtype, in);
    const int64_t xa_bytes = (passes * L * Rt * in + 63) / 64 * 64;
    const int64_t xd_bytes = (passes * Rt * ns * 4 + 63) / 64 * 64;   /* also P's size */
    const int64_t s_bytes = (passes * per * ns * 4 + 63) / 64 * 64;
    const int64_t fixed = 2 * 1024 + 2 * 512 * 4;   /* ring of two unpacked units, two steps' C tiles */
    uint8_t *buf = amx_scratch_for(xa_bytes + 2 * xd_bytes + s_bytes + fixed);
    const int ok = buf != NULL && amx_usable();
    int8_t *xa = (int8_t *)buf;
    float *xd = ok ? (float *)(buf + xa_bytes) : NULL;
    int32_t *P = ok && amx_i8_code_offset(qtype) ? (int32_t *)(buf + xa_bytes + xd_bytes) : NULL;
    float *S = ok && amx_has_min(qtype) ? (float *)(buf + xa_bytes + 2 * xd_bytes) : NULL;
    uint8_t *ring = ok ? buf + xa_bytes + 2 * xd_bytes + s_bytes : NULL;
    int32_t *cbuf = ok ? (int32_t *)(ring + 2 * 1024) : NULL;
    if (ok)
        for (int64_t ps = 0; ps < passes; ps++) {
            const int R = (int)(rows - ps * per < per ? rows - ps * per : per);
            amx_i8_split_rows(x + ps * per * ldx, ldx, R, Rt, np, L, in, sb, xa + ps * L * Rt * in, xd + ps * Rt * ns,
                              S ? S + ps * per * ns : NULL, P ? P + ps * Rt * ns : NULL);
        }
    int configured = 0;
#pragma omp for schedule(dynamic, work_chunk(groups))
    for (int64_t g = 0; g < groups; g++) {
        if (!ok) continue;
        const uint8_t *gp = w + g * row_bytes;
        for (int64_t ps = 0; ps < passes; ps++) {
            const int R = (int)(rows - ps * per < per ? rows - ps * per : per);
            if (!configured) amx_i8_configure(Rt, sb, L), configured = 1;
            float *o = out + ps * per * ldo + g * 16;
            amx_i8_group_rows_for(qtype, np, L, gp, in, xa + ps * L * Rt * in, xd + ps * Rt * ns,
                                  S ? S + ps * per * ns : NULL, P ? P + ps * Rt * ns : NULL, R, ring, cbuf, o, ldo);
            if (bias) {
                const __m512 bv = _mm512_loadu_ps(bias + g * 16);
                for (int r = 0; r < R; r++) _mm512_storeu_ps(o + r * ldo, _mm512_add_ps(_mm512_loadu_ps(o + r * ldo), bv));
            }
        }
    }
    if (configured) _tile_release();
    return ok ? 0 : -3;
}

#endif /* AMX int8 */
#endif /* SPECSERVE_AMX_INT8_H */
