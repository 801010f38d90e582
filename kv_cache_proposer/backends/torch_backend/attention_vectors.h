/* Scores and value sums of a few query rows over a tile of keys on the CPU's vectors (AVX-512, or AVX2 with FMA):
   each row's sums in registers, in one order whatever rows are computed beside it; and the conversions and
   transpositions that lay a tile's keys out for them. Shared by held_kernel.c and dense_kernel.c. */

#ifndef KAKEYA_ATTENTION_VECTORS_H
#define KAKEYA_ATTENTION_VECTORS_H

#include "attention_kernel.h"

#if VECTORS
/* Scores of `rows` (1 to 4) query rows against a tile's 64 keys (`by_dim`: dimension-major), as vectors over the keys
   with every row's sums in registers; each row's sum runs over the dimensions in order, whatever `rows` is. */
static inline __attribute__((always_inline)) void tile_scores(const float *q, int rows, int D, const float *by_dim,
                                                              float *out /* [rows][TILE] */) {
    __m512 s[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) s[i][j] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        const float *bd = by_dim + d * TILE;
        __m512 k0 = _mm512_loadu_ps(bd), k1 = _mm512_loadu_ps(bd + 16), k2 = _mm512_loadu_ps(bd + 32),
               k3 = _mm512_loadu_ps(bd + 48);
        for (int i = 0; i < 4; i++) {
            if (i >= rows) break;
            __m512 qi = _mm512_set1_ps(q[(int64_t)i * D + d]);
            s[i][0] = _mm512_fmadd_ps(qi, k0, s[i][0]);
            s[i][1] = _mm512_fmadd_ps(qi, k1, s[i][1]);
            s[i][2] = _mm512_fmadd_ps(qi, k2, s[i][2]);
            s[i][3] = _mm512_fmadd_ps(qi, k3, s[i][3]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(out + i * TILE + 16 * j, s[i][j]);
}

/* Sixteen values at `at` (held as `kind`) as float32, each converted exactly. */
static inline __attribute__((always_inline)) __m512 values16(const void *at, int kind) {
    if (kind == AS_BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)at)), 16));
    if (kind == AS_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)at)));
    return _mm512_loadu_ps((const float *)at);
}

/* acc[i] += sum over the tile's nt keys of w[i][t] * value[t] for `rows` (1 to 4) rows, 64 dimensions at a time
   with the sums in registers; each row's sum runs over the keys in order, whatever `rows` is. The values are read
   where they lie, rows s_pos elements apart from key t0 (float32 rows converted before, or bfloat16 values or int8
   coordinates as held, converted in registers, exactly: a kind gives the same sums as its float32 copy would), and
   past nt keys none is read (a converted copy's rows there are zeros, which change no sum). */
static inline __attribute__((always_inline)) void tile_values(float *acc, const float *w, int rows, int D, int nt,
                                                              const void *base, int kind, int64_t s_pos, int64_t t0) {
    const int64_t elem = kind == AS_FLOAT32 ? 4 : kind == AS_BF16 ? 2 : 1;
    for (int d0 = 0; d0 < D; d0 += 64) {
        int width = D - d0 < 64 ? D - d0 : 64; /* a multiple of 16 */
        int parts = width / 16;
        __m512 a[4][4];
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < parts; j++) a[i][j] = _mm512_loadu_ps(acc + (int64_t)i * D + d0 + 16 * j);
        for (int t = 0; t < nt; t++) {
            const char *row = (const char *)base + ((t0 + t) * s_pos + d0) * elem;
            __m512 c[4];
            for (int j = 0; j < parts; j++) c[j] = values16(row + 16 * j * elem, kind);
            for (int i = 0; i < 4; i++) {
                if (i >= rows) break;
                __m512 wi = _mm512_set1_ps(w[i * TILE + t]);
                for (int j = 0; j < parts; j++) a[i][j] = _mm512_fmadd_ps(wi, c[j], a[i][j]);
            }
        }
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < parts; j++) _mm512_storeu_ps(acc + (int64_t)i * D + d0 + 16 * j, a[i][j]);
    }
}
#endif

#if VECTORS8
/* Eight values at `at` (held as `kind`) as float32, each converted exactly. */
static inline __attribute__((always_inline)) __m256 values8(const void *at, int kind) {
    if (kind == AS_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)at)), 16));
    if (kind == AS_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)at)));
    return _mm256_loadu_ps((const float *)at);
}

/* How many vectors of 8 sums each of `rows` query rows hold in registers at a time (scores of 8 times as many keys,
   value sums of as many dimensions): up to 12 independent chains of fma, which a decode step's few rows (a K/V head's
   query heads) would not have at 2 each, and registers left for the operands. */
#define ROW_VECTORS(rows) ((rows) <= 1 ? 8 : (rows) <= 3 ? 4 : 2)

/* tile_scores on 256-bit vectors: scores of `rows` (1 to ROW_GROUP) query rows against a tile's 64 keys (`by_dim`),
   8 * ROW_VECTORS(rows) keys at a time with every row's sums in registers; each row's sum runs over the dimensions in
   order, whatever `rows` is. */
static inline __attribute__((always_inline)) void tile_scores8(const float *q, int rows, int D, const float *by_dim,
                                                               float *out /* [rows][TILE] */) {
    const int V = ROW_VECTORS(rows);
    for (int k = 0; k < TILE; k += 8 * V) {
        __m256 s[ROW_GROUP][8];
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < V; j++) s[i][j] = _mm256_setzero_ps();
        for (int d = 0; d < D; d++) {
            const float *bd = by_dim + d * TILE + k;
            __m256 keys[8];
            for (int j = 0; j < V; j++) keys[j] = _mm256_loadu_ps(bd + 8 * j);
            for (int i = 0; i < rows; i++) {
                __m256 qi = _mm256_broadcast_ss(q + (int64_t)i * D + d);
                for (int j = 0; j < V; j++) s[i][j] = _mm256_fmadd_ps(qi, keys[j], s[i][j]);
            }
        }
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < V; j++) _mm256_storeu_ps(out + i * TILE + k + 8 * j, s[i][j]);
    }
}

/* tile_values on 256-bit vectors: acc[i] += sum over the tile's nt keys of w[i][t] * value[t] for `rows` (1 to
   ROW_GROUP) rows, 8 * V dimensions at a time with the sums in registers; each row's sum runs over the keys in order,
   whatever `rows` and V are. The values are read as tile_values reads them. */
static inline __attribute__((always_inline)) void values_by8(float *acc, const float *w, int rows, int D, int nt,
                                                             const void *base, int kind, int64_t s_pos, int64_t t0,
                                                             const int V) {
    const int64_t elem = kind == AS_FLOAT32 ? 4 : kind == AS_BF16 ? 2 : 1;
    for (int d0 = 0; d0 < D; d0 += 8 * V) {
        __m256 a[ROW_GROUP][8];
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < V; j++) a[i][j] = _mm256_loadu_ps(acc + (int64_t)i * D + d0 + 8 * j);
        for (int t = 0; t < nt; t++) {
            const char *row = (const char *)base + ((t0 + t) * s_pos + d0) * elem;
            if (V == 2) { /* the values first, then each row's weight: rows x 2 sums and 3 operands in registers */
                __m256 c0 = values8(row, kind), c1 = values8(row + 8 * elem, kind);
                for (int i = 0; i < rows; i++) {
                    __m256 wi = _mm256_broadcast_ss(w + i * TILE + t);
                    a[i][0] = _mm256_fmadd_ps(wi, c0, a[i][0]);
                    a[i][1] = _mm256_fmadd_ps(wi, c1, a[i][1]);
                }
                continue;
            }
            __m256 wi[ROW_GROUP]; /* each row's weight first, then the values a vector at a time */
            for (int i = 0; i < rows; i++) wi[i] = _mm256_broadcast_ss(w + i * TILE + t);
            for (int j = 0; j < V; j++) {
                __m256 c = values8(row + 8 * j * elem, kind);
                for (int i = 0; i < rows; i++) a[i][j] = _mm256_fmadd_ps(wi[i], c, a[i][j]);
            }
        }
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < V; j++) _mm256_storeu_ps(acc + (int64_t)i * D + d0 + 8 * j, a[i][j]);
    }
}

/* values_by8 with ROW_VECTORS(rows) vectors where D is a multiple of their width, else 2. */
static inline __attribute__((always_inline)) void tile_values8(float *acc, const float *w, int rows, int D, int nt,
                                                               const void *base, int kind, int64_t s_pos,
                                                               int64_t t0) {
    if (D % (8 * ROW_VECTORS(rows)) == 0)
        values_by8(acc, w, rows, D, nt, base, kind, s_pos, t0, ROW_VECTORS(rows));
    else
        values_by8(acc, w, rows, D, nt, base, kind, s_pos, t0, 2);
}
#endif

#if VECTORS || VECTORS8
/* A tile's scores (tile_scores, or tile_scores8) and value sums (tile_values, or tile_values8) of `rows` query rows,
   1 to ROW_GROUP, with the rows' count known to the compiler, so the sums stay in registers. */
static inline __attribute__((always_inline)) void scores_of(const float *q, int rows, int D, const float *by_dim,
                                                            float *out) {
#if VECTORS
    if (rows == 4)
        tile_scores(q, 4, D, by_dim, out);
    else
        tile_scores(q, rows, D, by_dim, out);
#else
    switch (rows) {
    case 6: tile_scores8(q, 6, D, by_dim, out); break;
    case 5: tile_scores8(q, 5, D, by_dim, out); break;
    case 4: tile_scores8(q, 4, D, by_dim, out); break;
    case 3: tile_scores8(q, 3, D, by_dim, out); break;
    case 2: tile_scores8(q, 2, D, by_dim, out); break;
    default: tile_scores8(q, 1, D, by_dim, out);
    }
#endif
}

static inline __attribute__((always_inline)) void values_of(float *acc, const float *w, int rows, int D, int nt,
                                                            const void *base, int kind, int64_t s_pos, int64_t t0) {
#if VECTORS
    if (rows == 4)
        tile_values(acc, w, 4, D, nt, base, kind, s_pos, t0);
    else
        tile_values(acc, w, rows, D, nt, base, kind, s_pos, t0);
#else
    switch (rows) {
    case 6: tile_values8(acc, w, 6, D, nt, base, kind, s_pos, t0); break;
    case 5: tile_values8(acc, w, 5, D, nt, base, kind, s_pos, t0); break;
    case 4: tile_values8(acc, w, 4, D, nt, base, kind, s_pos, t0); break;
    case 3: tile_values8(acc, w, 3, D, nt, base, kind, s_pos, t0); break;
    case 2: tile_values8(acc, w, 2, D, nt, base, kind, s_pos, t0); break;
    default: tile_values8(acc, w, 1, D, nt, base, kind, s_pos, t0);
    }
#endif
}
#endif

/* Keys [t0, t0 + TILE) of one head as float32 rows [TILE][D], zeros past `count`. */
static inline void dense_rows(const void *base, int bf16, int64_t s_pos, int64_t t0, int64_t count, int D,
                              float *by_key) {
    int nt = (int)(count - t0 < TILE ? count - t0 : TILE);
    for (int t = 0; t < nt; t++) {
        if (bf16) {
            const uint16_t *src = (const uint16_t *)base + (t0 + t) * s_pos;
            uint32_t *dst = (uint32_t *)(by_key + (int64_t)t * D);
            for (int d = 0; d < D; d++) dst[d] = (uint32_t)src[d] << 16;
        } else {
            memcpy(by_key + (int64_t)t * D, (const float *)base + (t0 + t) * s_pos, sizeof(float) * (size_t)D);
        }
    }
    if (nt < TILE) memset(by_key + (int64_t)nt * D, 0, sizeof(float) * (size_t)(TILE - nt) * (size_t)D);
}

/* Keys [t0, t0 + TILE) of one head as they are held, bfloat16, a row's pairs of dimensions as uint32 [TILE][D/2],
   zeros past `count`. */
static inline void pair_rows(const void *base, int64_t s_pos, int64_t t0, int64_t count, int D, uint32_t *rows) {
    int nt = (int)(count - t0 < TILE ? count - t0 : TILE);
    for (int t = 0; t < nt; t++)
        memcpy(rows + (int64_t)t * (D / 2), (const uint16_t *)base + (t0 + t) * s_pos, sizeof(uint16_t) * (size_t)D);
    if (nt < TILE) memset(rows + (int64_t)nt * (D / 2), 0, sizeof(uint16_t) * (size_t)(TILE - nt) * (size_t)D);
}

#if VECTORS
/* A 16 x 16 block of float32 transposed: row i of `src` (step s_src) becomes column i of `dst` (step s_dst). */
static inline __attribute__((always_inline)) void transpose16(const float *src, int64_t s_src, float *dst,
                                                               int64_t s_dst) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * s_src);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);     /* a0 b0 a1 b1 | a4 b4 a5 b5 | ... per 128-bit lane */
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]); /* a2 b2 a3 b3 | ... */
    }
    for (int i = 0; i < 16; i += 4) {
        __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]), c = _mm512_castps_pd(t[i + 2]),
                d = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));     /* a0 b0 c0 d0 per lane */
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c)); /* a1 b1 c1 d1 */
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d)); /* a2 b2 c2 d2 */
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d)); /* a3 b3 c3 d3 */
    }
    /* r[4k + j] holds, in 128-bit lane l, dimension 4l + j of rows 4k..4k+3. */
    for (int j = 0; j < 4; j++) {
        __m512 a = r[j], b = r[4 + j], c = r[8 + j], d = r[12 + j];
        __m512 ab_lo = _mm512_shuffle_f32x4(a, b, 0x44); /* a.l0 a.l1 b.l0 b.l1 */
        __m512 ab_hi = _mm512_shuffle_f32x4(a, b, 0xee); /* a.l2 a.l3 b.l2 b.l3 */
        __m512 cd_lo = _mm512_shuffle_f32x4(c, d, 0x44);
        __m512 cd_hi = _mm512_shuffle_f32x4(c, d, 0xee);
        t[j] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0x88);      /* lane 0 of a b c d: dimension j */
        t[4 + j] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0xdd);  /* lane 1: dimension 4 + j */
        t[8 + j] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0x88);  /* lane 2: dimension 8 + j */
        t[12 + j] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0xdd); /* lane 3: dimension 12 + j */
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + i * s_dst, t[i]);
}
#endif

#if VECTORS8
/* Eight rows of eight float32 (r[i]: row i) transposed in registers: out[j] holds dimension j of the eight rows. */
static inline __attribute__((always_inline)) void transpose8(__m256 r[8], __m256 out[8]) {
    __m256 t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);     /* a0 b0 a1 b1 | a4 b4 a5 b5 */
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]); /* a2 b2 a3 b3 | a6 b6 a7 b7 */
    }
    __m256 u[8];
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);         /* a0 b0 c0 d0 | a4 b4 c4 d4 */
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);     /* a1 b1 c1 d1 | a5 b5 c5 d5 */
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44); /* a2 b2 c2 d2 | a6 b6 c6 d6 */
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee); /* a3 b3 c3 d3 | a7 b7 c7 d7 */
    }
    for (int j = 0; j < 4; j++) {
        out[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);     /* dimension j of rows 0-3, then of rows 4-7 */
        out[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31); /* dimension 4 + j */
    }
}

/* Keys [t0, t0 + TILE) of one head (held as `kind`, rows s_pos elements apart) as float32 [D][TILE], zeros past
   `count`: eight keys' eight dimensions at a time converted and transposed in registers. D a multiple of 8. */
static inline __attribute__((always_inline)) void keys_by_dimension8(const void *base, int kind, int64_t s_pos,
                                                                     int64_t t0, int64_t count, int D,
                                                                     float *by_dim) {
    const int64_t elem = kind == AS_FLOAT32 ? 4 : kind == AS_BF16 ? 2 : 1;
    int nt = (int)(count - t0 < TILE ? count - t0 : TILE);
    for (int k0 = 0; k0 < TILE; k0 += 8)
        for (int d0 = 0; d0 < D; d0 += 8) {
            __m256 r[8], c[8];
            for (int i = 0; i < 8; i++) {
                if (k0 + i >= nt) {
                    r[i] = _mm256_setzero_ps();
                    continue;
                }
                r[i] = values8((const char *)base + ((t0 + k0 + i) * s_pos + d0) * elem, kind);
            }
            transpose8(r, c);
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(by_dim + (int64_t)(d0 + j) * TILE + k0, c[j]);
        }
}
#endif

/* [TILE][D] rows as [D][TILE]. */
static inline __attribute__((always_inline)) void by_dimension(const float *by_key, int D, float *by_dim) {
#if VECTORS
    if (D % 16 == 0) {
        for (int t0 = 0; t0 < TILE; t0 += 16)
            for (int d0 = 0; d0 < D; d0 += 16)
                transpose16(by_key + (int64_t)t0 * D + d0, D, by_dim + (int64_t)d0 * TILE + t0, TILE);
        return;
    }
#endif
    for (int t = 0; t < TILE; t++)
        for (int d = 0; d < D; d++) by_dim[d * TILE + t] = by_key[t * D + d];
}

#endif
