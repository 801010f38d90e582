/* Attention of a few queries over keys and values held as int8 lattice coordinates, on the CPU, in one pass over
   them: 64 keys' coordinates at a time are converted to float32 in a buffer that stays in the core's cache, scored
   against the rotated queries, and the values accumulated under a softmax kept online, so no float32 copy of the
   history is ever written; then the dense tail (the forward's own K/V). Built with dense_kernel.c into one library
   and loaded by held_kernel.py; the values are those of `_held_attention` (held_attention.py) within float rounding.

   The keys are read in segments of `seg` at fixed boundaries, one segment per work item, and the segments of a
   (batch, K/V head) merged in order: a query's result does not depend on the thread count. A block of few query rows
   scores keys another way than a block of many (see segment_of), which rounds differently (compressed sessions are
   exact to float rounding only: docs/protocol.md#determinism); over dense K/V (dense_kernel.c) a query's result
   does not depend on the queries beside it either. */

#include "attention_tiles.h"

#define TRANSPOSE_ROWS 8 /* query rows from which a tile's keys are transposed to score them (see segment_of) */

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
#if PAIRS
    /* Many rows and a head size of whole 32s: the rotated queries rounded to bfloat16 and scored by the CPU's
       bfloat16 dot products, two dimensions a step (the coordinates are exact in bfloat16). */
    const int pairs = G >= TRANSPOSE_ROWS && D % 32 == 0;
    uint32_t by_query[pairs ? G * D : 1]; /* row r's pairs of dimensions from r * D, as tile_scores_pairs reads */
    if (pairs)
        for (int r = 0; r < G; r++)
            for (int d = 0; d < D; d += 32)
                _mm512_storeu_si512(by_query + (int64_t)r * D + d / 2,
                                    (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + (int64_t)r * D + d + 16),
                                                                 _mm512_loadu_ps(q + (int64_t)r * D + d)));
#endif
    for (int64_t t0 = start; t0 < end; t0 += TILE) {
        int nt = (int)(end - t0 < TILE ? end - t0 : TILE);
        factors_of(held->key_norms, held->key_qmax, held->s_scale, held->half_over_q, t0, nt, factors);
#if PAIRS
        if (pairs) {
            coordinates_bf16(keys, s_pos, t0, nt, D, (uint16_t *)converted);
            by_dimension(converted, D / 2, by_dim); /* a pair of dimensions' 64 keys side by side */
            for (int r = 0; r < G; r += 4) {
                const uint32_t *qr = by_query + (int64_t)r * D;
                if (G - r >= 4) /* the rows' count known to the compiler: no test in the loop */
                    tile_scores_pairs(qr, 4, D, (const uint32_t *)by_dim, 1.0f, scores + r * TILE);
                else
                    tile_scores_pairs(qr, G - r, D, (const uint32_t *)by_dim, 1.0f, scores + r * TILE);
            }
            for (int r = 0; r < G; r++)
                for (int t = 0; t < nt; t++) scores[r * TILE + t] *= factors[t];
        } else
#endif
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
#if PAIRS
        if (pairs && D % 64 == 0) { /* the weights rounded to bfloat16, two keys a step by the dot product */
            uint32_t *value_by_pair = (uint32_t *)converted;
            coordinate_pairs(values, s_pos, t0, nt, D, value_by_pair);
            for (; r < G; r += 4) {
                int rows = G - r < 4 ? G - r : 4;
                for (int i = 0; i < rows; i++) /* a partial tile's keys past nt weigh 0 */
                    for (int t = nt; t < TILE; t++) scores[(r + i) * TILE + t] = 0.0f;
                weighted_pairs(acc + (int64_t)r * D, scores + r * TILE, rows, D, (nt + 1) / 2, value_by_pair);
            }
            continue;
        }
#endif
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

#if TILES
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
