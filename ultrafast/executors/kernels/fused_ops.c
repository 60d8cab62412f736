/* Fused elementwise steps of the wide passes (executors/fused_ops.py), each one pass over its
 * rows where torch runs three to six ops (and as many parallel regions, temporaries and
 * dtype copies):
 *
 *   rms_norm_bf16  out = bf16(x * rsqrt(mean(x^2) + eps) * w)       x float32, w float32
 *   add_rms_norm_bf16  x += y (bf16 rows, the residual's next branch), then rms_norm_bf16
 *                  of the sum: the same numbers as torch's add_ then the norm, one pass
 *   rope_f32       q|k heads of a bf16 projection, RoPE'd, as float32 (HF "halves" layout:
 *                  x_i pairs with x_{i + d/2}; cos/sin rows [rows, d], their halves equal)
 *   silu_mul_bf16  out = bf16(silu(gate) * up)                       gate|up bf16 [rows, 2n]
 *   rope_store_bf16  rope_f32's math rounded to bf16: the q heads to a contiguous output,
 *                  the k heads and the v heads (copied) into per-head destinations (the KV
 *                  mirror's rows), so a prefill chunk's attention reads them with no copy
 *
 * Layouts: every row may have its own stride (elements); outputs are contiguous. Work splits
 * over rows with OpenMP (torch's libgomp, same soname: one thread pool) when a call is big
 * enough to pay for a parallel region, else it runs on the calling thread.
 * bf16 rounding is to nearest even, NaN kept NaN (as torch's .to(torch.bfloat16)).
 */
#include <string.h>

#include "vec_math.h"

#define GRAIN 32768 /* elements below which a call runs on one thread (torch's grain size) */

static inline uint16_t float_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if (isnan(f)) return (uint16_t)((v.u >> 16) | 0x40); /* quiet, sign kept */
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 floats to bf16, nearest even, NaN kept NaN */
static inline __m256i to_bf16x16(__m512 f) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(f);
#else
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
#endif
}

static inline void store_bf16x16(uint16_t *p, __mmask16 k, __m512 f) {
    _mm256_mask_storeu_epi16(p, k, to_bf16x16(f));
}

static inline __mmask16 tail(int64_t n, int64_t i) {
    return n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
}

/* silu(g) = g * sigmoid(g), sigmoid from e = e^-|g| <= 1: 1/(1+e) for g >= 0, e/(1+e) below.
 * 1/(1+e) as the 14-bit reciprocal refined by one Newton step (to float rounding, as exact as
 * the division for a bf16 result, so its rounding stays correct at near-ties): a 512 x 1,536
 * call 0.27 -> 0.165 ms (2 threads, AMX Xeon), ~2.5% of a 512-token prefill pass. */
static inline __m512 silu16(__m512 g) {
    const __m512 e = exp2_poly(_mm512_mul_ps(_mm512_abs_ps(g), _mm512_set1_ps(-1.44269504f)), 7);
    const __m512 d = _mm512_add_ps(e, _mm512_set1_ps(1.f));
    const __m512 r = _mm512_rcp14_ps(d);
    const __m512 inv = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.f)), r);
    const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sig = _mm512_mask_mul_ps(inv, neg, inv, e);
    return _mm512_mul_ps(g, sig);
}

static void norm_row(const float *x, const float *w, uint16_t *out, int64_t dim, float eps) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(tail(dim, i), x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps);
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < dim; i += 16) {
        const __mmask16 k = tail(dim, i);
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), s);
        store_bf16x16(out + i, k, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(k, w + i)));
    }
}

static void add_norm_row(float *x, const uint16_t *y, const float *w, uint16_t *out, int64_t dim,
                         float eps) {
    for (int64_t i = 0; i < dim; i += 16) {
        const __mmask16 k = tail(dim, i);
        const __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(k, x + i), load_bf16x16(y + i, k));
        _mm512_mask_storeu_ps(x + i, k, v);
    }
    norm_row(x, w, out, dim, eps); /* the row is in L1 now */
}

static void silu_mul_row(const uint16_t *h, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail(n, i);
        const __m512 g = load_bf16x16(h + i, k), u = load_bf16x16(h + n + i, k);
        store_bf16x16(out + i, k, _mm512_mul_ps(silu16(g), u));
    }
}

/* one head of x turned by RoPE (HF halves: x_i pairs with x_{i+d/2}) into out, float32 or
 * (as_bf16) bf16 */
static void rope_head(const uint16_t *x, const float *c, const float *s, void *out, int64_t d,
                      int as_bf16) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 k = tail(half, i);
        const __m512 a = load_bf16x16(x + i, k), b = load_bf16x16(x + half + i, k);
        const __m512 lo = _mm512_fmsub_ps(a, _mm512_maskz_loadu_ps(k, c + i),
                                          _mm512_mul_ps(b, _mm512_maskz_loadu_ps(k, s + i)));
        const __m512 hi = _mm512_fmadd_ps(b, _mm512_maskz_loadu_ps(k, c + half + i),
                                          _mm512_mul_ps(a, _mm512_maskz_loadu_ps(k, s + half + i)));
        if (as_bf16) {
            store_bf16x16((uint16_t *)out + i, k, lo);
            store_bf16x16((uint16_t *)out + half + i, k, hi);
        } else {
            _mm512_mask_storeu_ps((float *)out + i, k, lo);
            _mm512_mask_storeu_ps((float *)out + half + i, k, hi);
        }
    }
}

const char *kernel_kind(void) { return "avx512"; }

#else /* portable C: the compiler vectorizes what it can */

static void norm_row(const float *x, const float *w, uint16_t *out, int64_t dim, float eps) {
    float acc = 0.f;
    for (int64_t i = 0; i < dim; i++) acc += x[i] * x[i];
    const float scale = 1.0f / sqrtf(acc / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) out[i] = float_to_bf16(x[i] * scale * w[i]);
}

static void add_norm_row(float *x, const uint16_t *y, const float *w, uint16_t *out, int64_t dim,
                         float eps) {
    for (int64_t i = 0; i < dim; i++) x[i] += bf16_to_float(y[i]);
    norm_row(x, w, out, dim, eps);
}

static void silu_mul_row(const uint16_t *h, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        out[i] = float_to_bf16(silu(bf16_to_float(h[i])) * bf16_to_float(h[n + i]));
}

static void rope_head(const uint16_t *x, const float *c, const float *s, void *out, int64_t d,
                      int as_bf16) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = bf16_to_float(x[i]), b = bf16_to_float(x[half + i]);
        /* explicit fmaf: the same rounding whatever the compiler contracts, and the
         * AVX-512 build's (fmsub / fmadd), so the float and bf16 outputs agree */
        const float lo = fmaf(a, c[i], -(b * s[i])), hi = fmaf(b, c[half + i], a * s[half + i]);
        if (as_bf16) {
            ((uint16_t *)out)[i] = float_to_bf16(lo);
            ((uint16_t *)out)[half + i] = float_to_bf16(hi);
        } else {
            ((float *)out)[i] = lo;
            ((float *)out)[half + i] = hi;
        }
    }
}

const char *kernel_kind(void) { return "portable"; }

#endif

int rms_norm_bf16(const float *x, int64_t x_stride, const float *w, uint16_t *out, int64_t rows,
                  int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= GRAIN)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * x_stride, w, out + r * dim, dim, eps);
    return 0;
}

int add_rms_norm_bf16(float *x, int64_t x_stride, const uint16_t *y, int64_t y_stride,
                      const float *w, uint16_t *out, int64_t rows, int64_t dim, float eps,
                      int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= GRAIN)
    for (int64_t r = 0; r < rows; r++)
        add_norm_row(x + r * x_stride, y + r * y_stride, w, out + r * dim, dim, eps);
    return 0;
}

int silu_mul_bf16(const uint16_t *h, int64_t h_stride, uint16_t *out, int64_t rows, int64_t n,
                  int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= GRAIN)
    for (int64_t r = 0; r < rows; r++) silu_mul_row(h + r * h_stride, out + r * n, n);
    return 0;
}

/* h: bf16 rows (stride h_stride) whose first `heads` x d elements are the q|k heads; row r
 * turns by cos / sin rows r (float32 [rows, d]); out float32 [rows, heads, d] contiguous */
int rope_f32(const uint16_t *h, int64_t h_stride, const float *cos, const float *sin, float *out,
             int64_t rows, int64_t heads, int64_t d, int threads) {
    if (d % 2) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * heads * d >= GRAIN)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < heads; j++)
            rope_head(h + r * h_stride + j * d, cos + r * d, sin + r * d,
                      out + (r * heads + j) * d, d, 0);
    return 0;
}

/* h: bf16 rows (stride h_stride) of heads q heads, kv_heads k heads, kv_heads v heads of d
 * each; q out bf16 [rows, heads, d] contiguous; k head j of row r to
 * k_dst + j * head_stride + r * d, the same for v (v copied, k RoPE'd as the queries) */
int rope_store_bf16(const uint16_t *h, int64_t h_stride, const float *cos, const float *sin,
                    uint16_t *q, uint16_t *k_dst, uint16_t *v_dst, int64_t head_stride,
                    int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, int threads) {
    if (d % 2) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (rows * (heads + 2 * kv_heads) * d >= GRAIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *x = h + r * h_stride;
        const float *c = cos + r * d, *s = sin + r * d;
        for (int64_t j = 0; j < heads; j++)
            rope_head(x + j * d, c, s, q + (r * heads + j) * d, d, 1);
        for (int64_t j = 0; j < kv_heads; j++) {
            rope_head(x + (heads + j) * d, c, s, k_dst + j * head_stride + r * d, d, 1);
            memcpy(v_dst + j * head_stride + r * d, x + (heads + kv_heads + j) * d, d * 2);
        }
    }
    return 0;
}
