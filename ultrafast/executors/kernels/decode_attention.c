/* Decode attention for the wide decode step (executors/decode_attention.py): one query token
 * per slot against that slot's bf16 K/V rows in the torch KV mirror, float32 throughout.
 *
 * Why not torch's SDPA: a decode step is B slots x kv_heads tiny problems ([group x dim]
 * queries against [len x dim] keys); the flash kernel packs every key block for a GEMM of 3
 * query rows and its per-problem overhead made attention a quarter of a 16-slot step at 200
 * positions. Here each (slot, kv head) task reads its K and V rows once, scores all `group`
 * query heads against each key row as it passes (grouped-query attention without expanding
 * K/V), and keeps an online softmax per query head. Memory-bound by design.
 *
 * Layouts: q float32 [batch, heads, dim] with row stride q_stride (elements); K and V bf16
 * [rows, kv_heads, capacity, dim] contiguous (the mirror's tensors); rows[b] the mirror row
 * of batch entry b, lens[b] how many positions it attends; out float32 [batch, heads, dim].
 * Query head j reads kv head j / group, as in Hugging Face's GQA.
 *
 * Returns 0, or -1 for a shape this file has no kernel for (dim other than 64 or 128, a group
 * over MAX_GROUP): the caller keeps SDPA.
 */

#define BLOCK 64      /* key rows scored before the softmax update and the V pass */
#define MAX_GROUP 16  /* query heads per kv head */

#include "vec_math.h"

#ifdef __AVX512F__
/* The K and V rows of the block after [t0, t0 + BLOCK) asked for now: at long context a step
 * reads them from DRAM (~12 MB a layer at 16 x 1,000), and the hardware prefetcher alone left
 * ~10% of the bandwidth unused. (The fp32 build below; the bf16 build asks for them two rows
 * at a time through its P.V loop instead.) */
static inline void prefetch_next_block(const uint16_t *k, const uint16_t *v, int64_t t0,
                                       int64_t len, const int dim) {
    const int64_t ahead = len - t0 - BLOCK < BLOCK ? len - t0 - BLOCK : BLOCK;
    for (int64_t i = 0; i < ahead * dim; i += 32) {
        _mm_prefetch((const char *)(k + (t0 + BLOCK) * dim + i), _MM_HINT_T0);
        _mm_prefetch((const char *)(v + (t0 + BLOCK) * dim + i), _MM_HINT_T0);
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)

/* The bf16 dot-product build (AVX512-BF16): the fp32 build below spent half its time on
 * arithmetic (a horizontal sum per key and query head, a widening per loaded row) and
 * read a 16-slot step's keys at ~13 GB/s where the machine streams ~22. Here the queries
 * (scaled to base 2) and the probabilities are rounded to bf16, as the AMX prefill kernel
 * and llama.cpp's f16 path round theirs, and each product pairs two bf16 values per float
 * lane (vdpbf16ps): K rows are read as they are, 16 keys' sums are reduced together, and
 * V rows are paired by key with one unpack per 32 values. */

/* lane i <- the sum of x[i]'s 16 lanes: a transpose-and-add tree over 16 vectors */
static inline __m512 sum16(const __m512 *x) {
    __m512 y[8], z[4], w[2];
    for (int i = 0; i < 8; i++)
        y[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]),
                             _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
    for (int j = 0; j < 4; j++) {
        const __m512d c = _mm512_castps_pd(y[2 * j]), d = _mm512_castps_pd(y[2 * j + 1]);
        z[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    }
    for (int k = 0; k < 2; k++)
        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * k], z[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(z[2 * k], z[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

static inline __mmask16 first_lanes(int n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}

/* scores (base 2) of keys [t0, t0 + n), n <= 16, for one query head: 16 lanes, -inf past n */
static inline __m512 scores16(const __m512bh *qb, const uint16_t *k, int64_t t0, int n,
                              const int dim) {
    __m512 d[16];
    if (n >= 16) { /* the common case, without a test per key: unrolled, in registers */
        for (int t = 0; t < 16; t++) {
            d[t] = _mm512_setzero_ps();
            for (int c = 0; c < dim / 32; c++)
                d[t] = _mm512_dpbf16_ps(
                    d[t], qb[c], as_bh(_mm512_loadu_si512(k + (t0 + t) * dim + 32 * c)));
        }
        return sum16(d);
    }
    for (int t = 0; t < 16; t++) {
        d[t] = _mm512_setzero_ps();
        if (t < n)
            for (int c = 0; c < dim / 32; c++)
                d[t] = _mm512_dpbf16_ps(
                    d[t], qb[c], as_bh(_mm512_loadu_si512(k + (t0 + t) * dim + 32 * c)));
    }
    return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), first_lanes(n), sum16(d));
}

static inline __attribute__((always_inline)) void attend(
    const float *q, int64_t q_stride, const uint16_t *k, const uint16_t *v, int64_t len,
    int group, float scale, float *out, const int dim) {
    const int qc = dim / 32, ac = dim / 16; /* bf16 query vectors, float accumulators */
    __m512bh qb[MAX_GROUP][4];
    __m512 acc[MAX_GROUP][8];
    float max[MAX_GROUP], sum[MAX_GROUP];
    float s[MAX_GROUP][BLOCK] __attribute__((aligned(64)));
    uint16_t p[MAX_GROUP][BLOCK] __attribute__((aligned(64)));
    const __m512 base2 = _mm512_set1_ps(scale * 1.44269504088896341f);
    for (int g = 0; g < group; g++) {
        max[g] = -INFINITY;
        sum[g] = 0.f;
        for (int c = 0; c < qc; c++) {
            const float *x = q + g * q_stride + 32 * c;
            qb[g][c] = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + 16), base2),
                                           _mm512_mul_ps(_mm512_loadu_ps(x), base2));
        }
        for (int c = 0; c < ac; c++) acc[g][c] = _mm512_setzero_ps();
    }
    for (int64_t t0 = 0; t0 < len; t0 += BLOCK) {
        const int n = len - t0 < BLOCK ? (int)(len - t0) : BLOCK;
        const int ahead = len - t0 - BLOCK < BLOCK ? (int)(len - t0 - BLOCK) : BLOCK;
        for (int g = 0; g < group; g++) {
            __m512 m = _mm512_set1_ps(max[g]);
            for (int b = 0; b < BLOCK; b += 16) {
                const __m512 x = b < n ? scores16(qb[g], k, t0 + b, n - b, dim)
                                       : _mm512_set1_ps(-INFINITY);
                _mm512_store_ps(s[g] + b, x);
                m = _mm512_max_ps(m, x);
            }
            const float top = _mm512_reduce_max_ps(m);
            const float alpha = exp2f(max[g] - top); /* the first block: e^-inf = 0 */
            const __m512 shift = _mm512_set1_ps(top);
            __m512 total = _mm512_setzero_ps();
            for (int b = 0; b < BLOCK; b += 16) {
                /* -inf past the keys: 2^-126 from the polynomial, masked to 0 */
                const __mmask16 live = first_lanes(n - b);
                const __m512 e = _mm512_maskz_mov_ps(
                    live, exp2_poly(_mm512_sub_ps(_mm512_load_ps(s[g] + b), shift), 4));
                total = _mm512_add_ps(total, e);
                _mm256_store_si256((__m256i *)(p[g] + b), (__m256i)_mm512_cvtneps_pbh(e));
            }
            sum[g] = sum[g] * alpha + _mm512_reduce_add_ps(total);
            max[g] = top;
            const __m512 a = _mm512_set1_ps(alpha);
            for (int c = 0; c < ac; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], a);
        }
        for (int t = 0; t < n; t += 2) {
            /* the next block's rows t and t + 1 asked for now, spread over this loop: asked for
             * all at once at the block's start (prefetch_next_block), 16 slots' attention at
             * 1,100 positions read its 405 MB a step at 17.8 GB/s, spread at 20.5 (two threads
             * stream ~24 here); two blocks ahead was slower (model-167 Xeon) */
            if (t < ahead) {
                const char *nk = (const char *)(k + (t0 + BLOCK + t) * dim);
                const char *nv = (const char *)(v + (t0 + BLOCK + t) * dim);
                for (int b = 0; b < 4 * dim; b += 64) {
                    _mm_prefetch(nk + b, _MM_HINT_T0);
                    _mm_prefetch(nv + b, _MM_HINT_T0);
                }
            }
            /* keys t and t + 1 paired per value (a missing t + 1 reads as zeros, weight 0):
             * unpacklo / unpackhi of 32 values give dims {0-3, 8-11, 16-19, 24-27} and
             * {4-7, ...} of the 32, reordered once at the end */
            __m512i pair[8];
            for (int c = 0; c < qc; c++) {
                const __m512i a = _mm512_loadu_si512(v + (t0 + t) * dim + 32 * c);
                const __m512i b = t + 1 < n ? _mm512_loadu_si512(v + (t0 + t + 1) * dim + 32 * c)
                                            : _mm512_setzero_si512();
                pair[2 * c] = _mm512_unpacklo_epi16(a, b);
                pair[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
            }
            for (int g = 0; g < group; g++) {
                const __m512bh w = as_bh(_mm512_set1_epi32(*(const int32_t *)(p[g] + t)));
                for (int c = 0; c < ac; c++)
                    acc[g][c] = _mm512_dpbf16_ps(acc[g][c], w, as_bh(pair[c]));
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const float inv = 1.f / sum[g];
        float lanes[16] __attribute__((aligned(64)));
        for (int c = 0; c < ac; c++) {
            _mm512_store_ps(lanes, acc[g][c]);
            const int base = 32 * (c / 2) + 4 * (c % 2);
            for (int j = 0; j < 16; j++) out[g * dim + base + 8 * (j / 4) + j % 4] = lanes[j] * inv;
        }
    }
}
#define KERNEL_KIND "avx512-bf16"

#elif defined(__AVX512F__)

/* s[0, n) <- e^(s - max); returns their sum */
static inline float exp_block(float *s, int n, float max) {
    const __m512 m = _mm512_set1_ps(max);
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < n; t += 16) {
        const __mmask16 k = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(
            k, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m)));
        _mm512_mask_storeu_ps(s + t, k, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

static inline __attribute__((always_inline)) void attend(
    const float *q, int64_t q_stride, const uint16_t *k, const uint16_t *v, int64_t len,
    int group, float scale, float *out, const int dim) {
    const int chunks = dim / 16;
    __m512 qs[MAX_GROUP][8], acc[MAX_GROUP][8];
    float max[MAX_GROUP], sum[MAX_GROUP], s[MAX_GROUP][BLOCK];
    for (int g = 0; g < group; g++) {
        max[g] = -INFINITY;
        sum[g] = 0.f;
        for (int c = 0; c < chunks; c++) {
            qs[g][c] = _mm512_mul_ps(_mm512_loadu_ps(q + g * q_stride + 16 * c),
                                     _mm512_set1_ps(scale));
            acc[g][c] = _mm512_setzero_ps();
        }
    }
    for (int64_t t0 = 0; t0 < len; t0 += BLOCK) {
        const int n = len - t0 < BLOCK ? (int)(len - t0) : BLOCK;
        prefetch_next_block(k, v, t0, len, dim);
        for (int t = 0; t < n; t++) {
            __m512 kf[8];
            for (int c = 0; c < chunks; c++) kf[c] = load_bf16x16(k + (t0 + t) * dim + 16 * c, 0xFFFF);
            for (int g = 0; g < group; g++) {
                __m512 d = _mm512_mul_ps(qs[g][0], kf[0]);
                for (int c = 1; c < chunks; c++) d = _mm512_fmadd_ps(qs[g][c], kf[c], d);
                s[g][t] = _mm512_reduce_add_ps(d);
            }
        }
        for (int g = 0; g < group; g++) {
            float m = max[g];
            for (int t = 0; t < n; t++) m = s[g][t] > m ? s[g][t] : m;
            const float rescale = expf(max[g] - m);
            const __m512 r = _mm512_set1_ps(rescale);
            for (int c = 0; c < chunks; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], r);
            sum[g] = sum[g] * rescale + exp_block(s[g], n, m);
            max[g] = m;
        }
        for (int t = 0; t < n; t++) {
            __m512 vf[8];
            for (int c = 0; c < chunks; c++) vf[c] = load_bf16x16(v + (t0 + t) * dim + 16 * c, 0xFFFF);
            for (int g = 0; g < group; g++) {
                const __m512 p = _mm512_set1_ps(s[g][t]);
                for (int c = 0; c < chunks; c++) acc[g][c] = _mm512_fmadd_ps(p, vf[c], acc[g][c]);
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const __m512 inv = _mm512_set1_ps(1.f / sum[g]);
        for (int c = 0; c < chunks; c++)
            _mm512_storeu_ps(out + g * dim + 16 * c, _mm512_mul_ps(acc[g][c], inv));
    }
}
#define KERNEL_KIND "avx512"

#else /* portable C: the compiler vectorizes the dim loops for the CPU it targets */

static inline __attribute__((always_inline)) void attend(
    const float *q, int64_t q_stride, const uint16_t *k, const uint16_t *v, int64_t len,
    int group, float scale, float *out, const int dim) {
    float qs[MAX_GROUP][128], acc[MAX_GROUP][128], row[128];
    float max[MAX_GROUP], sum[MAX_GROUP], s[MAX_GROUP][BLOCK];
    for (int g = 0; g < group; g++) {
        max[g] = -INFINITY;
        sum[g] = 0.f;
        for (int d = 0; d < dim; d++) {
            qs[g][d] = q[g * q_stride + d] * scale;
            acc[g][d] = 0.f;
        }
    }
    for (int64_t t0 = 0; t0 < len; t0 += BLOCK) {
        const int n = len - t0 < BLOCK ? (int)(len - t0) : BLOCK;
        for (int t = 0; t < n; t++) {
            for (int d = 0; d < dim; d++) row[d] = bf16_to_float(k[(t0 + t) * dim + d]);
            for (int g = 0; g < group; g++) {
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < dim; d++) dot += qs[g][d] * row[d];
                s[g][t] = dot;
            }
        }
        for (int g = 0; g < group; g++) {
            float m = max[g];
            for (int t = 0; t < n; t++) m = s[g][t] > m ? s[g][t] : m;
            const float rescale = expf(max[g] - m);
            for (int d = 0; d < dim; d++) acc[g][d] *= rescale;
            float total = 0.f;
            for (int t = 0; t < n; t++) {
                s[g][t] = expf(s[g][t] - m);
                total += s[g][t];
            }
            sum[g] = sum[g] * rescale + total;
            max[g] = m;
        }
        for (int t = 0; t < n; t++) {
            for (int d = 0; d < dim; d++) row[d] = bf16_to_float(v[(t0 + t) * dim + d]);
            for (int g = 0; g < group; g++)
                for (int d = 0; d < dim; d++) acc[g][d] += s[g][t] * row[d];
        }
    }
    for (int g = 0; g < group; g++)
        for (int d = 0; d < dim; d++) out[g * dim + d] = acc[g][d] / sum[g];
}
#define KERNEL_KIND "portable"
#endif

static void attend64(const float *q, int64_t qs, const uint16_t *k, const uint16_t *v,
                     int64_t len, int group, float scale, float *out) {
    attend(q, qs, k, v, len, group, scale, out, 64);
}

static void attend128(const float *q, int64_t qs, const uint16_t *k, const uint16_t *v,
                      int64_t len, int group, float scale, float *out) {
    attend(q, qs, k, v, len, group, scale, out, 128);
}

const char *kernel_kind(void) { return KERNEL_KIND; }

int decode_attention(const float *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                     const int64_t *rows, const int64_t *lens, int batch, int heads,
                     int kv_heads, int dim, int64_t capacity, float scale, int threads,
                     float *out) {
    const int group = heads / kv_heads;
    if ((dim != 64 && dim != 128) || group > MAX_GROUP || group * kv_heads != heads) return -1;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)
    for (int b = 0; b < batch; b++) {
        for (int h = 0; h < kv_heads; h++) {
            const int64_t kv = (rows[b] * kv_heads + h) * capacity * dim;
            const float *qb = q + b * q_stride + (int64_t)h * group * dim;
            float *ob = out + ((int64_t)b * heads + (int64_t)h * group) * dim;
            if (dim == 64)
                attend64(qb, dim, k + kv, v + kv, lens[b], group, scale, ob);
            else
                attend128(qb, dim, k + kv, v + kv, lens[b], group, scale, ob);
        }
    }
    return 0;
}
