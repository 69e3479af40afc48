// One ReDrafter draft slot in one call (eval/native_chain.py): the recurrence, the input projection, the residual
// blocks, the int8 vocabulary head with its max / argmax / logsumexp, and the copy gate's mixture, for one beam.
//
// A drafted token through torch is ~60 small calls; inside a decode loop each of them runs with the code and data
// the target step just evicted (a 1-token draft: ~0.6 ms warm, ~1.5 ms in place). Here the only memory a slot
// touches is the weights and a few vectors.
//
// Products are int8 weights w (stored offset by 128, as uint8) with one fp32 scale per output row: y[r] = s[r] *
// sum_j w[r, j] x[j]. With AVX-512 VNNI (`sd_qdot_vnni`) each activation vector is quantised to int8 once
// (x ~ sx q, one scale, as fbgemm's dynamic int8 products do) and a row is 64 byte products an instruction,
// minus 128 sum(q) for the offset; elsewhere the weights are widened to fp32 against fp32 activations (AVX2 +
// FMA). The drafts differ slightly from the torch int8 view's; verification decides every token either way.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

static inline float dc_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

// sum_j (w[j] - 128) * x[j]: w the weights stored offset by 128 (uint8), x fp32, k any length
static inline float dc_dot(const uint8_t *w, const float *x, int64_t k) {
    const __m256i off = _mm256_set1_epi32(128);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {
        __m128i q = _mm_loadu_si128((const __m128i *)(w + j));
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(q), off));
        __m256 w1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)), off));
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + j), a0);
        a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + j + 8), a1);
    }
    float acc = dc_hsum(_mm256_add_ps(a0, a1));
    for (; j < k; j++) acc += (float)((int)w[j] - 128) * x[j];
    return acc;
}

// sum_j w[j] * q[j] with w uint8, q int8, k a multiple of 64 (AVX-512 VNNI: 64 products an instruction)
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static inline int32_t dc_dot_vnni(
    const uint8_t *w, const int8_t *q, int64_t k) {
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    int64_t j = 0;
    for (; j + 128 <= k; j += 128) {
        a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(w + j), _mm512_loadu_si512(q + j));
        a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512(w + j + 64), _mm512_loadu_si512(q + j + 64));
    }
    for (; j < k; j += 64) a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(w + j), _mm512_loadu_si512(q + j));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a1));
}

// x (k,) -> q int8 (x / sx rounded, within +-127), sx = max|x| / 127, qsum = sum(q)
static void dc_quant(const float *x, int64_t k, int8_t *q, float *sx, int32_t *qsum) {
    float m = 0.0f;
    for (int64_t j = 0; j < k; j++) m = fabsf(x[j]) > m ? fabsf(x[j]) : m;
    float s = m > 0.0f ? m / 127.0f : 1.0f, inv = 1.0f / s;
    int32_t t = 0;
    for (int64_t j = 0; j < k; j++) {
        int v = (int)lrintf(x[j] * inv);
        v = v > 127 ? 127 : (v < -127 ? -127 : v);
        q[j] = (int8_t)v;
        t += v;
    }
    *sx = s;
    *qsum = t;
}

// A quantised activation vector: its int8 values, scale and sum (the VNNI products read it).
typedef struct {
    int8_t q[4096];
    float s;
    int32_t sum;
} dc_act;

// sum_j (w[j] - 128) * x[j], through the VNNI product of x's quantised copy `a` where `vnni` (k % 64 == 0)
static inline float dc_row(int vnni, const uint8_t *w, const float *x, const dc_act *a, int64_t k) {
    if (vnni) return a->s * (float)(dc_dot_vnni(w, a->q, k) - 128 * a->sum);
    return dc_dot(w, x, k);
}

static inline float dc_silu(float v) { return v / (1.0f + expf(-v)); }

int sd_qdot_vnni(void); /* qdot.c: AVX-512 VNNI on this CPU and the AVX-512 switch on */

// The vocabulary head and the copy gate of one draft slot, called by every thread of the caller's parallel region
// (its `omp for` and barriers bind to it): logits[v] = S[v] * (W[v] . x) over the VD int8 rows (x quantised in
// `a` where `vnni`), their argmax and logsumexp, then the pick under the mixture (1 - lam) p + lam onehot(cand)
// with lam = sigmoid((out(SiLU(fc([x; e(cand)]))) + bias[clen]) * scale) where gate != NULL and there is a
// candidate (a draft id; -1: none). tmax, tsum, targ: 64 entries each, shared by the threads.
static void dc_head_pick(int vnni, const uint8_t *W, const float *S, const float *x, const dc_act *a, int64_t X,
                         int64_t VD, float *logits, float *tmax, float *tsum, int64_t *targ,
                         const float *const *gate, int64_t HC, int64_t E, int64_t cand, int64_t clen,
                         const float *cand_emb, float gate_scale, int64_t *out_id, float *out_logp) {
    int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    float m = -INFINITY;
    int64_t am = 0;
#pragma omp for schedule(static)
    for (int64_t v = 0; v < VD; v++) {
        float l = S[v] * dc_row(vnni, W + v * X, x, a, X);
        logits[v] = l;
        if (l > m) m = l, am = v;
    }
    tmax[tid] = m;
    targ[tid] = am;
#pragma omp barrier
    float gm = -INFINITY;
    for (int i = 0; i < nt; i++) gm = tmax[i] > gm ? tmax[i] : gm;
    float ssum = 0.0f;
#pragma omp for schedule(static)
    for (int64_t v = 0; v < VD; v++) ssum += expf(logits[v] - gm);
    tsum[tid] = ssum;
#pragma omp barrier
#pragma omp single
    {
        float best = -INFINITY, tot = 0.0f;
        int64_t arg = 0;
        for (int i = 0; i < nt; i++) {  // the first thread holding the max: the lowest index wins ties
            if (tmax[i] > best) best = tmax[i], arg = targ[i];
            tot += tsum[i];
        }
        float lse = gm + logf(tot), lam = 0.0f;
        if (gate && cand >= 0 && clen > 0) {
            const float *Gw = gate[0], *Gb = gate[1], *Ow = gate[2], *Ob = gate[3], *Lb = gate[4];
            float z = Ob[0];
            for (int64_t k = 0; k < HC; k++) {
                const float *row = Gw + k * (X + E);
                float acc = Gb[k];
                for (int64_t j = 0; j < X; j++) acc += row[j] * x[j];
                for (int64_t j = 0; j < E; j++) acc += row[X + j] * cand_emb[j];
                z += Ow[k] * dc_silu(acc);
            }
            lam = 1.0f / (1.0f + expf(-(z + Lb[clen]) * gate_scale));
            if (lam > 1.0f - 1.1920929e-07f) lam = 1.0f - 1.1920929e-07f;
        }
        float la = best - lse;  // the head's best token
        if (lam > 0.0f) {
            float lc = logits[cand] - lse;
            float pi = (1.0f - lam) * expf(lc) + lam;
            float lcm = logf(pi > 1.17549435e-38f ? pi : 1.17549435e-38f);
            float lam_other = la + log1pf(-lam);
            if (arg == cand || lcm >= lam_other) {
                *out_id = cand;
                *out_logp = lcm;
            } else {
                *out_id = arg;
                *out_logp = lam_other;
            }
        } else {
            *out_id = arg;
            *out_logp = la;
        }
    }
}

// Pointers in `p` (int64 addresses), in this order:
//   0 rnn_u (E, E)   1 its row scales (E,)   2 its bias (E,)   3 rnn_w (E, E)   4 its row scales (E,)
//   5 input_proj (X, E + F) (state columns first)   6 its row scales (X,)   7 its bias (X,)
//   8 blocks (NB, X, X)   9 their row scales (NB, X)   10 their biases (NB, X)
//   11 head (VD, X)   12 its row scales (VD,)   (the products' weights: int8 + 128 as uint8)
//   13 copy gate fc fp32 (HC, X + E)   14 its bias (HC,)   15 gate out fp32 (HC,)   16 its bias (1,)
//   17 length bias fp32 (NGRAM + 1,)
// dims: E, X, F, VD, NB, HC, has_gate.
// state (E,): in/out. emb_tok (E,): the embedding of the token drafted last (NULL at the first slot: `state` is
// already the root's embedding). feats (F,): the target features, given at the first slot (NULL after): fproj
// (X,) then holds input_proj's feature columns times feats plus its bias for the later slots. cand / clen: the
// copy gate's candidate (a draft id, -1: none) and its match length; cand_emb (E,) its embedding. scratch: 2 X +
// max(E, X) + VD + 2 * 64 floats. Out: the chosen draft id and its log-probability under the slot's mixture.
void sd_redrafter_slot(const int64_t *p, const int64_t *dims, float *state, const float *emb_tok,
                       const float *feats, float *fproj, int64_t cand, int64_t clen, const float *cand_emb,
                       float gate_scale, float *scratch, int64_t *out_id, float *out_logp, int nthreads) {
    const int64_t E = dims[0], X = dims[1], F = dims[2], VD = dims[3], NB = dims[4], HC = dims[5];
    const int has_gate = (int)dims[6];
    const uint8_t *U = (const uint8_t *)p[0], *W = (const uint8_t *)p[3], *P = (const uint8_t *)p[5];
    const uint8_t *B = (const uint8_t *)p[8], *H = (const uint8_t *)p[11];
    const float *Us = (const float *)p[1], *Ub = (const float *)p[2], *Ws = (const float *)p[4];
    const float *Ps = (const float *)p[6], *Pb = (const float *)p[7];
    const float *Bs = (const float *)p[9], *Bb = (const float *)p[10], *Hs = (const float *)p[12];
    float *g = scratch, *h = scratch + X, *t = scratch + 2 * X;
    int64_t tl = E > X ? E : X;
    float *logits = t + tl;
    float *tmax = logits + VD, *tsum = tmax + 64;
    int64_t targ[64];
    static dc_act a0, a1;  // quantised activations (one slot runs at a time: the decoder is one thread)
    // VNNI where every inner size is a multiple of 64 and the activations fit the buffers
    const int vnni = sd_qdot_vnni() && E % 64 == 0 && X % 64 == 0 && F % 64 == 0 && E <= 4096 && X <= 4096 &&
                     F <= 4096;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
#pragma omp parallel num_threads(nthreads)
    {
        if (feats) {
#pragma omp single
            if (vnni) dc_quant(feats, F, a0.q, &a0.s, &a0.sum);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < X; r++) fproj[r] = Ps[r] * dc_row(vnni, P + r * (E + F) + E, feats, &a0, F) + Pb[r];
        }
        if (emb_tok) {  // s' = SiLU(U s + b + W e(token))
#pragma omp single
            if (vnni) {
                dc_quant(state, E, a0.q, &a0.s, &a0.sum);
                dc_quant(emb_tok, E, a1.q, &a1.s, &a1.sum);
            }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < E; r++)
                t[r] = dc_silu(Us[r] * dc_row(vnni, U + r * E, state, &a0, E) + Ub[r] +
                               Ws[r] * dc_row(vnni, W + r * E, emb_tok, &a1, E));
#pragma omp single
            memcpy(state, t, (size_t)E * sizeof(float));
        }
#pragma omp single
        if (vnni) dc_quant(state, E, a0.q, &a0.s, &a0.sum);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < X; r++) g[r] = Ps[r] * dc_row(vnni, P + r * (E + F), state, &a0, E) + fproj[r];
        for (int64_t b = 0; b < NB; b++) {  // g = g + SiLU(B g + c)
            const uint8_t *Bw = B + b * X * X;
            const float *bs = Bs + b * X, *bb = Bb + b * X;
            float *src = (b % 2 == 0) ? g : h, *dst = (b % 2 == 0) ? h : g;
#pragma omp single
            if (vnni) dc_quant(src, X, a0.q, &a0.s, &a0.sum);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < X; r++)
                dst[r] = src[r] + dc_silu(bs[r] * dc_row(vnni, Bw + r * X, src, &a0, X) + bb[r]);
        }
        const float *gx = (NB % 2 == 0) ? g : h;
#pragma omp single
        if (vnni) dc_quant(gx, X, a1.q, &a1.s, &a1.sum);
        const float *gp[5] = {(const float *)p[13], (const float *)p[14], (const float *)p[15],
                              (const float *)p[16], (const float *)p[17]};
        dc_head_pick(vnni, H, Hs, gx, &a1, X, VD, logits, tmax, tsum, targ, has_gate ? gp : NULL, HC, E, cand,
                     clen, cand_emb, gate_scale, out_id, out_logp);
    }
}

// ---- EAGLE heads: one draft slot (or one committed position) of an EAGLE-1 / EAGLE-3 head in one call ----------
// (eval/eagle_chain.py). The head's decoder layer over one new position appended to its own KV cache (fp32,
// (NKV, CAP, D) per keys / values), its vocabulary head's argmax and logsumexp, and the copy gate's mixture:
//   EAGLE-3: g = fc(feats) at a committed position (feats NULL at a drafted one: g is the previous output);
//            x = [rms(e(token)); rms(g)] (2H), residual g
//   EAGLE-1: x = fc([e(token); g]) + b (H), residual x (the layer has no input norm)
//   o = residual + Wo attn(rope(Wq x), rope(Wk x), Wv x);  o2 = o + Wd (SiLU(Wg h) * Wu h), h = rms(o)
//   g <- o2;  head on rms(o2) (EAGLE-3) or o2 (EAGLE-1), as `draft_logits`
// Products are int8 rows with fp32 scales as in `sd_redrafter_slot` (VNNI where the sizes allow).

static void ec_rms(const float *x, const float *w, float eps, int64_t n, float *out) {
    double s = 0.0;
    for (int64_t j = 0; j < n; j++) s += (double)x[j] * x[j];
    float r = 1.0f / sqrtf((float)(s / (double)n) + eps);
    for (int64_t j = 0; j < n; j++) out[j] = w[j] * (x[j] * r);
}

// HF's rotary embedding of one head vector v (D,) at the tables' row: v*cos + rotate_half(v)*sin
static void ec_rope(float *v, const float *cs, const float *sn, int64_t D) {
    int64_t h = D / 2;
    for (int64_t i = 0; i < h; i++) {
        float a = v[i], b = v[i + h];
        v[i] = a * cs[i] - b * sn[i];
        v[i + h] = b * cs[i + h] + a * sn[i + h];
    }
}

// Pointers in `p` (int64 addresses), in this order (int8 weights stored + 128 as uint8, fp32 row scales):
//   0 fc (H, F) 1 its scales 2 its bias (H)   3 qkv (NQ D + 2 NKV D, KIN) 4 its scales 5 its bias
//   6 o (H, NQ D) 7 its scales 8 its bias   9 gate|up (2I, H) 10 its scales   11 down (H, I) 12 its scales
//   13 input norm w (H) 14 hidden norm w (H) 15 post-attention norm w (H) 16 final norm w (H)
//   17 head (VD, H) 18 its scales   19 gate fc fp32 (HC, 2H) 20 its bias 21 gate out (HC) 22 its bias
//   23 length bias (NGRAM + 1)   24 cos table (ROWS, D) 25 sin table (ROWS, D)   26 eps (4: in, hid, post, final)
// dims: H, KIN, F, NQ, NKV, D, I, VD, HC, has_gate, eagle3, CAP.
// feats (F,): the committed position's target features (EAGLE-3: the fused layers; NULL at a drafted slot).
// g (H,): in: the position's input feature (EAGLE-1 always; EAGLE-3 at a drafted slot), out: the head's output.
// emb (H,): the embedding of the position's token. pos: its rotary position; len: the cache entries before it
// (its keys and values are written at index len). want_head: run the vocabulary head (else out_* untouched).
// scratch: KIN + 2 (NQ + 2 NKV) D + NQ CAP + 6 H + 3 I + VD + 128 floats.
void sd_eagle_slot(const int64_t *p, const int64_t *dims, const float *feats, float *g, const float *emb,
                   int64_t pos, float *kc, float *vc, int64_t len, int want_head, int64_t cand, int64_t clen,
                   const float *cand_emb, float gate_scale, float attn_scale, float *scratch, int64_t *out_id,
                   float *out_logp, int nthreads) {
    const int64_t H = dims[0], KIN = dims[1], F = dims[2], NQ = dims[3], NKV = dims[4], D = dims[5];
    const int64_t I = dims[6], VD = dims[7], HC = dims[8], CAP = dims[11];
    const int has_gate = (int)dims[9], eagle3 = (int)dims[10];
    const uint8_t *Wfc = (const uint8_t *)p[0], *Wqkv = (const uint8_t *)p[3], *Wo = (const uint8_t *)p[6];
    const uint8_t *Wgu = (const uint8_t *)p[9], *Wd = (const uint8_t *)p[11], *Wh = (const uint8_t *)p[17];
    const float *Sfc = (const float *)p[1], *Bfc = (const float *)p[2], *Sqkv = (const float *)p[4];
    const float *Bqkv = (const float *)p[5], *So = (const float *)p[7], *Bo = (const float *)p[8];
    const float *Sgu = (const float *)p[10], *Sd = (const float *)p[12], *Sh = (const float *)p[18];
    const float *Nin = (const float *)p[13], *Nhid = (const float *)p[14], *Npost = (const float *)p[15];
    const float *Nfin = (const float *)p[16], *cs = (const float *)p[24] + pos * D;
    const float *sn = (const float *)p[25] + pos * D, *eps = (const float *)p[26];
    const int64_t QKV = (NQ + 2 * NKV) * D;
    float *x = scratch, *qkv = x + KIN, *att = qkv + QKV, *sc = att + NQ * D, *o = sc + NQ * CAP;
    float *hp = o + H, *gu = hp + H, *a = gu + 2 * I, *s = a + I, *fin = s + H, *ecat = fin + H;
    float *logits = ecat + 2 * H, *tmax = logits + VD, *tsum = tmax + 64;
    int64_t targ[64];
    static dc_act a0;
    const int vnni = sd_qdot_vnni() && H % 64 == 0 && KIN % 64 == 0 && F % 64 == 0 && I % 64 == 0 &&
                     (NQ * D) % 64 == 0 && KIN <= 4096 && F <= 4096 && I <= 4096 && NQ * D <= 4096;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    const float *resid = eagle3 ? g : x;
#pragma omp parallel num_threads(nthreads)
    {
        // the layer's input x
        if (eagle3) {
            if (feats) {  // g = fc(feats) at a committed position
#pragma omp single
                if (vnni) dc_quant(feats, F, a0.q, &a0.s, &a0.sum);
#pragma omp for schedule(static)
                for (int64_t r = 0; r < H; r++) g[r] = Sfc[r] * dc_row(vnni, Wfc + r * F, feats, &a0, F) + Bfc[r];
            }
#pragma omp single
            {
                ec_rms(emb, Nin, eps[0], H, x);
                ec_rms(g, Nhid, eps[1], H, x + H);
                if (vnni) dc_quant(x, KIN, a0.q, &a0.s, &a0.sum);
            }
        } else {
#pragma omp single
            {
                memcpy(ecat, emb, (size_t)H * sizeof(float));
                memcpy(ecat + H, g, (size_t)H * sizeof(float));
                if (vnni) dc_quant(ecat, 2 * H, a0.q, &a0.s, &a0.sum);
            }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < H; r++) x[r] = Sfc[r] * dc_row(vnni, Wfc + r * 2 * H, ecat, &a0, 2 * H) + Bfc[r];
#pragma omp single
            if (vnni) dc_quant(x, KIN, a0.q, &a0.s, &a0.sum);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < QKV; r++) qkv[r] = Sqkv[r] * dc_row(vnni, Wqkv + r * KIN, x, &a0, KIN) + Bqkv[r];
#pragma omp single
        {
            for (int64_t h = 0; h < NQ + NKV; h++) ec_rope(qkv + h * D, cs, sn, D);  // q heads, then k heads
            for (int64_t h = 0; h < NKV; h++) {
                memcpy(kc + (h * CAP + len) * D, qkv + (NQ + h) * D, (size_t)D * sizeof(float));
                memcpy(vc + (h * CAP + len) * D, qkv + (NQ + NKV + h) * D, (size_t)D * sizeof(float));
            }
        }
#pragma omp for schedule(static)
        for (int64_t h = 0; h < NQ; h++) {  // attention of head h over the len + 1 cached positions
            const float *q = qkv + h * D;
            int64_t kvh = h / (NQ / NKV);
            const float *K = kc + kvh * CAP * D, *V = vc + kvh * CAP * D;
            float *w = sc + h * CAP, m = -INFINITY;
            for (int64_t t = 0; t <= len; t++) {
                float d = 0.0f;
                for (int64_t i = 0; i < D; i++) d += q[i] * K[t * D + i];
                w[t] = d * attn_scale;
                m = w[t] > m ? w[t] : m;
            }
            float tot = 0.0f;
            for (int64_t t = 0; t <= len; t++) tot += (w[t] = expf(w[t] - m));
            float *out = att + h * D;
            for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
            for (int64_t t = 0; t <= len; t++) {
                float pw = w[t] / tot;
                for (int64_t i = 0; i < D; i++) out[i] += pw * V[t * D + i];
            }
        }
#pragma omp single
        if (vnni) dc_quant(att, NQ * D, a0.q, &a0.s, &a0.sum);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < H; r++) o[r] = resid[r] + So[r] * dc_row(vnni, Wo + r * NQ * D, att, &a0, NQ * D) + Bo[r];
#pragma omp single
        {
            ec_rms(o, Npost, eps[2], H, hp);
            if (vnni) dc_quant(hp, H, a0.q, &a0.s, &a0.sum);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < 2 * I; r++) gu[r] = Sgu[r] * dc_row(vnni, Wgu + r * H, hp, &a0, H);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < I; r++) a[r] = dc_silu(gu[r]) * gu[I + r];
#pragma omp single
        if (vnni) dc_quant(a, I, a0.q, &a0.s, &a0.sum);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < H; r++) s[r] = o[r] + Sd[r] * dc_row(vnni, Wd + r * I, a, &a0, I);
#pragma omp single
        {
            memcpy(g, s, (size_t)H * sizeof(float));  // the head's output: the next slot's input feature
            if (eagle3) ec_rms(s, Nfin, eps[3], H, fin);
            else memcpy(fin, s, (size_t)H * sizeof(float));
            if (want_head && vnni) dc_quant(fin, H, a0.q, &a0.s, &a0.sum);
        }
        if (want_head) {
            const float *gp[5] = {(const float *)p[19], (const float *)p[20], (const float *)p[21],
                                  (const float *)p[22], (const float *)p[23]};
            dc_head_pick(vnni, Wh, Sh, fin, &a0, H, VD, logits, tmax, tsum, targ, has_gate ? gp : NULL, HC, H,
                         cand, clen, cand_emb, gate_scale, out_id, out_logp);
        }
    }
}

// ---- Medusa heads: the first n heads' top-k draft ids at one position in one call (eval/medusa_native.py) ------
// Head j: x = h (+ R_j rms(e(root)) with the root token, models/medusa_root.py), then x = x + SiLU(B x + c) per
// residual block, then logits = S * (W x) over the VD int8 vocabulary rows and their k largest (largest first; the
// lower index first among equal logits, as a stable sort). Products as in `sd_redrafter_slot` (VNNI where H % 64 =
// 0). Pointers in `p` (int64 addresses): 0 root projection (K*H, H)  1 its row scales (K*H,)  2 blocks (K, NB, H,
// H)  3 their row scales (K, NB, H)  4 their biases (K, NB, H)  5 vocabulary rows (K, VD, H)  6 their row scales
// (K, VD) (weights int8 + 128 as uint8; 0-1 unread without the root). dims: H, VD, NB, has_root.
// hidden (H,): the target's last-layer state; root_emb (H,): the root's embedding (NULL without the root).
// scratch: 3 H + VD floats. out_ids (n, k): draft ids. k <= 64. out_states (n, H), out_logits (n, VD): each head's
// last block output and its logits, for the copy gate (models/medusa_copy.py); NULL: not kept.
void sd_medusa_heads(const int64_t *p, const int64_t *dims, const float *hidden, const float *root_emb, float eps,
                     int64_t n, int64_t k, float *scratch, int64_t *out_ids, int nthreads, float *out_states,
                     float *out_logits) {
    const int64_t H = dims[0], VD = dims[1], NB = dims[2];
    const int has_root = (int)dims[3] && root_emb != NULL;
    const uint8_t *R = (const uint8_t *)p[0], *B = (const uint8_t *)p[2], *W = (const uint8_t *)p[5];
    const float *Rs = (const float *)p[1], *Bs = (const float *)p[3], *Bb = (const float *)p[4];
    const float *Ws = (const float *)p[6];
    float *e = scratch, *x = scratch + H, *y = scratch + 2 * H, *logits = scratch + 3 * H;
    static dc_act a0, ae;  // one call at a time (the decoder is one thread); ae: the root's, read by every head
    const int vnni = sd_qdot_vnni() && H % 64 == 0 && H <= 4096;
    if (k > 64) k = 64;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    if (has_root) {  // the weightless RMS normalisation of the root's embedding
        double s = 0.0;
        for (int64_t j = 0; j < H; j++) s += (double)root_emb[j] * root_emb[j];
        float inv = 1.0f / sqrtf((float)(s / (double)H) + eps);
        for (int64_t j = 0; j < H; j++) e[j] = root_emb[j] * inv;
        if (vnni) dc_quant(e, H, ae.q, &ae.s, &ae.sum);
    }
#pragma omp parallel num_threads(nthreads)
    for (int64_t hd = 0; hd < n; hd++) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < H; r++) {
            const int64_t row = hd * H + r;
            x[r] = hidden[r] + (has_root ? Rs[row] * dc_row(vnni, R + row * H, e, &ae, H) : 0.0f);
        }
        float *src = x, *dst = y;
        for (int64_t b = 0; b < NB; b++) {  // x = x + SiLU(B x + c)
            const int64_t blk = hd * NB + b;
            const uint8_t *Bw = B + blk * H * H;
            const float *bs = Bs + blk * H, *bb = Bb + blk * H;
#pragma omp single
            if (vnni) dc_quant(src, H, a0.q, &a0.s, &a0.sum);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < H; r++)
                dst[r] = src[r] + dc_silu(bs[r] * dc_row(vnni, Bw + r * H, src, &a0, H) + bb[r]);
            float *t = src;
            src = dst;
            dst = t;
        }
#pragma omp single
        {
            if (vnni) dc_quant(src, H, a0.q, &a0.s, &a0.sum);
            if (out_states) memcpy(out_states + hd * H, src, (size_t)H * sizeof(float));  // the copy gate's state
        }
        const uint8_t *Wh = W + hd * VD * H;
        const float *ws = Ws + hd * VD;
        float *lg = out_logits ? out_logits + hd * VD : logits;  // (VD,) this head's logits (kept when asked)
#pragma omp for schedule(static)
        for (int64_t v = 0; v < VD; v++) lg[v] = ws[v] * dc_row(vnni, Wh + v * H, src, &a0, H);
#pragma omp single
        {
            float bv[64];
            int64_t bi[64], cnt = 0;
            for (int64_t v = 0; v < VD; v++) {
                float l = lg[v];
                if (cnt == k && !(l > bv[cnt - 1])) continue;  // not above the k-th (NaN never enters)
                if (cnt < k) cnt++;
                int64_t pos = cnt - 1;
                while (pos > 0 && bv[pos - 1] < l) {  // strictly smaller move down: ties keep the lower index first
                    bv[pos] = bv[pos - 1];
                    bi[pos] = bi[pos - 1];
                    pos--;
                }
                bv[pos] = l;
                bi[pos] = v;
            }
            for (int64_t r = 0; r < k; r++) out_ids[hd * k + r] = r < cnt ? bi[r] : 0;
        }
    }
}
