/* A decoder layer's row-wise work in two calls, for quantized weights on CPUs.
 *
 * Called from specserve/model_executor/layers/quant_layer.py through ctypes, around the
 * paged-attention call that stays in Python (it mixes the compiled kernel and SDPA):
 *
 *   specserve_qlayer_attn_in:  h = [norm](x) ; qkv = h @ Wqkv.T (+ bias) ; [q/k norms] ;
 *                              rotate q and k (the first rotary_dim dims; none in NoPE layers)
 *   specserve_qlayer_mlp:      h = [out_norm](attn @ Wo.T) ; x += h * rs ; h = [norm](x) ;
 *                              gu = h @ Wgate_up.T ; a = act(gate) * up ;
 *                              h = [out_norm](a @ Wdown.T) ; x += h * rs
 *
 * Each row may carry a LoRA adapter (``lora_row``: an index into each matrix's table of ``qlora``,
 * set per step by Python): the row gains its adapter's B (A in), added right after the matmul,
 * before anything reads it, so rows of different adapters (and of none) share one call.
 *
 * The bracketed parts are the family's (models/decoder_spec.py), set per layer in ``qlayer``:
 * a NULL norm is absent, act is silu or GELU-tanh, rs the residual scale (Granite; 1 adds
 * without a multiply), each layer its own rotary tables (Gemma 3's local and global layers).
 *
 * and, when the compiled paged-attention kernel serves every request of the step (decoding
 * and verification steps), all layers in one call: specserve_qmodel_layers runs, per layer,
 * attn_in, that kernel (through the function pointer Python hands it, with the same
 * arguments the Python path gives it, the layer's sliding window and soft cap included) and mlp. Same functions, same inputs: the same bits
 * as the per-layer calls, without ~3 ctypes calls and their Python per layer.
 *
 * Why: a batch-1 decode step of the default model is ~30 small PyTorch calls per layer outside
 * the matmuls (norms, rotary, residual adds, activation), each paying dispatch, and each matmul
 * its own OpenMP fork and join. Here each half is one call and one parallel region, the phases
 * separated by barriers (docs/benchmarks.md, "Quantized weights").
 *
 * Every phase is row-wise or the row-invariant matmul (quant_blocks.h), so a token's numbers do
 * not depend on the other rows of its step: greedy speculative output stays the plain output.
 * The rotary is computed as the PyTorch path computes it (x * cos + rotate_half(x) * sin, each
 * product and the sum rounded once); the norm and silu are this file's own.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"

/* A weight matrix as up to 4 runs of rows, each in one GGUF format (quantized.py's segments). */
typedef struct {
    int32_t num_segments;
    int32_t qtype[4];
    int64_t rows[4];
    const uint8_t *data[4];
} qmatrix;

/* A LoRA adapter on one matrix: out[t] += bt.T (a in[t]); a [rank, in], bt [rank, out] (B
 * transposed, so the update runs along contiguous rows); rank 0: none (entry 0 of every table). */
typedef struct {
    int64_t rank;
    const float *a, *bt;
} qlora;


enum { QK_NORM_NONE = 0, QK_NORM_HEAD = 1, QK_NORM_ALL = 2 };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* One decoder layer: shapes, norms, bias and its four matrices (set up once, after loading);
 * its attention's sliding window (0: none) and logit soft cap (0: none), which differ per
 * layer in Gemma 2/3 (local and global layers). Norm weights are what x / rms(x) is
 * multiplied by (Gemma's 1 + w already added). */
typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps;
    int32_t sliding_window;
    float attn_softcap;
    const float *input_norm, *post_norm; /* [hidden]: before attention and before the MLP, or NULL */
    const float *qkv_bias;               /* [(num_heads + 2 num_kv_heads) head_dim], or NULL */
    qmatrix qkv, o, gate_up, down;
    const float *attn_out_norm, *mlp_out_norm; /* [hidden] on each branch's output, or NULL */
    const float *q_norm, *k_norm;        /* [head_dim] (QK_NORM_HEAD) or [heads * head_dim] (QK_NORM_ALL) */
    int32_t qk_norm, activation;
    float residual_scale;
    const float *cos_table, *sin_table;  /* [max_positions, rotary_dim / 2], or NULL: no rotary */
    int64_t rotary_dim;
    const int32_t *lora_row;             /* [T]: each row's entry in the tables below, or NULL: no LoRA */
    const qlora *lora_qkv, *lora_o, *lora_gate_up, *lora_down; /* the step's adapters on each matrix */
    int64_t lora_max_rank;               /* the largest rank in the tables */
} qlayer;

int specserve_qlayer_struct_sizes(int64_t *sizes) { /* the Python side checks its mirror */
    sizes[0] = (int64_t)sizeof(qmatrix);
    sizes[1] = (int64_t)sizeof(qlayer);
    sizes[2] = (int64_t)sizeof(qlora);
    return 0;
}

#if defined(__F16C__)

/* out = x @ m.T (+ bias), in a parallel region: each segment fills its own columns of out. */
static int qmatrix_gemm(const qmatrix *m, const float *x, int64_t ldx, int64_t rows, int64_t in,
                        const float *bias, float *out, int64_t ldo) {
    int status = 0;
    int64_t col = 0;
    for (int s = 0; s < m->num_segments; s++) {
        status |= quant_gemm_team(x, ldx, rows, m->data[s], m->qtype[s], m->rows[s], in, bias ? bias + col : NULL,
                                  out + col, ldo);
        col += m->rows[s];
    }
    return status;
}

/* out[t] += B (A in[t]) of row t's adapter (table[L->lora_row[t]]), for every row, shared out over the
 * team: first the low-rank products low[t, r] = a[r] . in[t], then each output element adds low[t, r] *
 * bt[r, o] over r in order (one row's numbers never depend on another's: row-invariant). in [T, in]
 * (row stride ldx), out [T, n_out] (contiguous rows), low [T, L->lora_max_rank] scratch shared by the
 * team (NULL: no LoRA rows this call, nothing to add). */
#define QLORA_COLUMNS 64
static void lora_add(const qlayer *L, const qlora *table, const float *x, int64_t ldx, int64_t T, int64_t in,
                     float *out, int64_t n_out, float *low) {
    if (low == NULL) return;
    const int32_t *row = L->lora_row;
    const int64_t R = L->lora_max_rank, ldo = n_out, blocks = (n_out + QLORA_COLUMNS - 1) / QLORA_COLUMNS;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < T * R; i++) {
        const qlora *l = table + row[i / R];
        if (i % R >= l->rank) continue;
        const float *ar = l->a + (i % R) * in, *xt = x + (i / R) * ldx;
        float lanes[8] = {0}; /* 8 fixed partial sums (vectorized), added in a fixed order */
        int64_t j = 0;
        for (; j + 8 <= in; j += 8)
            for (int k = 0; k < 8; k++) lanes[k] += ar[j + k] * xt[j + k];
        float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        for (; j < in; j++) sum += ar[j] * xt[j];
        low[i] = sum;
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < T * blocks; i++) {
        const int64_t t = i / blocks, o0 = (i % blocks) * QLORA_COLUMNS;
        const int64_t o1 = o0 + QLORA_COLUMNS < n_out ? o0 + QLORA_COLUMNS : n_out;
        const qlora *l = table + row[t];
        float *ot = out + t * ldo;
        for (int64_t r = 0; r < l->rank; r++) {
            const float c = low[t * R + r], *br = l->bt + r * n_out;
            for (int64_t o = o0; o < o1; o++) ot[o] += c * br[o];
        }
    }
}

/* The low-rank scratch for a call's adapters ([T, largest rank]); NULL without any (or on failure,
 * told apart by *failed). */
static float *lora_scratch(const qlayer *L, int64_t T, int *failed) {
    if (L->lora_row == NULL || L->lora_max_rank == 0) return NULL;
    float *low = (float *)malloc((size_t)(T * L->lora_max_rank) * sizeof(float));
    *failed = low == NULL;
    return low;
}

static inline void rms_norm_row(const float *x, const float *w, int64_t n, float eps, float *y) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] * inv) * w[i];
}

static inline float gelu_tanh(float x) { /* torch's gelu(approximate="tanh") */
    const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + tanhf(inner));
}

/* x [T, hidden]; positions [T] (indices into the layer's rotary tables); h [T, hidden]
 * scratch; qkv [T, (Hq + 2 Hk) hd] out, q and k normed (if the layer has q/k norms) and rotated. */
int specserve_qlayer_attn_in(const qlayer *L, const float *x, int64_t T, const int64_t *positions, float *h,
                             float *qkv, int num_threads) {
    const int64_t H = L->hidden, hd = L->head_dim, half = L->rotary_dim / 2;
    const int64_t n_qkv = (L->num_heads + 2 * L->num_kv_heads) * hd, n_rot = L->num_heads + L->num_kv_heads;
    const int64_t q_width = L->num_heads * hd, k_width = L->num_kv_heads * hd;
    if (num_threads < 1) num_threads = 1;
    int status = 0, failed = 0;
    float *low = lora_scratch(L, T, &failed); /* [T, largest LoRA rank], or NULL */
    if (failed) return -3;
#pragma omp parallel num_threads(num_threads) reduction(| : status)
    {
        const float *in = x;
        if (L->input_norm) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) rms_norm_row(x + t * H, L->input_norm, H, L->eps, h + t * H);
            in = h;
        }
        status |= qmatrix_gemm(&L->qkv, in, H, T, H, L->qkv_bias, qkv, n_qkv);
        lora_add(L, L->lora_qkv, in, H, T, H, qkv, n_qkv, low);
        if (L->qk_norm == QK_NORM_HEAD) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < T * n_rot; i++) {
                const int64_t t = i / n_rot, head = i % n_rot;
                float *v = qkv + t * n_qkv + head * hd;
                rms_norm_row(v, head < L->num_heads ? L->q_norm : L->k_norm, hd, L->eps, v);
            }
        } else if (L->qk_norm == QK_NORM_ALL) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < 2 * T; i++) {
                float *v = qkv + (i / 2) * n_qkv + (i % 2) * q_width;
                if (i % 2) rms_norm_row(v, L->k_norm, k_width, L->eps, v);
                else rms_norm_row(v, L->q_norm, q_width, L->eps, v);
            }
        }
        if (L->cos_table) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < T * n_rot; i++) {
                const int64_t t = i / n_rot, head = i % n_rot;
                float *v = qkv + t * n_qkv + head * hd;
                const float *c = L->cos_table + positions[t] * half, *s = L->sin_table + positions[t] * half;
                for (int64_t j = 0; j < half; j++) {
                    const float x1 = v[j], x2 = v[j + half];
                    v[j] = x1 * c[j] + (-x2) * s[j];
                    v[j + half] = x2 * c[j] + x1 * s[j];
                }
            }
        }
    }
    free(low);
    return status;
}

/* x += h (* residual_scale), h first normed by ``out_norm`` where the layer has one. */
static inline void add_branch(const qlayer *L, float *xt, float *ht, const float *out_norm) {
    const int64_t H = L->hidden;
    if (out_norm) rms_norm_row(ht, out_norm, H, L->eps, ht);
    if (L->residual_scale == 1.0f) {
        for (int64_t i = 0; i < H; i++) xt[i] = xt[i] + ht[i];
    } else {
        for (int64_t i = 0; i < H; i++) xt[i] = xt[i] + ht[i] * L->residual_scale;
    }
}

/* x [T, hidden] updated in place; attn [T, Hq hd] (row stride ld_attn); h [T, hidden] and
 * gu [T, 2 intermediate] scratch. */
int specserve_qlayer_mlp(const qlayer *L, float *x, int64_t T, const float *attn, int64_t ld_attn, float *h,
                         float *gu, int num_threads) {
    const int64_t H = L->hidden, I = L->intermediate, A = L->num_heads * L->head_dim;
    if (num_threads < 1) num_threads = 1;
    int status = 0, failed = 0;
    float *low = lora_scratch(L, T, &failed); /* [T, largest LoRA rank], or NULL */
    if (failed) return -3;
#pragma omp parallel num_threads(num_threads) reduction(| : status)
    {
        status |= qmatrix_gemm(&L->o, attn, ld_attn, T, A, NULL, h, H);
        lora_add(L, L->lora_o, attn, ld_attn, T, A, h, H, low);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *xt = x + t * H, *ht = h + t * H;
            add_branch(L, xt, ht, L->attn_out_norm);
            if (L->post_norm) rms_norm_row(xt, L->post_norm, H, L->eps, ht);
            else memcpy(ht, xt, (size_t)H * sizeof(float));
        }
        status |= qmatrix_gemm(&L->gate_up, h, H, T, H, NULL, gu, 2 * I);
        lora_add(L, L->lora_gate_up, h, H, T, H, gu, 2 * I, low);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T * I; i++) { /* act(gate) * up, into gate's place */
            float *g = gu + (i / I) * 2 * I + i % I;
            const float gate = *g;
            const float a = L->activation == ACT_GELU_TANH ? gelu_tanh(gate) : gate / (1.0f + expf(-gate));
            *g = a * g[I];
        }
        status |= qmatrix_gemm(&L->down, gu, 2 * I, T, I, NULL, h, H);
        lora_add(L, L->lora_down, gu, 2 * I, T, I, h, H, low);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) add_branch(L, x + t * H, h + t * H, L->mlp_out_norm);
    }
    free(low);
    return status;
}

/* paged_attention.c's specserve_paged_attention (its own library; Python passes its address). */
typedef int (*attention_fn)(const float *q, int64_t q_token_stride, const void *k_cache, const void *v_cache,
                            float *out, const int64_t *block_tables, int64_t max_blocks, const int64_t *query_start,
                            const int64_t *query_lens, const int64_t *context_lens, int num_reqs, int num_heads,
                            int num_kv_heads, int hd, int block_size, int64_t num_blocks, float scale,
                            int sliding_window, float logit_softcap, int num_threads, int cache_half, const uint32_t *tree_masks, const float *k_new,
                            int64_t k_token_stride, const float *v_new, int64_t v_token_stride,
                            const int64_t *slot_mapping);

/* What every layer's attention call of one step shares. */
typedef struct {
    attention_fn attend;
    const int64_t *block_tables; /* [num_reqs, max_blocks] */
    int64_t max_blocks;
    const int64_t *query_start, *query_lens, *context_lens; /* [num_reqs] */
    const uint32_t *tree_masks;  /* [T] or NULL */
    const int64_t *slot_mapping; /* [T] */
    int64_t num_blocks;
    int32_t num_reqs, block_size, cache_half;
    float scale;
} qattention;

int specserve_qattention_struct_size(void) { return (int)sizeof(qattention); }

/* Every layer: x [T, hidden] in place. k_caches[l], v_caches[l]: layer l's K and V caches
 * [Hk, num_blocks, block_size, hd]; h [T, hidden], qkv [T, (Hq + 2 Hk) hd], attn [T, Hq hd] and
 * gu [T, 2 intermediate] scratch. Returns 0; a layer function's status; or 1000 - the
 * attention kernel's status (-2: no F16C for a float16 cache, else scratch). */
int specserve_qmodel_layers(const qlayer *const *layers, int num_layers, const void *const *k_caches,
                            const void *const *v_caches, const qattention *A, float *x, int64_t T,
                            const int64_t *positions, float *h, float *qkv, float *attn, float *gu,
                            int num_threads) {
    for (int l = 0; l < num_layers; l++) {
        const qlayer *L = layers[l];
        const int64_t hd = L->head_dim, n_qkv = (L->num_heads + 2 * L->num_kv_heads) * hd;
        int status = specserve_qlayer_attn_in(L, x, T, positions, h, qkv, num_threads);
        if (status) return status;
        const float *k_new = qkv + L->num_heads * hd, *v_new = k_new + L->num_kv_heads * hd;
        status = A->attend(qkv, n_qkv, k_caches[l], v_caches[l], attn, A->block_tables, A->max_blocks,
                           A->query_start, A->query_lens, A->context_lens, A->num_reqs, (int)L->num_heads,
                           (int)L->num_kv_heads, (int)hd, A->block_size, A->num_blocks, A->scale,
                           L->sliding_window, L->attn_softcap, num_threads, A->cache_half, A->tree_masks, k_new, n_qkv, v_new, n_qkv, A->slot_mapping);
        if (status) return 1000 - status;
        status = specserve_qlayer_mlp(L, x, T, attn, L->num_heads * hd, h, gu, num_threads);
        if (status) return status;
    }
    return 0;
}

#else /* no F16C */

int specserve_qlayer_attn_in(const qlayer *L, const float *x, int64_t T, const int64_t *positions, float *h,
                             float *qkv, int num_threads) {
    (void)L, (void)x, (void)T, (void)positions, (void)h, (void)qkv, (void)num_threads;
    return -2;
}

int specserve_qlayer_mlp(const qlayer *L, float *x, int64_t T, const float *attn, int64_t ld_attn, float *h,
                         float *gu, int num_threads) {
    (void)L, (void)x, (void)T, (void)attn, (void)ld_attn, (void)h, (void)gu, (void)num_threads;
    return -2;
}

int specserve_qattention_struct_size(void) { return -1; }

int specserve_qmodel_layers(const void *const *layers, int num_layers, const void *const *k_caches,
                            const void *const *v_caches, const void *A, float *x, int64_t T,
                            const int64_t *positions, float *h, float *qkv, float *attn, float *gu,
                            int num_threads) {
    (void)layers, (void)num_layers, (void)k_caches, (void)v_caches, (void)A, (void)x, (void)T, (void)positions;
    (void)h, (void)qkv, (void)attn, (void)gu, (void)num_threads;
    return -2;
}

#endif
