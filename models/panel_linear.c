/* specdraft's fp32 CPU product for decode steps: y = x @ W.T (+ bias), W packed in 16-column panels.
 *
 * Layout: P[b][i][c] = W[16 b + c][i] for panel b, input i, column c (zero-padded past N): each panel is K x 16
 * floats, contiguous, so a product streams every weight exactly once, in order, whatever the row count M.
 * Each thread takes whole panels; within a panel, rows go in chunks of up to 6 held in 12 AVX2 accumulators
 * (two 8-float vectors per row), the panel re-read from cache for the next chunk.
 *
 * Every output element is summed over i = 0..K-1 in order with one FMA per term, so a row's result is the same
 * bits whatever M is and whatever the other rows hold (row-invariant: a tree verify and an AR step compute the
 * same products for the same row). Built by models/panel_linear.py with -O3 -mavx2 -mfma -fopenmp.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define PW 16     /* panel width: output columns per panel */
#define RMAX 6    /* rows per register chunk */

/* out[r, 0:16] = sum_i x[r, i] * p[i, 0:16] for r < R (R a compile-time constant after inlining). */
static inline __attribute__((always_inline)) void panel_rows(const int R, const float *x, int64_t K,
                                                             const float *p, float *out) {
    __m256 a0[RMAX], a1[RMAX];
    for (int r = 0; r < R; r++) {
        a0[r] = _mm256_setzero_ps();
        a1[r] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < K; i++) {
        const __m256 w0 = _mm256_loadu_ps(p + i * PW), w1 = _mm256_loadu_ps(p + i * PW + 8);
        for (int r = 0; r < R; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * K + i);
            a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]);
            a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out + r * PW, a0[r]);
        _mm256_storeu_ps(out + r * PW + 8, a1[r]);
    }
}

/* y (M, N) = x (M, K) @ W.T + bias (N or NULL); P as above; nthreads OpenMP threads (torch's runtime). */
void sd_panel_linear(const float *x, int64_t M, int64_t K, const float *P, int64_t N, const float *bias,
                     float *y, int nthreads) {
    const int64_t panels = (N + PW - 1) / PW;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < panels; b++) {
        const float *p = P + b * K * PW;
        const int64_t n0 = b * PW, width = N - n0 < PW ? N - n0 : PW;
        float out[RMAX * PW];
        for (int64_t m0 = 0; m0 < M; m0 += RMAX) {
            const int R = M - m0 < RMAX ? (int)(M - m0) : RMAX;
            const float *xr = x + m0 * K;
            switch (R) {
                case 1: panel_rows(1, xr, K, p, out); break;
                case 2: panel_rows(2, xr, K, p, out); break;
                case 3: panel_rows(3, xr, K, p, out); break;
                case 4: panel_rows(4, xr, K, p, out); break;
                case 5: panel_rows(5, xr, K, p, out); break;
                default: panel_rows(RMAX, xr, K, p, out); break;
            }
            for (int r = 0; r < R; r++) {
                float *yr = y + (m0 + r) * N + n0;
                if (bias) {
                    for (int64_t j = 0; j < width; j++) yr[j] = out[r * PW + j] + bias[n0 + j];
                } else {
                    memcpy(yr, out + r * PW, (size_t)width * sizeof(float));
                }
            }
        }
    }
}
