/* What the CPU attention kernels share (held_kernel.c over held coordinates, dense_kernel.c over dense K/V, built
   together into one library by kernel_build.py): the exponential, the vector widths this build has, each row's
   softmax kept online over tiles of TILE keys, and the merge of a row's segments in order. Every function here is
   static: each kernel file takes its own copy. */

#ifndef KAKEYA_ATTENTION_KERNEL_H
#define KAKEYA_ATTENTION_KERNEL_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define TILE 64      /* keys scored at a time within a segment */
#define MAX_DIM 256  /* the largest head size served */

/* exp(x) for x <= 0 (a score minus the running maximum), 0 below the float range and for -inf; a polynomial the
   compiler vectorises, within 2 ulp of expf. */
static inline float exp_nonpositive(float x) {
    float c = x < -87.0f ? -87.0f : x;
    float k = floorf(c * 1.44269504088896341f + 0.5f);
    float r = c - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float power;
    memcpy(&power, &bits, sizeof power);
    y *= power;
    return x < -87.0f ? 0.0f : y;
}

/* An fp16 value (a norm or a scale) as float32. */
static inline float from_half(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    float f;
    if (exponent == 0) { /* zero or subnormal: mantissa x 2^-24 */
        f = (float)mantissa * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    bits = exponent == 31 ? sign | 0x7f800000u | (mantissa << 13) : sign | ((exponent + 112) << 23) | (mantissa << 13);
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

#if defined(__AVX512F__)
#define VECTORS 1
#else
#define VECTORS 0
#endif

/* Without AVX-512, dense attention scores and sums on 256-bit vectors (AVX2 with FMA): its own arithmetic, which
   like the wider one gives a row the same sums whatever rows are computed beside it. */
#if !VECTORS && defined(__AVX2__) && defined(__FMA__)
#define VECTORS8 1
#define ROW_GROUP 6 /* query rows of dense attention scored and summed together: 12 sums and 3 operands in registers */
#else
#define VECTORS8 0
#define ROW_GROUP 4
#endif

/* The tile unit (AMX) for bfloat16 products: attention on it where the caller asks (see dense_tiles_enable). */
#if VECTORS && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define TILES 1
#else
#define TILES 0
#endif

/* How the values of a tile are held where tile_values reads them. */
enum { AS_FLOAT32 = 0, AS_BF16 = 1, AS_INT8 = 2 };

#if VECTORS
/* exp_nonpositive of 16 values at once (the same polynomial, its own rounding). */
static inline __m512 exp_nonpositive16(__m512 x) {
    __m512 c = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 k = _mm512_roundscale_ps(_mm512_fmadd_ps(c, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), c));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    y = _mm512_scalef_ps(y, k); /* y * 2^k, rounded once, as multiplying by the power of two would */
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), y);
}
#endif

#if VECTORS
/* exp(x) for x <= 0 to about 5e-5 relative (a Taylor polynomial of degree 4 on [-ln 2 / 2, ln 2 / 2]), 0 below
   -87 and for -inf: for weights that are rounded to bfloat16 (3.9e-3) before they multiply. */
static inline __m512 exp_coarse16(__m512 x) {
    __m512 c = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), c));
    __m512 p = _mm512_set1_ps(1.0f / 24.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), _mm512_scalef_ps(p, k));
}
#endif

#if VECTORS8
/* exp_nonpositive of 8 values at once (the same polynomial, its own rounding). */
static inline __m256 exp_nonpositive8(__m256 x) {
    __m256 c = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 k = _mm256_floor_ps(_mm256_fmadd_ps(c, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fmadd_ps(k, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), c));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* times 2^k (k from -125 up: a normal power of two, so the product is rounded once) */
    __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(power));
    return _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}
#endif

/* A row's scores s[width] (a multiple of 16) over its running maximum m (not -inf) made its weights exp(s - m), in
   place (by exp_coarse16 where `coarse`); returns their sum, always summed in the same order. */
static inline __attribute__((always_inline)) float tile_weights(float *s, int width, float m, int coarse) {
#if VECTORS
    __m512 top = _mm512_set1_ps(m), total = _mm512_setzero_ps();
    for (int t = 0; t < width; t += 16) {
        __m512 x = _mm512_sub_ps(_mm512_loadu_ps(s + t), top);
        __m512 e = coarse ? exp_coarse16(x) : exp_nonpositive16(x);
        _mm512_storeu_ps(s + t, e);
        total = _mm512_add_ps(total, e);
    }
    return _mm512_reduce_add_ps(total);
#elif VECTORS8
    (void)coarse; /* the coarse exponential serves the tile unit, which a build without AVX-512 has not */
    __m256 top = _mm256_set1_ps(m), total = _mm256_setzero_ps();
    for (int t = 0; t < width; t += 8) {
        __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + t), top));
        _mm256_storeu_ps(s + t, e);
        total = _mm256_add_ps(total, e);
    }
    __m128 four = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
    __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
#else
    float total = 0.0f;
    for (int t = 0; t < width; t++) {
        float e = exp_nonpositive(s[t] - m);
        total += e;
        s[t] = e;
    }
    return total;
#endif
}

/* Row `row`'s scores s[width] of keys [t0, t0 + width), times `scale`, made its weights under its running softmax
   (maximum *top, total *sum, unnormalised output o [D] rescaled to the new maximum), keys it does not read weighing
   exactly 0; `coarse`: by exp_coarse16 (weights that are rounded to bfloat16 next). */
static inline __attribute__((always_inline)) void row_weights(float *s, int width, float scale, int coarse,
                                                              int64_t t0, const int64_t *hi, const uint8_t *allowed,
                                                              int64_t s_allowed, int n, int row, int D, float *o,
                                                              float *top, float *sum) {
    int64_t limit = hi[row % n];
    const uint8_t *a = allowed ? allowed + (int64_t)(row % n) * s_allowed : NULL;
    if (a)
        for (int t = 0; t < width; t++)
            if (t0 + t >= limit || !a[t0 + t]) s[t] = -INFINITY;
    if (!a && limit < t0 + width)
        for (int t = (int)(limit > t0 ? limit - t0 : 0); t < width; t++) s[t] = -INFINITY;
    float m = *top;
#pragma omp simd reduction(max : m)
    for (int t = 0; t < width; t++) {
        s[t] *= scale;
        m = s[t] > m ? s[t] : m;
    }
    if (m == -INFINITY) { /* nothing readable yet: weights 0 */
        for (int t = 0; t < width; t++) s[t] = 0.0f;
        return;
    }
    float correction = *top == -INFINITY ? 0.0f : exp_nonpositive(*top - m);
    float total = tile_weights(s, width, m, coarse);
    *sum = *sum * correction + total;
    *top = m;
    for (int d = 0; d < D; d++) o[d] *= correction;
}

/* A value of the queries or the tail K/V: float32, or bfloat16 (the top half of a float32). */
static inline float value_at(const void *base, int bf16, int64_t at) {
    if (!bf16) return ((const float *)base)[at];
    uint32_t bits = (uint32_t)((const uint16_t *)base)[at] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Row r's partial results of one (batch, K/V head)'s segments (each `stride` floats: [G][D] sums, [G] maxima, [G]
   totals) merged in order: its maximum, total and unnormalised output. */
static void merge_segments(const float *parts, int64_t stride, int64_t segments, int G, int D, int r, float *top,
                           float *total, float *acc) {
    float m = -INFINITY, sum = 0.0f;
    for (int64_t part = 0; part < segments; part++) {
        float t = parts[part * stride + (int64_t)G * D + r];
        m = t > m ? t : m;
    }
    for (int d = 0; d < D; d++) acc[d] = 0.0f;
    if (m != -INFINITY) {
        for (int64_t part = 0; part < segments; part++) {
            const float *p = parts + part * stride;
            float t = p[(int64_t)G * D + r];
            if (t == -INFINITY) continue;
            float c = expf(t - m);
            sum += p[(int64_t)G * D + G + r] * c;
            for (int d = 0; d < D; d++) acc[d] += p[(int64_t)r * D + d] * c;
        }
    }
    *top = m;
    *total = sum;
}

#endif
