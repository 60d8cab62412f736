/* Prefill attention on AMX tiles (executors/prefill_attention.py): one sequence's T new
 * queries over its `total` keys (the last T its own), causal, grouped-query, bf16 in and out,
 * float32 scores and softmax.
 *
 * Why: torch's fused CPU attention spent 36-40% of a 512-token pass after 488 positions on
 * this shape (9 query / 3 KV heads of 64) at ~200-400 GFLOP/s, while a bf16 GEMM reaches
 * ~1,200 on the same AMX cores: its softmax runs several passes over each score block. Here
 * each task is 16 query rows of one head: per block of 64 keys, 8 tile products give the
 * scores, one pass in registers scales, masks, exponentiates (2^x), sums and rounds them to
 * bf16, and 8 more tile products add P.V onto the float accumulator, loaded into the
 * tiles; an online softmax whose max moves lazily (LAZY_MAX) rescales the accumulator only
 * in the blocks where a row's max moved (a pass over the accumulator in every block: 3-8%
 * of the kernel at 1,024 queries over 1,024-2,048 keys, model-167 Xeon).
 * K and V are first packed per KV head into the tiles' pair-interleaved (VNNI) layout, once
 * per call, read by every query head of the group.
 *
 * Layouts (strides in elements): q bf16 [T, heads, 64] rows q_stride apart, each row's heads
 * contiguous; k, v bf16 [kv_heads, total, 64] with a head and a row stride each, each row's
 * dims contiguous; out bf16 [T, heads * 64] contiguous. Query i (position total - T + i)
 * sees keys [0, total - T + i]; query head j reads KV head j / (heads / kv_heads).
 *
 * Returns 0; -1 without an AMX build (the caller keeps SDPA), -2 for a head size other
 * than 64, -3 when the kernel does not grant this process the tile state, -4 out of memory.
 */
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

#define DIM 64     /* the head size this file has tiles for */
#define QROWS 16   /* query rows per task: one tile's rows */
#define KBLOCK 64  /* keys per softmax block: four 16-key score tiles */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "amx_tiles.h"

const char *kernel_kind(void) { return "amx"; }

int prefill_attention_ready(void) { return amx_granted(); }

/* eight tiles of 16 rows x 64 bytes: 0-3 results, 4-5 the A operand, 6-7 the B operand */
static void configure_tiles(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    _tile_loadconfig(&c);
}

/* r[c][n] <- r[n][c] for a 16 x 16 block of 32-bit values: unpacks, then 128-bit lane moves */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
    }
}

/* K of one KV head as B tiles of Q.K^T: per 16 keys and dim half, tile row r holds dims
 * (2r, 2r+1) of the half for each of the 16 keys (a 16 x 16 transpose of dim pairs, in
 * registers: the scalar copy it replaced cost ~8 ms of a 498-token pass after 512 positions).
 * Keys past `total` are zero (masked later). */
static void pack_keys(const uint16_t *k, int64_t row_stride, int64_t total, int64_t blocks,
                      uint32_t *out) {
    for (int64_t b = 0; b < blocks; b++) {
        for (int half = 0; half < 2; half++) {
            __m512i r[16];
            for (int n = 0; n < 16; n++) {
                const int64_t key = 16 * b + n;
                r[n] = key < total ? _mm512_loadu_si512(k + key * row_stride + 32 * half)
                                   : _mm512_setzero_si512();
            }
            transpose16(r);
            uint32_t *tile = out + (2 * b + half) * 256;
            for (int i = 0; i < 16; i++) _mm512_store_si512(tile + 16 * i, r[i]);
        }
    }
}

/* V of one KV head as B tiles of P.V: per 32 keys and 16 dims, tile row r holds keys
 * (2r, 2r+1) interleaved for each of the 16 dims (one two-source permute per 16 dims). */
static void pack_values(const uint16_t *v, int64_t row_stride, int64_t total, int64_t blocks,
                        uint16_t *out) {
    int16_t lo[32], hi[32];
    for (int d = 0; d < 16; d++) {
        lo[2 * d] = (int16_t)d, lo[2 * d + 1] = (int16_t)(32 + d);
        hi[2 * d] = (int16_t)(16 + d), hi[2 * d + 1] = (int16_t)(48 + d);
    }
    const __m512i first16 = _mm512_loadu_si512(lo), second16 = _mm512_loadu_si512(hi);
    for (int64_t c = 0; c < blocks; c++) {
        for (int r = 0; r < 16; r++) {
            __m512i rows[2][2]; /* key (2r, 2r + 1) x dims (0-31, 32-63) */
            for (int e = 0; e < 2; e++) {
                const int64_t key = 32 * c + 2 * r + e;
                for (int h = 0; h < 2; h++)
                    rows[e][h] = key < total ? _mm512_loadu_si512(v + key * row_stride + 32 * h)
                                             : _mm512_setzero_si512();
            }
            for (int n = 0; n < 4; n++) {
                const __m512i pick = n % 2 ? second16 : first16;
                _mm512_store_si512(out + (4 * c + n) * 512 + r * 32,
                                   _mm512_permutex2var_epi16(rows[0][n / 2], pick, rows[1][n / 2]));
            }
        }
    }
}

static inline __mmask16 first(int n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}

/* the probabilities are rounded to bf16 (8 significant bits): a degree-4 exp2 (relative
 * error < 5e-5, a fortieth of a bf16 step) saves three FMAs on the kernel's busiest line;
 * the row sums take these float values */
static inline __m512 exp2_for_bf16(__m512 t) { return exp2_poly(t, 4); }

/* A row's running max moves only when a block's max passes it by more than this (base 2):
 * its probabilities are then at most 2^LAZY_MAX (bf16 and the float sums hold them as
 * exactly, relative to size, as values <= 1), and in most blocks no row's max moves, so the
 * accumulator needs no rescaling and the P.V products add onto it in the tiles. */
#define LAZY_MAX 8.0f

/* One block's scores (s: 16 rows x 64 floats) to bf16 probabilities (p) for rows [0, m):
 * keys from seen[r] on masked (seen[] grows with r: row 0 seeing all 64 means every row
 * does, the common case, taken without masks). Updates the rows' running max (16 lanes,
 * base 2: the scores times `scale`; lazily, LAZY_MAX) and their sums (16 lanes a row,
 * reduced once at the end); writes the factors that rescale each row's accumulator to
 * `alpha` (1 where the max stayed) and returns whether any row's max moved. */
static inline int softmax_block(const float *s, const int *seen, int m, float scale,
                                __m512 *max, float *row_sums, uint16_t *p, float *alpha) {
    float block_max[16] __attribute__((aligned(64)));
    const __m512 none = _mm512_set1_ps(-INFINITY);
    const int full = seen[0] >= KBLOCK;
    for (int r = 0; r < 16; r++) {
        const float *x = s + r * KBLOCK;
        __m512 mx = none;
        if (r < m && full) {
            mx = _mm512_max_ps(_mm512_max_ps(_mm512_load_ps(x), _mm512_load_ps(x + 16)),
                               _mm512_max_ps(_mm512_load_ps(x + 32), _mm512_load_ps(x + 48)));
        } else {
            for (int c = 0; r < m && c < 4; c++)
                mx = _mm512_mask_max_ps(mx, first(seen[r] - 16 * c), mx, _mm512_load_ps(x + 16 * c));
        }
        block_max[r] = _mm512_reduce_max_ps(mx) * scale; /* scale > 0: the max commutes */
    }
    /* a row that sees nothing of the block keeps its max (-inf never passes it) */
    const __m512 seen_max = _mm512_load_ps(block_max);
    const __mmask16 moved = _mm512_cmp_ps_mask(
        seen_max, _mm512_add_ps(*max, _mm512_set1_ps(LAZY_MAX)), _CMP_GT_OQ);
    const __m512 next = _mm512_mask_mov_ps(*max, moved, seen_max);
    /* the first block: 2^-inf = 0 */
    _mm512_store_ps(alpha, _mm512_mask_mov_ps(_mm512_set1_ps(1.f), moved,
                                              exp2_nonpositive(_mm512_sub_ps(*max, next))));
    _mm512_store_ps(block_max, next);
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < m; r++) {
        const __m512 shift = _mm512_set1_ps(block_max[r]);
        float *sums = row_sums + 16 * r;
        __m512 total = _mm512_mul_ps(_mm512_load_ps(sums), _mm512_set1_ps(alpha[r]));
        for (int c = 0; c < 4; c++) {
            const __m512 x = _mm512_fmsub_ps(_mm512_load_ps(s + r * KBLOCK + 16 * c), sc, shift);
            __m512 e = exp2_for_bf16(x);
            if (!full) e = _mm512_maskz_mov_ps(first(seen[r] - 16 * c), e);
            total = _mm512_add_ps(total, e);
            _mm256_store_si256((__m256i *)(p + r * KBLOCK + 16 * c), (__m256i)_mm512_cvtneps_pbh(e));
        }
        _mm512_store_ps(sums, total);
    }
    *max = next;
    return moved != 0;
}

#define SCORES(j)                                                     \
    do {                                                              \
        const uint32_t *t = kp + (2 * (kb / 16 + (j))) * 256;         \
        _tile_zero(j);                                                \
        _tile_loadd(6, t, 64);                                        \
        _tile_dpbf16ps(j, 4, 6);                                      \
        _tile_loadd(7, t + 256, 64);                                  \
        _tile_dpbf16ps(j, 5, 7);                                      \
    } while (0)

/* result tiles 0-3 to four 16-float column blocks of a row-major float buffer */
#define STORE_RESULTS(base, row_bytes)                                \
    do {                                                              \
        _tile_stored(0, (base), (row_bytes));                         \
        _tile_stored(1, (base) + 16, (row_bytes));                    \
        _tile_stored(2, (base) + 32, (row_bytes));                    \
        _tile_stored(3, (base) + 48, (row_bytes));                    \
    } while (0)

/* P.V of the block's keys added onto the accumulator's column block n (in the tiles) */
#define VALUES(n)                                                     \
    do {                                                              \
        _tile_loadd(n, acc + 16 * (n), 4 * DIM);                      \
        _tile_loadd(6, vt + (n) * 512, 64);                           \
        _tile_dpbf16ps(n, 4, 6);                                      \
        _tile_loadd(7, vt + 2048 + (n) * 512, 64);                    \
        _tile_dpbf16ps(n, 5, 7);                                      \
    } while (0)

/* rows [i0, i0 + m) of query head `head` over the keys they see */
static void attend_rows(const uint16_t *q, int64_t q_stride, int head, int64_t i0, int m,
                        int64_t earlier, const uint32_t *kp, const uint16_t *vp, float scale,
                        uint16_t *out, int64_t out_stride) {
    float s[QROWS * KBLOCK] __attribute__((aligned(64)));
    float acc[QROWS * DIM] __attribute__((aligned(64)));
    uint16_t qb[QROWS * DIM] __attribute__((aligned(64)));
    uint16_t pb[QROWS * KBLOCK] __attribute__((aligned(64)));
    float alpha[QROWS] __attribute__((aligned(64)));
    float sums[QROWS * 16] __attribute__((aligned(64))); /* each row's sum in 16 lanes */
    int seen[QROWS];
    memset(qb, 0, sizeof qb);
    memset(pb, 0, sizeof pb);
    memset(acc, 0, sizeof acc);
    for (int r = 0; r < m; r++)
        memcpy(qb + r * DIM, q + (i0 + r) * q_stride + head * DIM, DIM * sizeof(uint16_t));
    /* rows past m: max 0 (not -inf: their alpha stays finite), never read */
    __m512 max = _mm512_mask_mov_ps(_mm512_setzero_ps(), first(m), _mm512_set1_ps(-INFINITY));
    memset(sums, 0, sizeof sums);
    const int64_t end = earlier + i0 + m; /* keys [0, end) are seen by some row */
    for (int64_t kb = 0; kb < end; kb += KBLOCK) {
        _tile_loadd(4, qb, 2 * DIM);
        _tile_loadd(5, qb + 32, 2 * DIM);
        SCORES(0);
        SCORES(1);
        SCORES(2);
        SCORES(3);
        STORE_RESULTS(s, 4 * KBLOCK);
        for (int r = 0; r < m; r++) {
            const int64_t n = earlier + i0 + r + 1 - kb; /* keys of this block row r sees */
            seen[r] = n >= KBLOCK ? KBLOCK : n <= 0 ? 0 : (int)n;
        }
        if (softmax_block(s, seen, m, scale, &max, sums, pb, alpha))
            for (int r = 0; r < m; r++) { /* a row's max moved: its accumulator rescaled */
                const __m512 a = _mm512_set1_ps(alpha[r]);
                for (int c = 0; c < DIM; c += 16)
                    _mm512_store_ps(acc + r * DIM + c, _mm512_mul_ps(_mm512_load_ps(acc + r * DIM + c), a));
            }
        const uint16_t *vt = vp + (kb / 32) * 4 * 512;
        _tile_loadd(4, pb, 2 * KBLOCK);
        _tile_loadd(5, pb + 32, 2 * KBLOCK);
        VALUES(0);
        VALUES(1);
        VALUES(2);
        VALUES(3);
        STORE_RESULTS(acc, 4 * DIM);
    }
    for (int r = 0; r < m; r++) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(sums + 16 * r)));
        uint16_t *row = out + (i0 + r) * out_stride + head * DIM;
        for (int c = 0; c < DIM; c += 16) {
            const __m512 x = _mm512_mul_ps(_mm512_load_ps(acc + r * DIM + c), inv);
            _mm256_storeu_si256((__m256i *)(row + c), (__m256i)_mm512_cvtneps_pbh(x));
        }
    }
}

/* The packed K and V of a call, kept per calling thread and grown by need: a fresh buffer
 * per call (~0.8 MB at 1,010 positions) was mapped and paged in anew each time, ~0.25 ms a
 * layer, a quarter of the kernel's time on a 498-token chunk after 512 positions. */
static __thread void *packed;
static __thread size_t packed_bytes;

static void *packed_buffer(size_t bytes) {
    if (bytes > packed_bytes) {
        free(packed);
        packed = aligned_alloc(64, bytes); /* bytes: a multiple of 64 (whole key blocks) */
        packed_bytes = packed != NULL ? bytes : 0;
    }
    return packed;
}

int prefill_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                      int64_t k_head_stride, int64_t k_row_stride, const uint16_t *v,
                      int64_t v_head_stride, int64_t v_row_stride, int64_t total, int64_t t,
                      int heads, int kv_heads, int dim, float scale, int threads,
                      uint16_t *out) {
    if (dim != DIM) return -2;
    const int64_t padded = (total + KBLOCK - 1) / KBLOCK * KBLOCK;
    const int64_t per_head = padded * DIM; /* bf16 elements of one KV head's K (or V) */
    const size_t bytes = (size_t)(kv_heads * per_head) * sizeof(uint16_t); /* K's, V's */
    uint32_t *kp = packed_buffer(2 * bytes);
    if (kp == NULL) return -4;
    uint16_t *vp = (uint16_t *)((char *)kp + bytes);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int h = 0; h < 2 * kv_heads; h++) {
        if (h < kv_heads)
            pack_keys(k + h * k_head_stride, k_row_stride, total, padded / 16,
                      kp + h * per_head / 2);
        else
            pack_values(v + (h - kv_heads) * v_head_stride, v_row_stride, total, padded / 32,
                        vp + (h - kv_heads) * per_head);
    }
    const int group = heads / kv_heads;
    const int64_t blocks = (t + QROWS - 1) / QROWS;
    const int64_t tasks = blocks * heads;
    const float scale2 = scale * 1.44269504088896341f; /* e^x as 2^(x log2 e) */
#pragma omp parallel num_threads(threads)
    {
        configure_tiles();
        /* the last query blocks see the most keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t block = blocks - 1 - task / heads;
            const int head = (int)(task % heads), kv = head / group;
            const int64_t i0 = block * QROWS;
            const int m = (int)(t - i0 < QROWS ? t - i0 : QROWS);
            attend_rows(q, q_stride, head, i0, m, total - t, kp + kv * per_head / 2,
                        vp + kv * per_head, scale2, out, (int64_t)heads * DIM);
        }
        _tile_release();
    }
    return 0;
}

#else /* no AMX in this build: the caller keeps torch's SDPA */

const char *kernel_kind(void) { return "none"; }

int prefill_attention_ready(void) { return -1; }

int prefill_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                      int64_t k_head_stride, int64_t k_row_stride, const uint16_t *v,
                      int64_t v_head_stride, int64_t v_row_stride, int64_t total, int64_t t,
                      int heads, int kv_heads, int dim, float scale, int threads,
                      uint16_t *out) {
    (void)q, (void)q_stride, (void)k, (void)k_head_stride, (void)k_row_stride, (void)v;
    (void)v_head_stride, (void)v_row_stride, (void)total, (void)t, (void)heads;
    (void)kv_heads, (void)dim, (void)scale, (void)threads, (void)out;
    return -1;
}

#endif
