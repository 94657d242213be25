/* Paged attention for float32 queries on CPUs, in one pass over each request's K/V.
 *
 * Called from specserve/model_executor/layers/cpu_attention.py through ctypes.
 * The PyTorch path gathers every request's blocks into a padded copy and then
 * runs SDPA over it, reading the context twice and paying per-(head, request)
 * set-up inside SDPA; here each (request, KV head) pair reads its keys and
 * values once, straight from the block table, for all the query rows that
 * share that KV head (grouped-query attention) and all its new tokens.
 *
 * Layouts (all contiguous float32 / int64 unless a stride is given):
 *   q            [T, Hq, hd]  token stride q_token_stride (q is a view of the fused qkv output)
 *   k_cache      [Hk, num_blocks, block_size, hd]     (kv_cache[0]) float32, or float16 (cache_half)
 *   v_cache      [Hk, num_blocks, block_size, hd]     (kv_cache[1]) the same dtype
 *   out          [T, Hq, hd]
 *   block_tables [B, max_blocks]
 *   query_start  [B]      request b's first new token is row query_start[b] of q and out
 *   query_lens   [B]      ... and it has query_lens[b] new tokens
 *   context_lens [B]      tokens in the cache for request b, its new tokens included
 *   tree_masks   [T] uint32, or NULL: row t may attend new token j of its request iff bit j
 *                is set (a tree of drafts: a node sees its ancestors and itself)
 * New token i of request b sits in slot context_len - q_len + i and attends to slots
 * 0 .. that slot (causal), except that with tree_masks it sees only the new tokens
 * its mask allows (every cached token before the new ones is always visible).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__FMA__)
#include <immintrin.h>
#endif

/* 8 floats: one AVX register, two SSE/NEON ones; GCC and Clang lower it for any target. */
typedef float f32x8 __attribute__((vector_size(32)));

static inline f32x8 load8(const float *p) {
    f32x8 v;
    memcpy(&v, p, sizeof v);  /* unaligned load */
    return v;
}

/* acc + a * b. Built with -ffp-contract=off the compiler fuses nothing on its own (it used
 * to fuse some multiply-adds and not others, so one key's score depended in the last bit
 * on which function summed it); the vector sums fuse here, explicitly and everywhere alike,
 * with one rounding where the CPU has FMA, and scalar tails always round twice. */
static inline f32x8 fma8(f32x8 a, f32x8 b, f32x8 acc) {
#if defined(__FMA__)
    __m256 x, y, z;
    memcpy(&x, &a, sizeof x);
    memcpy(&y, &b, sizeof y);
    memcpy(&z, &acc, sizeof z);
    z = _mm256_fmadd_ps(x, y, z);
    memcpy(&acc, &z, sizeof acc);
    return acc;
#else
    return acc + a * b;
#endif
}

static inline f32x8 splat8(float x) { return (f32x8){x, x, x, x, x, x, x, x}; }

/* A float16 cache is read through F16C's conversion (exact), so the arithmetic is the
 * float32 kernel's on the stored values. Without F16C the half variant is not built:
 * specserve_paged_attention_has_f16() says which. */
#if defined(__F16C__)
static inline f32x8 half8(const uint16_t *p) {
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    f32x8 v;
    memcpy(&v, &f, sizeof v);
    return v;
}
static inline float half1(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline f32x8 half8(const uint16_t *p) { (void)p; __builtin_unreachable(); }
static inline float half1(uint16_t h) { (void)h; __builtin_unreachable(); }
#endif

int specserve_paged_attention_has_f16(void) {
#if defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

/* Store x (n floats) at element i of a cache, rounded to float16 (to nearest even, as
 * torch's .to(torch.float16)) when half. */
static void store_kv(void *base, int64_t i, const float *x, int n, const int half) {
    if (!half) {
        memcpy((float *)base + i, x, (size_t)n * sizeof(float));
        return;
    }
#if defined(__F16C__)
    uint16_t *dst = (uint16_t *)base + i;
    int d = 0;
    for (; d + 8 <= n; d += 8)
        _mm_storeu_si128((__m128i *)(dst + d), _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT));
    for (; d < n; d++) dst[d] = _cvtss_sh(x[d], _MM_FROUND_TO_NEAREST_INT);
#endif
}

/* Element i of a cache (float32, or float16 when half): 8 at a time, or one. The
 * callers pass half as a constant and are inlined, so each variant is its own code. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))
ALWAYS_INLINE f32x8 kv8(const void *base, int64_t i, const int half) {
    return half ? half8((const uint16_t *)base + i) : load8((const float *)base + i);
}
ALWAYS_INLINE float kv1(const void *base, int64_t i, const int half) {
    return half ? half1(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline float hsum(f32x8 v) {
    /* A tree, not a chain of 7 dependent adds. */
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

/* q . k for the key at element offset k of the cache kc. Every score, whichever function
 * computes it, sums in this order (8-wide chunks in sequence, then the lanes, then the
 * tail), so a row's scores are the same bits whether its step decodes one token or
 * verifies several. */
ALWAYS_INLINE float dot(const float *q, const void *kc, int64_t k, int n, const int half) {
    f32x8 acc = {0};
    int d = 0;
    for (; d + 8 <= n; d += 8) acc = fma8(load8(q + d), kv8(kc, k + d, half), acc);
    float t = hsum(acc);
    for (; d < n; d++) t += q[d] * kv1(kc, k + d, half);
    return t;
}

/* The end of four chains of q . k (keys at offsets k + u stride, u < 4): their lanes,
 * then the tail dims d .. n - 1, into out[0..3]. dot4 and dot4x2 both finish here. */
ALWAYS_INLINE void finish4(const float *q, const void *kc, int64_t k, int64_t stride, int d, int n,
                           f32x8 a0, f32x8 a1, f32x8 a2, f32x8 a3, float *out, const int half) {
    float t0 = hsum(a0), t1 = hsum(a1), t2 = hsum(a2), t3 = hsum(a3);
    for (; d < n; d++) {
        t0 += q[d] * kv1(kc, k + d, half);
        t1 += q[d] * kv1(kc, k + stride + d, half);
        t2 += q[d] * kv1(kc, k + 2 * stride + d, half);
        t3 += q[d] * kv1(kc, k + 3 * stride + d, half);
    }
    out[0] = t0, out[1] = t1, out[2] = t2, out[3] = t3;
}

/* q . k for four keys at element offsets k, k + stride, k + 2 stride, k + 3 stride of
 * the cache kc: four independent chains. */
ALWAYS_INLINE void dot4(const float *q, const void *kc, int64_t k, int64_t stride, int n, float *out,
                        const int half) {
    f32x8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int d = 0;
    for (; d + 8 <= n; d += 8) {
        const f32x8 qv = load8(q + d);
        a0 = fma8(qv, kv8(kc, k + d, half), a0);
        a1 = fma8(qv, kv8(kc, k + stride + d, half), a1);
        a2 = fma8(qv, kv8(kc, k + 2 * stride + d, half), a2);
        a3 = fma8(qv, kv8(kc, k + 3 * stride + d, half), a3);
    }
    finish4(q, kc, k, stride, d, n, a0, a1, a2, a3, out, half);
}

/* Two query rows against four keys: eight chains, each summed exactly as dot4 (and dot)
 * sums it, so a score has the same bits whichever function computed it. Each key vector
 * loaded (and, from a float16 cache, converted) serves both rows. */
ALWAYS_INLINE void dot4x2(const float *q0, const float *q1, const void *kc, int64_t k, int64_t stride, int n,
                          float *out0, float *out1, const int half) {
    f32x8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    int d = 0;
    for (; d + 8 <= n; d += 8) {
        const f32x8 k0 = kv8(kc, k + d, half), k1 = kv8(kc, k + stride + d, half);
        const f32x8 k2 = kv8(kc, k + 2 * stride + d, half), k3 = kv8(kc, k + 3 * stride + d, half);
        const f32x8 x = load8(q0 + d), y = load8(q1 + d);
        a0 = fma8(x, k0, a0), a1 = fma8(x, k1, a1), a2 = fma8(x, k2, a2), a3 = fma8(x, k3, a3);
        b0 = fma8(y, k0, b0), b1 = fma8(y, k1, b1), b2 = fma8(y, k2, b2), b3 = fma8(y, k3, b3);
    }
    finish4(q0, kc, k, stride, d, n, a0, a1, a2, a3, out0, half);
    finish4(q1, kc, k, stride, d, n, b0, b1, b2, b3, out1, half);
}

/* score[j] = q . key j for j in [from, to), keys found through the block table. */
ALWAYS_INLINE void score_range(const float *qr, float *score, const void *k_cache, int64_t head_offset,
                               const int64_t *table, int64_t from, int64_t to, int hd, int block_size,
                               const int half) {
    int64_t j = from;
    while (j < to) {
        const int64_t in_block = j % block_size;
        const int64_t n = to - j < block_size - in_block ? to - j : block_size - in_block;
        const int64_t k = head_offset + (table[j / block_size] * block_size + in_block) * hd;
        int64_t o = 0;
        for (; o + 4 <= n; o += 4) dot4(qr, k_cache, k + o * hd, hd, hd, score + j + o, half);
        for (; o < n; o++) score[j + o] = dot(qr, k_cache, k + o * hd, hd, half);
        j += n;
    }
}

typedef int32_t i32x8 __attribute__((vector_size(32)));

/* e^x for x <= 0, 8 at a time (Cephes' expf polynomial; ~1 ulp): 2^n * e^r with
 * n = round(x / ln 2) and |r| <= ln 2 / 2. Underflows to 0 below -87. */
static inline f32x8 exp8_nonpositive(f32x8 x) {
    const f32x8 lo = x - x - 87.0f;
    const i32x8 below = x < lo;                              /* lanes of -1 (true) or 0 */
    i32x8 xb, lob;
    memcpy(&xb, &x, sizeof xb);
    memcpy(&lob, &lo, sizeof lob);
    xb = (below & lob) | (~below & xb);                      /* x = max(x, -87) */
    memcpy(&x, &xb, sizeof x);
    const f32x8 t = fma8(x, splat8(1.44269504088896341f), splat8(-0.5f));  /* t <= -0.5: truncation rounds x / ln 2 */
    const i32x8 n = __builtin_convertvector(t, i32x8);
    const f32x8 nf = __builtin_convertvector(n, f32x8);
    const f32x8 r = fma8(nf, splat8(2.12194440e-4f), fma8(nf, splat8(-0.693359375f), x));
    f32x8 p = fma8(r, splat8(1.9875691500e-4f), splat8(1.3981999507e-3f));
    p = fma8(p, r, splat8(8.3334519073e-3f));
    p = fma8(p, r, splat8(4.1665795894e-2f));
    p = fma8(p, r, splat8(1.6666665459e-1f));
    p = fma8(p, r, splat8(5.0000001201e-1f));
    p = fma8(p * r, r, r) + 1.0f;
    const i32x8 bits = (n + 127) << 23;                      /* 2^n as a float */
    f32x8 scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* s[0..n) <- exp(s - max) / sum, in place. */
static void softmax_in_place(float *s, int64_t n) {
    float m = s[0];
    for (int64_t j = 1; j < n; j++) m = s[j] > m ? s[j] : m;
    float sum = 0.0f;
    int64_t j = 0;
    f32x8 acc = {0};
    for (; j + 8 <= n; j += 8) {
        f32x8 e = exp8_nonpositive(load8(s + j) - m);
        memcpy(s + j, &e, sizeof e);
        acc += e;
    }
    for (; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    for (int u = 0; u < 8; u++) sum += acc[u];
    const float inv = 1.0f / sum;
    for (j = 0; j < n; j++) s[j] *= inv;
}

/* Bit (j - new_start) of allowed says whether key j >= new_start may be seen. */
static inline int key_allowed(int64_t j, int64_t new_start, uint32_t allowed) {
    return j < new_start || ((allowed >> (j - new_start)) & 1u);
}

/* softmax_in_place for a node of a tree of drafts: keys j >= new_start that `allowed`
 * leaves out (other branches) get weight 0. The allowed keys are packed into `packed`
 * (room for n floats) and go through softmax_in_place itself, so they get exactly the bits
 * of the same branch verified as a chain; the value sums that follow add the zeros
 * exactly, so the whole row equals the chain's. */
static void softmax_in_place_masked(float *s, int64_t n, int64_t new_start, uint32_t allowed, float *packed) {
    const int64_t span = n - new_start;
    const uint32_t all = span >= 32 ? 0xffffffffu : (1u << span) - 1u;
    if (span <= 0 || (allowed & all) == all) {
        softmax_in_place(s, n);
        return;
    }
    int64_t kept = 0;
    for (int64_t j = 0; j < n; j++)
        if (key_allowed(j, new_start, allowed)) packed[kept++] = s[j];
    softmax_in_place(packed, kept);
    for (int64_t j = n - 1; j >= 0; j--)
        s[j] = key_allowed(j, new_start, allowed) ? packed[--kept] : 0.0f;
}

/* Scratch for one (request, KV head) pair, sized for the largest pair of the call. */
typedef struct {
    float *scores;        /* [rows, ctx] */
    const float **q_row;  /* [rows] query vector of each row */
    float **out_row;      /* [rows] where each row's output goes */
    int64_t *last_key;    /* [rows] last slot each row may attend to */
    uint32_t *allowed;    /* [rows] the new tokens each row may attend to (tree_masks), or all */
    float *packed;        /* [ctx] a tree row's allowed scores, packed (softmax_in_place_masked) */
} Scratch;

ALWAYS_INLINE void attend_one(const float *q, int64_t q_token_stride, const void *k_cache, const void *v_cache,
                              float *out, const int64_t *table, int64_t q_first, int q_len, int64_t ctx,
                              int kv_head, int group, int num_heads, int hd, int block_size, int64_t num_blocks,
                              float scale, const uint32_t *tree_masks, Scratch *w, const int half) {
    /* Row r = new token r / group, query head kv_head * group + r % group (the heads sharing this KV head). */
    const int rows = q_len * group;
    for (int i = 0, r = 0; i < q_len; i++) {
        for (int g = 0; g < group; g++, r++) {
            const int head = kv_head * group + g;
            w->q_row[r] = q + (q_first + i) * q_token_stride + (int64_t)head * hd;
            w->out_row[r] = out + ((q_first + i) * num_heads + head) * (int64_t)hd;
            w->last_key[r] = ctx - q_len + i;
            w->allowed[r] = tree_masks ? tree_masks[q_first + i] : 0xffffffffu;
        }
    }
    const int64_t head_offset = (int64_t)kv_head * num_blocks * block_size * hd;
    /* Scores, two rows at a time over the keys both see (4 keys at a time), then the
     * second row's extra keys alone (rows are in position order, so it sees at least as
     * many). Every score sums as dot() does: the grouping changes no bits. */
    int r = 0;
    for (; r + 1 < rows; r += 2) {
        float *s0 = w->scores + (int64_t)r * ctx, *s1 = s0 + ctx;
        const int64_t both = w->last_key[r] + 1, visible1 = w->last_key[r + 1] + 1;
        for (int64_t j0 = 0; j0 < both; j0 += block_size) {
            const int64_t k = head_offset + table[j0 / block_size] * block_size * hd;
            const int64_t n = both - j0 < block_size ? both - j0 : block_size;
            int64_t o = 0;
            for (; o + 4 <= n; o += 4)
                dot4x2(w->q_row[r], w->q_row[r + 1], k_cache, k + o * hd, hd, hd, s0 + j0 + o, s1 + j0 + o, half);
            for (; o < n; o++) {
                s0[j0 + o] = dot(w->q_row[r], k_cache, k + o * hd, hd, half);
                s1[j0 + o] = dot(w->q_row[r + 1], k_cache, k + o * hd, hd, half);
            }
        }
        score_range(w->q_row[r + 1], s1, k_cache, head_offset, table, both, visible1, hd, block_size, half);
    }
    if (r < rows)
        score_range(w->q_row[r], w->scores + (int64_t)r * ctx, k_cache, head_offset, table, 0,
                    w->last_key[r] + 1, hd, block_size, half);
    for (r = 0; r < rows; r++) {
        float *score = w->scores + (int64_t)r * ctx;
        for (int64_t j = 0; j <= w->last_key[r]; j++) score[j] *= scale;
    }
    /* Softmax per row, in place; keys a row may not see get weight 0. */
    for (int r = 0; r < rows; r++) {
        float *score = w->scores + (int64_t)r * ctx;
        const int64_t visible = w->last_key[r] + 1;
        if (tree_masks)
            softmax_in_place_masked(score, visible, ctx - q_len, w->allowed[r], w->packed);
        else
            softmax_in_place(score, visible);
        memset(score + visible, 0, (size_t)(ctx - visible) * sizeof(float));
    }
    /* Weighted values, two rows and 32 output dims at a time held in registers: each value
     * vector loaded feeds both rows. A row's sums run over keys in order, the same with or
     * without a partner row (a partner's invisible keys have weight 0 and add exact zeros). */
    for (int r = 0; r < rows; r += 2) {
        const int pair = r + 1 < rows;
        const float *p0 = w->scores + (int64_t)r * ctx;
        const float *p1 = pair ? p0 + ctx : p0;
        const int64_t visible = w->last_key[pair ? r + 1 : r] + 1;  /* rows are in position order */
        float *dst0 = w->out_row[r], *dst1 = w->out_row[pair ? r + 1 : r];
        int d0 = 0;
        for (; d0 + 32 <= hd; d0 += 32) {
            f32x8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
            for (int64_t j0 = 0; j0 < visible; j0 += block_size) {
                int64_t v = head_offset + table[j0 / block_size] * block_size * hd + d0;
                const int64_t n = visible - j0 < block_size ? visible - j0 : block_size;
                for (int64_t o = 0; o < n; o++, v += hd) {
                    const f32x8 v0 = kv8(v_cache, v, half), v1 = kv8(v_cache, v + 8, half);
                    const f32x8 v2 = kv8(v_cache, v + 16, half), v3 = kv8(v_cache, v + 24, half);
                    const f32x8 x = splat8(p0[j0 + o]), y = splat8(p1[j0 + o]);
                    a0 = fma8(x, v0, a0), a1 = fma8(x, v1, a1), a2 = fma8(x, v2, a2), a3 = fma8(x, v3, a3);
                    b0 = fma8(y, v0, b0), b1 = fma8(y, v1, b1), b2 = fma8(y, v2, b2), b3 = fma8(y, v3, b3);
                }
            }
            memcpy(dst0 + d0, &a0, sizeof a0);
            memcpy(dst0 + d0 + 8, &a1, sizeof a1);
            memcpy(dst0 + d0 + 16, &a2, sizeof a2);
            memcpy(dst0 + d0 + 24, &a3, sizeof a3);
            if (pair) {
                memcpy(dst1 + d0, &b0, sizeof b0);
                memcpy(dst1 + d0 + 8, &b1, sizeof b1);
                memcpy(dst1 + d0 + 16, &b2, sizeof b2);
                memcpy(dst1 + d0 + 24, &b3, sizeof b3);
            }
        }
        for (; d0 < hd; d0++) {  /* head_dim not a multiple of 32 */
            for (int u = 0; u <= pair; u++) {
                const float *pu = u ? p1 : p0;
                const int64_t vis = w->last_key[r + u] + 1;
                float acc = 0.0f;
                for (int64_t j = 0; j < vis; j++)
                    acc += pu[j] * kv1(v_cache, head_offset + (table[j / block_size] * block_size + j % block_size) * hd + d0, half);
                (u ? dst1 : dst0)[d0] = acc;
            }
        }
    }
}

/* Attention for num_reqs requests: the (request, KV head) pairs are shared out over
 * num_threads OpenMP threads, each pair computed whole by one thread with its own scratch,
 * so a row's result never depends on the thread count or on the other requests.
 * Built with -fopenmp, the library's libgomp.so.1 is the one torch already loaded, so these
 * are torch's own worker threads (still spinning from the last matmul), not a second pool.
 * query_start[b] is the first row of request b in q and out; it has query_lens[b] rows.
 * With k_new / v_new ([T, Hk, hd] float32, token strides k_token_stride / v_token_stride), each pair first
 * writes its request's new K/V of its head into the cache at slot_mapping[t] (saves the
 * caller two scatters and a conversion per layer). Returns 0; -1 when scratch memory could
 * not be allocated (out is then incomplete); -2 when cache_half is asked of a build without
 * F16C. */
int specserve_paged_attention(const float *q, int64_t q_token_stride, const void *k_cache,
                              const void *v_cache, float *out, const int64_t *block_tables,
                              int64_t max_blocks, const int64_t *query_start, const int64_t *query_lens,
                              const int64_t *context_lens, int num_reqs, int num_heads, int num_kv_heads,
                              int hd, int block_size, int64_t num_blocks, float scale, int num_threads,
                              int cache_half, const uint32_t *tree_masks, const float *k_new,
                              int64_t k_token_stride, const float *v_new, int64_t v_token_stride,
                              const int64_t *slot_mapping) {
    if (cache_half && !specserve_paged_attention_has_f16()) return -2;
    const int group = num_heads / num_kv_heads;
    int64_t max_rows = 1, max_scores = 1, max_ctx = 1;
    for (int b = 0; b < num_reqs; b++) {
        max_ctx = context_lens[b] > max_ctx ? context_lens[b] : max_ctx;
        const int64_t rows = query_lens[b] * group;
        max_rows = rows > max_rows ? rows : max_rows;
        max_scores = rows * context_lens[b] > max_scores ? rows * context_lens[b] : max_scores;
    }
    const int num_pairs = num_reqs * num_kv_heads;
    if (num_threads > num_pairs) num_threads = num_pairs;
    if (num_threads < 1) num_threads = 1;
    int status = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : status)
    {
        Scratch w;
        w.scores = malloc((size_t)max_scores * sizeof(float));
        w.q_row = malloc((size_t)max_rows * sizeof(*w.q_row));
        w.out_row = malloc((size_t)max_rows * sizeof(*w.out_row));
        w.last_key = malloc((size_t)max_rows * sizeof(*w.last_key));
        w.allowed = malloc((size_t)max_rows * sizeof(*w.allowed));
        w.packed = tree_masks ? malloc((size_t)max_ctx * sizeof(float)) : NULL;
        const int ok = w.scores && w.q_row && w.out_row && w.last_key && w.allowed && (w.packed || !tree_masks);
        if (!ok) status = -1;
#pragma omp for schedule(dynamic, 1)
        for (int pair = 0; pair < num_pairs; pair++) {
            const int b = pair / num_kv_heads, h = pair % num_kv_heads;
            if (!ok || query_lens[b] == 0) continue;
            const int64_t *table = block_tables + (int64_t)b * max_blocks;
            if (k_new) {
                /* This pair's new K/V first: only this pair reads its request's slots of head h. */
                const int64_t head_offset = (int64_t)h * num_blocks * block_size * hd;
                for (int64_t t = query_start[b]; t < query_start[b] + query_lens[b]; t++) {
                    const int64_t dst = head_offset + slot_mapping[t] * hd;
                    store_kv((void *)k_cache, dst, k_new + t * k_token_stride + (int64_t)h * hd, hd, cache_half);
                    store_kv((void *)v_cache, dst, v_new + t * v_token_stride + (int64_t)h * hd, hd, cache_half);
                }
            }
            if (cache_half)
                attend_one(q, q_token_stride, k_cache, v_cache, out, table, query_start[b], (int)query_lens[b],
                           context_lens[b], h, group, num_heads, hd, block_size, num_blocks, scale, tree_masks, &w, 1);
            else
                attend_one(q, q_token_stride, k_cache, v_cache, out, table, query_start[b], (int)query_lens[b],
                           context_lens[b], h, group, num_heads, hd, block_size, num_blocks, scale, tree_masks, &w, 0);
        }
        free(w.scores);
        free(w.q_row);
        free(w.out_row);
        free(w.last_key);
        free(w.allowed);
        free(w.packed);
    }
    return status;
}
