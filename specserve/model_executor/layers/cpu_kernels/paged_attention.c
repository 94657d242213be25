/* Paged attention for float32 queries on CPUs, in one pass over each request's K/V.
 *
 * Called from specserve/model_executor/layers/cpu_attention.py through ctypes.
 * The PyTorch path gathers every request's blocks into a padded copy and then
 * runs SDPA over it, reading the context twice and paying per-(head, request)
 * set-up inside SDPA; here each (request, KV head, tile of new tokens) reads its
 * keys and values once, straight from the block table, for all the query rows
 * that share that KV head (grouped-query attention). It serves decoding,
 * verification and prefill chunks alike, and a row's result depends on its
 * position alone (see specserve_paged_attention).
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
 *   tree         uint32 words, or NULL: trees of drafts in the step, laid out as
 *                  tree[0]          W, the 32-bit words of one row's mask
 *                  tree[1 + b]      back[b]: request b's tree starts back[b] slots before its
 *                                   first new slot (0: its new tokens are the whole tree; a
 *                                   draft growing a tree over several forwards has the
 *                                   earlier nodes cached)
 *                  tree[1 + B + t*W .. +W]  row t's mask: bit j = it may see slot tree_start + j
 *                                   (tree_start = its first new slot - back); a node sees its
 *                                   ancestors and itself; back = 0xffffffff (NO_TREE): a
 *                                   causal request (its rows' words are not read)
 * New token i of request b sits in slot context_len - q_len + i and attends to slots
 * 0 .. that slot (causal), except that with a tree it sees only the tree slots its mask
 * allows (every slot before the tree is visible). A tree has at most 32 * W nodes.
 *
 * Per call (per layer: Gemma's local and global layers differ), as Hugging Face
 * transformers computes them:
 *   sliding_window W > 0  a row at absolute position p sees key position j only if
 *                         p - j < W (masking_utils.sliding_window_overlay:
 *                         kv_idx > q_idx - W), so W keys at most, itself included. A tree
 *                         node's position is tree_start + its depth (depth =
 *                         popcount(mask) - 1), and its ancestors have theirs: the window is
 *                         applied exactly, to the cached keys and to the ancestors alike.
 *                         Keys before a row's window are never read (long contexts get
 *                         faster; docs/benchmarks.md, "Sliding window").
 *   logit_softcap c > 0   scores = tanh(scale * q.k / c) * c before the softmax (Gemma 2's
 *                         attn_logit_softcapping).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__FMA__)
#include <immintrin.h>
#endif

/* 8 floats: one AVX register (a float16 cache is converted 8 at a time without AVX-512). */
typedef float f32x8 __attribute__((vector_size(32)));

static inline f32x8 load8(const float *p) {
    f32x8 v;
    memcpy(&v, p, sizeof v);  /* unaligned load */
    return v;
}

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

/* 16 floats: one AVX-512 register, two AVX ones. Scores and weighted values are computed
 * with one lane per output (a key's score, an output dim), each lane its own chain of
 * fused multiply-adds in a fixed order, so neither the vector width nor which rows share
 * a call changes a single bit. */
typedef float f32x16 __attribute__((vector_size(64)));
#define KEYS_PER_CHUNK 32  /* keys scored per chunk (two vectors) */

static inline f32x16 load16(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void store16(float *p, f32x16 v) { memcpy(p, &v, sizeof v); }
static inline f32x16 splat16(float x) { return (f32x16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* acc + a * b per lane, one rounding where the CPU has FMA (fma1: the same for one lane).
 * Built with -ffp-contract=off the compiler fuses nothing on its own (it once fused some
 * multiply-adds and not others, so a key's score depended in the last bit on which function
 * summed it); every sum fuses here, explicitly and everywhere alike. */
static inline f32x16 fma16(f32x16 a, f32x16 b, f32x16 acc) {
#if defined(__AVX512F__)
    __m512 x, y, z;
    memcpy(&x, &a, sizeof x);
    memcpy(&y, &b, sizeof y);
    memcpy(&z, &acc, sizeof z);
    z = _mm512_fmadd_ps(x, y, z);
    memcpy(&acc, &z, sizeof acc);
    return acc;
#elif defined(__FMA__)
    __m256 x[2], y[2], z[2];
    memcpy(x, &a, sizeof x);
    memcpy(y, &b, sizeof y);
    memcpy(z, &acc, sizeof z);
    z[0] = _mm256_fmadd_ps(x[0], y[0], z[0]);
    z[1] = _mm256_fmadd_ps(x[1], y[1], z[1]);
    memcpy(&acc, z, sizeof acc);
    return acc;
#else
    return acc + a * b;
#endif
}

/* The scalar lane of fma16: the same bits as any one of its lanes. */
static inline float fma1(float a, float b, float acc) {
#if defined(__FMA__)
    return __builtin_fmaf(a, b, acc);
#else
    return acc + a * b;
#endif
}

/* 16 elements of a cache (float32, or float16 converted exactly) as float32. */
ALWAYS_INLINE f32x16 kv16(const void *base, int64_t i, const int half) {
    if (!half) return load16((const float *)base + i);
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
    f32x16 v;
    memcpy(&v, &f, sizeof v);
    return v;
#else
    const f32x8 lo = kv8(base, i, 1), hi = kv8(base, i + 8, 1);
    f32x16 v;
    memcpy(&v, &lo, sizeof lo);
    memcpy((char *)&v + sizeof lo, &hi, sizeof hi);
    return v;
#endif
}

/* kt[d * 32 + o] = dim d of key o (o < n), 0 for o >= n: a chunk of 32 keys, at element
 * offsets off[o] of the cache kc, laid out so that two vectors hold a dim of all 32 keys.
 * A copy: exact, whichever way it is done. */
ALWAYS_INLINE void transpose_keys(const void *kc, const int64_t *off, int n, int hd, float *kt, const int half) {
    int d = 0;
#if defined(__AVX512F__)
    for (; d + 16 <= hd; d += 16) {
        for (int h = 0; h < KEYS_PER_CHUNK; h += 16) {
            __m512 r[16], t[16];
            for (int o = 0; o < 16; o++) {
                const f32x16 v = h + o < n ? kv16(kc, off[h + o] + d, half) : splat16(0.0f);
                memcpy(&r[o], &v, sizeof v);
            }
            /* 16 x 16 transpose: pairs of keys interleaved, then quads, then 128-bit blocks. */
            for (int i = 0; i < 16; i += 2) {
                t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
                t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
            }
            for (int g = 0; g < 16; g += 4) {  /* r[g + m], 128-bit block L: dim 4L + m of keys g .. g + 3 */
                r[g] = _mm512_shuffle_ps(t[g], t[g + 2], 0x44);
                r[g + 1] = _mm512_shuffle_ps(t[g], t[g + 2], 0xEE);
                r[g + 2] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0x44);
                r[g + 3] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
            }
            float *dst = kt + (int64_t)d * KEYS_PER_CHUNK + h;
            for (int m = 0; m < 4; m++) {
                const __m512 lo01 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x44);
                const __m512 hi01 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xEE);
                const __m512 lo23 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x44);
                const __m512 hi23 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xEE);
                _mm512_storeu_ps(dst + m * KEYS_PER_CHUNK, _mm512_shuffle_f32x4(lo01, lo23, 0x88));
                _mm512_storeu_ps(dst + (4 + m) * KEYS_PER_CHUNK, _mm512_shuffle_f32x4(lo01, lo23, 0xDD));
                _mm512_storeu_ps(dst + (8 + m) * KEYS_PER_CHUNK, _mm512_shuffle_f32x4(hi01, hi23, 0x88));
                _mm512_storeu_ps(dst + (12 + m) * KEYS_PER_CHUNK, _mm512_shuffle_f32x4(hi01, hi23, 0xDD));
            }
        }
    }
#endif
    for (; d < hd; d++)
        for (int o = 0; o < KEYS_PER_CHUNK; o++) kt[d * KEYS_PER_CHUNK + o] = o < n ? kv1(kc, off[o] + d, half) : 0.0f;
}

/* s_u[o] = q_u . key o for R <= 4 query rows and the 32 keys of kt: each score is one
 * chain of fused multiply-adds over d = 0 .. hd - 1 in order. (Eight chains at once: an
 * FMA's latency is about four of its issue slots.) */
ALWAYS_INLINE void score_chunk(const float *const *q, const int R, const float *kt, int hd, float *const *s) {
    f32x16 a[4][2] = {{{0}}};
    for (int d = 0; d < hd; d++) {
        const f32x16 k0 = load16(kt + d * KEYS_PER_CHUNK), k1 = load16(kt + d * KEYS_PER_CHUNK + 16);
        for (int u = 0; u < R; u++) {
            const f32x16 x = splat16(q[u][d]);
            a[u][0] = fma16(x, k0, a[u][0]);
            a[u][1] = fma16(x, k1, a[u][1]);
        }
    }
    for (int u = 0; u < R; u++) {
        store16(s[u], a[u][0]);
        store16(s[u] + 16, a[u][1]);
    }
}

typedef int32_t i32x16 __attribute__((vector_size(64)));

/* e^x for x <= 0, 16 at a time (Cephes' expf polynomial; ~1 ulp): 2^n * e^r with
 * n = round(x / ln 2) and |r| <= ln 2 / 2. Underflows to 0 below -87. */
static inline f32x16 exp16_nonpositive(f32x16 x) {
    const f32x16 lo = splat16(-87.0f);
    const i32x16 below = x < lo;                             /* lanes of -1 (true) or 0 */
    i32x16 xb, lob;
    memcpy(&xb, &x, sizeof xb);
    memcpy(&lob, &lo, sizeof lob);
    xb = (below & lob) | (~below & xb);                      /* x = max(x, -87) */
    memcpy(&x, &xb, sizeof x);
    const f32x16 t = fma16(x, splat16(1.44269504088896341f), splat16(-0.5f));  /* t <= -0.5: truncation rounds x / ln 2 */
    const i32x16 n = __builtin_convertvector(t, i32x16);
    const f32x16 nf = __builtin_convertvector(n, f32x16);
    const f32x16 r = fma16(nf, splat16(2.12194440e-4f), fma16(nf, splat16(-0.693359375f), x));
    f32x16 p = fma16(r, splat16(1.9875691500e-4f), splat16(1.3981999507e-3f));
    p = fma16(p, r, splat16(8.3334519073e-3f));
    p = fma16(p, r, splat16(4.1665795894e-2f));
    p = fma16(p, r, splat16(1.6666665459e-1f));
    p = fma16(p, r, splat16(5.0000001201e-1f));
    p = fma16(p * r, r, r) + 1.0f;
    const i32x16 bits = (n + 127) << 23;                     /* 2^n as a float */
    f32x16 scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* s[0..n) <- exp(s - max) / sum, in place: 16 at a time, the last n % 16 one by one; the
 * sum's order depends on n alone. */
static void softmax_in_place(float *s, int64_t n) {
    f32x16 mv = splat16(s[0]);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {  /* max is exact in any order */
        const f32x16 x = load16(s + j);
        const i32x16 gt = x > mv;
        i32x16 xb, mb;
        memcpy(&xb, &x, sizeof xb);
        memcpy(&mb, &mv, sizeof mb);
        mb = (gt & xb) | (~gt & mb);
        memcpy(&mv, &mb, sizeof mv);
    }
    float m = mv[0];
    for (int u = 1; u < 16; u++) m = mv[u] > m ? mv[u] : m;
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    f32x16 acc = {0};
    const f32x16 mm = splat16(m);
    for (j = 0; j + 16 <= n; j += 16) {
        const f32x16 e = exp16_nonpositive(load16(s + j) - mm);
        store16(s + j, e);
        acc += e;
    }
    float sum = 0.0f;
    for (; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    for (int u = 0; u < 16; u++) sum += acc[u];
    const float inv = 1.0f / sum;
    const f32x16 iv = splat16(inv);
    for (j = 0; j + 16 <= n; j += 16) store16(s + j, load16(s + j) * iv);
    for (; j < n; j++) s[j] *= inv;
}

/* Bit (j - tree_start) of the W-word mask `allowed` says whether key j >= tree_start may be seen. */
static inline int key_allowed(int64_t j, int64_t tree_start, const uint32_t *allowed) {
    if (j < tree_start) return 1;
    const int64_t m = j - tree_start;
    return (allowed[m >> 5] >> (m & 31)) & 1u;
}

/* Whether bits 0 .. span - 1 of the W-word mask are all set. */
static inline int all_bits_set(const uint32_t *allowed, int64_t span) {
    for (int64_t m = 0; m < span; m += 32) {
        const int64_t bits = span - m < 32 ? span - m : 32;
        const uint32_t all = bits == 32 ? 0xffffffffu : (1u << bits) - 1u;
        if ((allowed[m >> 5] & all) != all) return 0;
    }
    return 1;
}

/* softmax_in_place for a node of a tree of drafts: keys j >= tree_start that `allowed`
 * leaves out (other branches) get weight 0. The allowed keys are packed into `packed`
 * (room for n floats) and go through softmax_in_place itself, so they get exactly the bits
 * of the same branch verified as a chain; the value sums that follow add the zeros
 * exactly, so the whole row equals the chain's. */
static void softmax_in_place_masked(float *s, int64_t n, int64_t tree_start, const uint32_t *allowed, float *packed) {
    const int64_t span = n - tree_start;
    if (span <= 0 || all_bits_set(allowed, span)) {
        softmax_in_place(s, n);
        return;
    }
    int64_t kept = 0;
    for (int64_t j = 0; j < n; j++)
        if (key_allowed(j, tree_start, allowed)) packed[kept++] = s[j];
    softmax_in_place(packed, kept);
    for (int64_t j = n - 1; j >= 0; j--)
        s[j] = key_allowed(j, tree_start, allowed) ? packed[--kept] : 0.0f;
}

/* A request's new tokens are attended in tiles of this many (trees of drafts: whole), so a
 * long prefill chunk is shared out over the threads like many short requests. A row's bits
 * do not depend on its tile. */
#define TILE_TOKENS 32

/* tree[1 + b] of a request without a tree in a step with trees. */
#define NO_TREE 0xffffffffu

/* Scratch for one work unit (request, KV head, tile), sized for the largest unit of the call. */
typedef struct {
    float *scores;        /* [rows, ctx rounded up to KEYS_PER_CHUNK] */
    float *kt;            /* [hd, 32] a chunk of keys, transposed (transpose_keys) */
    const float **q_row;  /* [rows] query vector of each row */
    float **out_row;      /* [rows] where each row's output goes */
    int64_t *first_key;   /* [rows] first slot each row may attend to: 0, or its sliding window's start */
    int64_t *last_key;    /* [rows] last slot each row may attend to */
    uint32_t *allowed;    /* [q_len, W] the tree slots each new token may attend to (its mask) */
    float *packed;        /* [ctx] a tree row's allowed scores, packed (softmax_in_place_masked) */
} Scratch;

/* Weighted values for R <= 4 rows (weights p[u][j], zero outside a row's keys) over keys
 * from .. to - 1, output dims d0 .. d0 + 16 * V - 1 (V = 1 or 2 vectors): each output is
 * one chain of fused multiply-adds over the keys in order. A row whose first key comes after
 * `from` adds exact zeros until then (fma(0, v, +0) = +0), so its chain starts where its own
 * keys do, whatever its partners. */
ALWAYS_INLINE void weigh_values(const float *const *p, const int R, const int V, const void *v_cache,
                                int64_t head_offset, const int64_t *table, int64_t from, int64_t to, int hd,
                                int block_size, int d0, float *const *dst, const int half) {
    f32x16 a[4][2] = {{{0}}};
    for (int64_t j0 = from, n; j0 < to; j0 += n) {  /* the keys of one block at a time */
        const int64_t in_block = j0 % block_size;
        int64_t v = head_offset + (table[j0 / block_size] * block_size + in_block) * hd + d0;
        n = to - j0 < block_size - in_block ? to - j0 : block_size - in_block;
        for (int64_t o = 0; o < n; o++, v += hd) {
            const f32x16 v0 = kv16(v_cache, v, half);
            const f32x16 v1 = V > 1 ? kv16(v_cache, v + 16, half) : v0;
            for (int u = 0; u < R; u++) {
                const f32x16 x = splat16(p[u][j0 + o]);
                a[u][0] = fma16(x, v0, a[u][0]);
                if (V > 1) a[u][1] = fma16(x, v1, a[u][1]);
            }
        }
    }
    for (int u = 0; u < R; u++) {
        store16(dst[u] + d0, a[u][0]);
        if (V > 1) store16(dst[u] + d0 + 16, a[u][1]);
    }
}

/* The first key a row may see under a sliding window of `window` keys (it sees key position j
 * iff its position - j < window), and its tree mask (allowed, W words) cut to the ancestors
 * inside the window. A row whose mask covers every tree slot up to its own (`last`) is causal:
 * its position is its slot. Any other is a tree node: its position is tree_start + depth,
 * depth = popcount(mask) - 1, and its ancestors are a chain laid out parents first, so the
 * ancestor at bit m has depth = the mask's set bits below m. Windows are far longer than
 * trees, so the ancestors are normally all inside; when the window ends inside the tree
 * they are cut exactly. */
static inline int64_t window_start(int64_t last, int64_t tree_start, int window, int words, uint32_t *allowed) {
    if (all_bits_set(allowed, last - tree_start + 1)) {
        const int64_t first = last - window + 1;
        return first > 0 ? first : 0;
    }
    int depth = -1;
    for (int u = 0; u < words; u++) depth += __builtin_popcount(allowed[u]);
    const int64_t first = tree_start + depth - window + 1;
    if (first <= tree_start) return first > 0 ? first : 0;
    int below = 0;  /* the window starts inside the tree: no key before it, fewer ancestors */
    for (int m = 0; m < 32 * words; m++) {
        if (!(allowed[m >> 5] >> (m & 31) & 1u)) continue;
        if (below <= depth - window) allowed[m >> 5] &= ~(1u << (m & 31));
        below++;
    }
    return tree_start;
}

/* A score row: keys by slot, room for a chunk of 32 starting at any key before ctx. */
static inline int64_t score_stride(int64_t ctx) {
    return (ctx + 2 * KEYS_PER_CHUNK - 1) / KEYS_PER_CHUNK * KEYS_PER_CHUNK;
}

ALWAYS_INLINE void attend_one(const float *q, int64_t q_token_stride, const void *k_cache, const void *v_cache,
                              float *out, const int64_t *table, int64_t q_first, int q_len, int64_t ctx,
                              int kv_head, int group, int num_heads, int hd, int block_size, int64_t num_blocks,
                              float scale, int window, float softcap, const uint32_t *tree_masks, int words,
                              int64_t back, Scratch *w, const int half) {
    /* Row r = new token r / group, query head kv_head * group + r % group (the heads sharing
     * this KV head); rows are in slot order. A row sees slots first_key .. last_key (those its
     * tree mask allows among the tree's slots); `from` is the earliest first_key of the unit.
     * tree_masks: the rows' masks (words each), NULL: causal; back: the tree starts that many
     * slots before the first new one. */
    const int rows = q_len * group;
    const int64_t new_start = ctx - q_len;  /* the tile's first slot (a tree's: it is one tile) */
    const int64_t tree_start = new_start - back;
    const int64_t stride = score_stride(ctx);
    int64_t from = ctx;
    for (int i = 0, r = 0; i < q_len; i++) {
        uint32_t *allowed = w->allowed + (int64_t)i * words;
        if (tree_masks) memcpy(allowed, tree_masks + (q_first + (int64_t)i) * words, (size_t)words * sizeof(uint32_t));
        const int64_t first = window > 0 && tree_masks ? window_start(new_start + i, tree_start, window, words, allowed)
                              : window > 0 ? (new_start + i - window + 1 > 0 ? new_start + i - window + 1 : 0) : 0;
        from = first < from ? first : from;
        for (int g = 0; g < group; g++, r++) {
            const int head = kv_head * group + g;
            w->q_row[r] = q + (q_first + i) * q_token_stride + (int64_t)head * hd;
            w->out_row[r] = out + ((q_first + i) * num_heads + head) * (int64_t)hd;
            w->first_key[r] = first;
            w->last_key[r] = new_start + i;
        }
    }
    const int64_t head_offset = (int64_t)kv_head * num_blocks * block_size * hd;
    /* Scores, one chunk of 32 keys at a time from the unit's first key (never a key before
     * every row's window): transposed once, then scored for every group of 4 rows that sees
     * any of it (lanes outside a row's keys are computed and ignored). A score is one chain
     * over the head dims whatever its lane, so where chunks start changes no bit. */
    int first_group = 0;  /* groups before it see none of the chunk: their last row is too early */
    for (int64_t j0 = from; j0 <= w->last_key[rows - 1]; j0 += KEYS_PER_CHUNK) {
        int64_t off[KEYS_PER_CHUNK];
        const int n = ctx - j0 < KEYS_PER_CHUNK ? (int)(ctx - j0) : KEYS_PER_CHUNK;
        for (int o = 0; o < n; o++)
            off[o] = head_offset + (table[(j0 + o) / block_size] * block_size + (j0 + o) % block_size) * hd;
        transpose_keys(k_cache, off, n, hd, w->kt, half);
        while (w->last_key[(first_group + 1) * 4 - 1 < rows ? (first_group + 1) * 4 - 1 : rows - 1] < j0)
            first_group++;
        for (int r = first_group * 4; r < rows; r += 4) {
            const float *qs[4];
            float *ss[4];
            const int R = rows - r < 4 ? rows - r : 4;
            int64_t group_first = w->first_key[r];
            for (int u = 1; u < R; u++)
                group_first = w->first_key[r + u] < group_first ? w->first_key[r + u] : group_first;
            if (group_first >= j0 + n) continue;  /* the chunk ends before these rows' windows */
            for (int u = 0; u < R; u++) qs[u] = w->q_row[r + u], ss[u] = w->scores + (r + u) * stride + j0;
            switch (R) {
                case 4: score_chunk(qs, 4, w->kt, hd, ss); break;
                case 3: score_chunk(qs, 3, w->kt, hd, ss); break;
                case 2: score_chunk(qs, 2, w->kt, hd, ss); break;
                default: score_chunk(qs, 1, w->kt, hd, ss); break;
            }
        }
    }
    /* Softmax per row over its own keys, in place; keys a row may not see get weight 0 (from
     * the unit's first key to the end of its context). The order of the sums depends on the
     * number of keys alone. */
    for (int r = 0; r < rows; r++) {
        float *score = w->scores + r * stride;
        const int64_t first = w->first_key[r], visible = w->last_key[r] + 1;
        for (int64_t j = first; j < visible; j++) score[j] *= scale;
        if (softcap > 0.0f)  /* as transformers: tanh(s / cap) * cap, s already scaled */
            for (int64_t j = first; j < visible; j++) score[j] = tanhf(score[j] / softcap) * softcap;
        if (tree_masks)  /* a tree row's first key is at most tree_start (window_start) */
            softmax_in_place_masked(score + first, visible - first, tree_start - first,
                                    w->allowed + (int64_t)(r / group) * words, w->packed);
        else
            softmax_in_place(score + first, visible - first);
        memset(score + from, 0, (size_t)(first - from) * sizeof(float));
        memset(score + visible, 0, (size_t)(ctx - visible) * sizeof(float));
    }
    /* Weighted values, 4 rows and 32 output dims at a time held in registers: each value
     * vector loaded feeds 4 rows. A row's sums run over keys in order, the same whatever its
     * partners (a partner's invisible keys have weight 0 and add exact zeros). */
    for (int r = 0; r < rows; r += 4) {
        const float *ps[4];
        float *dst[4];
        const int R = rows - r < 4 ? rows - r : 4;
        int64_t lo = w->first_key[r];
        for (int u = 0; u < R; u++) {
            ps[u] = w->scores + (r + u) * stride, dst[u] = w->out_row[r + u];
            lo = w->first_key[r + u] < lo ? w->first_key[r + u] : lo;
        }
        const int64_t visible = w->last_key[r + R - 1] + 1;  /* rows are in slot order */
        int d0 = 0;
        for (; d0 + 32 <= hd; d0 += 32) {
            switch (R) {
#define WEIGH(R_) weigh_values(ps, R_, 2, v_cache, head_offset, table, lo, visible, hd, block_size, d0, dst, half)
                case 4: WEIGH(4); break;
                case 3: WEIGH(3); break;
                case 2: WEIGH(2); break;
                default: WEIGH(1); break;
#undef WEIGH
            }
        }
        for (; d0 + 16 <= hd; d0 += 16)
            weigh_values(ps, R, 1, v_cache, head_offset, table, lo, visible, hd, block_size, d0, dst, half);
        for (; d0 < hd; d0++) {  /* head_dim not a multiple of 16: the same chains, one lane each */
            for (int u = 0; u < R; u++) {
                float acc = 0.0f;
                for (int64_t j = lo; j < visible; j++)
                    acc = fma1(ps[u][j], kv1(v_cache, head_offset + (table[j / block_size] * block_size + j % block_size) * hd + d0, half), acc);
                dst[u][d0] = acc;
            }
        }
    }
}

/* Attention for num_reqs requests. Work units are (request, KV head, tile of TILE_TOKENS new
 * tokens; a tree of drafts is one tile), shared out over num_threads OpenMP threads, each
 * unit computed whole by one thread with its own scratch. Every row's scores, softmax and
 * weighted values are computed in an order fixed by its own position alone, so a row's result
 * never depends on the thread count, on the other requests, on how many new tokens its
 * request has (a decode step, a verification, a prefill chunk cut anywhere) or on its tile.
 * Built with -fopenmp, the library's libgomp.so.1 is the one torch already loaded, so these
 * are torch's own worker threads (still spinning from the last matmul), not a second pool.
 * query_start[b] is the first row of request b in q and out; it has query_lens[b] rows.
 * With k_new / v_new ([T, Hk, hd] float32, token strides k_token_stride / v_token_stride), the
 * requests' new K/V are first written into the cache at slot_mapping[t] (saves the caller two
 * scatters and a conversion per layer), one (request, KV head) pair per thread, before any
 * unit attends. sliding_window (0: none) and logit_softcap (0: none) as in the file's header:
 * a windowed row's keys, their order and so its bits depend on its position alone too.
 * Returns 0; -1 when scratch memory could not be allocated (out is then incomplete); -2 when
 * cache_half is asked of a build without F16C. */
int specserve_paged_attention(const float *q, int64_t q_token_stride, const void *k_cache,
                              const void *v_cache, float *out, const int64_t *block_tables,
                              int64_t max_blocks, const int64_t *query_start, const int64_t *query_lens,
                              const int64_t *context_lens, int num_reqs, int num_heads, int num_kv_heads,
                              int hd, int block_size, int64_t num_blocks, float scale, int sliding_window,
                              float logit_softcap, int num_threads,
                              int cache_half, const uint32_t *tree, const float *k_new,
                              int64_t k_token_stride, const float *v_new, int64_t v_token_stride,
                              const int64_t *slot_mapping) {
    if (cache_half && !specserve_paged_attention_has_f16()) return -2;
    const int group = num_heads / num_kv_heads;
    const int words = tree ? (int)tree[0] : 1;                        /* see the file's header */
    const uint32_t *tree_back = tree ? tree + 1 : NULL;
    const uint32_t *tree_masks = tree ? tree + 1 + num_reqs : NULL;   /* [T, words] */
    const int64_t tile = tree_masks ? INT64_MAX / 2 : TILE_TOKENS;
    /* unit_first[b]: index of request b's first unit; its units are head-major, then tile. */
    int64_t *unit_first = malloc((size_t)(num_reqs + 1) * sizeof(int64_t));
    if (!unit_first) return -1;
    int64_t max_rows = 1, max_scores = 1, max_ctx = 1;
    unit_first[0] = 0;
    for (int b = 0; b < num_reqs; b++) {
        const int64_t tiles = (query_lens[b] + tile - 1) / tile;
        unit_first[b + 1] = unit_first[b] + tiles * num_kv_heads;
        max_ctx = context_lens[b] > max_ctx ? context_lens[b] : max_ctx;
        const int64_t rows = (query_lens[b] < tile ? query_lens[b] : tile) * group;
        const int64_t stride = score_stride(context_lens[b]);
        max_rows = rows > max_rows ? rows : max_rows;
        max_scores = rows * stride > max_scores ? rows * stride : max_scores;
    }
    const int64_t num_units = unit_first[num_reqs];
    const int num_pairs = num_reqs * num_kv_heads;
    if (num_threads > num_units) num_threads = (int)num_units;  /* pairs with K/V to write have units too */
    if (num_threads < 1) num_threads = 1;
    int status = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : status)
    {
        if (k_new) {
            /* The new K/V first, each (request, KV head) pair's slots by one thread. */
#pragma omp for schedule(static)
            for (int pair = 0; pair < num_pairs; pair++) {
                const int b = pair / num_kv_heads, h = pair % num_kv_heads;
                const int64_t head_offset = (int64_t)h * num_blocks * block_size * hd;
                for (int64_t t = query_start[b]; t < query_start[b] + query_lens[b]; t++) {
                    const int64_t dst = head_offset + slot_mapping[t] * hd;
                    store_kv((void *)k_cache, dst, k_new + t * k_token_stride + (int64_t)h * hd, hd, cache_half);
                    store_kv((void *)v_cache, dst, v_new + t * v_token_stride + (int64_t)h * hd, hd, cache_half);
                }
            }  /* the implicit barrier: every unit below reads keys that any pair wrote */
        }
        Scratch w;
        w.scores = malloc((size_t)max_scores * sizeof(float));
        w.kt = malloc((size_t)hd * KEYS_PER_CHUNK * sizeof(float));
        w.q_row = malloc((size_t)max_rows * sizeof(*w.q_row));
        w.out_row = malloc((size_t)max_rows * sizeof(*w.out_row));
        w.first_key = malloc((size_t)max_rows * sizeof(*w.first_key));
        w.last_key = malloc((size_t)max_rows * sizeof(*w.last_key));
        w.allowed = malloc((size_t)max_rows * words * sizeof(*w.allowed));
        w.packed = tree_masks ? malloc((size_t)max_ctx * sizeof(float)) : NULL;
        const int ok = w.scores && w.kt && w.q_row && w.out_row && w.first_key && w.last_key && w.allowed
                       && (w.packed || !tree_masks);
        if (!ok) status = -1;
        int b = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < num_units; unit++) {
            if (!ok) continue;
            while (unit_first[b + 1] <= unit) b++;  /* units come in order to each thread */
            while (unit_first[b] > unit) b--;
            const int64_t tiles = (query_lens[b] + tile - 1) / tile;
            const int h = (int)((unit - unit_first[b]) / tiles);
            const int64_t t0 = (unit - unit_first[b]) % tiles * tile;
            const int len = (int)(query_lens[b] - t0 < tile ? query_lens[b] - t0 : tile);
            /* The tile's rows see the context up to its last token: ctx - q_len + t0 + len. */
            const int64_t ctx = context_lens[b] - query_lens[b] + t0 + len;
            const int64_t *table = block_tables + (int64_t)b * max_blocks;
            /* A request without a tree in a step with trees: back = NO_TREE, causal. */
            const uint32_t *req_masks = tree_masks && tree_back[b] != NO_TREE ? tree_masks : NULL;
            if (cache_half)
                attend_one(q, q_token_stride, k_cache, v_cache, out, table, query_start[b] + t0, len, ctx, h, group,
                           num_heads, hd, block_size, num_blocks, scale, sliding_window, logit_softcap, req_masks,
                           words, req_masks ? (int64_t)tree_back[b] : 0, &w, 1);
            else
                attend_one(q, q_token_stride, k_cache, v_cache, out, table, query_start[b] + t0, len, ctx, h, group,
                           num_heads, hd, block_size, num_blocks, scale, sliding_window, logit_softcap, req_masks,
                           words, req_masks ? (int64_t)tree_back[b] : 0, &w, 0);
        }
        free(w.scores);
        free(w.kt);
        free(w.q_row);
        free(w.out_row);
        free(w.first_key);
        free(w.last_key);
        free(w.allowed);
        free(w.packed);
    }
    free(unit_first);
    return status;
}
