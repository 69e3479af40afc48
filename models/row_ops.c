/* The small per-row steps of a Llama-family decoder layer in fp32, one call each instead of 4-8 torch ops.
 *
 * On a 2-core EPYC a torch op on a decode step's few rows costs 3-40 us of dispatch (an RMSNorm, six ops in
 * torch's CPU composite, ~25-40 us), against microseconds of arithmetic; a SmolLM2-135M step runs ~60 norms,
 * ~60 rotary embeddings and 30 gated activations. models/fast_target.py calls these where the target's Linears
 * run the panel kernel (fp32 on a CPU), built into the same library by models/panel_linear.py.
 *
 * Every row is computed on its own, in a fixed order, whatever the number of rows: a tree verify, a batch and an
 * AR step give a row the same bits (what the lossless decoders rely on). The rotary embedding is transformers'
 * t * cos + rotate_half(t) * sin bit for bit (built with -ffp-contract=off: no fused multiply-adds); the norm
 * and the activation equal torch's to rounding (another summation order; exp8's polynomial for the exponential).
 *
 * sd_attention is a decode step's attention over the cache (a few queries, grouped key/value heads, an additive
 * mask) with every query computed alone over its visible keys in order: torch's SDPA kernels block queries and
 * keys by the call's shape, so a tree node and the AR step at the same position agreed only to rounding; here
 * they agree bit for bit, and the call costs a fraction of torch's ~60-120 us on a 2-core EPYC.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* inv rms of row x (H,): 1 / sqrt(mean(x^2) + eps), the sum in double (order-independent enough to match
 * torch's float reduction to rounding) */
static inline float inv_rms(const float *x, int64_t H, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < H; i++) ss += (double)x[i] * (double)x[i];
    return 1.0f / sqrtf((float)(ss / (double)H) + eps);
}

/* y (M, H) = w * (x * inv_rms(x)) per row: transformers' RMSNorm of an fp32 x. */
void sd_rms_norm(const float *x, int64_t M, int64_t H, const float *w, float eps, float *y) {
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * H;
        float *yr = y + r * H;
        const float s = inv_rms(xr, H, eps);
        for (int64_t i = 0; i < H; i++) yr[i] = w[i] * (xr[i] * s);
    }
}

/* s (M, H) = x + a (the residual stream), y (M, H) = sd_rms_norm(s): a layer's residual add and the norm after. */
void sd_add_rms_norm(const float *x, const float *a, int64_t M, int64_t H, const float *w, float eps, float *s,
                     float *y) {
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * H, *ar = a + r * H;
        float *sr = s + r * H, *yr = y + r * H;
        for (int64_t i = 0; i < H; i++) sr[i] = xr[i] + ar[i];
        const float inv = inv_rms(sr, H, eps);
        for (int64_t i = 0; i < H; i++) yr[i] = w[i] * (sr[i] * inv);
    }
}

/* In place, the first `heads` heads of d columns of each row r of t (M rows, `stride` floats apart):
 * t = t * cos + roll(t, d / 2) * ssin, with cos / ssin (trows, d) rows r % trows (a table per row, or one per
 * position shared by a batch's rows). ssin is sin with its first half negated (fast_target.rotary_tables). */
void sd_rope_rows(float *t, int64_t M, int64_t stride, int64_t heads, int64_t d, const float *cos,
                  const float *ssin, int64_t trows) {
    float tmp[1024];
    const int64_t half = d / 2;
    for (int64_t r = 0; r < M; r++) {
        const float *c = cos + (r % trows) * d, *s = ssin + (r % trows) * d;
        for (int64_t h = 0; h < heads; h++) {
            float *v = t + r * stride + h * d;
            memcpy(tmp, v, (size_t)d * sizeof(float));
            for (int64_t i = 0; i < d; i++) {
                const float a = tmp[i] * c[i];
                const float b = tmp[i < half ? i + half : i - half] * s[i];
                v[i] = a + b;
            }
        }
    }
}

/* ---- attention of a decode step's few queries over the cache ------------------------------------------ */
#define MASKED (-1e30f) /* an additive mask value at or below this hides the key (decoders write dtype-min) */
#ifndef PAR_WORK
#define PAR_WORK 50000 /* query x key x dim products past which the attention splits over threads */
#endif

/* the sum of acc's lanes in the order ((0+1)+(2+3)) + ((4+5)+(6+7)), which dots4's vector reduction shares */
static inline float hsum(__m256 acc) {
    float l[8];
    _mm256_storeu_ps(l, acc);
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* e^x per lane (Cephes' expf: a degree-6 polynomial after x = n ln2 + r; within ~2 ulp of expf), 0 below -87.3
 * (-inf included): lane by lane, so a key's weight does not depend on its neighbours */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

/* out (M, N) = silu(g) * u = g / (1 + e^-g) * u, g and u rows `stride` floats apart (the halves of one gate/up
 * product); e^-g by exp8, eight lanes at a time (a trailing part through the same code on a padded copy), so each
 * element's value depends on nothing else. libm's scalar expf made this 0.6 ms of a ~15 ms SmolLM2-135M step on a
 * 2-core EPYC, and as much again for every further row of a verify (session 49). */
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

void sd_silu_mul(const float *g, const float *u, int64_t M, int64_t N, int64_t stride, float *out) {
    for (int64_t r = 0; r < M; r++) {
        const float *gr = g + r * stride, *ur = u + r * stride;
        float *o = out + r * N;
        int64_t i = 0;
        for (; i + 8 <= N; i += 8) _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(gr + i), _mm256_loadu_ps(ur + i)));
        if (i < N) {
            float gt[8] = {0}, ut[8] = {0}, ot[8];
            memcpy(gt, gr + i, (size_t)(N - i) * sizeof(float));
            memcpy(ut, ur + i, (size_t)(N - i) * sizeof(float));
            _mm256_storeu_ps(ot, silu_mul8(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
            memcpy(o + i, ot, (size_t)(N - i) * sizeof(float));
        }
    }
}

/* sc[h][j0 + t] = q_h . k[idx[j0 + t]] for H heads (a constant after inlining, <= 3) and 4 keys t (idx 4 valid
 * entries): each key row read once for the H heads; each dot one 8-lane chain over d in order, then hsum's order
 * (four keys' lanes reduced together). sc rows `sp` floats apart. */
static inline __attribute__((always_inline)) void dots4(const int H, const float *const *qs, const float *k,
                                                        int64_t ks, const int32_t *idx, int64_t d, float *sc,
                                                        int64_t sp) {
    __m256 a[3][4];
    for (int h = 0; h < H; h++)
        for (int t = 0; t < 4; t++) a[h][t] = _mm256_setzero_ps();
    const float *k0 = k + idx[0] * ks, *k1 = k + idx[1] * ks, *k2 = k + idx[2] * ks, *k3 = k + idx[3] * ks;
    for (int64_t i = 0; i < d; i += 8) {
        __m256 x[3];
        for (int h = 0; h < H; h++) x[h] = _mm256_loadu_ps(qs[h] + i);
        const __m256 y0 = _mm256_loadu_ps(k0 + i), y1 = _mm256_loadu_ps(k1 + i);
        for (int h = 0; h < H; h++) a[h][0] = _mm256_fmadd_ps(x[h], y0, a[h][0]);
        for (int h = 0; h < H; h++) a[h][1] = _mm256_fmadd_ps(x[h], y1, a[h][1]);
        const __m256 y2 = _mm256_loadu_ps(k2 + i), y3 = _mm256_loadu_ps(k3 + i);
        for (int h = 0; h < H; h++) a[h][2] = _mm256_fmadd_ps(x[h], y2, a[h][2]);
        for (int h = 0; h < H; h++) a[h][3] = _mm256_fmadd_ps(x[h], y3, a[h][3]);
    }
    for (int h = 0; h < H; h++) { /* per key: (0+1, 2+3 | 4+5, 6+7), then ((0+1)+(2+3) | ...), then the halves */
        const __m256 g = _mm256_hadd_ps(_mm256_hadd_ps(a[h][0], a[h][1]), _mm256_hadd_ps(a[h][2], a[h][3]));
        _mm_storeu_ps(sc + h * sp, _mm_add_ps(_mm256_castps256_ps128(g), _mm256_extractf128_ps(g, 1)));
    }
}

/* the same for one key (the last n % 4): the same chain and order as dots4 */
static inline void dot1(const int H, const float *const *qs, const float *kr, int64_t d, float *sc, int64_t sp) {
    for (int h = 0; h < H; h++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(qs[h] + i), _mm256_loadu_ps(kr + i), acc);
        sc[h * sp] = hsum(acc);
    }
}

/* o_h[c0 : c0 + 8 C] = sum over j < n in order of w_h[j] * v[idx[j]][c0 : ...] for H heads (<= 3) and C
 * (<= 4) 8-float chunks, constants after inlining: each value row slice read once for the H heads, the H C sums
 * in registers (up to 12 independent FMA chains: two chunks left the loop waiting on FMA latency). w rows `sp`
 * floats apart, o rows `os` apart. */
static inline __attribute__((always_inline)) void weigh(const int H, const int C, const float *w, int64_t sp,
                                                        const int32_t *idx, int64_t n, const float *v, int64_t vs,
                                                        float *o, int64_t os) {
    __m256 a[3][4];
    for (int h = 0; h < H; h++)
        for (int c = 0; c < C; c++) a[h][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const float *vv = v + idx[j] * vs;
        __m256 wb[3];
        for (int h = 0; h < H; h++) wb[h] = _mm256_set1_ps(w[h * sp + j]);
        for (int c = 0; c < C; c++) {
            const __m256 y = _mm256_loadu_ps(vv + 8 * c);
            for (int h = 0; h < H; h++) a[h][c] = _mm256_fmadd_ps(wb[h], y, a[h][c]);
        }
    }
    for (int h = 0; h < H; h++)
        for (int c = 0; c < C; c++) _mm256_storeu_ps(o + h * os + 8 * c, a[h][c]);
}

/* Softmax of H (<= 3) score rows sc[h][0:n] (rows `sp` floats apart, scaled by `scale`, plus the mask values mv)
 * in place, lane by lane; each sum by key index mod 8; padded with zero weights to a multiple of 8. */
static inline __attribute__((always_inline)) void softmax_rows(const int H, float *sc, int64_t sp, int64_t n,
                                                               const float *mv, float scale) {
    const int64_t np = (n + 7) / 8 * 8;
    const __m256 s8 = _mm256_set1_ps(scale);
    for (int h = 0; h < H; h++) {
        float *e = sc + h * sp;
        int64_t j;
        for (j = n; j < np; j++) e[j] = -INFINITY;
        __m256 m8 = _mm256_set1_ps(-INFINITY);
        for (j = 0; j < np; j += 8) {
            const __m256 x = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(e + j), s8), _mm256_loadu_ps(mv + j));
            _mm256_storeu_ps(e + j, x);
            m8 = _mm256_max_ps(m8, x);
        }
        float l[8], mx = -INFINITY;
        _mm256_storeu_ps(l, m8);
        for (int t = 0; t < 8; t++) mx = l[t] > mx ? l[t] : mx;
        m8 = _mm256_set1_ps(mx);
        __m256 z8 = _mm256_setzero_ps();
        for (j = 0; j < np; j += 8) {
            const __m256 x = exp8(_mm256_sub_ps(_mm256_loadu_ps(e + j), m8));
            _mm256_storeu_ps(e + j, x);
            z8 = _mm256_add_ps(z8, x);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / hsum(z8));
        for (j = 0; j < np; j += 8) _mm256_storeu_ps(e + j, _mm256_mul_ps(_mm256_loadu_ps(e + j), inv));
    }
}

/* o_h[c : d] for the last 0-3 8-float chunks of the value rows (weigh at C = (d - c) / 8) */
static inline __attribute__((always_inline)) void weigh_tail(const int H, const float *w, int64_t sp,
                                                             const int32_t *idx, int64_t n, const float *v, int64_t vs,
                                                             float *o, int64_t os, int64_t c, int64_t d) {
    switch ((d - c) / 8) {
        case 3: weigh(H, 3, w, sp, idx, n, v + c, vs, o + c, os); break;
        case 2: weigh(H, 2, w, sp, idx, n, v + c, vs, o + c, os); break;
        case 1: weigh(H, 1, w, sp, idx, n, v + c, vs, o + c, os); break;
        default: break;
    }
}

/* The body of `heads` and `heads_wide`, one sequence for both so their bits stay equal: the key dots four keys at
 * a time through DOTS4, the rest one by one, the softmax, then the value sums 32 columns at a time through WEIGH32
 * and the last 0-3 8-column chunks. */
#define HEADS_BODY(DOTS4, WEIGH32)                                                      \
    int64_t j = 0;                                                                      \
    for (; j + 4 <= n; j += 4) DOTS4(H, qs, kr, ks, idx + j, d, sc + j, sp);            \
    for (; j < n; j++) dot1(H, qs, kr + idx[j] * ks, d, sc + j, sp);                    \
    softmax_rows(H, sc, sp, n, mv, scale);                                              \
    int64_t c = 0;                                                                      \
    for (; c + 32 <= d; c += 32) WEIGH32(H, sc, sp, idx, n, vr + c, vs, o + c, os);     \
    weigh_tail(H, sc, sp, idx, n, vr, vs, o, os, c, d);

/* weigh at 32 floats (C = 4), in `weigh32_wide`'s signature */
#define WEIGH32(H, w, sp, idx, n, v, vs, o, os) weigh(H, 4, w, sp, idx, n, v, vs, o, os)

/* H (<= 3, a constant after inlining) query heads sharing one key/value head and one visible key list idx
 * (n keys, their mask values mv, padded with zeros to a multiple of 8): their attention outputs o_h (rows `os`
 * apart). sc: H rows of `sp` floats of scratch. */
static inline __attribute__((always_inline)) void heads(const int H, const float *const *qs, const float *kr,
                                                        int64_t ks, const float *vr, int64_t vs, const int32_t *idx,
                                                        int64_t n, const float *mv, int64_t d, float scale,
                                                        float *sc, int64_t sp, float *o, int64_t os) {
    HEADS_BODY(dots4, WEIGH32)
}

/* ---- AVX-512 (where panel_linear.c's AVX-512 paths run): the same lanes' chains in half the instructions ---- */
#define AVX512R __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
int sd_avx512_on(void); /* panel_linear.c's AVX-512 switch (SPECDRAFT_AVX512, sd_set_avx512) */

/* dots4 with two keys a zmm (lanes 0-7: key t's 8-lane chain, 8-15: key t + 1's): every lane the same FMAs in
 * the same order as dots4's, then dots4's reduction of the four keys' chains: the same bits. */
static inline __attribute__((always_inline)) AVX512R void dots4_wide(const int H, const float *const *qs,
                                                                    const float *k, int64_t ks, const int32_t *idx,
                                                                    int64_t d, float *sc, int64_t sp) {
    __m512 a[3][2];
    for (int h = 0; h < H; h++) a[h][0] = a[h][1] = _mm512_setzero_ps();
    const float *k0 = k + idx[0] * ks, *k1 = k + idx[1] * ks, *k2 = k + idx[2] * ks, *k3 = k + idx[3] * ks;
    for (int64_t i = 0; i < d; i += 8) {
        __m512 x[3];
        for (int h = 0; h < H; h++) x[h] = _mm512_broadcast_f32x8(_mm256_loadu_ps(qs[h] + i));
        const __m512 y01 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(k0 + i)), _mm256_loadu_ps(k1 + i), 1);
        const __m512 y23 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(k2 + i)), _mm256_loadu_ps(k3 + i), 1);
        for (int h = 0; h < H; h++) a[h][0] = _mm512_fmadd_ps(x[h], y01, a[h][0]);
        for (int h = 0; h < H; h++) a[h][1] = _mm512_fmadd_ps(x[h], y23, a[h][1]);
    }
    for (int h = 0; h < H; h++) {
        const __m256 t0 = _mm512_castps512_ps256(a[h][0]), t1 = _mm512_extractf32x8_ps(a[h][0], 1);
        const __m256 t2 = _mm512_castps512_ps256(a[h][1]), t3 = _mm512_extractf32x8_ps(a[h][1], 1);
        const __m256 g = _mm256_hadd_ps(_mm256_hadd_ps(t0, t1), _mm256_hadd_ps(t2, t3));
        _mm_storeu_ps(sc + h * sp, _mm_add_ps(_mm256_castps256_ps128(g), _mm256_extractf128_ps(g, 1)));
    }
}

/* weigh at 32 floats (C = 4) with 16 a zmm: each output lane the same chain over the keys in order. */
static inline __attribute__((always_inline)) AVX512R void weigh32_wide(const int H, const float *w, int64_t sp,
                                                                      const int32_t *idx, int64_t n, const float *v,
                                                                      int64_t vs, float *o, int64_t os) {
    __m512 a[3][2];
    for (int h = 0; h < H; h++) a[h][0] = a[h][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const float *vv = v + idx[j] * vs;
        const __m512 y0 = _mm512_loadu_ps(vv), y1 = _mm512_loadu_ps(vv + 16);
        for (int h = 0; h < H; h++) {
            const __m512 wb = _mm512_set1_ps(w[h * sp + j]);
            a[h][0] = _mm512_fmadd_ps(wb, y0, a[h][0]);
            a[h][1] = _mm512_fmadd_ps(wb, y1, a[h][1]);
        }
    }
    for (int h = 0; h < H; h++) {
        _mm512_storeu_ps(o + h * os, a[h][0]);
        _mm512_storeu_ps(o + h * os + 16, a[h][1]);
    }
}

/* heads through dots4_wide and weigh32_wide: the same bits. */
static inline __attribute__((always_inline)) AVX512R void heads_wide(const int H, const float *const *qs,
                                                                    const float *kr, int64_t ks, const float *vr,
                                                                    int64_t vs, const int32_t *idx, int64_t n,
                                                                    const float *mv, int64_t d, float scale,
                                                                    float *sc, int64_t sp, float *o, int64_t os) {
    HEADS_BODY(dots4_wide, weigh32_wide)
}

static AVX512R void heads_wide_any(int H, const float *const *qs, const float *kr, int64_t ks, const float *vr,
                                   int64_t vs, const int32_t *idx, int64_t n, const float *mv, int64_t d,
                                   float scale, float *sc, int64_t sp, float *o, int64_t os) {
    switch (H) {
        case 3: heads_wide(3, qs, kr, ks, vr, vs, idx, n, mv, d, scale, sc, sp, o, os); break;
        case 2: heads_wide(2, qs, kr, ks, vr, vs, idx, n, mv, d, scale, sc, sp, o, os); break;
        default: heads_wide(1, qs, kr, ks, vr, vs, idx, n, mv, d, scale, sc, sp, o, os); break;
    }
}

/* out (B, L, Hq, d) contiguous = softmax(q k^T * scale + mask) v for every batch row b, query head h (key/value
 * head h / (Hq / Hkv)) and query l, d a multiple of 8. q[b, h, l, :] at q + b*qb + h*qh + l*ql; k, v
 * [b, g, s, :] at + b*kb + g*kh + s*ks (v: vb, vh, vs); mask NULL (every key visible) or mask[b, l, s] at
 * + b*mb + l*ml + s (mb 0: shared). A key whose mask is <= MASKED is skipped (a query that sees none gets
 * zeros). Each (b, l, key/value head) is one work item: its query heads, three at a time, read each visible
 * key and value row once. Every query is computed over its visible keys in order, each sum in an order fixed
 * by that sequence: its bits depend on neither L, B, the hidden keys in between nor the threads, so a tree node
 * and the AR step at the same position, seeing the same keys, get the same output. */
void sd_attention_rows(const float *q, int64_t qb, int64_t qh, int64_t ql, const float *k, int64_t kb, int64_t kh,
                       int64_t ks, const float *v, int64_t vb, int64_t vh, int64_t vs, const float *mask,
                       int64_t mb, int64_t ml, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t d,
                       float scale, const int64_t *krow, float *out, int nthreads);

void sd_attention(const float *q, int64_t qb, int64_t qh, int64_t ql, const float *k, int64_t kb, int64_t kh,
                  int64_t ks, const float *v, int64_t vb, int64_t vh, int64_t vs, const float *mask, int64_t mb,
                  int64_t ml, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t d, float scale,
                  float *out, int nthreads) {
    sd_attention_rows(q, qb, qh, ql, k, kb, kh, ks, v, vb, vh, vs, mask, mb, ml, B, Hq, Hkv, L, S, d, scale, NULL,
                      out, nthreads);
}

/* sd_attention with batch row b's keys and values at cache row krow[b] (k + krow[b] * kb; NULL: row b): the
 * rows of a batched cache a step runs, read in place (models/layer_rows.c). */
void sd_attention_rows(const float *q, int64_t qb, int64_t qh, int64_t ql, const float *k, int64_t kb, int64_t kh,
                       int64_t ks, const float *v, int64_t vb, int64_t vh, int64_t vs, const float *mask,
                       int64_t mb, int64_t ml, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t d,
                       float scale, const int64_t *krow, float *out, int nthreads) {
    const int64_t groups = Hq / Hkv, items = B * L * Hkv, sp = (S + 7) / 8 * 8;
    const int par = nthreads > 1 && B * Hq * L * S * d > PAR_WORK;
    const int wide = sd_avx512_on() && __builtin_cpu_supports("avx512dq"); /* the heads' AVX-512 code */
#pragma omp parallel num_threads(par ? nthreads : 1)
    {
        float *sc = (float *)malloc((size_t)3 * sp * sizeof(float)), *mv = (float *)malloc((size_t)sp * sizeof(float));
        int32_t *idx = (int32_t *)malloc((size_t)S * sizeof(int32_t));
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t b = it / (L * Hkv), l = (it / Hkv) % L, g = it % Hkv;
            const int64_t kb_ = krow ? krow[b] : b;
            const float *kr = k + kb_ * kb + g * kh, *vr = v + kb_ * vb + g * vh;
            const float *mr = mask ? mask + b * mb + l * ml : NULL;
            int64_t n = 0;
            for (int64_t s = 0; s < S; s++) /* the visible keys, in order, and their mask values */
                if (!mr || mr[s] > MASKED) mv[n] = mr ? mr[s] : 0.0f, idx[n++] = (int32_t)s;
            for (int64_t j = n; j < sp; j++) mv[j] = 0.0f;
            for (int64_t h0 = g * groups; h0 < (g + 1) * groups; h0 += 3) {
                const int H = (int)((g + 1) * groups - h0 < 3 ? (g + 1) * groups - h0 : 3);
                float *o = out + ((b * L + l) * Hq + h0) * d;
                if (n == 0) { /* no visible key */
                    memset(o, 0, (size_t)H * d * sizeof(float));
                    continue;
                }
                const float *qs[3];
                for (int h = 0; h < H; h++) qs[h] = q + b * qb + (h0 + h) * qh + l * ql;
                if (wide) {
                    heads_wide_any(H, qs, kr, ks, vr, vs, idx, n, mv, d, scale, sc, sp, o, d);
                    continue;
                }
                switch (H) {
                    case 3: heads(3, qs, kr, ks, vr, vs, idx, n, mv, d, scale, sc, sp, o, d); break;
                    case 2: heads(2, qs, kr, ks, vr, vs, idx, n, mv, d, scale, sc, sp, o, d); break;
                    default: heads(1, qs, kr, ks, vr, vs, idx, n, mv, d, scale, sc, sp, o, d); break;
                }
            }
        }
        free(sc);
        free(mv);
        free(idx);
    }
}
