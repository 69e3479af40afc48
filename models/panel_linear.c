/* specdraft's fp32 CPU product for decode steps: y = x @ W.T (+ bias), W packed in 16-column panels.
 *
 * Layout: P[b][i][c] = W[16 b + c][i] for panel b, input i, column c (zero-padded past N): each panel is K x 16
 * floats, contiguous, so a product streams every weight exactly once, in order, whatever the row count M.
 * Each thread takes whole panels; within a panel, rows go in chunks of up to 6 held in 12 AVX2 accumulators
 * (two 8-float vectors per row), the panel re-read from cache for the next chunk. Where AVX-512 runs, 2 or more
 * rows go through two panels at once, 12 rows a pass in 24 zmm accumulators (wide_panels).
 *
 * Every output element is summed over i = 0..K-1 in order with one FMA per term, so a row's result is the same
 * bits whatever M is and whatever the other rows hold (row-invariant: a tree verify and an AR step compute the
 * same products for the same row). Built by models/panel_linear.py with -O3 -mavx2 -mfma -fopenmp.
 *
 * Exact panels (sd_qpanel_linear, models/exact_panels.py): a weight whose blocks of 32 inputs are
 * W[n][32j + t] == fma((float)u, d[n][j], m[n][j]) bit for bit, u an unsigned 4- or 8-bit integer (what a
 * dequantised GGUF Q4_0 / Q4_1 / Q8_0 weight is), is stored as those integers and per-block d, m (0.75 or 1.25
 * bytes a weight instead of 4); one whose every value is a bf16 or an fp16 (a 16-bit checkpoint run in fp32) as
 * those 2 bytes. Each weight is rebuilt in registers to its fp32 value and fed to the same FMA chain in the same
 * order: the outputs are sd_panel_linear's bit for bit, with 2-5x fewer bytes streamed. At one or a few rows
 * the product is bound by the vector ops that rebuild the weights, not by memory (a 2-core EPYC streams
 * 10 GB/s of 4-bit weights here against ~20 available), so a 4- or 8-bit weight row is rebuilt with one
 * in-lane shuffle per 8 weights (vpshufb of the bytes broadcast to both lanes) rather than cross-lane
 * zero-extensions (session 48: 1,536 x 576 Q4 product at 1 row 75-104 -> 58-61 us). Where AVX-512 runs, a paired
 * 4-bit row is rebuilt 16 weights a zmm; with AVX512-VBMI one multishift puts each column's nibble in its lane and
 * one vpermps (which reads an index's low 4 bits) turns it into float(u): 3 vector ops a panel with the fma
 * (session 61, a 2-core AMX Xeon: the target's 4-bit products at 1 / 4 / 8 rows 0.69 / 0.72 / 0.82x the time).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PW 16     /* panel width: output columns per panel */
#define RMAX 6    /* rows per register chunk */
#define RCHUNK 4  /* exact panels, 7-8 rows: two chunks of up to 4, each weight rebuilt twice in registers */

/* y[r, n0:n0+width] = out[r, 0:width] (+ bias[n0:n0+width]) for r < R; y points at the chunk's first row. */
static inline void store_rows(const int R, const float *out, const float *bias, int64_t n0, int64_t width,
                              int64_t N, float *y) {
    for (int r = 0; r < R; r++) {
        float *yr = y + r * N + n0;
        if (bias) {
            for (int64_t j = 0; j < width; j++) yr[j] = out[r * PW + j] + bias[n0 + j];
        } else {
            memcpy(yr, out + r * PW, (size_t)width * sizeof(float));
        }
    }
}

/* ---- the panel loops: fp32 panels and exact ones ------------------------------------------------------- */
/* Layout of an exact panel b: Q (K, QB) bytes per kind: 4 (QB 8: byte c holds column c in its low nibble, column c + 8 in
 * its high one), 8 (QB 16: byte c is column c), 16 (bf16, QB 32: the upper halves of the fp32 weights) or 17
 * (fp16, QB 32); D, Mn (K / 32, 16) floats for kinds 4 and 8 (fp16 for kinds 5 and 9, below): block j's d and m
 * per column (K a multiple of 32). */
#define QBLK 32
#define KIND_BF16 16
#define KIND_FP16 17
#define KIND_F32 32 /* plain fp32 panels (sd_panel_linear): the same loops, weights loaded as they are */
/* Kinds 5 and 9: kinds 4 and 8 with D, Mn held as fp16 (a GGUF's d and m are fp16, so its blocks' tables are
 * exact in 2 bytes): 0.625 instead of 0.75 bytes a 4-bit weight. A decode step streams its weights from memory
 * (~23 GB/s on a 2-core EPYC), so the bytes are its time; the tables are converted once per 32 input rows. */
#define KIND_Q4H 5
#define KIND_Q8H 9
#define IS_Q4(KIND) ((KIND) == 4 || (KIND) == KIND_Q4H)
#define HALF_TABLES(KIND) ((KIND) == KIND_Q4H || (KIND) == KIND_Q8H)

static inline int64_t kind_bytes(int kind) {
    return IS_Q4(kind) ? 8 : kind == 8 || kind == KIND_Q8H ? 16 : kind == KIND_F32 ? 64 : 32;
}

/* bytes of one D or Mn entry: 2 for the fp16 tables, else 4 */
static inline int64_t table_bytes(int kind) { return HALF_TABLES(kind) ? 2 : 4; }

/* 8 consecutive table entries from entry `at` (fp16 tables converted exactly to fp32). */
static inline __attribute__((always_inline)) __m256 table8(const int KIND, const float *t, int64_t at) {
    if (HALF_TABLES(KIND)) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)t + at)));
    return _mm256_loadu_ps(t + at);
}

/* vpshufb control: lane 0 takes bytes 0-3, lane 1 bytes 4-7 (of the 8 broadcast to both lanes), each
 * zero-extended to a dword. */
static inline __m256i spread8(void) {
    return _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                            4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
}

/* columns 0-7 and 8-15 of input row q rebuilt as fp32 (d, m: the block's constants for kinds 4 and 8). */
static inline __attribute__((always_inline)) void dequant(const int KIND, const uint8_t *q, __m256 d0,
                                                          __m256 d1, __m256 m0, __m256 m1, __m256 *w0,
                                                          __m256 *w1) {
    if (KIND == KIND_F32) {
        *w0 = _mm256_loadu_ps((const float *)q);
        *w1 = _mm256_loadu_ps((const float *)q + 8);
        return;
    }
    if (KIND == KIND_BF16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)q);
        *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16));
        *w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16));
        return;
    }
    if (KIND == KIND_FP16) {
        *w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)q));
        *w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(q + 16)));
        return;
    }
    if (IS_Q4(KIND)) {
        /* bytes 0-7 in both 128-bit lanes, zero-extended in lane: dword c = byte c (c < 8), one in-lane shuffle */
        int64_t b8;
        memcpy(&b8, q, 8);
        const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi64x(b8), spread8());
        const __m256i nib = _mm256_set1_epi32(0x0F);
        *w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, nib)), d0, m0);
        *w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d1, m1);
    } else {
        *w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q))), d0, m0);
        *w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)))),
                              d1, m1);
    }
}

/* Runs BODY(i, w0, w1) for i = 0..K-1 in order with input row i's 16 weights rebuilt (the block constants
 * reloaded every 32 rows for kinds 4 and 8). S: panels side by side in the layout (1, or 2 for a paired store,
 * whose input rows hold both panels' bytes and whose blocks both panels' constants: q, d, m then point at this
 * panel's first ones). */
#ifndef QPANEL_AHEAD
#define QPANEL_AHEAD 4 /* blocks of 32 input rows whose bytes a pass prefetches ahead */
#endif
#define FOR_EACH_WEIGHT_ROW(KIND, S, K, q, d, m, BODY)                                                       \
    do {                                                                                                     \
        const int64_t qb_ = kind_bytes(KIND) * (S);                                                          \
        if ((KIND) < KIND_BF16) {                                                                            \
            for (int64_t j_ = 0; j_ < (K) / QBLK; j_++) {                                                    \
                const int64_t t_ = j_ * PW * (S);                                                            \
                const char *ahead_ = (const char *)(q + (j_ + QPANEL_AHEAD) * QBLK * qb_); /* never faults */     \
                for (int64_t c_ = 0; c_ < QBLK * qb_; c_ += 64) _mm_prefetch(ahead_ + c_, _MM_HINT_T0);         \
                const __m256 d0_ = table8(KIND, d, t_), d1_ = table8(KIND, d, t_ + 8);                       \
                const __m256 m0_ = table8(KIND, m, t_), m1_ = table8(KIND, m, t_ + 8);                       \
                for (int64_t i = j_ * QBLK; i < (j_ + 1) * QBLK; i++) {                                      \
                    __m256 w0, w1;                                                                           \
                    dequant(KIND, q + i * qb_, d0_, d1_, m0_, m1_, &w0, &w1);                                \
                    BODY;                                                                                    \
                }                                                                                            \
            }                                                                                                \
        } else {                                                                                             \
            const __m256 z_ = _mm256_setzero_ps(); /* unused by these kinds */                              \
            for (int64_t i = 0; i < (K); i++) {                                                              \
                __m256 w0, w1;                                                                               \
                dequant(KIND, q + i * qb_, z_, z_, z_, z_, &w0, &w1);                                        \
                BODY;                                                                                        \
            }                                                                                                \
        }                                                                                                    \
    } while (0)

/* out[r, 0:16] for r < R with each weight rebuilt in registers: panel_rows' FMA chain, the same order. */
static inline __attribute__((always_inline)) void qpanel_rows(const int R, const int KIND, const int S,
                                                              const float *x, int64_t K, const uint8_t *q,
                                                              const float *d, const float *m, float *out) {
    __m256 a0[RMAX], a1[RMAX];
    for (int r = 0; r < R; r++) {
        a0[r] = _mm256_setzero_ps();
        a1[r] = _mm256_setzero_ps();
    }
    FOR_EACH_WEIGHT_ROW(KIND, S, K, q, d, m, {
        for (int r = 0; r < R; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * K + i);
            a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]);
            a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);
        }
    });
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out + r * PW, a0[r]);
        _mm256_storeu_ps(out + r * PW + 8, a1[r]);
    }
}

/* Both panels of a pair at once for R <= PAIR_ROWS rows: out_a, out_b [r, 0:16], each column's chain exactly
 * qpanel_rows' (the same FMAs in the same order), four independent chains a row instead of two. At one or two
 * rows a single panel's two chains wait on FMA latency; with the pair's bytes side by side the four run in the
 * time of two and the weights still stream as one sequence (two panels read from two places ran slower here). */
#define PAIR_ROWS 2
static inline __attribute__((always_inline)) void pair_rows(const int R, const int KIND, const float *x, int64_t K,
                                                            const uint8_t *q, const float *d, const float *m,
                                                            float *out_a, float *out_b) {
    const int64_t qb = kind_bytes(KIND);
    __m256 a0[PAIR_ROWS], a1[PAIR_ROWS], b0[PAIR_ROWS], b1[PAIR_ROWS];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = b0[r] = b1[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < K / QBLK; j++) {
        const int64_t t = j * 2 * PW;
        const __m256 da0 = table8(KIND, d, t), da1 = table8(KIND, d, t + 8);
        const __m256 db0 = table8(KIND, d, t + PW), db1 = table8(KIND, d, t + PW + 8);
        const __m256 ma0 = table8(KIND, m, t), ma1 = table8(KIND, m, t + 8);
        const __m256 mb0 = table8(KIND, m, t + PW), mb1 = table8(KIND, m, t + PW + 8);
        for (int64_t i = j * QBLK; i < (j + 1) * QBLK; i++) {
            __m256 wa0, wa1, wb0, wb1;
            dequant(KIND, q + i * 2 * qb, da0, da1, ma0, ma1, &wa0, &wa1);
            dequant(KIND, q + i * 2 * qb + qb, db0, db1, mb0, mb1, &wb0, &wb1);
            for (int r = 0; r < R; r++) {
                const __m256 xb = _mm256_broadcast_ss(x + r * K + i);
                a0[r] = _mm256_fmadd_ps(xb, wa0, a0[r]);
                a1[r] = _mm256_fmadd_ps(xb, wa1, a1[r]);
                b0[r] = _mm256_fmadd_ps(xb, wb0, b0[r]);
                b1[r] = _mm256_fmadd_ps(xb, wb1, b1[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out_a + r * PW, a0[r]);
        _mm256_storeu_ps(out_a + r * PW + 8, a1[r]);
        _mm256_storeu_ps(out_b + r * PW, b0[r]);
        _mm256_storeu_ps(out_b + r * PW + 8, b1[r]);
    }
}

/* CALL_R(n) with R's value as a compile-time constant n (R <= RMAX: ROWS_SWITCH; R <= 8: ROWS_SWITCH8). */
#define ROWS_CASES_1_5(CALL_R)              \
        case 1: CALL_R(1); break;           \
        case 2: CALL_R(2); break;           \
        case 3: CALL_R(3); break;           \
        case 4: CALL_R(4); break;           \
        case 5: CALL_R(5); break;
#define ROWS_SWITCH(CALL_R)                 \
    switch (R) {                            \
        ROWS_CASES_1_5(CALL_R)              \
        default: CALL_R(RMAX); break;       \
    }
#define ROWS_SWITCH8(CALL_R)                \
    switch (R) {                            \
        ROWS_CASES_1_5(CALL_R)              \
        case 6: CALL_R(6); break;           \
        case 7: CALL_R(7); break;           \
        default: CALL_R(8); break;          \
    }

/* ---- AVX-512 (used where the CPU has it: one zmm holds a panel's 16 columns) ------------------------------- */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

/* 16 table entries from entry `at` (fp16 tables converted exactly). */
static inline __attribute__((always_inline)) AVX512 __m512 table16(const int KIND, const float *t, int64_t at) {
    if (HALF_TABLES(KIND)) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)t + at)));
    return _mm512_loadu_ps(t + at);
}

/* An 8-bit panel's 16 weights of one input row (byte c: column c) rebuilt in one zmm: the same fma(u, d, m) per
 * column as `dequant` (4-bit pairs: q4_pair16). */
static inline __attribute__((always_inline)) AVX512 __m512 q8_16(const uint8_t *q, __m512 d, __m512 m) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q))), d, m);
}

/* vpmultishiftqb (AVX512-VBMI) as inline asm, so the library's AVX-512 functions need no VBMI target: byte k of
 * each qword of the result = the 8 bits of the same qword of `data` from bit ctrl[k] (mod 64). Runs only where
 * sd_vbmi_on() says the CPU has it. */
static inline __attribute__((always_inline)) AVX512 __m512i multishift(__m512i ctrl, __m512i data) {
    __m512i r;
    __asm__("vpmultishiftqb %2, %1, %0" : "=v"(r) : "v"(ctrl), "v"(data));
    return r;
}

/* A paired 4-bit store's input row (q: panel a's 8 bytes, then b's) rebuilt as both panels' 16 weights, the same
 * fma(u, d, m) per column as `dequant`. VBMI: each panel's 8 bytes broadcast to every qword, one multishift puts
 * column c's nibble in dword c's low bits and one vpermps turns it into float(u): 3 vector ops a panel with the
 * fma. Else the 16 bytes and their copy shifted right by 4 are unpacked once for both panels: 9 ops a pair (a
 * panel at a time with masks and conversions took 16, session 60). */
static inline __attribute__((always_inline)) AVX512 void q4_pair16(const int VBMI, const uint8_t *q, __m512 da,
                                                                   __m512 ma, __m512 db, __m512 mb, __m512 *wa,
                                                                   __m512 *wb) {
    /* vpermps reads only an index's low 4 bits: a dword whose low 4 bits are u picks float(u) from 0..15, so
     * neither path masks the other bits off or converts an integer */
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i ia, ib; /* dword c: column c's nibble in its low 4 bits */
    if (VBMI) { /* column c < 8: low nibble of byte c (bit 8c); c >= 8: high nibble of byte c - 8 */
        const __m512i ctrl = _mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 4, 12, 20, 28, 36, 44, 52, 60);
        int64_t a8, b8;
        memcpy(&a8, q, 8);
        memcpy(&b8, q + 8, 8);
        ia = multishift(ctrl, _mm512_set1_epi64(a8));
        ib = multishift(ctrl, _mm512_set1_epi64(b8));
    } else { /* bytes 0-7 as they are (low nibbles), then shifted right 4 (high nibbles), zero-extended */
        const __m128i v = _mm_loadu_si128((const __m128i *)q), hi = _mm_srli_epi16(v, 4);
        ia = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(v, hi));
        ib = _mm512_cvtepu8_epi32(_mm_unpackhi_epi64(v, hi));
    }
    const __m512 ua = _mm512_permutexvar_ps(ia, iota), ub = _mm512_permutexvar_ps(ib, iota);
    *wa = _mm512_fmadd_ps(ua, da, ma);
    *wb = _mm512_fmadd_ps(ub, db, mb);
}

/* pair_rows with one zmm a panel, up to PAIR16_ROWS rows: 2 R chains (R <= 8: 16 accumulators of 32 registers),
 * each column's chain the same FMAs in the same order as every other path. */
#define PAIR16_ROWS 8
#ifndef PAIR16_AHEAD
#define PAIR16_AHEAD 4 /* blocks of 32 input rows whose bytes a pass prefetches ahead */
#endif
static inline __attribute__((always_inline)) AVX512 void pair_rows16(const int R, const int KIND, const int VBMI,
                                                                     const float *x, int64_t K, const uint8_t *q,
                                                                     const float *d, const float *m, float *out_a,
                                                                     float *out_b) {
    const int64_t qb = kind_bytes(KIND);
    __m512 a[PAIR16_ROWS], b[PAIR16_ROWS];
    for (int r = 0; r < R; r++) a[r] = b[r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < K / QBLK; j++) {
        const int64_t t = j * 2 * PW;
        const char *ahead = (const char *)(q + (j + PAIR16_AHEAD) * QBLK * 2 * qb); /* never faults */
        for (int64_t c = 0; c < QBLK * 2 * qb; c += 64) _mm_prefetch(ahead + c, _MM_HINT_T0);
        const __m512 da = table16(KIND, d, t), db = table16(KIND, d, t + PW);
        const __m512 ma = table16(KIND, m, t), mb = table16(KIND, m, t + PW);
        for (int64_t i = j * QBLK; i < (j + 1) * QBLK; i++) {
            __m512 wa, wb;
            if (IS_Q4(KIND)) {
                q4_pair16(VBMI, q + i * 2 * qb, da, ma, db, mb, &wa, &wb);
            } else {
                wa = q8_16(q + i * 2 * qb, da, ma);
                wb = q8_16(q + i * 2 * qb + qb, db, mb);
            }
            for (int r = 0; r < R; r++) {
                const __m512 xb = _mm512_set1_ps(x[r * K + i]);
                a[r] = _mm512_fmadd_ps(xb, wa, a[r]);
                b[r] = _mm512_fmadd_ps(xb, wb, b[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(out_a + r * PW, a[r]);
        _mm512_storeu_ps(out_b + r * PW, b[r]);
    }
}

/* pair_rows16 at R rows (R <= PAIR16_ROWS) of one kind (a compile-time constant where inlined). */
static inline __attribute__((always_inline)) AVX512 void pair_rows16_r(const int R, const int KIND, const int VBMI,
                                                                       const float *x, int64_t K, const uint8_t *q,
                                                                       const float *d, const float *m, float *out_a,
                                                                       float *out_b) {
#define P16_R(RR) pair_rows16(RR, KIND, VBMI, x, K, q, d, m, out_a, out_b)
    ROWS_SWITCH8(P16_R)
}

/* vbmi: the 4-bit kinds' rebuild through vpmultishiftqb (sd_vbmi_on) */
static AVX512 void pair_rows16_any(int R, int kind, int vbmi, const float *x, int64_t K, const uint8_t *q,
                                   const float *d, const float *m, float *out_a, float *out_b) {
#define P16_ANY(KK, V) pair_rows16_r(R, KK, V, x, K, q, d, m, out_a, out_b)
    switch (kind) {
        case 4: if (vbmi) P16_ANY(4, 1); else P16_ANY(4, 0); break;
        case 8: P16_ANY(8, 0); break;
        case KIND_Q4H: if (vbmi) P16_ANY(KIND_Q4H, 1); else P16_ANY(KIND_Q4H, 0); break;
        default: P16_ANY(KIND_Q8H, 0); break;
    }
}

/* fp32 panels at 2 or more rows where AVX-512 runs (sd_panel_linear): two panels a pass (pa, pb: K x 16 each;
 * pb NULL for a lone last panel), up to WIDE_ROWS rows at a time in 2 R accumulators (24 of 32 zmm): per input
 * row two weight loads and R broadcasts feed 2 R FMAs. Each column's chain: the same FMAs in the same order as
 * every path. Against the AVX2 6-row loop, same bits, on a 2-core AMX Xeon (session 60; 4 products of a
 * 135M-sized model's shapes, round robin): 1.12-1.23x faster at 2-6 rows, 1.5-1.7x at 7-256, equal at 1. */
#define WIDE_ROWS 12
#ifndef WIDE_MIN
#define WIDE_MIN 2 /* rows from which an fp32 panel product takes this path (1 row: the AVX2 loop, as fast) */
#endif
static inline __attribute__((always_inline)) AVX512 void wide_rows(const int R, const int TWO, const float *x,
                                                                   int64_t K, const float *pa, const float *pb,
                                                                   float *out_a, float *out_b) {
    __m512 a[WIDE_ROWS], b[WIDE_ROWS];
    for (int r = 0; r < R; r++) a[r] = b[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K; i++) {
        const __m512 wa = _mm512_loadu_ps(pa + i * PW);
        const __m512 wb = TWO ? _mm512_loadu_ps(pb + i * PW) : wa;
        for (int r = 0; r < R; r++) {
            const __m512 xb = _mm512_set1_ps(x[r * K + i]);
            a[r] = _mm512_fmadd_ps(xb, wa, a[r]);
            if (TWO) b[r] = _mm512_fmadd_ps(xb, wb, b[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(out_a + r * PW, a[r]);
        if (TWO) _mm512_storeu_ps(out_b + r * PW, b[r]);
    }
}

#define WIDE_SWITCH(CALL_R)                 \
    switch (R) {                            \
        ROWS_CASES_1_5(CALL_R)              \
        case 6: CALL_R(6); break;           \
        case 7: CALL_R(7); break;           \
        case 8: CALL_R(8); break;           \
        case 9: CALL_R(9); break;           \
        case 10: CALL_R(10); break;         \
        case 11: CALL_R(11); break;         \
        default: CALL_R(WIDE_ROWS); break;  \
    }

/* y[:, n0 : n0 + 32] (the columns that exist; + bias) for all M rows from panels pa, pb (pb NULL: 16 columns). */
static AVX512 void wide_panels(int64_t M, const float *x, int64_t K, const float *pa, const float *pb,
                               const float *bias, int64_t n0, int64_t N, float *y) {
    float out_a[WIDE_ROWS * PW], out_b[WIDE_ROWS * PW];
    const int64_t wa = N - n0 < PW ? N - n0 : PW, wb = N - n0 - PW < PW ? N - n0 - PW : PW;
    for (int64_t m0 = 0; m0 < M; m0 += WIDE_ROWS) {
        const int R = M - m0 < WIDE_ROWS ? (int)(M - m0) : WIDE_ROWS;
        const float *xr = x + m0 * K;
#define WIDE2(RR) wide_rows(RR, 1, xr, K, pa, pb, out_a, out_b)
#define WIDE1(RR) wide_rows(RR, 0, xr, K, pa, pa, out_a, out_b)
        if (pb) {
            WIDE_SWITCH(WIDE2)
        } else {
            WIDE_SWITCH(WIDE1)
        }
        store_rows(R, out_a, bias, n0, wa, N, y + m0 * N);
        if (pb && wb > 0) store_rows(R, out_b, bias, n0 + PW, wb, N, y + m0 * N);
    }
}

static int avx512_state = -1; /* -1: not decided yet; else whether the AVX-512 paths run */

/* Whether the CPU has AVX-512 F, BW and VL. */
static int cpu_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}

/* Whether the AVX-512 paths run: where the CPU has them, unless SPECDRAFT_AVX512=0 or sd_set_avx512(0) (read by
 * models/qdot.c too: one switch for every AVX-512 path of the library). */
int sd_avx512_on(void) {
    if (avx512_state < 0) {
        const char *env = getenv("SPECDRAFT_AVX512");
        avx512_state = cpu_avx512() && !(env && env[0] == '0');
    }
    return avx512_state;
}

/* on: 1 use the AVX-512 paths where the CPU has them, 0 never (the AVX2 paths: the same bits); returns whether
 * they run now. */
int sd_set_avx512(int on) {
    avx512_state = on && cpu_avx512();
    return avx512_state;
}

static int vbmi_state = -1; /* -1: not decided yet; else whether 4-bit pairs are rebuilt through vpmultishiftqb */

/* Whether the AVX-512 pair pass rebuilds 4-bit weights with AVX512-VBMI: where the AVX-512 paths run and the CPU
 * has VBMI, unless SPECDRAFT_VBMI=0 or sd_set_vbmi(0). The same bits either way. */
int sd_vbmi_on(void) {
    if (vbmi_state < 0) {
        const char *env = getenv("SPECDRAFT_VBMI");
        vbmi_state = __builtin_cpu_supports("avx512vbmi") && !(env && env[0] == '0');
    }
    return vbmi_state && sd_avx512_on();
}

/* Turns the VBMI rebuild on or off (tests and A/B runs); returns whether it runs now. */
int sd_set_vbmi(int on) {
    vbmi_state = on && __builtin_cpu_supports("avx512vbmi");
    return sd_vbmi_on();
}

/* out[r, 0:16] = sum_i x[r, i] * p[i, 0:16] for r < R (R a compile-time constant after inlining): the fp32
 * panels' loop, which every exact kind above repeats with its weights rebuilt. */
static inline __attribute__((always_inline)) void panel_rows(const int R, const float *x, int64_t K,
                                                             const float *p, float *out) {
    qpanel_rows(R, KIND_F32, 1, x, K, (const uint8_t *)p, NULL, NULL, out);
}

static inline __attribute__((always_inline)) void unpack_kind(const int KIND, const int S, int64_t K,
                                                              const uint8_t *q, const float *d, const float *m,
                                                              float *p) {
    FOR_EACH_WEIGHT_ROW(KIND, S, K, q, d, m, {
        _mm256_storeu_ps(p + i * PW, w0);
        _mm256_storeu_ps(p + i * PW + 8, w1);
    });
}

#define KIND_CASES(CALL_K)                           \
    switch (kind) {                                  \
        case 4: CALL_K(4); break;                    \
        case 8: CALL_K(8); break;                    \
        case KIND_Q4H: CALL_K(KIND_Q4H); break;      \
        case KIND_Q8H: CALL_K(KIND_Q8H); break;      \
        case KIND_BF16: CALL_K(KIND_BF16); break;    \
        default: CALL_K(KIND_FP16); break;           \
    }

/* panel (K, 16) floats rebuilt (the weights qpanel_rows computes with); S as FOR_EACH_WEIGHT_ROW. */
static void unpack_panel(int kind, int S, int64_t K, const uint8_t *q, const float *d, const float *m, float *p) {
#define UNPACK1(KK) unpack_kind(KK, 1, K, q, d, m, p)
#define UNPACK2(KK) unpack_kind(KK, 2, K, q, d, m, p)
    if (S == 1) {
        KIND_CASES(UNPACK1)
    } else {
        KIND_CASES(UNPACK2)
    }
}

/* A paired store (kind | KIND_PAIRED, kinds 4, 5, 8 and 9): panels 2g and 2g + 1 side by side, input row i's
 * bytes of panel 2g then of 2g + 1, and block j's 16 d of panel 2g then 16 of 2g + 1 (m the same): one stream
 * of bytes for two panels. The panel count is even (models/exact_panels.py pairs only those). */
#define KIND_PAIRED 64
/* or-ed into 4 / 8: a store of models/qdot.c's layout, multiplied with the activations quantised to int8 */
#define KIND_QDOT 128
void sd_qdot_linear(const float *x, int64_t M, int64_t K, const uint8_t *Q, const float *D, const float *Mn,
                    int bits, int64_t N, const float *bias, float *y, int nthreads);

/* Where panel b of a store starts: its bytes, d and m, and the stride S between its input rows' bytes. */
static inline void panel_at(int kind, int S, int64_t K, const uint8_t *Q, const float *D, const float *Mn,
                            int64_t b, const uint8_t **q, const float **d, const float **m) {
    const int64_t qb = kind_bytes(kind), tb = kind < KIND_BF16 ? (K / QBLK) * PW * table_bytes(kind) : 0;
    const int64_t g = b / S, h = b % S; /* the group (pair) and the panel's place in it */
    *q = Q + g * S * K * qb + h * qb;
    *d = (const float *)((const char *)D + g * S * tb + h * PW * table_bytes(kind));
    *m = (const float *)((const char *)Mn + g * S * tb + h * PW * table_bytes(kind));
}

/* P (panels, K, 16) floats rebuilt from Q, D, Mn: what sd_qpanel_linear multiplies by (checked against the fp32
 * panels before a weight is stored this way). */
void sd_qpanel_unpack(const uint8_t *Q, const float *D, const float *Mn, int kind, int64_t panels, int64_t K,
                      float *P) {
    const int S = kind & KIND_PAIRED ? 2 : 1;
    kind &= ~KIND_PAIRED;
    for (int64_t b = 0; b < panels; b++) {
        const uint8_t *q;
        const float *d, *m;
        panel_at(kind, S, K, Q, D, Mn, b, &q, &d, &m);
        unpack_panel(kind, S, K, q, d, m, P + b * K * PW);
    }
}


/* qpanel_rows at R rows (R <= RMAX) of one kind and stride (compile-time constants where inlined). */
static inline __attribute__((always_inline)) void qpanel_rows_r(const int R, const int KIND, const int S,
                                                                const float *x, int64_t K, const uint8_t *q,
                                                                const float *d, const float *m, float *out) {
#define QPANEL_R(RR) qpanel_rows(RR, KIND, S, x, K, q, d, m, out)
    ROWS_SWITCH(QPANEL_R)
}

/* One panel's outputs for rows m0.. of x: up to 6 rows with each weight rebuilt in registers, 7-8 as two chunks
 * of up to 4, more from `buf` (the panel rebuilt once); stored into y. */
static inline __attribute__((always_inline)) void one_panel(const int S, int kind, const float *x, int64_t M,
                                                            int64_t K, const uint8_t *q, const float *d,
                                                            const float *m, const float *bias, int64_t n0,
                                                            int64_t N, float *buf, float *y) {
    const int64_t width = N - n0 < PW ? N - n0 : PW;
    float out[RMAX * PW];
    if (buf) unpack_panel(kind, S, K, q, d, m, buf);
    const int64_t step = buf ? RMAX : M <= RMAX ? RMAX : RCHUNK;
    for (int64_t m0 = 0; m0 < M; m0 += step) {
        const int R = M - m0 < step ? (int)(M - m0) : step;
        const float *xr = x + m0 * K;
#define FROM_BUF(RR) panel_rows(RR, xr, K, buf, out)
#define ROWS_OF(KK) qpanel_rows_r(R, KK, S, xr, K, q, d, m, out)
        if (buf) {
            ROWS_SWITCH(FROM_BUF)
        } else {
            KIND_CASES(ROWS_OF)
        }
        store_rows(R, out, bias, n0, width, N, y + m0 * N);
    }
}

/* y (M, N) = x (M, K) @ W.T + bias, W as exact panels of `kind` (| KIND_PAIRED: a paired store). A paired store
 * where the AVX-512 code runs: both panels of a pair in one pass, 8 rows at a time (each weight rebuilt in
 * registers once per 8 rows; 12-128 rows took 0.64-0.75x the time of the rebuilt-panel path below). Else up to 6
 * rows: weights rebuilt in registers (a pair's two panels at once up to PAIR_ROWS rows); 7-8 rows: rebuilt in
 * registers twice, for two chunks of up to 4 rows (cheaper on a 2-core EPYC than a rebuilt panel plus a 2-row
 * chunk waiting on FMA latency); more: each panel rebuilt once into a per-thread buffer, then sd_panel_linear's
 * loop. */
void sd_qpanel_linear(const float *x, int64_t M, int64_t K, const uint8_t *Q, const float *D, const float *Mn,
                      int kind, int64_t N, const float *bias, float *y, int nthreads) {
    if (kind & KIND_QDOT) { /* int8 activations (models/qdot.c) */
        sd_qdot_linear(x, M, K, Q, D, Mn, kind & ~KIND_QDOT, N, bias, y, nthreads);
        return;
    }
    const int S = kind & KIND_PAIRED ? 2 : 1;
    kind &= ~KIND_PAIRED;
    const int64_t panels = (N + PW - 1) / PW, groups = (panels + S - 1) / S;
    const int avx512 = S == 2 && kind < KIND_BF16 && sd_avx512_on();
    const int vbmi = avx512 && sd_vbmi_on();
#pragma omp parallel num_threads(nthreads)
    {
        /* more than 8 rows, unless the AVX-512 pair pass takes them 8 at a time: each panel rebuilt once */
        const int rebuild = M > 2 * RCHUNK && !(S == 2 && avx512);
        float *buf = rebuild ? (float *)malloc((size_t)K * PW * sizeof(float)) : NULL;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *q;
            const float *d, *m;
            if (S == 2 && avx512) { /* both panels in one pass, one zmm each, 8 rows at a time */
                float out_a[PAIR16_ROWS * PW], out_b[PAIR16_ROWS * PW];
                panel_at(kind, S, K, Q, D, Mn, 2 * g, &q, &d, &m);
                for (int64_t r0 = 0; r0 < M; r0 += PAIR16_ROWS) {
                    const int R = (int)(M - r0 < PAIR16_ROWS ? M - r0 : PAIR16_ROWS);
                    pair_rows16_any(R, kind, vbmi, x + r0 * K, K, q, d, m, out_a, out_b);
                    for (int h = 0; h < 2; h++) {
                        const int64_t n0 = (2 * g + h) * PW, width = N - n0 < PW ? N - n0 : PW;
                        if (width > 0) store_rows(R, h ? out_b : out_a, bias, n0, width, N, y + r0 * N);
                    }
                }
                continue;
            }
            if (S == 2 && M <= PAIR_ROWS) { /* both panels of the pair in one pass */
                float out_a[PAIR_ROWS * PW], out_b[PAIR_ROWS * PW];
                panel_at(kind, S, K, Q, D, Mn, 2 * g, &q, &d, &m);
#define PAIR_OF(KK) do { if (M == 1) pair_rows(1, KK, x, K, q, d, m, out_a, out_b); \
                         else pair_rows(2, KK, x, K, q, d, m, out_a, out_b); } while (0)
                KIND_CASES(PAIR_OF)
                for (int h = 0; h < 2; h++) {
                    const int64_t n0 = (2 * g + h) * PW, width = N - n0 < PW ? N - n0 : PW;
                    if (width > 0) store_rows((int)M, h ? out_b : out_a, bias, n0, width, N, y);
                }
                continue;
            }
            for (int64_t b = g * S; b < (g + 1) * S && b < panels; b++) {
                panel_at(kind, S, K, Q, D, Mn, b, &q, &d, &m);
                if (S == 1)
                    one_panel(1, kind, x, M, K, q, d, m, bias, b * PW, N, buf, y);
                else
                    one_panel(2, kind, x, M, K, q, d, m, bias, b * PW, N, buf, y);
            }
        }
        free(buf);
    }
}

/* y (M, N) = x (M, K) @ W.T + bias (N or NULL); P as above; nthreads OpenMP threads (torch's runtime). */
void sd_panel_linear(const float *x, int64_t M, int64_t K, const float *P, int64_t N, const float *bias,
                     float *y, int nthreads) {
    const int64_t panels = (N + PW - 1) / PW;
    if (M >= WIDE_MIN && sd_avx512_on()) { /* wide_panels: two panels a pass, 12 rows at a time */
        const int64_t pairs = (panels + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t g = 0; g < pairs; g++) {
            const float *pa = P + 2 * g * K * PW, *pb = 2 * g + 1 < panels ? pa + K * PW : NULL;
            wide_panels(M, x, K, pa, pb, bias, 2 * g * PW, N, y);
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < panels; b++) {
        const float *p = P + b * K * PW;
        const int64_t n0 = b * PW, width = N - n0 < PW ? N - n0 : PW;
        float out[RMAX * PW];
        for (int64_t m0 = 0; m0 < M; m0 += RMAX) {
            const int R = M - m0 < RMAX ? (int)(M - m0) : RMAX;
            const float *xr = x + m0 * K;
#define F32(RR) panel_rows(RR, xr, K, p, out)
            ROWS_SWITCH(F32)
            store_rows(R, out, bias, n0, width, N, y + m0 * N);
        }
    }
}
