/* The tile unit (AMX) for bfloat16 attention: its configuration, kept from the caller and put back, the scores of
   up to 16 query rows against 64 keys, and value sums under bfloat16 weights. Shared by held_kernel.c and
   dense_kernel.c; empty on a build without it (TILES 0). */

#ifndef KAKEYA_ATTENTION_TILES_H
#define KAKEYA_ATTENTION_TILES_H

#include "attention_pairs.h"

#if TILES
#define STEP 256 /* keys under one softmax step of the tile path: STEP / TILE tiles, at fixed places */
#define IN_PLACE_ROWS 32 /* query rows up to which the tile path scores keys where they are held */

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
#endif

#endif
