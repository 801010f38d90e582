/* Attention of a few queries over keys and values held as int8 lattice coordinates, on the CPU, in one pass over
   them: 64 keys' coordinates at a time are converted to float32 in a buffer that stays in the core's cache, scored
   against the rotated queries, and the values accumulated under a softmax kept online, so no float32 copy of the
   history is ever written; then the dense tail (the forward's own K/V). Built and loaded by held_kernel.py; the
   values are those of `_held_attention` (held_attention.py) within float rounding.

   The keys are read in segments of `seg` at fixed boundaries, one segment per work item, and the segments of a
   (batch, K/V head) merged in order: a query's result does not depend on the thread count, on the other queries
   beside it, or on how its history was delivered. */

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define TILE 64      /* keys scored at a time within a segment */
#define MAX_DIM 256  /* the largest head size served */
#define TRANSPOSE_ROWS 8 /* query rows from which a tile's keys are transposed to score them (see segment_of) */

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
    for (int t = 0; t < nt; t++) {
        int64_t at = (t0 + t) * s_scale;
        out[t] = from_half(qmax[at]) * from_half(norms[at]) * half_over_q;
    }
}

#if defined(__AVX512F__)
#define VECTORS 1
#else
#define VECTORS 0
#endif

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

/* acc[i] += sum over the tile's nt keys of w[i][t] * converted[t] for `rows` (1 to 4) rows, 64 dimensions at a time
   with the sums in registers; each row's sum runs over the keys in order, whatever `rows` is. */
static inline __attribute__((always_inline)) void tile_values(float *acc, const float *w, int rows, int D, int nt,
                                                              const float *converted) {
    for (int d0 = 0; d0 < D; d0 += 64) {
        int width = D - d0 < 64 ? D - d0 : 64; /* a multiple of 16 */
        int parts = width / 16;
        __m512 a[4][4];
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < parts; j++) a[i][j] = _mm512_loadu_ps(acc + (int64_t)i * D + d0 + 16 * j);
        for (int t = 0; t < nt; t++) {
            const float *cv = converted + t * D + d0;
            __m512 c[4];
            for (int j = 0; j < parts; j++) c[j] = _mm512_loadu_ps(cv + 16 * j);
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

/* Keys [start, end) of one (batch, K/V head) for its G query rows: unnormalised output acc [G, D], running maximum
   top [G] and sum sums [G]. A tile's key coordinates are converted once, transposed (`by_dim`: a dimension's 64
   keys side by side), so each row's 64 scores build up as vectors over the keys, one dimension at a time; its value
   coordinates are converted once (`converted`) and read by four rows at a time, their running sums in registers (D
   known to the compiler: see segment_64). Every row's sums run in the same order whatever the other rows. */
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
            for (int t = 0; t < nt; t++) {
                const int8_t *k = keys + (t0 + t) * s_pos;
                for (int d = 0; d < D; d++) by_dim[d * TILE + t] = (float)k[d];
            }
            for (int t = nt; t < TILE; t++)
                for (int d = 0; d < D; d++) by_dim[d * TILE + t] = 0.0f;
#if VECTORS
            if (D % 16 == 0) {
                for (int r = 0; r < G; r += 4)
                    tile_scores(q + (int64_t)r * D, G - r < 4 ? G - r : 4, D, by_dim, scores + r * TILE);
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
        for (int t = 0; t < nt; t++) {
            const int8_t *v = values + (t0 + t) * s_pos;
            for (int d = 0; d < D; d++) converted[t * D + d] = (float)v[d];
        }
        int r = 0;
#if VECTORS
        if (D % 16 == 0)
            for (; r < G; r += 4) tile_values(acc + (int64_t)r * D, scores + r * TILE, G - r < 4 ? G - r : 4, D, nt,
                                              converted);
#endif
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
        segment(rotated + bh * G * D, &held, call->allowed, call->s_allowed, n, G, D, start, end, p,
                p + (int64_t)G * D, p + (int64_t)G * D + G);
    }
    /* Per row: the segments merged in order, rotated back, then the dense tail under the same running softmax. */
    for (int64_t bh = 0; bh < (int64_t)B * H; bh++) {
        int64_t b = bh / H, h = bh % H;
        for (int r = 0; r < G; r++) {
            float m = -INFINITY, total = 0.0f, acc[MAX_DIM];
            for (int64_t part = 0; part < segments; part++) {
                float t = parts[(bh * segments + part) * stride + (int64_t)G * D + r];
                m = t > m ? t : m;
            }
            for (int d = 0; d < D; d++) acc[d] = 0.0f;
            if (m != -INFINITY) {
                for (int64_t part = 0; part < segments; part++) {
                    const float *p = parts + (bh * segments + part) * stride;
                    float t = p[(int64_t)G * D + r];
                    if (t == -INFINITY) continue;
                    float c = expf(t - m);
                    total += p[(int64_t)G * D + G + r] * c;
                    for (int d = 0; d < D; d++) acc[d] += p[(int64_t)r * D + d] * c;
                }
            }
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
