/* Q8 activations for 4- and 8-bit exact panels (models/qdot.py): the product a GGUF runtime computes on a CPU.
 *
 * A product y = x @ W.T with W a dequantised GGUF weight (W[n][32j + t] = u d[n][j] + m[n][j], u an unsigned
 * 4- or 8-bit integer) is computed the way llama.cpp computes Q4_1 x Q8_1: each row of x is quantised per block
 * of 32 inputs to int8 (dx = amax / 127, q = nearbyint(x / dx) within +-127, sx = sum(q) dx), the integer sums
 * I[n][j] = sum_t u[n][32j + t] q[32j + t] are exact (int32), and the output is
 *
 *     acc = 0; for j in order: acc = acc + (float)I[n][j] * (d[n][j] * dx[j]); acc = acc + m[n][j] * sx[j]
 *
 * in fp32 with no fused multiply-add, then + bias: a row's result is the same bits whatever the row count, the
 * other rows and the code path (AVX-512 VNNI or AVX2), and models/qdot.py's torch reference gives those bits too.
 * The integer sums run 4 inputs x 16 outputs per instruction (vpdpbusd), 4x the fp32 FMA's multiply rate, with
 * no weight rebuilt in registers: the few-row products a tree verify feeds cost little more than one row's.
 * Each thread takes whole panels; a panel's rows go in tiles of up to 8 (AVX-512) or 4 (AVX2).
 *
 * Layout of a panel (16 outputs, zero past N; `KIND_QDOT | 4` or `| 8` in sd_qpanel_linear's kind):
 *   8-bit: (K / 4, 16, 4) bytes, byte [g][c][t] = u[c][4g + t];
 *   4-bit: (K / 8, 16, 4) bytes, byte [h][c][t] = u[c][8h + t] | u[c][8h + 4 + t] << 4;
 *   d, m: (K / 32, 16) fp32, or fp16 where every entry is one (`| 1` in the kind: a GGUF's tables, half the bytes
 *   streamed for them; converted exactly, so the same bits).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QD_PW 16  /* outputs per panel */
#define QD_BLK 32 /* inputs per block */
#define QD_RT 8   /* rows per tile (AVX-512) */
#define QD_RT2 4  /* rows per tile (AVX2; 3 and 6 measured no better at 1-3 rows, 4 rows 1.15x faster) */
#define QD_AHEAD 8 /* blocks a tile prefetches its weights ahead (AVX-512: a verify of 2-8 rows 5-25% faster) */

/* 16 / 8 table entries from entry `at` of a fp32 (HALF 0) or fp16 (HALF 1) table, as fp32 */
#define TAB16(HALF, t, at)                                                                              \
    ((HALF) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)(t) + (at))))      \
            : _mm512_loadu_ps((const float *)(t) + (at)))
#define TAB8(HALF, t, at)                                                                               \
    ((HALF) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)(t) + (at))))         \
            : _mm256_loadu_ps((const float *)(t) + (at)))

/* x (M, K) -> xq (M, K) int8, dx / sx / qs (M, K / 32): the block scale, sum(q) * scale and sum(q). Per block:
 * amax = max |x|, d = amax / 127, q = nearbyint(x * (1 / d)) clamped to +-127 (0 where amax is 0). */
static void quant_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx, float *sx, int32_t *qs) {
    const int64_t nb = K / QD_BLK;
    const __m256 sign = _mm256_set1_ps(-0.0f), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (int64_t r = 0; r < M; r++)
        for (int64_t j = 0; j < nb; j++) {
            const float *v = x + r * K + j * QD_BLK;
            int8_t *o = xq + r * K + j * QD_BLK;
            __m256 a[4], mx;
            for (int c = 0; c < 4; c++) a[c] = _mm256_loadu_ps(v + 8 * c);
            mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1])),
                               _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3])));
            float lanes[8], amax = 0.0f;
            _mm256_storeu_ps(lanes, mx);
            for (int t = 0; t < 8; t++) amax = lanes[t] > amax ? lanes[t] : amax;
            const float d = amax / 127.0f, id = amax > 0.0f ? 1.0f / d : 0.0f;
            int32_t qi[QD_BLK], sum = 0;
            for (int c = 0; c < 4; c++) {
                __m256 f = _mm256_round_ps(_mm256_mul_ps(a[c], _mm256_set1_ps(id)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                f = _mm256_min_ps(_mm256_max_ps(f, lo), hi); /* NaN -> -127 */
                _mm256_storeu_si256((__m256i *)(qi + 8 * c), _mm256_cvtps_epi32(f));
            }
            for (int t = 0; t < QD_BLK; t++) {
                o[t] = (int8_t)qi[t];
                sum += qi[t];
            }
            dx[r * nb + j] = d;
            sx[r * nb + j] = (float)sum * d;
            qs[r * nb + j] = sum;
        }
}

static inline int32_t dword_at(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* CALL(B, r) at r = R, compile-time row counts 1..4 (QD_SWITCH4: 4 for any larger R) or 1..8 (QD_SWITCH8), for
 * B = 8 or 4 bits as `bits` says (QD_BITS): one instantiation of a tile per bits and row count. */
#define QD_CASES_1_3(CALL, B) case 1: CALL(B, 1); break; case 2: CALL(B, 2); break; case 3: CALL(B, 3); break;
#define QD_SWITCH4(CALL, B) switch (R) { QD_CASES_1_3(CALL, B) default: CALL(B, 4); break; }
#define QD_SWITCH8(CALL, B)                                                                             \
    switch (R) {                                                                                        \
    QD_CASES_1_3(CALL, B)                                                                               \
    case 4: CALL(B, 4); break;                                                                          \
    case 5: CALL(B, 5); break;                                                                          \
    case 6: CALL(B, 6); break;                                                                          \
    case 7: CALL(B, 7); break;                                                                          \
    default: CALL(B, 8); break;                                                                         \
    }
#define QD_BITS(SWITCH, CALL) if (bits == 8) { SWITCH(CALL, 8) } else { SWITCH(CALL, 4) }

/* ---- AVX-512 VNNI ------------------------------------------------------------------------------------------ */
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

/* One panel x R rows (out: (R, 16)); BITS, HALF, R compile-time constants where inlined. One panel a tile: a
 * tile of 2-4 panels (more independent chains) streamed 4-12 weight and table streams at once and ran 15-30%
 * slower at 1-4 rows on a 2-core Zen 5 (the products are bound by streaming the weights there). */
static inline __attribute__((always_inline)) VNNI void tile16(const int BITS, const int HALF, const int R,
                                                              const int8_t *xq, const float *dx, const float *sx,
                                                              int64_t K, const uint8_t *q, const void *d,
                                                              const void *m, float *out) {
    const int64_t nb = K / QD_BLK;
    const int split = R <= 4; /* two chains per row (even / odd groups) where few run */
    __m512 acc[QD_RT];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        __m512i is0[QD_RT], is1[QD_RT];
        _Pragma("GCC unroll 8")
        for (int r = 0; r < R; r++) is0[r] = is1[r] = _mm512_setzero_si512();
        /* (past the end: prefetches never fault) */
        const char *ahead = (const char *)(q + (j + QD_AHEAD) * (BITS == 8 ? 512 : 256));
        _mm_prefetch(ahead, _MM_HINT_T0);
        _mm_prefetch(ahead + 64, _MM_HINT_T0);
        _mm_prefetch(ahead + 128, _MM_HINT_T0);
        _mm_prefetch(ahead + 192, _MM_HINT_T0);
        if (BITS == 8) {
            _mm_prefetch(ahead + 256, _MM_HINT_T0);
            _mm_prefetch(ahead + 320, _MM_HINT_T0);
            _mm_prefetch(ahead + 384, _MM_HINT_T0);
            _mm_prefetch(ahead + 448, _MM_HINT_T0);
        }
        _Pragma("GCC unroll 8")
        for (int g = 0; g < 8; g++) {
            __m512i w;
            if (BITS == 8) {
                w = _mm512_loadu_si512((const void *)(q + j * 512 + g * 64));
            } else {
                const __m512i v = _mm512_loadu_si512((const void *)(q + j * 256 + (g >> 1) * 64));
                w = _mm512_and_si512(g & 1 ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0F));
            }
            _Pragma("GCC unroll 8")
            for (int r = 0; r < R; r++) {
                const __m512i xb = _mm512_set1_epi32(dword_at(xq + r * K + j * QD_BLK + 4 * g));
                if (split && (g & 1))
                    is1[r] = _mm512_dpbusd_epi32(is1[r], w, xb);
                else
                    is0[r] = _mm512_dpbusd_epi32(is0[r], w, xb);
            }
        }
        const __m512 dv = TAB16(HALF, d, j * QD_PW), mv = TAB16(HALF, m, j * QD_PW);
        _Pragma("GCC unroll 8")
        for (int r = 0; r < R; r++) {
            const __m512 s = _mm512_set1_ps(dx[r * nb + j]), t = _mm512_set1_ps(sx[r * nb + j]);
            const __m512i isum = split ? _mm512_add_epi32(is0[r], is1[r]) : is0[r];
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dv, s)));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(mv, t));
        }
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * QD_PW, acc[r]);
}

static VNNI void tile16_any(int bits, int half, int R, const int8_t *xq, const float *dx, const float *sx,
                            int64_t K, const uint8_t *q, const void *d, const void *m, float *out) {
#define T16(B, RR) do { if (half) tile16(B, 1, RR, xq, dx, sx, K, q, d, m, out); \
                         else tile16(B, 0, RR, xq, dx, sx, K, q, d, m, out); } while (0)
    QD_BITS(QD_SWITCH8, T16)
}

/* ---- AVX2 ------------------------------------------------------------------------------------------------- */

/* One panel x R rows (R <= QD_RT2), out: (R, 16). 8-bit weights go through vpmaddubsw as (u - 128) against the
 * activations' signs (|u - 128| <= 128 keeps the pair sums within int16), then + 128 sum(q). */
static inline __attribute__((always_inline)) void tile8(const int BITS, const int HALF, const int R,
                                                        const int8_t *xq, const float *dx, const float *sx,
                                                        const int32_t *qs, int64_t K, const uint8_t *q,
                                                        const void *d, const void *m, float *out) {
    const int64_t nb = K / QD_BLK;
    const __m256i ones = _mm256_set1_epi16(1), nib = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[2 * QD_RT2];
    _Pragma("GCC unroll 32")
    for (int i = 0; i < 2 * R; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        __m256i is[2 * QD_RT2];
        _Pragma("GCC unroll 32")
        for (int i = 0; i < 2 * R; i++) is[i] = _mm256_setzero_si256();
        _Pragma("GCC unroll 32")
        for (int g = 0; g < 8; g++) {
            _Pragma("GCC unroll 32")
            for (int h = 0; h < 2; h++) {
                __m256i w;
                if (BITS == 8) {
                    w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + j * 512 + g * 64 + h * 32)), flip);
                } else {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + j * 256 + (g >> 1) * 64 + h * 32));
                    w = _mm256_and_si256(g & 1 ? _mm256_srli_epi16(v, 4) : v, nib);
                }
                _Pragma("GCC unroll 32")
                for (int r = 0; r < R; r++) {
                    const __m256i xb = _mm256_set1_epi32(dword_at(xq + r * K + j * QD_BLK + 4 * g));
                    const __m256i pr = BITS == 8 ? _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xb, w))
                                                 : _mm256_maddubs_epi16(w, xb);
                    is[2 * r + h] = _mm256_add_epi32(is[2 * r + h], _mm256_madd_epi16(pr, ones));
                }
            }
        }
        _Pragma("GCC unroll 32")
        for (int r = 0; r < R; r++) {
            const __m256 s = _mm256_set1_ps(dx[r * nb + j]), t = _mm256_set1_ps(sx[r * nb + j]);
            const __m256i shift = _mm256_set1_epi32(128 * qs[r * nb + j]);
            _Pragma("GCC unroll 32")
            for (int h = 0; h < 2; h++) {
                const __m256 dv = TAB8(HALF, d, j * QD_PW + 8 * h), mv = TAB8(HALF, m, j * QD_PW + 8 * h);
                const __m256i isum = BITS == 8 ? _mm256_add_epi32(is[2 * r + h], shift) : is[2 * r + h];
                const int i = 2 * r + h;
                acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dv, s)));
                acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(mv, t));
            }
        }
    }
    _Pragma("GCC unroll 32")
    for (int i = 0; i < 2 * R; i++) _mm256_storeu_ps(out + i * 8, acc[i]);
}

static void tile8_any(int bits, int half, int R, const int8_t *xq, const float *dx, const float *sx,
                      const int32_t *qs, int64_t K, const uint8_t *q, const void *d, const void *m, float *out) {
#define T8(B, RR) do { if (half) tile8(B, 1, RR, xq, dx, sx, qs, K, q, d, m, out); \
                       else tile8(B, 0, RR, xq, dx, sx, qs, K, q, d, m, out); } while (0)
    QD_BITS(QD_SWITCH4, T8)
}

/* ---- the product ------------------------------------------------------------------------------------------- */

int sd_avx512_on(void); /* panel_linear.c's AVX-512 switch (SPECDRAFT_AVX512, sd_set_avx512) */

static int vnni_cpu = -1; /* -1: not asked yet; else whether the CPU has AVX-512 VNNI */

/* Whether the AVX-512 VNNI path runs: the library's AVX-512 paths are on and the CPU has VNNI (else AVX2: the same
 * bits). */
int sd_qdot_vnni(void) {
    if (vnni_cpu < 0) {
        __builtin_cpu_init();
        vnni_cpu = __builtin_cpu_supports("avx512vnni");
    }
    return sd_avx512_on() && vnni_cpu;
}

/* Outputs [n0, n0 + 16) of rows r0.. (out: (R, 16)) into y (M, N), + bias. */
static void store_tile(int R, const float *out, const float *bias, int64_t r0, int64_t n0, int64_t N, float *y) {
    for (int r = 0; r < R; r++)
        for (int64_t c = 0; c < QD_PW && n0 + c < N; c++) {
            const float v = out[r * QD_PW + c];
            y[(r0 + r) * N + n0 + c] = bias ? v + bias[n0 + c] : v;
        }
}

/* y (M, N) = x (M, K) @ W.T + bias with x quantised to int8 per block of 32 (see the top of this file); W: the
 * panels of a `kind` store in this file's layout: 4 or 8 bits, + 1 for fp16 tables. */
void sd_qdot_linear(const float *x, int64_t M, int64_t K, const uint8_t *Q, const float *D, const float *Mn,
                    int kind, int64_t N, const float *bias, float *y, int nthreads) {
    const int bits = kind & ~1, half = kind & 1, tb = half ? 2 : 4;
    const int64_t nb = K / QD_BLK, panels = (N + QD_PW - 1) / QD_PW;
    const int64_t qstride = K * (bits == 8 ? 16 : 8), tstride = nb * QD_PW;
    const char *Dc = (const char *)D, *Mc = (const char *)Mn;
    if (M <= 0 || N <= 0) return;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *dx = (float *)malloc((size_t)(M * nb) * sizeof(float));
    float *sx = (float *)malloc((size_t)(M * nb) * sizeof(float));
    int32_t *qs = (int32_t *)malloc((size_t)(M * nb) * sizeof(int32_t));
    quant_rows(x, M, K, xq, dx, sx, qs);
    const int vnni = sd_qdot_vnni();
    const int64_t rt = vnni ? QD_RT : QD_RT2;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < panels; b++) {
        float out[QD_RT * QD_PW];
        const uint8_t *qb = Q + b * qstride;
        const void *db = Dc + b * tstride * tb, *mb = Mc + b * tstride * tb;
        for (int64_t r0 = 0; r0 < M; r0 += rt) {
            const int R = (int)(M - r0 < rt ? M - r0 : rt);
            if (vnni)
                tile16_any(bits, half, R, xq + r0 * K, dx + r0 * nb, sx + r0 * nb, K, qb, db, mb, out);
            else
                tile8_any(bits, half, R, xq + r0 * K, dx + r0 * nb, sx + r0 * nb, qs + r0 * nb, K, qb, db, mb, out);
            store_tile(R, out, bias, r0, b * QD_PW, N, y);
        }
    }
    free(xq);
    free(dx);
    free(sx);
    free(qs);
}
