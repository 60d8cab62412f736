/* A few rows of float32 activations times a float16 copy of a weight (executors/half_gemm.py):
 *
 *   half_gemm   y[r][n] = sum_k x[r][k] * w[n][k] (+ bias[n])
 *
 * Why: on a CPU without bf16 instructions (the AVX2-only EPYC) the wide passes' weights are
 * float32 (packed_linear.gemm_dtype), and a decode step of a few rows streams all of them: 424
 * MB a step for SmolLM2. Their float16 copy (exact: a bf16 GGUF's values fit float16, checked
 * per matrix) is half the bytes, and F16C widens 8 of them per instruction into the FMAs.
 *
 * Layout: w is packed as [n / 16][k][16] halves: for every input column k, the 16 outputs of a
 * block side by side, so one 32-byte load feeds two 8-wide FMAs per row with no horizontal sum.
 * A block's rows go MR at a time (12 accumulators), the block staying in L1/L2 while the rows
 * pass. Output blocks split over OpenMP threads (torch's libgomp: one pool).
 *
 * Without F16C and FMA (a build for another target) there is no kernel: ready() says so and
 * the float32 weights stay. */
#include <stdint.h>

#define NB 16 /* outputs per packed block */
#define MR 6  /* rows per register block */

#if defined(__F16C__) && defined(__FMA__) && defined(__AVX2__)
#include <immintrin.h>

int half_gemm_ready(void) { return 0; }
const char *kernel_kind(void) { return "avx2-f16c"; }

/* `rows` (a constant after inlining) rows of x times one packed block: 16 outputs each */
static inline __attribute__((always_inline)) void block(
    const float *x, int64_t ldx, const int rows, const uint16_t *wb, int64_t k,
    const float *bias, float *y, int64_t ldy) {
    __m256 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        const __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + i * NB)));
        const __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + i * NB + 8)));
        for (int r = 0; r < rows; r++) {
            const __m256 b = _mm256_broadcast_ss(x + r * ldx + i);
            acc[r][0] = _mm256_fmadd_ps(b, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(b, w1, acc[r][1]);
        }
    }
    const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(y + r * ldy, _mm256_add_ps(acc[r][0], b0));
        _mm256_storeu_ps(y + r * ldy + 8, _mm256_add_ps(acc[r][1], b1));
    }
}

/* x [m, k] (row stride ldx), w packed [n / NB][k][NB], bias [n] or NULL, y [m, n] */
void half_gemm(const float *x, int64_t m, int64_t ldx, int64_t k, const uint16_t *w, int64_t n,
               const float *bias, float *y, int threads) {
    const int64_t blocks = n / NB;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks > 1)
    for (int64_t nb = 0; nb < blocks; nb++) {
        const uint16_t *wb = w + nb * k * NB;
        const float *bb = bias ? bias + nb * NB : 0;
        for (int64_t r = 0; r < m; r += MR) {
            const float *xr = x + r * ldx;
            float *yr = y + r * n + nb * NB;
            switch (m - r < MR ? (int)(m - r) : MR) { /* each count its own unrolled copy */
            case 6: block(xr, ldx, 6, wb, k, bb, yr, n); break;
            case 5: block(xr, ldx, 5, wb, k, bb, yr, n); break;
            case 4: block(xr, ldx, 4, wb, k, bb, yr, n); break;
            case 3: block(xr, ldx, 3, wb, k, bb, yr, n); break;
            case 2: block(xr, ldx, 2, wb, k, bb, yr, n); break;
            default: block(xr, ldx, 1, wb, k, bb, yr, n); break;
            }
        }
    }
}

#else

int half_gemm_ready(void) { return -1; }
const char *kernel_kind(void) { return "none"; }
void half_gemm(const float *x, int64_t m, int64_t ldx, int64_t k, const uint16_t *w, int64_t n,
               const float *bias, float *y, int threads) {
    (void)x, (void)m, (void)ldx, (void)k, (void)w, (void)n, (void)bias, (void)y, (void)threads;
}

#endif
