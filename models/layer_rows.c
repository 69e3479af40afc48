/* A decode step's decoder layers on a CPU in fp32 as ONE call: models/fast_target.py's `_layer_rows`, every layer,
 * with the same kernels in the same order, so the outputs are its bits.
 *
 * Per layer `_layer_rows` makes ~11 kernel calls and ~30 torch views, splits and allocations from Python. On a
 * 2-core EPYC a SmolLM2-135M one-token step spent ~13 of its ~29 ms there, outside any kernel (session 48,
 * cProfile). Here the loop runs in C over a table of the layers' weights (`sd_layer`, filled once by
 * models/layer_rows.py), writing each layer's new keys and values into the decoder's preallocated cache:
 *
 *   h = rms_norm(x, norm1);  qkv = h @ Wqkv.T (+ b);  rope(q, k) in place;  cache[start : start + M] = k, v
 *   a = attention(q, cache[: start + M], mask);  s = x + a @ Wo.T;  h = rms_norm(s, norm2)
 *   gu = h @ Wgu.T;  x = s + (silu(gu[:, :I]) * gu[:, I:]) @ Wdown.T
 *
 * One batch row (M new positions of one sequence), the cache as models/../eval/static_kv.py lays it out: one
 * buffer (layers, 2, 1, kv_heads, max_len, d), keys then values per layer. Built into the panel kernel's library
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
void sd_attention(const float *q, int64_t qb, int64_t qh, int64_t ql, const float *k, int64_t kb, int64_t kh,
                  int64_t ks, const float *v, int64_t vb, int64_t vh, int64_t vs, const float *mask, int64_t mb,
                  int64_t ml, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t d, float scale,
                  float *out, int nthreads);

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

/* x (M, H): the residual stream of M new positions, run through `nlayers` layers in place.
 *
 * heads, kv_heads, d: attention geometry (q: heads x d columns of qkv, then k and v: kv_heads x d each);
 * inter: the MLP width I (gate_up has 2 I columns). cache: the buffer above, max_len positions a head; the new
 * positions go to [start, start + M), attention reads [0, start + M). cos, ssin: rotary tables (rope_rows,
 * d columns) used by row r % rope_rows. mask: NULL (every key visible) or (M, start + M) additive, rows
 * mask_row floats apart (0: one row for all). keep: NULL or per layer NULL / a (M, H) buffer that receives
 * x after that layer. */
void sd_decoder_layers(const sd_layer *layers, int64_t nlayers, int64_t M, int64_t H, int64_t heads,
                       int64_t kv_heads, int64_t d, int64_t inter, float *cache, int64_t max_len, int64_t start,
                       const float *cos, const float *ssin, int64_t rope_rows, const float *mask, int64_t mask_row,
                       float scale, float *x, float *const *keep, int nthreads) {
    const int64_t wq = heads * d, wkv = kv_heads * d, wqkv = wq + 2 * wkv, S = start + M;
    const int64_t head_stride = max_len * d, layer_stride = 2 * kv_heads * head_stride;
    float *h = (float *)malloc((size_t)M * (H + wqkv + wq + H + 2 * inter + inter + H) * sizeof(float));
    float *qkv = h + M * H, *att = qkv + M * wqkv, *o = att + M * wq, *gu = o + M * H, *act = gu + M * 2 * inter;
    float *down = act + M * inter;
    for (int64_t i = 0; i < nlayers; i++) {
        const sd_layer *ly = layers + i;
        float *keys = cache + i * layer_stride, *values = keys + kv_heads * head_stride;
        sd_rms_norm(x, M, H, ly->norm1, ly->eps1, h);
        product(&ly->qkv, h, M, H, qkv, nthreads);
        sd_rope_rows(qkv, M, wqkv, heads + kv_heads, d, cos, ssin, rope_rows);
        for (int64_t t = 0; t < M; t++)
            for (int64_t g = 0; g < kv_heads; g++) {
                memcpy(keys + g * head_stride + (start + t) * d, qkv + t * wqkv + wq + g * d, (size_t)d * 4);
                memcpy(values + g * head_stride + (start + t) * d, qkv + t * wqkv + wq + wkv + g * d, (size_t)d * 4);
            }
        sd_attention(qkv, M * wqkv, d, wqkv, keys, layer_stride, head_stride, d, values, layer_stride, head_stride,
                     d, mask, 0, mask_row, 1, heads, kv_heads, M, S, d, scale, att, nthreads);
        product(&ly->o, att, M, wq, o, nthreads);
        sd_add_rms_norm(x, o, M, H, ly->norm2, ly->eps2, x, h); /* s overwrites x: read before written, row by row */
        product(&ly->gate_up, h, M, H, gu, nthreads);
        sd_silu_mul(gu, gu + inter, M, inter, 2 * inter, act);
        product(&ly->down, act, M, inter, down, nthreads);
        for (int64_t r = 0; r < M * H; r++) x[r] += down[r];
        if (keep && keep[i]) memcpy(keep[i], x, (size_t)M * H * sizeof(float));
    }
    free(h);
}
