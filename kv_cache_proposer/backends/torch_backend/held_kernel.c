/* Attention of a few queries over keys and values held as int8 lattice coordinates, on the CPU, in one pass over
   them: 64 keys' coordinates at a time are converted to float32 in a buffer that stays in the core's cache, scored
   against the rotated queries, and the values accumulated under a softmax kept online, so no float32 copy of the
   history is ever written; then the dense tail (the forward's own K/V). Built and loaded by held_kernel.py; the
   values are those of `_held_attention` (held_attention.py) within float rounding.

   The keys are read in segments of `seg` at fixed boundaries, one segment per work item, and the segments of a
   (batch, K/V head) merged in order: a query's result does not depend on the thread count. Over dense K/V (below)
   it does not depend on the other queries beside it or on how its history was delivered either; over held
   coordinates a block of few query rows scores keys another way than a block of many (see segment_of), which
   rounds differently (compressed sessions are exact to float rounding only: docs/protocol.md#determinism). */

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define TILE 64      /* keys scored at a time within a segment */
#define MAX_DIM 256  /* the largest head size served */
#define TRANSPOSE_ROWS 8 /* query rows from which a tile's keys are transposed to score them (see segment_of) */
#define ROW_BLOCK 128    /* query rows of one work item of dense attention (see dense_attend) */

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

/* Where one (batch, K/V head)'s held entries lie: int8 coordinates of its K and V rows, and their fp16 norms and
   scales, each at key 0, with the step from one key to the next (in elements). */
typedef struct {
    const int8_t *keys, *values;
    const uint16_t *key_norms, *key_qmax, *value_norms, *value_qmax;
    int64_t s_pos, s_scale;
    float half_over_q; /* 1 / (2Q): a coordinate's factor is qmax * norm / (2Q) */
} Held;

/* The factor s*n/2 of keys [t0, t0 + nt) of one tensor. */
static inline void factors_of(const uint16_t *norms, const uint16_t *qmax, int64_t s_scale, float half_over_q,
                              int64_t t0, int nt, float *out) {
    int t = 0;
#if defined(__AVX512F__)
    if (s_scale == 1)
        for (; t + 16 <= nt; t += 16) {
            __m512 sn = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(qmax + t0 + t))),
                                      _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(norms + t0 + t))));
            _mm512_storeu_ps(out + t, _mm512_mul_ps(sn, _mm512_set1_ps(half_over_q)));
        }
#endif
    for (; t < nt; t++) {
        int64_t at = (t0 + t) * s_scale;
        out[t] = from_half(qmax[at]) * from_half(norms[at]) * half_over_q;
    }
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

static inline __attribute__((always_inline)) void by_dimension(const float *by_key, int D, float *by_dim);
#if VECTORS8
static inline __attribute__((always_inline)) void keys_by_dimension8(const void *base, int kind, int64_t s_pos,
                                                                     int64_t t0, int64_t count, int D, float *by_dim);
#endif

/* Keys [start, end) of one (batch, K/V head) for its G query rows: unnormalised output acc [G, D], running maximum
   top [G] and sum sums [G]. Fewer than TRANSPOSE_ROWS rows score each key by its own dot products; more, a tile's
   key coordinates are converted once, transposed (`by_dim`: a dimension's 64 keys side by side), so each row's 64
   scores build up as vectors over the keys, one dimension at a time. The two round differently, so a query's scores
   depend, within float rounding, on whether its block has few rows or many. The value coordinates are converted in
   registers as four rows at a time sum them, their running sums in registers (D known to the compiler: see
   segment_64). */
static inline __attribute__((always_inline)) void segment_of(const float *q, const Held *held,
                                                             const uint8_t *allowed, int64_t s_allowed, int n, int G,
                                                             int D, int64_t start, int64_t end, float *acc,
                                                             float *top, float *sums) {
    float scores[G * TILE];
    float by_dim[D * TILE];
    float converted[TILE * D];
    float factors[TILE];
    const int8_t *keys = held->keys, *values = held->values;
    int64_t s_pos = held->s_pos;
    for (int r = 0; r < G; r++) {
        top[r] = -INFINITY;
        sums[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)G * (size_t)D);
    for (int64_t t0 = start; t0 < end; t0 += TILE) {
        int nt = (int)(end - t0 < TILE ? end - t0 : TILE);
        factors_of(held->key_norms, held->key_qmax, held->s_scale, held->half_over_q, t0, nt, factors);
        if (G < TRANSPOSE_ROWS) {
            /* Few rows: each key's coordinates converted once and dotted with every row. */
            for (int t = 0; t < nt; t++) {
                const int8_t *k = keys + (t0 + t) * s_pos;
                float row[D];
                for (int d = 0; d < D; d++) row[d] = (float)k[d];
                for (int r = 0; r < G; r++) {
                    const float *qr = q + (int64_t)r * D;
                    float sum = 0.0f;
                    for (int d = 0; d < D; d++) sum += qr[d] * row[d];
                    scores[r * TILE + t] = sum * factors[t];
                }
            }
        } else {
            /* Many rows: the tile transposed once, each row's scores built as vectors over the keys. */
#if VECTORS
            if (D % 16 == 0) { /* rows converted 16 coordinates at a time, then transposed in 16 x 16 blocks */
                for (int t = 0; t < nt; t++) {
                    const int8_t *k = keys + (t0 + t) * s_pos;
                    for (int d = 0; d < D; d += 16)
                        _mm512_storeu_ps(converted + t * D + d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                                    _mm_loadu_si128((const __m128i *)(k + d)))));
                }
                if (nt < TILE) memset(converted + nt * D, 0, sizeof(float) * (size_t)(TILE - nt) * (size_t)D);
                by_dimension(converted, D, by_dim);
            } else
#endif
#if VECTORS8
            if (D % 16 == 0)
                keys_by_dimension8(keys, AS_INT8, s_pos, t0, t0 + nt, D, by_dim);
            else
#endif
            {
                for (int t = 0; t < nt; t++) {
                    const int8_t *k = keys + (t0 + t) * s_pos;
                    for (int d = 0; d < D; d++) by_dim[d * TILE + t] = (float)k[d];
                }
                for (int t = nt; t < TILE; t++)
                    for (int d = 0; d < D; d++) by_dim[d * TILE + t] = 0.0f;
            }
#if VECTORS || VECTORS8
            if (D % 16 == 0) {
                for (int r = 0; r < G; r += ROW_GROUP)
                    scores_of(q + (int64_t)r * D, G - r < ROW_GROUP ? G - r : ROW_GROUP, D, by_dim, scores + r * TILE);
                for (int r = 0; r < G; r++)
                    for (int t = 0; t < nt; t++) scores[r * TILE + t] *= factors[t];
            } else
#endif
                for (int r = 0; r < G; r++) {
                    const float *qr = q + (int64_t)r * D;
                    float sum[TILE];
                    for (int t = 0; t < TILE; t++) sum[t] = 0.0f;
                    for (int d = 0; d < D; d++) {
                        float qd = qr[d];
                        for (int t = 0; t < TILE; t++) sum[t] += qd * by_dim[d * TILE + t];
                    }
                    for (int t = 0; t < nt; t++) scores[r * TILE + t] = sum[t] * factors[t];
                }
        }
        if (allowed) {
            for (int r = 0; r < G; r++) {
                const uint8_t *a = allowed + (int64_t)(r % n) * s_allowed + t0;
                for (int t = 0; t < nt; t++)
                    if (!a[t]) scores[r * TILE + t] = -INFINITY;
            }
        }
        factors_of(held->value_norms, held->value_qmax, held->s_scale, held->half_over_q, t0, nt, factors);
        for (int r = 0; r < G; r++) {
            float *s = scores + r * TILE;
            float m = top[r];
#pragma omp simd reduction(max : m)
            for (int t = 0; t < nt; t++) m = s[t] > m ? s[t] : m;
            if (m == -INFINITY) { /* nothing readable yet: weights 0 */
                for (int t = 0; t < nt; t++) s[t] = 0.0f;
                continue;
            }
            float correction = top[r] == -INFINITY ? 0.0f : exp_nonpositive(top[r] - m);
            float total = 0.0f;
            for (int t = 0; t < nt; t++) {
                float e = exp_nonpositive(s[t] - m);
                total += e;
                s[t] = e * factors[t]; /* the weight of the value's coordinates */
            }
            sums[r] = sums[r] * correction + total;
            top[r] = m;
            float *a = acc + (int64_t)r * D;
            for (int d = 0; d < D; d++) a[d] *= correction;
        }
        int r = 0;
#if VECTORS || VECTORS8
        if (D % 16 == 0) { /* the coordinates converted in registers as they are summed */
            for (; r < G; r += ROW_GROUP) {
                int rows = G - r < ROW_GROUP ? G - r : ROW_GROUP;
                values_of(acc + (int64_t)r * D, scores + r * TILE, rows, D, nt, values, AS_INT8, s_pos, t0);
            }
            continue;
        }
#endif
        for (int t = 0; t < nt; t++) {
            const int8_t *v = values + (t0 + t) * s_pos;
            for (int d = 0; d < D; d++) converted[t * D + d] = (float)v[d];
        }
        for (; r + 4 <= G; r += 4) {
            float a0[D], a1[D], a2[D], a3[D];
            float *out = acc + (int64_t)r * D;
            const float *w = scores + r * TILE;
            for (int d = 0; d < D; d++) {
                a0[d] = out[d];
                a1[d] = out[D + d];
                a2[d] = out[2 * D + d];
                a3[d] = out[3 * D + d];
            }
            for (int t = 0; t < nt; t++) {
                const float *cv = converted + t * D;
                float w0 = w[t], w1 = w[TILE + t], w2 = w[2 * TILE + t], w3 = w[3 * TILE + t];
                for (int d = 0; d < D; d++) {
                    a0[d] += w0 * cv[d];
                    a1[d] += w1 * cv[d];
                    a2[d] += w2 * cv[d];
                    a3[d] += w3 * cv[d];
                }
            }
            for (int d = 0; d < D; d++) {
                out[d] = a0[d];
                out[D + d] = a1[d];
                out[2 * D + d] = a2[d];
                out[3 * D + d] = a3[d];
            }
        }
        for (; r < G; r++) {
            float row[D];
            float *a = acc + (int64_t)r * D;
            const float *w = scores + r * TILE;
            for (int d = 0; d < D; d++) row[d] = a[d];
            for (int t = 0; t < nt; t++)
                for (int d = 0; d < D; d++) row[d] += w[t] * converted[t * D + d];
            for (int d = 0; d < D; d++) a[d] = row[d];
        }
    }
}

/* The head sizes models use, with the size known to the compiler (loops unrolled, rows kept in registers). */
static void segment_64(const float *q, const Held *held, const uint8_t *allowed, int64_t s_allowed, int n, int G,
                       int64_t start, int64_t end, float *acc, float *top, float *sums) {
    segment_of(q, held, allowed, s_allowed, n, G, 64, start, end, acc, top, sums);
}

static void segment_128(const float *q, const Held *held, const uint8_t *allowed, int64_t s_allowed, int n, int G,
                        int64_t start, int64_t end, float *acc, float *top, float *sums) {
    segment_of(q, held, allowed, s_allowed, n, G, 128, start, end, acc, top, sums);
}

static void segment(const float *q, const Held *held, const uint8_t *allowed, int64_t s_allowed, int n, int G, int D,
                    int64_t start, int64_t end, float *acc, float *top, float *sums) {
    if (D == 64)
        segment_64(q, held, allowed, s_allowed, n, G, start, end, acc, top, sums);
    else if (D == 128)
        segment_128(q, held, allowed, s_allowed, n, G, start, end, acc, top, sums);
    else
        segment_of(q, held, allowed, s_allowed, n, G, D, start, end, acc, top, sums);
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

#if TILES
static void held_segment_tiles(const float *q, const Held *held, const uint8_t *allowed, int64_t s_allowed, int n,
                               int G, int D, int64_t start, int64_t end, float *acc, float *top, float *sums);
#endif

/* One call: attention of queries [B, H*g, n, D] over held entries [0, count) of H K/V heads and then a dense tail
   of tail_count entries. Strides in elements; a query head's K/V head is its index / g. */
typedef struct {
    const void *q;
    int64_t q_strides[3]; /* batch, head, query */
    int q_bf16;
    const int8_t *coords; /* doubled coordinates [2B, H, >=count, D]: K rows, then V rows */
    int64_t c_strides[3];
    const uint16_t *norms, *qmax; /* fp16 [2B, H, >=count, 1], laid out alike */
    int64_t n_strides[3];
    int64_t count;
    int q_range;
    const uint8_t *allowed; /* NULL (every held key) or [n, >=count] bytes */
    int64_t s_allowed;
    const void *tail_keys, *tail_values; /* [B, H, tail_count, D], laid out alike */
    int64_t t_strides[3];
    int tail_bf16;
    int64_t tail_count;
    const uint8_t *tail_allowed; /* NULL (every tail key) or [n, >=tail_count] bytes */
    int64_t s_tail_allowed;
    const float *hadamard; /* [D, D], self-inverse */
    float scale;
    int B, H, g, n, D;
    int64_t seg;
    int threads;
    int tiles; /* scores and values on the tile unit (dense_tiles_enable) for D a multiple of 32 and 8 rows or more */
    float *scratch; /* held_attend_scratch(...) floats */
    float *out;     /* [B, H, g*n, D]: the attention output */
    float *lse;     /* [B, H, g*n]: its log-sum-exp (-inf: no readable key) */
} HeldCall;

int64_t held_attend_scratch(int B, int H, int G, int D, int64_t count, int64_t seg) {
    int64_t segments = (count + seg - 1) / seg;
    return (int64_t)B * H * G * D + (int64_t)B * H * segments * G * (D + 2);
}

/* The Partial of _held_attention (held_attention.py) for one call. Returns 0, or -1 when the shapes are beyond what
   the kernel serves. */
int held_attend(const HeldCall *call) {
    const int B = call->B, H = call->H, n = call->n, D = call->D, G = call->g * call->n;
    const int64_t count = call->count, seg = call->seg;
    if (D > MAX_DIM || D < 1 || G < 1 || n < 1 || seg < 1 || call->q_range < 1 || count < 1) return -1;
    const int64_t segments = (count + seg - 1) / seg, items = (int64_t)B * H * segments, stride = (int64_t)G * (D + 2);
    float *rotated = call->scratch, *parts = call->scratch + (int64_t)B * H * G * D;
    const float *hadamard = call->hadamard;
    /* The queries rotated into the coordinates' space and scaled: row r of K/V head h is query r % n of head
       h*g + r/n. */
    for (int64_t bh = 0; bh < (int64_t)B * H; bh++) {
        int64_t b = bh / H, h = bh % H;
        for (int r = 0; r < G; r++) {
            int64_t base = b * call->q_strides[0] + (h * call->g + r / n) * call->q_strides[1] +
                           (int64_t)(r % n) * call->q_strides[2];
            float row[MAX_DIM];
            for (int d = 0; d < D; d++) row[d] = value_at(call->q, call->q_bf16, base + d);
            float *into = rotated + (bh * G + r) * D;
            for (int j = 0; j < D; j++) {
                float sum = 0.0f;
                for (int d = 0; d < D; d++) sum += row[d] * hadamard[(int64_t)j * D + d];
                into[j] = sum * call->scale;
            }
        }
    }
    const float half_over_q = (float)(0.5 / (double)call->q_range);
    const int64_t *cs = call->c_strides, *ns = call->n_strides;
#pragma omp parallel for num_threads(call->threads) schedule(static) if (call->threads > 1 && items > 1)
    for (int64_t i = 0; i < items; i++) {
        int64_t bh = i / segments, part = i % segments;
        int64_t b = bh / H, h = bh % H;
        int64_t start = part * seg, end = start + seg < count ? start + seg : count;
        int64_t k_scale = b * ns[0] + h * ns[1], v_scale = (b + B) * ns[0] + h * ns[1];
        Held held = {call->coords + b * cs[0] + h * cs[1],
                     call->coords + (b + B) * cs[0] + h * cs[1],
                     call->norms + k_scale,
                     call->qmax + k_scale,
                     call->norms + v_scale,
                     call->qmax + v_scale,
                     cs[2],
                     ns[2],
                     half_over_q};
        float *p = parts + i * stride;
#if TILES
        if (call->tiles && D % 32 == 0 && G >= TRANSPOSE_ROWS) /* fewer rows: key by key is as fast */
            held_segment_tiles(rotated + bh * G * D, &held, call->allowed, call->s_allowed, n, G, D, start, end, p,
                               p + (int64_t)G * D, p + (int64_t)G * D + G);
        else
#endif
            segment(rotated + bh * G * D, &held, call->allowed, call->s_allowed, n, G, D, start, end, p,
                    p + (int64_t)G * D, p + (int64_t)G * D + G);
    }
    /* Per row: the segments merged in order, rotated back, then the dense tail under the same running softmax. */
    for (int64_t bh = 0; bh < (int64_t)B * H; bh++) {
        int64_t b = bh / H, h = bh % H;
        for (int r = 0; r < G; r++) {
            float m, total, acc[MAX_DIM];
            merge_segments(parts + bh * segments * stride, stride, segments, G, D, r, &m, &total, acc);
            float *o = call->out + (bh * G + r) * D;
            for (int j = 0; j < D; j++) o[j] = 0.0f;
            for (int d = 0; d < D; d++)
                for (int j = 0; j < D; j++) o[j] += acc[d] * hadamard[(int64_t)d * D + j];
            if (call->tail_count > 0) {
                int64_t qbase = b * call->q_strides[0] + (h * call->g + r / n) * call->q_strides[1] +
                                (int64_t)(r % n) * call->q_strides[2];
                int64_t tbase = b * call->t_strides[0] + h * call->t_strides[1];
                const uint8_t *readable =
                    call->tail_allowed ? call->tail_allowed + (int64_t)(r % n) * call->s_tail_allowed : NULL;
                for (int64_t t = 0; t < call->tail_count; t++) {
                    if (readable && !readable[t]) continue;
                    int64_t at = tbase + t * call->t_strides[2];
                    float score = 0.0f;
                    for (int d = 0; d < D; d++)
                        score += value_at(call->q, call->q_bf16, qbase + d) *
                                 value_at(call->tail_keys, call->tail_bf16, at + d);
                    score *= call->scale;
                    float top = score > m ? score : m;
                    float correction = m == -INFINITY ? 0.0f : expf(m - top), weight = expf(score - top);
                    total = total * correction + weight;
                    for (int j = 0; j < D; j++)
                        o[j] = o[j] * correction + weight * value_at(call->tail_values, call->tail_bf16, at + j);
                    m = top;
                }
            }
            float divisor = total > 1.1754943508222875e-38f ? total : 1.1754943508222875e-38f;
            for (int j = 0; j < D; j++) o[j] /= divisor;
            call->lse[bh * G + r] = (m == -INFINITY ? 0.0f : m) + logf(total);
        }
    }
    return 0;
}

/* Attention over dense K/V (float32 or bfloat16), the same way: keys in tiles of TILE at fixed boundaries from the
   first key, every tile whole (keys past the history, or masked, weigh exactly 0), segments of `seg` keys merged in
   order, and every row's arithmetic the same whatever the rows beside it. A query's result therefore depends on its
   own values, the keys it reads and the mask alone: not on the block it came in, the batch, or the thread count. */

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

#if VECTORS && defined(__AVX512BF16__)
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
#else
#define PAIRS 0
#endif

/* 1 when dense attention multiplies bfloat16 queries and K/V as bfloat16, two dimensions a step (AVX512-BF16, and the
   tile unit where it is granted): the kernel's fast path for them. */
int dense_bf16_products(void) { return PAIRS; }

/* The width in bits of the vectors dense attention scores and sums on, float32 K/V included: 512 (AVX-512), 256
   (AVX2 with FMA), or 0 (plain C loops). */
int dense_vectors(void) { return VECTORS ? 512 : VECTORS8 ? 256 : 0; }

#if TILES
#include <sys/syscall.h>
#include <unistd.h>

/* Asks Linux for the tile registers' state (once per process suffices; asking again is harmless): 1 when granted. */
int dense_tiles_enable(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* The tile configuration a caller had (saved by _tile_storeconfig; palette 0: none) put back, or the tiles released:
   PyTorch's kernels keep their configuration from one call to the next on a thread. */
static inline void restore_tiles(const TileConfig *saved) {
    if (saved->palette)
        _tile_loadconfig(saved);
    else
        _tile_release();
}

/* Tiles 0-3: m rows of 16 float32 sums; 4: m rows of 32 bfloat16 (queries, or weights); 5 and 6: 16 rows of 16
   bfloat16 pairs (keys by pairs of dimensions, or values by pairs of keys). */
static void configure_tiles(int m) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 5; t++) {
        c.rows[t] = (uint8_t)m;
        c.colsb[t] = 64;
    }
    for (int t = 5; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* Dot products of m (1 to 16) bfloat16 query rows (pairs of dimensions as uint32, rows D floats apart) with 64 keys
   (`by_pair` [D/2][TILE]: a pair of dimensions' keys side by side) into out[i * ld + t], by the tile unit: each its
   own row's and key's, whatever m is. */
static inline void tiles_scores(const float *q, int D, const uint32_t *by_pair, float *out, int ld) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int p = 0; p < D / 32; p++) {
        const uint32_t *b = by_pair + (int64_t)16 * p * TILE;
        _tile_loadd(4, (const uint32_t *)q + 16 * p, D * 4);
        _tile_loadd(5, b, TILE * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + 16, TILE * 4);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, b + 32, TILE * 4);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, b + 48, TILE * 4);
        _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, out, ld * 4);
    _tile_stored(1, out + 16, ld * 4);
    _tile_stored(2, out + 32, ld * 4);
    _tile_stored(3, out + 48, ld * 4);
}

static inline __attribute__((always_inline)) void transpose16(const float *src, int64_t s_src, float *dst,
                                                               int64_t s_dst);

/* G bfloat16 query rows (pairs of dimensions as uint32, rows D floats apart) by pair, 16 rows at a time: for rows r to
   r + 16, [D/2][16] at by_query + r * D / 2, zeros past G: the right operands of tiles_key_scores. */
static inline void queries_by_pair(const float *q, int G, int D, uint32_t *by_query) {
    for (int r = 0; r < G; r += 16)
        for (int p = 0; p < D / 2; p++)
            for (int i = 0; i < 16; i++)
                by_query[r * D / 2 + p * 16 + i] = r + i < G ? ((const uint32_t *)(q + (int64_t)(r + i) * D))[p] : 0;
}

/* What tiles_scores gives for 16 keys, with the keys the tile unit's left operand, read where they are held (16
   bfloat16 rows s_key apart) instead of transposed first: out[i * ld + t] for query row i and key t. Each score is
   the same pairs' products summed in the same order as there, so the bits are the same. */
static inline void tiles_key_scores(const uint16_t *keys, int64_t s_key, int D, const uint32_t *by_query, float *out,
                                    int ld) {
    float by_key[16 * 16];
    _tile_zero(7);
    for (int p = 0; p < D / 32; p++) {
        _tile_loadd(5, keys + 32 * p, s_key * 2);
        _tile_loadd(6, by_query + 16 * 16 * p, 64);
        _tile_dpbf16ps(7, 5, 6);
    }
    _tile_stored(7, by_key, 64);
    transpose16(by_key, 16, out, ld);
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

/* acc[i] += sum over `width` keys of w[i][t] * v[t] for m (1 to 16) rows, the weights bfloat16 (`weights`
   [m][width]), multiplied by the value pairs by the tile unit 32 keys at a time; each row's sums its own. */
static inline void tiles_values(float *acc, int m, int D, const uint16_t *weights, int width, const uint32_t *pairs,
                                float *sums /* [16][64] */) {
    for (int d0 = 0; d0 < D; d0 += 64) {
        int parts = (D - d0 < 64 ? D - d0 : 64) / 16;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int h = 0; h < width / 32; h++) { /* keys 32h to 32h + 31: 16 pairs */
            const uint32_t *b = pairs + (int64_t)16 * h * D + d0;
            _tile_loadd(4, weights + 32 * h, width * 2);
            _tile_loadd(5, b, D * 4);
            _tile_dpbf16ps(0, 4, 5);
            if (parts > 1) {
                _tile_loadd(6, b + 16, D * 4);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (parts > 2) {
                _tile_loadd(5, b + 32, D * 4);
                _tile_dpbf16ps(2, 4, 5);
            }
            if (parts > 3) {
                _tile_loadd(6, b + 48, D * 4);
                _tile_dpbf16ps(3, 4, 6);
            }
        }
        _tile_stored(0, sums, 64 * 4);
        if (parts > 1) _tile_stored(1, sums + 16, 64 * 4);
        if (parts > 2) _tile_stored(2, sums + 32, 64 * 4);
        if (parts > 3) _tile_stored(3, sums + 48, 64 * 4);
        for (int i = 0; i < m; i++)
            for (int j = 0; j < parts; j++) {
                float *o = acc + (int64_t)i * D + d0 + 16 * j;
                _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_loadu_ps(sums + i * 64 + 16 * j)));
            }
    }
}
#else
int dense_tiles_enable(void) { return 0; }
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
            for (int d0 = 0; d0 < D; d0 += 16) transpose16(by_key + (int64_t)t0 * D + d0, D, by_dim + (int64_t)d0 * TILE + t0, TILE);
        return;
    }
#endif
    for (int t = 0; t < TILE; t++)
        for (int d = 0; d < D; d++) by_dim[d * TILE + t] = by_key[t * D + d];
}

/* A work item's G rows from row0 started (nothing read: output 0, maximum -inf, total 0); returns the end of the
   keys some row reads (row r reads below hi[r % n]). */
static inline int64_t dense_start(const int64_t *hi, int n, int row0, int G, int D, float *acc, float *top,
                                  float *sums) {
    for (int r = 0; r < G; r++) {
        top[r] = -INFINITY;
        sums[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)G * (size_t)D);
    int64_t reach = 0;
    for (int r = 0; r < G && r < n; r++) reach = hi[(row0 + r) % n] > reach ? hi[(row0 + r) % n] : reach;
    return reach;
}

#if VECTORS || VECTORS8
/* values_of for G query rows from row0, ROW_GROUP at a time, over a tile of keys from t0 whose values lie as
   tile_values reads them; a group of rows none of which reads the tile skips it (for such a row the tile changes
   nothing). */
static inline __attribute__((always_inline)) void dense_values(float *acc, const float *scores, const int64_t *hi,
                                                               int n, int row0, int G, int D, int64_t t0, int nt,
                                                               const void *base, int kind, int64_t s_pos,
                                                               int64_t origin) {
    for (int r = 0; r < G; r += ROW_GROUP) {
        int rows = G - r < ROW_GROUP ? G - r : ROW_GROUP, reads = 0;
        for (int i = 0; i < rows; i++) reads |= hi[(row0 + r + i) % n] > t0;
        if (!reads) continue;
        values_of(acc + (int64_t)r * D, scores + r * TILE, rows, D, nt, base, kind, s_pos, origin);
    }
}
#endif

/* Keys [start, end) of one (batch, K/V head) (K rows s_key apart, V rows s_value) for G of its query rows from
   row0 (row r: query r % n, which reads keys below hi[r % n] that `allowed` allows, or all of them where it is
   NULL): unnormalised output acc [G, D], running maximum top [G] and sum sums [G]. */
static inline __attribute__((always_inline)) void dense_segment_of(const float *q, const void *keys,
                                                                   const void *values, int bf16, int64_t s_key,
                                                                   int64_t s_value, int64_t count, const int64_t *hi,
                                                                   const uint8_t *allowed, int64_t s_allowed, int n,
                                                                   int row0, int G, int D, int pairs, float scale,
                                                                   int64_t start, int64_t end, float *acc,
                                                                   float *top, float *sums) {
    float scores[G * TILE];
    float by_key[TILE * D];
    float by_dim[D * TILE];
    int64_t reach = dense_start(hi, n, row0, G, D, acc, top, sums); /* keys below it are read by some row */
    for (int64_t t0 = start; t0 < end && t0 < reach; t0 += TILE) {
        if (pairs) { /* a pair of dimensions is one 32-bit value: transposed as such */
#if VECTORS
            if (t0 + TILE <= count && s_key % 2 == 0 && (D / 2) % 16 == 0) { /* a whole tile: from where it is held */
                const float *held = (const float *)((const uint16_t *)keys + t0 * s_key);
                for (int k0 = 0; k0 < TILE; k0 += 16)
                    for (int d0 = 0; d0 < D / 2; d0 += 16)
                        transpose16(held + k0 * (s_key / 2) + d0, s_key / 2, by_dim + (int64_t)d0 * TILE + k0, TILE);
            } else
#endif
            {
                pair_rows(keys, s_key, t0, count, D, (uint32_t *)by_key);
                by_dimension(by_key, D / 2, by_dim);
            }
        } else {
#if VECTORS8
            if (D % 16 == 0)
                keys_by_dimension8(keys, bf16 ? AS_BF16 : AS_FLOAT32, s_key, t0, count, D, by_dim);
            else
#endif
            {
                dense_rows(keys, bf16, s_key, t0, count, D, by_key);
                by_dimension(by_key, D, by_dim);
            }
        }
        /* A group of rows none of which reads this tile skips it: for such a row the tile would change
           nothing (its weights are 0, its correction exactly 1). */
        for (int r = 0; r < G; r += ROW_GROUP) {
            int rows = G - r < ROW_GROUP ? G - r : ROW_GROUP, reads = 0;
            for (int i = 0; i < rows; i++) reads |= hi[(row0 + r + i) % n] > t0;
            float *s = scores + r * TILE;
            if (!reads) {
                for (int i = 0; i < rows * TILE; i++) s[i] = -INFINITY;
                continue;
            }
#if PAIRS
            if (pairs) {
                const uint32_t *qp = (const uint32_t *)(q + (int64_t)r * D), *kp = (const uint32_t *)by_dim;
                if (rows == 4) /* the rows' count known to the compiler: no test in the loop */
                    tile_scores_pairs(qp, 4, D, kp, scale, s);
                else
                    tile_scores_pairs(qp, rows, D, kp, scale, s);
                continue;
            }
#endif
#if VECTORS || VECTORS8
            if (D % 16 == 0) {
                scores_of(q + (int64_t)r * D, rows, D, by_dim, s);
                continue;
            }
#endif
            for (int i = 0; i < rows; i++) {
                const float *qr = q + (int64_t)(r + i) * D;
                float sum[TILE];
                for (int t = 0; t < TILE; t++) sum[t] = 0.0f;
                for (int d = 0; d < D; d++) {
                    float qd = qr[d];
                    for (int t = 0; t < TILE; t++) sum[t] += qd * by_dim[d * TILE + t];
                }
                for (int t = 0; t < TILE; t++) s[i * TILE + t] = sum[t];
            }
        }
        for (int r = 0; r < G; r++)
            row_weights(scores + r * TILE, TILE, 1.0f, 0, t0, hi, allowed, s_allowed, n, row0 + r, D,
                        acc + (int64_t)r * D, top + r, sums + r);
#if VECTORS || VECTORS8
        if (D % 16 == 0) {
            if (bf16 || VECTORS8) /* the values read where they are held (float32 ones copied first on AVX-512) */
                dense_values(acc, scores, hi, n, row0, G, D, t0, (int)(count - t0 < TILE ? count - t0 : TILE), values,
                             bf16 ? AS_BF16 : AS_FLOAT32, s_value, t0);
            else {
                dense_rows(values, bf16, s_value, t0, count, D, by_key);
                dense_values(acc, scores, hi, n, row0, G, D, t0, TILE, by_key, AS_FLOAT32, D, 0);
            }
            continue;
        }
#endif
        dense_rows(values, bf16, s_value, t0, count, D, by_key);
        for (int r = 0; r < G; r++) {
            float row[D];
            float *o = acc + (int64_t)r * D;
            const float *w = scores + r * TILE;
            for (int d = 0; d < D; d++) row[d] = o[d];
            for (int t = 0; t < TILE; t++)
                for (int d = 0; d < D; d++) row[d] += w[t] * by_key[t * D + d];
            for (int d = 0; d < D; d++) o[d] = row[d];
        }
    }
}

#if TILES
#define STEP 256 /* keys under one softmax step of the tile path: STEP / TILE tiles, at fixed places */
#define IN_PLACE_ROWS 32 /* query rows up to which the tile path scores keys where they are held */

/* dense_segment_of for bfloat16 queries and K/V by the tile unit: keys in steps of STEP at fixed places, 16 rows at a
   time, each step's scores (a tile of 64 keys at a time), each row's weights over the step as there, rounded to
   bfloat16, times the values. A row's sums are its own whatever rows share its tiles (a row that does not read a
   step gets weights 0 from it, which change nothing); the caller's tile configuration, if any, is put back. */
static void dense_segment_tiles(const float *q, const void *keys, const void *values, int64_t s_key, int64_t s_value,
                                int64_t count, const int64_t *hi, const uint8_t *allowed, int64_t s_allowed, int n,
                                int row0, int G, int D, float scale, int64_t start, int64_t end, float *acc,
                                float *top, float *sums) {
    float scores[16 * STEP], products[16 * 64];
    uint16_t weights[16 * STEP];
    uint32_t by_key[TILE * D / 2], by_pair[STEP * D / 2], pairs[STEP / 2 * D], by_query[IN_PLACE_ROWS * D / 2];
    TileConfig saved;
    _tile_storeconfig(&saved);
    int configured = 0, in_place = G <= IN_PLACE_ROWS; /* keys scored where they are held, not transposed first */
    if (in_place) queries_by_pair(q, G, D, by_query);
    int64_t reach = dense_start(hi, n, row0, G, D, acc, top, sums); /* keys below it are read by some row */
    for (int64_t t0 = start; t0 < end && t0 < reach; t0 += STEP) {
        for (int j = 0; j < STEP / TILE && !in_place; j++) {
            pair_rows(keys, s_key, t0 + j * TILE, count, D, by_key);
            by_dimension((const float *)by_key, D / 2, (float *)(by_pair + j * TILE * D / 2));
        }
        value_pairs((const uint16_t *)values, s_value, t0, count, STEP, D, pairs);
        for (int r = 0; r < G; r += 16) {
            int m = G - r < 16 ? G - r : 16, reads = 0;
            for (int i = 0; i < m; i++) reads |= hi[(row0 + r + i) % n] > t0;
            if (!reads) continue; /* weights 0 for every row: nothing would change */
            if (m != configured) configure_tiles(configured = m);
            for (int j = 0; j < STEP / TILE && !in_place; j++)
                tiles_scores(q + (int64_t)r * D, D, by_pair + j * TILE * D / 2, scores + j * TILE, STEP);
            for (int t = 0; t < STEP && in_place; t += 16) {
                int64_t k = t0 + t, held = count - k < 16 ? count - k : 16;
                if (held <= 0) { /* past the keys: scored 0, as the zeros tiles_scores multiplies there */
                    for (int i = 0; i < m; i++) memset(scores + i * STEP + t, 0, sizeof(float) * 16);
                    continue;
                }
                if (held < 16) { /* the last keys, copied with zeros after them: nothing past them is read */
                    pair_rows(keys, s_key, k, count, D, by_key);
                    tiles_key_scores((const uint16_t *)by_key, D, D, by_query + r * D / 2, scores + t, STEP);
                } else {
                    tiles_key_scores((const uint16_t *)keys + k * s_key, s_key, D, by_query + r * D / 2, scores + t,
                                     STEP);
                }
            }
            for (int i = 0; i < m; i++) {
                float *s = scores + i * STEP;
                row_weights(s, STEP, scale, 1, t0, hi, allowed, s_allowed, n, row0 + r + i, D,
                            acc + (int64_t)(r + i) * D, top + r + i, sums + r + i);
                for (int t = 0; t < STEP; t += 32) {
                    __m512bh rounded = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + t + 16), _mm512_loadu_ps(s + t));
                    _mm512_storeu_si512(weights + i * STEP + t, (__m512i)rounded);
                }
            }
            tiles_values(acc + (int64_t)r * D, m, D, weights, STEP, pairs, products);
        }
    }
    restore_tiles(&saved);
}
#endif

#if TILES
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

/* segment_of on the tile unit: the rotated queries rounded to bfloat16 and scored against the key coordinates 16
   rows at a time, each key's score times its factor, each row's weights over the tile as there, times the value's
   factor and rounded to bfloat16, multiplied by the value coordinates. The caller's tile configuration, if any, is
   put back. */
static void held_segment_tiles(const float *q, const Held *held, const uint8_t *allowed, int64_t s_allowed, int n,
                               int G, int D, int64_t start, int64_t end, float *acc, float *top, float *sums) {
    float rows[G * D], scores[16 * TILE], products[16 * 64], key_factors[TILE], value_factors[TILE];
    uint16_t weights[16 * TILE], converted[TILE * D];
    uint32_t by_pair[TILE * D / 2], pairs[TILE / 2 * D], by_query[IN_PLACE_ROWS * D / 2];
    float scored[IN_PLACE_ROWS * TILE];
    TileConfig saved;
    _tile_storeconfig(&saved);
    int configured = 0, in_place = G <= IN_PLACE_ROWS; /* keys scored as converted, not transposed */
    for (int r = 0; r < G; r++) { /* a row's pairs of dimensions in its first D/2 floats, as tiles_scores reads */
        for (int d = 0; d < D; d += 32) {
            __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + (int64_t)r * D + d + 16),
                                                _mm512_loadu_ps(q + (int64_t)r * D + d));
            _mm512_storeu_si512((uint16_t *)(rows + (int64_t)r * D) + d, (__m512i)pair);
        }
        top[r] = -INFINITY;
        sums[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)G * (size_t)D);
    if (in_place) queries_by_pair(rows, G, D, by_query);
    for (int64_t t0 = start; t0 < end; t0 += TILE) {
        int nt = (int)(end - t0 < TILE ? end - t0 : TILE);
        factors_of(held->key_norms, held->key_qmax, held->s_scale, held->half_over_q, t0, nt, key_factors);
        factors_of(held->value_norms, held->value_qmax, held->s_scale, held->half_over_q, t0, nt, value_factors);
        for (int t = nt; t < TILE; t++) key_factors[t] = value_factors[t] = 0.0f;
        coordinates_bf16(held->keys, held->s_pos, t0, nt, D, converted);
        for (int r = 0; r < G && in_place; r += 16) {
            if (!configured) configure_tiles(configured = G - r < 16 ? G - r : 16);
            for (int t = 0; t < TILE; t += 16)
                tiles_key_scores(converted + t * D, D, D, by_query + r * D / 2, scored + r * TILE + t, TILE);
        }
        if (!in_place) by_dimension((const float *)converted, D / 2, (float *)by_pair);
        coordinates_bf16(held->values, held->s_pos, t0, nt, D, converted);
        value_pairs(converted, D, 0, TILE, TILE, D, pairs);
        for (int r = 0; r < G; r += 16) {
            int m = G - r < 16 ? G - r : 16;
            if (m != configured) configure_tiles(configured = m);
            float *group = in_place ? scored + r * TILE : scores; /* the group's scores [m][TILE] */
            if (!in_place) tiles_scores(rows + (int64_t)r * D, D, by_pair, scores, TILE);
            for (int i = 0; i < m; i++) {
                float *s = group + i * TILE;
                const uint8_t *a = allowed ? allowed + (int64_t)((r + i) % n) * s_allowed + t0 : NULL;
                __m512 best = _mm512_set1_ps(top[r + i]);
                for (int t = 0; t < TILE; t += 16) { /* keys past nt, or not allowed, score -inf */
                    __mmask16 keep = t >= nt ? 0 : nt - t >= 16 ? 0xffff : (__mmask16)((1u << (nt - t)) - 1);
                    if (a) keep = _mm_mask_test_epi8_mask(keep, _mm_maskz_loadu_epi8(keep, a + t), _mm_set1_epi8(-1));
                    __m512 v = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), keep, _mm512_loadu_ps(s + t),
                                                  _mm512_loadu_ps(key_factors + t));
                    _mm512_storeu_ps(s + t, v);
                    best = _mm512_max_ps(best, v);
                }
                float mx = _mm512_reduce_max_ps(best);
                if (mx == -INFINITY) { /* nothing readable yet: weights 0 */
                    memset(weights + i * TILE, 0, sizeof(uint16_t) * TILE);
                    continue;
                }
                float correction = top[r + i] == -INFINITY ? 0.0f : exp_nonpositive(top[r + i] - mx);
                float total = tile_weights(s, TILE, mx, 1);
                sums[r + i] = sums[r + i] * correction + total;
                top[r + i] = mx;
                float *o = acc + (int64_t)(r + i) * D;
                for (int d = 0; d < D; d++) o[d] *= correction;
                for (int t = 0; t < TILE; t += 32) {
                    __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(s + t), _mm512_loadu_ps(value_factors + t));
                    __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(s + t + 16), _mm512_loadu_ps(value_factors + t + 16));
                    _mm512_storeu_si512(weights + i * TILE + t, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                }
            }
            tiles_values(acc + (int64_t)r * D, m, D, weights, TILE, pairs, products);
        }
    }
    restore_tiles(&saved);
}
#endif

static void dense_segment_64(const float *q, const void *keys, const void *values, int bf16, int64_t s_key,
                             int64_t s_value, int64_t count, const int64_t *hi, const uint8_t *allowed,
                             int64_t s_allowed, int n, int row0, int G, int pairs, float scale, int64_t start,
                             int64_t end, float *acc, float *top, float *sums) {
    dense_segment_of(q, keys, values, bf16, s_key, s_value, count, hi, allowed, s_allowed, n, row0, G, 64, pairs, scale,
                     start, end, acc, top, sums);
}

static void dense_segment_128(const float *q, const void *keys, const void *values, int bf16, int64_t s_key,
                             int64_t s_value, int64_t count, const int64_t *hi, const uint8_t *allowed,
                             int64_t s_allowed, int n, int row0, int G, int pairs, float scale, int64_t start,
                             int64_t end, float *acc, float *top, float *sums) {
    dense_segment_of(q, keys, values, bf16, s_key, s_value, count, hi, allowed, s_allowed, n, row0, G, 128, pairs, scale,
                     start, end, acc, top, sums);
}

/* One call: attention of queries [B, H*g, n, D] over dense K/V [B, H, >=count, D]. */
typedef struct {
    const void *q;
    int64_t q_strides[3]; /* batch, head, query */
    int q_bf16;
    const void *keys, *values; /* of one dtype */
    int64_t k_strides[3], v_strides[3];
    int kv_bf16;
    int64_t count;
    const int64_t *hi;      /* [n]: query i reads keys below hi[i] */
    const uint8_t *allowed; /* NULL (every key below hi) or [n, >=count] bytes */
    int64_t s_allowed;
    float scale;
    int B, H, g, n, D;
    int64_t seg;
    int threads;
    int tiles;      /* bfloat16 queries and K/V by the tile unit (granted by dense_tiles_enable) */
    float *scratch; /* held_attend_scratch(...) floats: the same layout */
    float *out;     /* [B, H*g, n, D] at o_strides */
    int64_t o_strides[3]; /* batch, query head, query (of a contiguous output: H*g*n*D, n*D, D) */
    float *lse;     /* [B, H, g*n] (-inf: no readable key), or NULL */
    int rounded;    /* float32 queries read rounded to bfloat16 and the output rounded to bfloat16 (as float32), as
                       casting the queries to the K/V's bfloat16 and the output back would (not with bfloat16
                       products: those read bfloat16 queries) */
} DenseCall;

/* x rounded to the nearest bfloat16 (ties to even; a NaN stays a NaN), as float32: PyTorch's cast to bfloat16. */
static inline float bf16_rounded(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits = x != x ? 0x7fc00000u : ((bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u);
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Whether the kernel serves a call's shapes. */
static int dense_serves(const DenseCall *call) {
    if (call->D > MAX_DIM || call->D < 1 || call->g * call->n < 1 || call->n < 1 || call->seg < 1 ||
        call->seg % TILE != 0 || call->count < 1)
        return 0;
#if TILES
    if (call->tiles && call->seg % STEP != 0) return 0;
#endif
    if (call->rounded && (call->q_bf16 || PAIRS)) return 0; /* bfloat16 products (the tile unit's too) read bfloat16 */
    return 1;
}

/* bfloat16 queries and keys are scored by the CPU's bfloat16 dot product, the queries as they are (each row's first
   D/2 floats hold its pairs), the scale applied to the sums. */
static inline int dense_pairs(const DenseCall *call) {
    return PAIRS && call->q_bf16 && call->kv_bf16 && call->D % 32 == 0;
}

/* Work items of a call: a segment of a (batch, K/V head) for a block of up to ROW_BLOCK rows (the threads stay busy
   when a block of many queries reads few segments; a row's values do not depend on its block). */
static inline int64_t dense_items(const DenseCall *call) {
    const int G = call->g * call->n;
    const int64_t segments = (call->count + call->seg - 1) / call->seg, row_blocks = (G + ROW_BLOCK - 1) / ROW_BLOCK;
    return (int64_t)call->B * call->H * segments * row_blocks;
}

/* The queries of a call as its segments read them, in the front of its scratch. */
static void dense_prepare(const DenseCall *call) {
    const int H = call->H, n = call->n, D = call->D, G = call->g * call->n, pairs = dense_pairs(call);
    float *scaled = call->scratch;
    for (int64_t bh = 0; bh < (int64_t)call->B * H; bh++) {
        int64_t b = bh / H, h = bh % H;
        for (int r = 0; r < G; r++) {
            int64_t base = b * call->q_strides[0] + (h * call->g + r / n) * call->q_strides[1] +
                           (int64_t)(r % n) * call->q_strides[2];
            float *into = scaled + (bh * G + r) * D;
            if (pairs)
                memcpy(into, (const uint16_t *)call->q + base, sizeof(uint16_t) * (size_t)D);
            else
                for (int d = 0; d < D; d++) {
                    const float x = value_at(call->q, call->q_bf16, base + d);
                    into[d] = (call->rounded ? bf16_rounded(x) : x) * call->scale;
                }
        }
    }
}

/* Work item i of a call: its segment's partial result, in the call's scratch. */
static void dense_item(const DenseCall *call, int64_t i) {
    const int H = call->H, n = call->n, D = call->D, G = call->g * call->n, pairs = dense_pairs(call);
    const int64_t count = call->count, seg = call->seg;
    const int64_t segments = (count + seg - 1) / seg, stride = (int64_t)G * (D + 2);
    const int64_t row_blocks = (G + ROW_BLOCK - 1) / ROW_BLOCK;
    const float *scaled = call->scratch;
    float *parts = call->scratch + (int64_t)call->B * H * G * D;
    const int64_t *ks = call->k_strides, *vs = call->v_strides;
    const int64_t elem = call->kv_bf16 ? 2 : 4;
    int64_t rb = i % row_blocks, bh = i / row_blocks / segments, part = i / row_blocks % segments;
    int64_t b = bh / H, h = bh % H;
    int64_t start = part * seg, end = start + seg < count ? start + seg : count;
    int row0 = (int)(rb * ROW_BLOCK), rows = G - row0 < ROW_BLOCK ? G - row0 : ROW_BLOCK;
    const char *k = (const char *)call->keys + (b * ks[0] + h * ks[1]) * elem;
    const char *v = (const char *)call->values + (b * vs[0] + h * vs[1]) * elem;
    float *p = parts + (bh * segments + part) * stride;
    float *acc = p + (int64_t)row0 * D, *top = p + (int64_t)G * D + row0, *sums = p + (int64_t)G * D + G + row0;
    const float *qs = scaled + (bh * G + row0) * D;
#if TILES
    if (pairs && call->tiles)
        dense_segment_tiles(qs, k, v, ks[2], vs[2], count, call->hi, call->allowed, call->s_allowed, n, row0, rows, D,
                            call->scale, start, end, acc, top, sums);
    else
#endif
    if (D == 64)
        dense_segment_64(qs, k, v, call->kv_bf16, ks[2], vs[2], count, call->hi, call->allowed, call->s_allowed, n, row0,
                         rows, pairs, call->scale, start, end, acc, top, sums);
    else if (D == 128)
        dense_segment_128(qs, k, v, call->kv_bf16, ks[2], vs[2], count, call->hi, call->allowed, call->s_allowed, n,
                          row0, rows, pairs, call->scale, start, end, acc, top, sums);
    else
        dense_segment_of(qs, k, v, call->kv_bf16, ks[2], vs[2], count, call->hi, call->allowed, call->s_allowed, n,
                         row0, rows, D, pairs, call->scale, start, end, acc, top, sums);
}

/* A call's segments merged in order into its output (and log-sum-exp). */
static void dense_finish(const DenseCall *call) {
    const int H = call->H, D = call->D, G = call->g * call->n;
    const int64_t segments = (call->count + call->seg - 1) / call->seg, stride = (int64_t)G * (D + 2);
    const float *parts = call->scratch + (int64_t)call->B * H * G * D;
    const int64_t *os = call->o_strides;
    for (int64_t bh = 0; bh < (int64_t)call->B * H; bh++) {
        int64_t b = bh / H, h = bh % H;
        for (int r = 0; r < G; r++) {
            float m, total, acc[MAX_DIM];
            merge_segments(parts + bh * segments * stride, stride, segments, G, D, r, &m, &total, acc);
            float divisor = total > 1.1754943508222875e-38f ? total : 1.1754943508222875e-38f;
            float *o = call->out + b * os[0] + (h * call->g + r / call->n) * os[1] + (int64_t)(r % call->n) * os[2];
            for (int d = 0; d < D; d++) o[d] = call->rounded ? bf16_rounded(acc[d] / divisor) : acc[d] / divisor;
            if (call->lse) call->lse[bh * G + r] = m == -INFINITY ? -INFINITY : m + logf(total);
        }
    }
}

/* Attention over dense K/V with the guarantees above. Returns 0, or -1 when the shapes are beyond what the kernel
   serves. */
int dense_attend(const DenseCall *call) {
    if (!dense_serves(call)) return -1;
    dense_prepare(call);
    const int64_t items = dense_items(call);
#pragma omp parallel for num_threads(call->threads) schedule(static) if (call->threads > 1 && items > 1)
    for (int64_t i = 0; i < items; i++) dense_item(call, i);
    dense_finish(call);
    return 0;
}

#define MAX_CALLS 256 /* calls of one dense_attend_many */

/* Several independent calls (the rows of a batched forward, each its own queries, K/V and scratch) in one parallel
   region: their work items share the threads, so rows of different lengths keep both busy and the threads are
   woken once, not once per row. Each call's values are those dense_attend gives it: the same items, merged in the
   same order. Returns 0, or -1 when a call's shapes are beyond what the kernel serves (nothing is written then). */
int dense_attend_many(const DenseCall *calls, int count, int threads) {
    if (count < 1 || count > MAX_CALLS) return -1;
    int64_t first[MAX_CALLS + 1];
    first[0] = 0;
    for (int c = 0; c < count; c++) {
        if (!dense_serves(&calls[c])) return -1;
        first[c + 1] = first[c] + dense_items(&calls[c]);
    }
    for (int c = 0; c < count; c++) dense_prepare(&calls[c]);
    const int64_t items = first[count];
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && items > 1)
    for (int64_t i = 0; i < items; i++) {
        int lo = 0, hi = count - 1; /* the call whose items hold i: first[lo] <= i < first[lo + 1] */
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (first[mid] <= i) lo = mid; else hi = mid - 1;
        }
        dense_item(&calls[lo], i - first[lo]);
    }
    for (int c = 0; c < count; c++) dense_finish(&calls[c]);
    return 0;
}
