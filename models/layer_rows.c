/* A decode step's decoder layers on a CPU in fp32 as ONE call: models/fast_target.py's `_layer_rows`, every layer,
 * with the same kernels in the same order, so the outputs are its bits.
 *
 * Per layer `_layer_rows` makes ~11 kernel calls and ~30 torch views, splits and allocations from Python. On a
 * 2-core EPYC a SmolLM2-135M one-token step spent ~13 of its ~29 ms there, outside any kernel (session 48,
 * cProfile). Here the loop runs in C over a table of the layers' weights (`sd_layer`, filled once by
 * models/layer_rows.py), writing each layer's new keys and values into the decoder's preallocated cache:
 *
 *   h = rms_norm(x, norm1);  qkv = h @ Wqkv.T (+ b);  rope(q, k) in place;  cache[new positions] = k, v
 *   a = attention(q, cache[: span], mask);  s = x + a @ Wo.T;  h = rms_norm(s, norm2)
 *   gu = h @ Wgu.T;  x = s + (silu(gu[:, :I]) * gu[:, I:]) @ Wdown.T
 *
 * B rows of n new positions (a batch's padding packed out of the per-token products, as `_layer_rows` does),
 * the cache as eval/static_kv.py and eval/batch_kv.py lay it out: one buffer (layers, 2, rows, kv_heads, max_len,
 * d), keys then values per layer, written where the caller says. Built into the panel kernel's library
 * (models/panel_linear.py), which defines every function called here.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* panel_linear.c and row_ops.c (the same library) */
void sd_panel_linear(const float *x, int64_t M, int64_t K, const float *P, int64_t N, const float *bias,
                     float *y, int nthreads);
void sd_qpanel_linear(const float *x, int64_t M, int64_t K, const uint8_t *Q, const float *D, const float *Mn,
                      int kind, int64_t N, const float *bias, float *y, int nthreads);
void sd_rms_norm(const float *x, int64_t M, int64_t H, const float *w, float eps, float *y);
void sd_add_rms_norm(const float *x, const float *a, int64_t M, int64_t H, const float *w, float eps, float *s,
                     float *y);
void sd_rope_rows(float *t, int64_t M, int64_t stride, int64_t heads, int64_t d, const float *cos,
                  const float *ssin, int64_t R);
void sd_silu_mul(const float *g, const float *u, int64_t M, int64_t N, int64_t stride, float *out);
void sd_attention_rows(const float *q, int64_t qb, int64_t qh, int64_t ql, const float *k, int64_t kb, int64_t kh,
                       int64_t ks, const float *v, int64_t vb, int64_t vh, int64_t vs, const float *mask,
                       int64_t mb, int64_t ml, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t d,
                       float scale, const int64_t *krow, float *out, int nthreads);

#define KIND_F32 32 /* fp32 panels (sd_panel_linear); any other kind: exact panels (sd_qpanel_linear) */

/* One product: y (M, n_out) = x (M, K) @ W.T + bias, W as panels (`q`: fp32 panels for KIND_F32, else the exact
 * panels' integers with their block tables d, m). */
typedef struct {
    const void *q;
    const float *d, *m, *bias;
    int64_t n_out;
    int32_t kind;
} sd_prod;

/* One layer: its two norms' weights and epsilons and its four products (q/k/v and gate/up stacked). */
typedef struct {
    const float *norm1, *norm2;
    float eps1, eps2;
    sd_prod qkv, o, gate_up, down;
} sd_layer;

static void product(const sd_prod *p, const float *x, int64_t M, int64_t K, float *y, int nthreads) {
    if (p->kind == KIND_F32)
        sd_panel_linear(x, M, K, (const float *)p->q, p->n_out, p->bias, y, nthreads);
    else
        sd_qpanel_linear(x, M, K, (const uint8_t *)p->q, p->d, p->m, p->kind, p->n_out, p->bias, y, nthreads);
}

/* x (T, H): the residual stream of the wanted positions of a step over B rows of n new positions each, run
 * through `nlayers` layers in place.
 *
 * pack: NULL (T = B n, every position wanted) or (T,) ascending flat indices into the B n positions (a batch's
 * padding left out of every per-token product: its q, k, v are zeros, as fast_target.Packing.spread makes
 * them). heads, kv_heads, d: attention geometry (q: heads x d columns of qkv, then k and v: kv_heads x d each);
 * inter: the MLP width I (gate_up has 2 I columns). cache: (layers, 2, cache_rows, kv_heads, max_len, d), keys
 * then values per layer; widx (B kv_heads n,): where each new (row, head, position) goes, as rows of one
 * layer's keys viewed (cache_rows kv_heads max_len, d), laid out (B, kv_heads, n); krow (B,): each row's cache
 * row; attention reads each row's first `span` positions. cos, ssin: rotary tables (rope_rows, d), position
 * p of row b (flat index b n + p) using table row (b n + p) % rope_rows. mask: NULL (every key visible) or
 * additive (B or 1, n or 1, span): row b, query p at mask + b mask_b + p mask_row (0: shared). keep: NULL or
 * per layer NULL / a (T, H) buffer that receives x after that layer. */
void sd_decoder_layers(const sd_layer *layers, int64_t nlayers, int64_t B, int64_t n, int64_t T,
                       const int64_t *pack, int64_t H, int64_t heads, int64_t kv_heads, int64_t d, int64_t inter,
                       float *cache, int64_t cache_rows, int64_t max_len, const int64_t *widx, const int64_t *krow,
                       int64_t span, const float *cos, const float *ssin, int64_t rope_rows, const float *mask,
                       int64_t mask_b, int64_t mask_row, float scale, float *x, float *const *keep, int nthreads) {
    const int64_t wq = heads * d, wkv = kv_heads * d, wqkv = wq + 2 * wkv, P = B * n;
    const int64_t head_stride = max_len * d, row_stride = kv_heads * head_stride;
    const int64_t half = cache_rows * row_stride; /* one layer's keys (then its values) */
    float *h = (float *)malloc((size_t)(T * H + T * wqkv + P * wqkv + P * wq + T * wq + T * H + T * 2 * inter +
                                        T * inter + T * H) * sizeof(float));
    float *tq = h + T * H, *qkv = tq + T * wqkv, *att = qkv + P * wqkv, *tatt = att + P * wq, *o = tatt + T * wq;
    float *gu = o + T * H, *act = gu + T * 2 * inter, *down = act + T * inter;
    for (int64_t i = 0; i < nlayers; i++) {
        const sd_layer *ly = layers + i;
        float *keys = cache + 2 * i * half, *values = keys + half;
        sd_rms_norm(x, T, H, ly->norm1, ly->eps1, h);
        product(&ly->qkv, h, T, H, pack ? tq : qkv, nthreads);
        if (pack) { /* the padding positions' q, k, v: +0 in every layer, as Packing.spread makes them */
            memset(qkv, 0, (size_t)P * wqkv * sizeof(float));
            for (int64_t t = 0; t < T; t++) memcpy(qkv + pack[t] * wqkv, tq + t * wqkv, (size_t)wqkv * sizeof(float));
        }
        sd_rope_rows(qkv, P, wqkv, heads + kv_heads, d, cos, ssin, rope_rows);
        for (int64_t b = 0; b < B; b++)
            for (int64_t g = 0; g < kv_heads; g++)
                for (int64_t p = 0; p < n; p++) {
                    const int64_t dst = widx[(b * kv_heads + g) * n + p] * d;
                    const float *src = qkv + (b * n + p) * wqkv + wq + g * d;
                    memcpy(keys + dst, src, (size_t)d * sizeof(float));
                    memcpy(values + dst, src + wkv, (size_t)d * sizeof(float));
                }
        sd_attention_rows(qkv, n * wqkv, d, wqkv, keys, row_stride, head_stride, d, values, row_stride,
                          head_stride, d, mask, mask_b, mask_row, B, heads, kv_heads, n, span, d, scale, krow, att,
                          nthreads);
        if (pack)
            for (int64_t t = 0; t < T; t++) memcpy(tatt + t * wq, att + pack[t] * wq, (size_t)wq * sizeof(float));
        product(&ly->o, pack ? tatt : att, T, wq, o, nthreads);
        sd_add_rms_norm(x, o, T, H, ly->norm2, ly->eps2, x, h); /* s overwrites x: read before written */
        product(&ly->gate_up, h, T, H, gu, nthreads);
        sd_silu_mul(gu, gu + inter, T, inter, 2 * inter, act);
        product(&ly->down, act, T, inter, down, nthreads);
        for (int64_t r = 0; r < T * H; r++) x[r] += down[r];
        if (keep && keep[i]) memcpy(keep[i], x, (size_t)T * H * sizeof(float));
    }
    free(h);
}
