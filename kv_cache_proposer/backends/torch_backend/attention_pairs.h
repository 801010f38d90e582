/* Attention's bfloat16 pairs on a CPU with AVX512-BF16 (PAIRS): two dimensions (scores) or two keys (value sums) a
   step by the vector units' bfloat16 dot product, and the conversions that lay keys, values and held coordinates
   out as pairs for it and for the tile unit. Shared by held_kernel.c and dense_kernel.c; PAIRS 0 elsewhere. */

#ifndef KAKEYA_ATTENTION_PAIRS_H
#define KAKEYA_ATTENTION_PAIRS_H

#include "attention_vectors.h"

#if VECTORS && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAIRS 1
/* Scores of `rows` (1 to 4) bfloat16 query rows (pairs of dimensions as uint32, rows D apart) against a tile's 64
   bfloat16 keys (`by_pair`: a pair of dimensions' 64 keys side by side), times `scale`: two dimensions a step by
   the CPU's bfloat16 dot product, each row's sums in the same order whatever `rows` is. */
static inline __attribute__((always_inline)) void tile_scores_pairs(const uint32_t *q, int rows, int D,
                                                                    const uint32_t *by_pair, float scale,
                                                                    float *out /* [rows][TILE] */) {
    __m512 s[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) s[i][j] = _mm512_setzero_ps();
    for (int d = 0; d < D / 2; d++) {
        const uint32_t *bd = by_pair + d * TILE;
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(bd), k1 = (__m512bh)_mm512_loadu_si512(bd + 16),
                 k2 = (__m512bh)_mm512_loadu_si512(bd + 32), k3 = (__m512bh)_mm512_loadu_si512(bd + 48);
        for (int i = 0; i < 4; i++) {
            if (i >= rows) break;
            __m512bh qi = (__m512bh)_mm512_set1_epi32((int)q[(int64_t)i * D + d]);
            s[i][0] = _mm512_dpbf16_ps(s[i][0], qi, k0);
            s[i][1] = _mm512_dpbf16_ps(s[i][1], qi, k1);
            s[i][2] = _mm512_dpbf16_ps(s[i][2], qi, k2);
            s[i][3] = _mm512_dpbf16_ps(s[i][3], qi, k3);
        }
    }
    __m512 factor = _mm512_set1_ps(scale);
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(out + i * TILE + 16 * j, _mm512_mul_ps(s[i][j], factor));
}

/* `nt` rows of int8 coordinates (rows s_pos apart from key t0) as bfloat16 rows [TILE][D], zeros past nt: the
   coordinates are small integers, which bfloat16 holds exactly. */
static inline void coordinates_bf16(const int8_t *base, int64_t s_pos, int64_t t0, int nt, int D, uint16_t *rows) {
    for (int t = 0; t < nt; t++) {
        const int8_t *c = base + (t0 + t) * s_pos;
        for (int d = 0; d < D; d += 32) {
            __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + d))));
            __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + d + 16))));
            _mm512_storeu_si512(rows + (int64_t)t * D + d, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
    }
    if (nt < TILE) memset(rows + (int64_t)nt * D, 0, sizeof(uint16_t) * (size_t)(TILE - nt) * (size_t)D);
}
/* Keys [t0, t0 + nt) of int8 coordinates (rows s_pos apart) as bfloat16 pairs of keys [TILE / 2][D] (uint32: key
   2p's value in the low half, 2p + 1's in the high half; zeros past nt), as pair_values reads them. A small integer's
   bfloat16 is its float32's high half, exactly. */
static inline void coordinate_pairs(const int8_t *base, int64_t s_pos, int64_t t0, int nt, int D, uint32_t *pairs) {
    for (int t = 0; t < nt; t += 2) {
        const int8_t *a = base + (t0 + t) * s_pos, *b = a + s_pos;
        uint32_t *row = pairs + (int64_t)(t / 2) * D;
        for (int d = 0; d < D; d += 16) {
            __m512i low = _mm512_castps_si512(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(a + d)))));
            __m512i high = t + 1 < nt ? _mm512_castps_si512(_mm512_cvtepi32_ps(
                                            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + d)))))
                                      : _mm512_setzero_si512();
            _mm512_storeu_si512(row + d, _mm512_or_si512(_mm512_srli_epi32(low, 16),
                                                         _mm512_and_si512(high, _mm512_set1_epi32((int)0xffff0000u))));
        }
    }
}

/* acc[i][d] += the sum over key pairs p < np of the bfloat16 weights `w` (row i's pairs at i * TILE / 2) times the
   value pairs ([np][D], as coordinate_pairs lays them out), for `rows` (1 to 4) rows, 64 dimensions at a time with
   the sums in registers; each row's sums run over the keys in order, whatever `rows` is. */
static inline __attribute__((always_inline)) void pair_values(float *acc, const uint32_t *w, int rows, int D, int np,
                                                              const uint32_t *pairs) {
    for (int d0 = 0; d0 < D; d0 += 64) {
        __m512 a[4][4];
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < 4; j++) a[i][j] = _mm512_loadu_ps(acc + (int64_t)i * D + d0 + 16 * j);
        for (int p = 0; p < np; p++) {
            const uint32_t *v = pairs + (int64_t)p * D + d0;
            __m512bh v0 = (__m512bh)_mm512_loadu_si512(v), v1 = (__m512bh)_mm512_loadu_si512(v + 16),
                     v2 = (__m512bh)_mm512_loadu_si512(v + 32), v3 = (__m512bh)_mm512_loadu_si512(v + 48);
            for (int i = 0; i < 4; i++) {
                if (i >= rows) break;
                __m512bh wi = (__m512bh)_mm512_set1_epi32((int)w[i * (TILE / 2) + p]);
                a[i][0] = _mm512_dpbf16_ps(a[i][0], wi, v0);
                a[i][1] = _mm512_dpbf16_ps(a[i][1], wi, v1);
                a[i][2] = _mm512_dpbf16_ps(a[i][2], wi, v2);
                a[i][3] = _mm512_dpbf16_ps(a[i][3], wi, v3);
            }
        }
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + (int64_t)i * D + d0 + 16 * j, a[i][j]);
    }
}
/* `width` bfloat16 value rows (rows s_pos apart from key t0, zeros past `count`) as pairs of keys: for each pair,
   each dimension's two values side by side [width/2][D] (what the tile unit multiplies by). */
static inline void value_pairs(const uint16_t *base, int64_t s_pos, int64_t t0, int64_t count, int width, int D,
                               uint32_t *pairs) {
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int t = 0; t < width; t += 2) {
        uint32_t *row = pairs + (int64_t)(t / 2) * D;
        int64_t k = t0 + t;
        for (int d = 0; d < D; d += 32) {
            __m512i a = k < count ? _mm512_loadu_si512(base + k * s_pos + d) : _mm512_setzero_si512();
            __m512i b = k + 1 < count ? _mm512_loadu_si512(base + (k + 1) * s_pos + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(row + d, _mm512_permutex2var_epi16(a, low, b));
            _mm512_storeu_si512(row + d + 16, _mm512_permutex2var_epi16(a, high, b));
        }
    }
}

/* pair_values with the weights of `rows` (1 to 4) rows as float32 (`w` [rows][TILE]), rounded to bfloat16 first;
   the rows' count known to the compiler where it is 4 (no test in the loop). */
static inline __attribute__((always_inline)) void weighted_pairs(float *acc, const float *w, int rows, int D, int np,
                                                                 const uint32_t *pairs) {
    uint32_t weights[4 * TILE / 2];
    for (int i = 0; i < rows; i++)
        for (int t = 0; t < TILE; t += 32)
            _mm512_storeu_si512(weights + i * (TILE / 2) + t / 2,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(w + i * TILE + t + 16),
                                                             _mm512_loadu_ps(w + i * TILE + t)));
    if (rows == 4)
        pair_values(acc, weights, 4, D, np, pairs);
    else
        pair_values(acc, weights, rows, D, np, pairs);
}
#else
#define PAIRS 0
#endif

#endif
