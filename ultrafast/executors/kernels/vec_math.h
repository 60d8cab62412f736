/* Helpers shared by the kernels in this folder (decode_attention.c, fused_ops.c): bf16 <->
 * float and e^x on 16 lanes. native_build.py hashes this header into every kernel's cache
 * key, so a change here rebuilds them all. */
#ifndef ULTRAFAST_VEC_MATH_H
#define ULTRAFAST_VEC_MATH_H

#include <math.h>
#include <stdint.h>

static inline float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 bf16 values (lanes off in k read as 0) widened to float */
static inline __m512 load_bf16x16(const uint16_t *p, __mmask16 k) {
    const __m256i h = _mm256_maskz_loadu_epi16(k, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 2^t for t <= 0 on 16 lanes: 2^n * 2^f with f in [-0.5, 0.5], 2^f by the Taylor polynomial
 * of e^(f ln 2) of the given degree (a constant at every call: the loop unrolls), 2^n by
 * scalef; inputs under -126 give 2^-126 (callers mask what must be exactly 0). Degree 7:
 * relative error < 1e-8, below float rounding; degree 4: < 5e-5, for results rounded to bf16. */
static inline __attribute__((always_inline)) __m512 exp2_poly(__m512 t, const int degree) {
    static const float taylor[8] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720,
                                    1.f / 5040};
    t = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(taylor[degree]);
    for (int i = degree - 1; i >= 0; i--) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(taylor[i]));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 exp2_nonpositive(__m512 t) { return exp2_poly(t, 7); }

/* e^x for x <= 0 on 16 lanes as 2^(x log2 e); inputs under -87 give 0 to float precision */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    return exp2_nonpositive(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)));
}
#endif

#endif
