/* Attention over dense K/V (float32 or bfloat16) on the CPU, as held_kernel.c attends over held coordinates: keys in
   tiles of TILE at fixed boundaries from the first key, every tile whole (keys past the history, or masked, weigh
   exactly 0), segments of `seg` keys merged in order, and every row's arithmetic the same whatever the rows beside
   it. A query's result therefore depends on its own values, the keys it reads and the mask alone: not on the block
   it came in, the batch, or the thread count. Built with held_kernel.c into one library; held_kernel.py loads it
   and dense_calls.py lays out its calls. */

#include "attention_tiles.h"

#define ROW_BLOCK 128    /* query rows of one work item of dense attention (see dense_attend) */


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
#else
int dense_tiles_enable(void) { return 0; }
#endif

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
    const int64_t elem = bf16 ? 2 : 4;
    for (int64_t t0 = start; t0 < end && t0 < reach; t0 += TILE) {
        /* the next tile's keys and values on their way into the L2 cache while this one is computed (a tile's rows
           cross pages, where the CPU's own prefetch starts over); reads nothing, so no value depends on it */
        for (int64_t t = t0 + TILE; t < t0 + 2 * TILE && t < end && t < reach; t++)
            for (int64_t b = 0; b < D * elem; b += 64) {
                __builtin_prefetch((const char *)keys + t * s_key * elem + b, 0, 2);
                __builtin_prefetch((const char *)values + t * s_value * elem + b, 0, 2);
            }
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
#if PAIRS
        if (pairs && D % 64 == 0) { /* the weights rounded to bfloat16, two keys a step by the dot product */
            uint32_t *value_by_pair = (uint32_t *)by_key;
            value_pairs((const uint16_t *)values, s_value, t0, count, TILE, D, value_by_pair);
            for (int r = 0; r < G; r += 4) {
                int rows = G - r < 4 ? G - r : 4, reads = 0;
                for (int i = 0; i < rows; i++) reads |= hi[(row0 + r + i) % n] > t0;
                if (reads) weighted_pairs(acc + (int64_t)r * D, scores + r * TILE, rows, D, TILE / 2, value_by_pair);
            }
            continue;
        }
#endif
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
    dense_segment_of(q, keys, values, bf16, s_key, s_value, count, hi, allowed, s_allowed, n, row0, G, 128, pairs,
                     scale, start, end, acc, top, sums);
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
        dense_segment_64(qs, k, v, call->kv_bf16, ks[2], vs[2], count, call->hi, call->allowed, call->s_allowed, n,
                         row0, rows, pairs, call->scale, start, end, acc, top, sums);
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
