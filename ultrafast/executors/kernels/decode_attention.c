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
        /* the next block's K and V rows asked for now: at long context the step reads them
         * from DRAM (~12 MB a layer at 16 x 1,000), and the hardware prefetcher alone left
         * ~10% of the bandwidth unused */
        const int64_t ahead = len - t0 - BLOCK < BLOCK ? len - t0 - BLOCK : BLOCK;
        for (int64_t i = 0; i < ahead * dim; i += 32) {
            _mm_prefetch((const char *)(k + (t0 + BLOCK) * dim + i), _MM_HINT_T0);
            _mm_prefetch((const char *)(v + (t0 + BLOCK) * dim + i), _MM_HINT_T0);
        }
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
