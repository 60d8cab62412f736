/* Products of a few rows (a wide decode step's) on AMX tiles, reading the weight where oneDNN
 * packed it (executors/tile_gemm.py): out = bf16(x @ W.T), x bf16 [m <= 16, k], W [n, k].
 *
 * Why: at 16 rows a product is a stream of its weight (a decode step's 30 layers read 212 MB
 * of SmolLM2's), and oneDNN's kernel streamed it at ~14 GB/s from the L3 on the 2-core AMX
 * Xeon. Here one A tile holds all the rows of 32 inputs, and every weight tile is loaded once,
 * multiplied once and the next blocks prefetched ahead of use.
 *
 * The weight layout is oneDNN's blocked `AB16b{nb}a2b` (what mkldnn's _reorder_linear_weight
 * gives for bf16 on AMX: nb = 32 for a 16-row hint, 64 for a 1-row one): blocks of nb outputs
 * x 32 inputs, output blocks outer, input blocks inner, and inside a block [input / 2][output]
 * [input % 2] -- rows of an AMX B tile, 16 outputs a tile, nb * 4 bytes apart. The caller
 * checks that layout (tile_gemm.py) before it uses this file.
 *
 * Returns 0; -1 without an AMX build, -2 for a shape it does not take, -3 when the kernel does
 * not grant this process the tile state.
 */
#include <string.h>

#include "vec_math.h"

#define KB 32       /* inputs per block: one A tile's 64 bytes a row */
#define MAX_ROWS 16 /* rows of x: one A tile */
#define AHEAD 4     /* weight blocks prefetched ahead of the one multiplied (2-16 timed: 4) */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "amx_tiles.h"

const char *kernel_kind(void) { return "amx"; }

int tile_gemm_ready(void) { return amx_granted(); }

/* tile 0: A (m rows); 1-2: B (16 rows); 4-7: results (m rows); every row 64 bytes */
static void configure(int m) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = (uint8_t)m;
    c.rows[1] = c.rows[2] = 16;
    for (int i = 4; i < 8; i++) c.rows[i] = (uint8_t)m;
    for (int i = 0; i < 8; i++) c.colsb[i] = i == 3 ? 0 : 64;
    _tile_loadconfig(&c);
}

static inline void prefetch_block(const uint16_t *block, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch((const char *)block + off, _MM_HINT_T0);
}

/* results (m x 16 floats each, in `acc`) rounded to bf16 into out's columns [0, 16 * tiles) */
static void store_rows(const float *acc, int tiles, int m, uint16_t *out, int64_t out_stride) {
    for (int t = 0; t < tiles; t++)
        for (int r = 0; r < m; r++) {
            const __m512 v = _mm512_loadu_ps(acc + (t * MAX_ROWS + r) * 16);
            _mm256_storeu_si256((__m256i *)(out + r * out_stride + 16 * t),
                                (__m256i)_mm512_cvtneps_pbh(v));
        }
}

/* one output block: nb outputs over every input block */
static void output_block(const uint16_t *x, int64_t x_stride, const uint16_t *w, int64_t kblocks,
                         int nb, int m, uint16_t *out, int64_t out_stride) {
    const int64_t block = (int64_t)nb * KB, row_bytes = (int64_t)nb * 4;
    float acc[4 * MAX_ROWS * 16];
    _tile_zero(4);
    _tile_zero(5);
    if (nb == 64) {
        _tile_zero(6);
        _tile_zero(7);
    }
    for (int64_t kb = 0; kb < kblocks; kb++) {
        const uint16_t *b = w + kb * block;
        prefetch_block(b + AHEAD * block, block * 2); /* past the end: a no-op */
        _tile_loadd(0, x + kb * KB, x_stride * 2);
        _tile_loadd(1, b, row_bytes);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(2, b + 32, row_bytes);
        _tile_dpbf16ps(5, 0, 2);
        if (nb == 64) {
            _tile_loadd(1, b + 64, row_bytes);
            _tile_dpbf16ps(6, 0, 1);
            _tile_loadd(2, b + 96, row_bytes);
            _tile_dpbf16ps(7, 0, 2);
        }
    }
    _tile_stored(4, acc, 64);
    _tile_stored(5, acc + MAX_ROWS * 16, 64);
    if (nb == 64) {
        _tile_stored(6, acc + 2 * MAX_ROWS * 16, 64);
        _tile_stored(7, acc + 3 * MAX_ROWS * 16, 64);
    }
    store_rows(acc, nb / 16, m, out, out_stride);
}

/* x bf16 [m, k] rows x_stride apart; w in AB16b{nb}a2b for [n, k]; out bf16 [m, n] rows
 * out_stride apart. Output blocks split over `threads` in contiguous runs (each thread
 * streams its own part of the weight). */
int tile_gemm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, int64_t n, int64_t k,
                   int nb, uint16_t *out, int64_t out_stride, int m, int threads) {
    if ((nb != 32 && nb != 64) || m < 1 || m > MAX_ROWS || n % nb || k % KB) return -2;
    const int64_t kblocks = k / KB, nblocks = n / nb;
#pragma omp parallel num_threads(threads)
    {
        configure(m);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < nblocks; i++)
            output_block(x, x_stride, w + i * kblocks * nb * KB, kblocks, nb, m, out + i * nb,
                         out_stride);
    }
    return 0;
}

#else

const char *kernel_kind(void) { return "none"; }
int tile_gemm_ready(void) { return -1; }
int tile_gemm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, int64_t n, int64_t k,
                   int nb, uint16_t *out, int64_t out_stride, int m, int threads) {
    (void)x, (void)x_stride, (void)w, (void)n, (void)k, (void)nb, (void)out, (void)out_stride;
    (void)m, (void)threads;
    return -1;
}

#endif
