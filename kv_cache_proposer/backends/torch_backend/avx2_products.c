/* Linear layers' products for the torch backend on a CPU with AVX2, in the kernel's own arithmetic rather than a
   PyTorch kernel's, so each is chosen when its layer is loaded (weights.py; products.py loads them):

   - int8_float_head: float32 rows times int8 codes with one float32 scale per code row, the codes widened to
     float32 in the kernel: the int8 LM head's product on a CPU without int8 dot products (AVX2 or AVX-512 without
     VNNI), reading a quarter of the bytes of the codes' float32 values. Each sum runs over the inputs in order, 8 at
     a time in 8 lanes, its lanes added in one fixed order, then scaled, the same instructions for a row whatever
     rows and threads share the call.
   - int4_qrows: float32 rows times int4 codes, each row quantized per group of 32 inputs to integers of 8 bits of
     magnitude and a sign, multiplied by the codes with the CPU's byte products (AVX2), or its dot products where it
     has AVX512-VNNI: the int4 layers' product for every row count on a CPU with AVX2 (close to a GGUF Q4_1 product's
     as llama.cpp computes it, with a bit more for each input and the zero points meeting the float32 input sums):
     exact integer sums per group, the same with either instructions, then one float32 order per output, whatever
     rows and threads share the call. Given the RMS norm's weight, it first normalises each row itself
     (`normed_row`), the norm before the stacked Q/K/V or gate/up product.

   Built without reassociation (kernel_build.EXACT_FLAGS): the order written here is the order computed. */

#include "avx2_products.h"

/* int4_qrows' integer sums by AVX512-VNNI dot products where the build has them: the same exact sums, so the same
   values as the AVX2 build's byte products */
#if AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QDOT 1
#else
#define QDOT 0
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define FLOAT_HEAD 1
#else
#define FLOAT_HEAD 0
#endif

#if FLOAT_HEAD
/* v's 8 lanes added in one order: (0+4)+(2+6), (1+5)+(3+7), then those two. */
static inline float lanes_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* The largest of v's 8 lanes. */
static inline float lanes_max(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#endif

/* int4 codes times rows quantized to 9-bit integers: the int4 layers' product for any row count. */
#define Q_GROUP 32   /* inputs sharing a weight's scale and zero point, and a row's step */
#define Q_TILE 8     /* outputs whose codes are interleaved together */

/* Whether this build computes int4_qrows (else every call returns -1). */
int int4_qrows_served(void) { return AVX2; }

#if AVX2
/* 32 int32 lanes of `v` (each in the int8 or uint8 range) as 32 bytes in order, saturated to uint8 (`sign` 0) or
   int8 (`sign` 1). */
static inline __m256i bytes_in_order(const __m256i v[4], int sign) {
    const __m256i low = sign ? _mm256_packs_epi32(v[0], v[1]) : _mm256_packus_epi32(v[0], v[1]);
    const __m256i high = sign ? _mm256_packs_epi32(v[2], v[3]) : _mm256_packus_epi32(v[2], v[3]);
    const __m256i packed = sign ? _mm256_packs_epi16(low, high) : _mm256_packus_epi16(low, high);
    return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* One row's groups of Q_GROUP inputs as integers of 8 bits of magnitude and a sign: `q` holds the K magnitudes (each
   input's over its group's step, rounded to nearest even), then the K signs (-1 for a negative input, else 1), and
   `steps` ([K / Q_GROUP][2]) each group's step (its largest magnitude / 255) and the sum of its float32 inputs (its
   four vectors added pairwise, then their lanes: `lanes_sum`). A group of zeros has step 0 and magnitudes 0. */
static void quantized_row(const float *x, int K, uint8_t *q, float *steps) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    for (int g = 0; g < K / Q_GROUP; g++) {
        __m256 v[4], magnitude[4];
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + g * Q_GROUP + 8 * j);
            magnitude[j] = _mm256_andnot_ps(sign_bit, v[j]);
        }
        const float largest = lanes_max(
            _mm256_max_ps(_mm256_max_ps(magnitude[0], magnitude[1]), _mm256_max_ps(magnitude[2], magnitude[3])));
        const float step = largest / 255.0f;
        __m256i ints[4], signs[4];
        for (int j = 0; j < 4; j++) {
            const __m256 scaled = step > 0.0f ? _mm256_div_ps(magnitude[j], _mm256_set1_ps(step)) : _mm256_setzero_ps();
            ints[j] = _mm256_cvtps_epi32(_mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            const __m256i negative = _mm256_castps_si256(_mm256_cmp_ps(v[j], _mm256_setzero_ps(), _CMP_LT_OQ));
            signs[j] = _mm256_or_si256(negative, _mm256_set1_epi32(1)); /* -1 or 1 */
        }
        _mm256_storeu_si256((__m256i *)(q + g * Q_GROUP), bytes_in_order(ints, 0));
        _mm256_storeu_si256((__m256i *)(q + K + g * Q_GROUP), bytes_in_order(signs, 1));
        steps[2 * g] = step;
        steps[2 * g + 1] = lanes_sum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    }
}

/* Row `x` (K inputs, a multiple of 8) under the RMS norm, into `y`: y = weight × (x × r), r = 1 / sqrt(s / K + eps),
   s the sum of the squares in 8 lanes over the inputs in order (fma), then `lanes_sum`. The norm before a layer's
   products, computed as the kernel reads the rows (int4_qrows' `norm`), so a row's values do not depend on the rows
   beside it. */
static void normed_row(const float *x, int K, const float *weight, float eps, float *y) {
    __m256 squares = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) {
        const __m256 v = _mm256_loadu_ps(x + k);
        squares = _mm256_fmadd_ps(v, v, squares);
    }
    const float mean = lanes_sum(squares) / (float)K + eps;
    const __m256 r = _mm256_set1_ps(1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(mean))));
    for (int k = 0; k < K; k += 8)
        _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_loadu_ps(weight + k), _mm256_mul_ps(_mm256_loadu_ps(x + k), r)));
}

/* The codes of Q_TILE outputs for 4 inputs as signed bytes (code - 8): byte i of `packed` holds element i in its
   low nibble and element 16 + i in its high one; element e is output e / 4's code for input e % 4. */
static inline __m256i tile_codes(const uint8_t *packed) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)packed);
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(bytes, nibble), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    return _mm256_sub_epi8(_mm256_set_m128i(high, low), _mm256_set1_epi8(8));
}

/* 8 bfloat16 values as float32. */
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* R quantized rows (`q`, `steps` of rows m0..) against one tile of Q_TILE outputs: out[m][t * Q_TILE + j]. Per group,
   each output's exact integer sum of (code - 8) × the signed inputs, then in float32 from 0, group by group:
   acc = fma(sum, scale × step, acc), acc = fma(zero, the group's input sum, acc). A row's instructions are the same
   whatever R. */
static inline __attribute__((always_inline)) void qrows_tile(const uint8_t *codes, const uint16_t *qparams,
                                                             const uint8_t *q, const float *steps, float *out, int K,
                                                             int64_t N, int64_t t, int m0, const int R) {
    const int groups = K / Q_GROUP;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m256i sums[4];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
        const uint8_t *c = codes + (t * groups + g) * (Q_GROUP / 4) * 16;
        for (int s = 0; s < Q_GROUP / 4; s++) {
            const __m256i signed_codes = tile_codes(c + 16 * s);
            for (int r = 0; r < R; r++) {
                const uint8_t *row = q + (int64_t)(m0 + r) * 2 * K + g * Q_GROUP + 4 * s;
                int32_t magnitudes, signs;
                memcpy(&magnitudes, row, sizeof magnitudes);
                memcpy(&signs, row + K, sizeof signs);
                const __m256i weights = _mm256_sign_epi8(signed_codes, _mm256_set1_epi32(signs));
                /* a lane adds 8 pairs of products, each pair at most 2 x 255 x 8: no int16 saturation */
                sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(_mm256_set1_epi32(magnitudes), weights));
            }
        }
        const uint16_t *p = qparams + (t * groups + g) * 2 * Q_TILE;
        const __m256 scale = bf16x8(p), zero = bf16x8(p + Q_TILE);
        for (int r = 0; r < R; r++) {
            const float *group = steps + ((int64_t)(m0 + r) * groups + g) * 2;
            const __m256 whole = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r], ones));
            acc[r] = _mm256_fmadd_ps(whole, _mm256_mul_ps(scale, _mm256_set1_ps(group[0])), acc[r]);
            acc[r] = _mm256_fmadd_ps(zero, _mm256_set1_ps(group[1]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + (int64_t)(m0 + r) * N + t * Q_TILE, acc[r]);
}

#if QDOT
/* A quantized row (`quantized_row`'s magnitudes m, then signs s) rewritten in place for dot products of unsigned
   codes: each input x = s × m as x >> 4 (from -16 to 15) over its magnitude's bytes and x & 15 over its sign's,
   x = 16 × (x >> 4) + (x & 15); `totals` [K / Q_GROUP] each group's sum of x. */
static void split_row(uint8_t *q, int K, int32_t *totals) {
    const __m256i ones = _mm256_set1_epi16(1), low_bits = _mm256_set1_epi16(15);
    for (int g = 0; g < K / Q_GROUP; g++) {
        __m256i total = _mm256_setzero_si256();
        for (int h = 0; h < Q_GROUP; h += 16) {
            uint8_t *m = q + g * Q_GROUP + h, *s = m + K;
            const __m256i x = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)m)),
                                                 _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)s)));
            _mm_storeu_si128((__m128i *)m, _mm256_cvtepi16_epi8(_mm256_srai_epi16(x, 4)));
            _mm_storeu_si128((__m128i *)s, _mm256_cvtepi16_epi8(_mm256_and_si256(x, low_bits)));
            total = _mm256_add_epi32(total, _mm256_madd_epi16(x, ones));
        }
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, total);
        totals[g] = lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
    }
}

/* qrows_tile by dot products over rows rewritten by `split_row`, for R rows and T tiles from t (R × T at most 4:
   as many independent sums in flight): per group, each output's sum of code × x (the codes unsigned, two steps of 4
   inputs a vector: lanes 2j and 2j + 1 hold output j's), 16 × the sum over x >> 4 plus the sum over x & 15, less
   8 × the group's total: exactly qrows_tile's integer sum of (code - 8) × x. The float32 steps after it are
   qrows_tile's, each output's in its order. */
static inline __attribute__((always_inline)) void qdot_tile(const uint8_t *codes, const uint16_t *qparams,
                                                            const uint8_t *q, const int32_t *totals,
                                                            const float *steps, float *out, int K, int64_t N,
                                                            int64_t t, int m0, const int R, const int T) {
    const int groups = K / Q_GROUP;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    __m256 acc[4][4];
    for (int u = 0; u < T; u++)
        for (int r = 0; r < R; r++) acc[u][r] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512i high[4][4], low[4][4];
        for (int u = 0; u < T; u++)
            for (int r = 0; r < R; r++) high[u][r] = low[u][r] = _mm512_setzero_si512();
        for (int s = 0; s < Q_GROUP / 4; s += 2) {
            __m512i above[4], below[4];
            for (int r = 0; r < R; r++) {
                const uint8_t *row = q + (int64_t)(m0 + r) * 2 * K + g * Q_GROUP + 4 * s;
                int64_t a, b;
                memcpy(&a, row, sizeof a);
                memcpy(&b, row + K, sizeof b);
                above[r] = _mm512_set1_epi64(a);
                below[r] = _mm512_set1_epi64(b);
            }
            for (int u = 0; u < T; u++) {
                /* steps s and s + 1: low nibbles, then high ones, of each; output j's lanes side by side */
                const uint8_t *c = codes + ((t + u) * groups + g) * (Q_GROUP / 4) * 16;
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(c + 16 * s));
                const __m256i lo = _mm256_and_si256(bytes, nibble);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
                const __m512i unsigned_codes =
                    _mm512_permutexvar_epi32(order, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
                for (int r = 0; r < R; r++) {
                    high[u][r] = _mm512_dpbusd_epi32(high[u][r], unsigned_codes, above[r]);
                    low[u][r] = _mm512_dpbusd_epi32(low[u][r], unsigned_codes, below[r]);
                }
            }
        }
        for (int u = 0; u < T; u++) {
            const uint16_t *p = qparams + ((t + u) * groups + g) * 2 * Q_TILE;
            const __m256 scale = bf16x8(p), zero = bf16x8(p + Q_TILE);
            for (int r = 0; r < R; r++) {
                const float *group = steps + ((int64_t)(m0 + r) * groups + g) * 2;
                __m512i both = _mm512_add_epi32(_mm512_slli_epi32(high[u][r], 4), low[u][r]);
                both = _mm512_add_epi32(both, _mm512_srli_epi64(both, 32)); /* each pair in its low lane */
                const __m256i sums = _mm256_sub_epi32(_mm512_cvtepi64_epi32(both),
                                                      _mm256_set1_epi32(8 * totals[(int64_t)(m0 + r) * groups + g]));
                const __m256 whole = _mm256_cvtepi32_ps(sums);
                acc[u][r] = _mm256_fmadd_ps(whole, _mm256_mul_ps(scale, _mm256_set1_ps(group[0])), acc[u][r]);
                acc[u][r] = _mm256_fmadd_ps(zero, _mm256_set1_ps(group[1]), acc[u][r]);
            }
        }
    }
    for (int u = 0; u < T; u++)
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out + (int64_t)(m0 + r) * N + (t + u) * Q_TILE, acc[u][r]);
}

/* qdot_tile of R rows from m0 over tiles [t, last), T at a time, the tiles past the last T one by one. */
static inline __attribute__((always_inline)) void qdot_tiles(const uint8_t *codes, const uint16_t *qparams,
                                                             const uint8_t *q, const int32_t *totals,
                                                             const float *steps, float *out, int K, int64_t N,
                                                             int64_t t, int64_t last, int m0, const int R,
                                                             const int T) {
    for (; t + T <= last; t += T) qdot_tile(codes, qparams, q, totals, steps, out, K, N, t, m0, R, T);
    for (; t < last; t++) qdot_tile(codes, qparams, q, totals, steps, out, K, N, t, m0, R, 1);
}
#endif
#endif

/* out [M, N] float32 = x [M, K] float32 times int4 weights (code - 8) × scale + zero, with each row's inputs
   quantized per group of Q_GROUP (`quantized_row`); where `norm` (float32 [K]) is given, of the rows under the RMS
   norm of that weight and `eps` (`normed_row`). `codes`: [N / Q_TILE][K / 4][16] bytes (`tile_codes`); `qparams`:
   bfloat16 [N / Q_TILE][K / Q_GROUP][2][Q_TILE] (the tile's scales, then its zero points). On `threads` threads over
   tiles. Returns 0; -1 when the shapes are beyond what the kernel serves or this build has no AVX2, -2 when its row
   buffer cannot be allocated (nothing is written then). */
int int4_qrows(const float *x, int M, const float *norm, float eps, const uint8_t *codes, const uint16_t *qparams,
               float *out, int64_t N, int K, int threads) {
#if AVX2
    if (M < 1 || N < Q_TILE || N % Q_TILE || K < Q_GROUP || K % Q_GROUP) return -1;
    const int groups = K / Q_GROUP;
    const size_t normed = norm != NULL ? (size_t)M * K : 0;
    float *steps = malloc(((size_t)M * groups * 3 + normed) * sizeof(float) + (size_t)M * K * 2);
    if (steps == NULL) return -2;
    int32_t *totals = (int32_t *)(steps + (size_t)M * groups * 2); /* the dot products' group totals */
#if !QDOT
    (void)totals; /* the byte products need none */
#endif
    float *rows = steps + (size_t)M * groups * 3;
    uint8_t *q = (uint8_t *)(rows + normed);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M > 1)
    for (int m = 0; m < M; m++) {
        const float *row = x + (int64_t)m * K;
        if (norm != NULL) {
            normed_row(row, K, norm, eps, rows + (int64_t)m * K);
            row = rows + (int64_t)m * K;
        }
        quantized_row(row, K, q + (int64_t)m * 2 * K, steps + (int64_t)m * groups * 2);
#if QDOT
        split_row(q + (int64_t)m * 2 * K, K, totals + (int64_t)m * groups);
#endif
    }
    const int64_t tiles = N / Q_TILE;
#if QDOT
    /* tiles 4 at a time: a row's sums of 4 tiles, 2 rows' of 2, or 4 rows' of each in flight */
    const int64_t quads = (tiles + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && quads > 1)
    for (int64_t b = 0; b < quads; b++) {
        const int64_t t = 4 * b, last = t + 4 < tiles ? t + 4 : tiles;
        int m = 0;
        for (; m + 4 <= M; m += 4) qdot_tiles(codes, qparams, q, totals, steps, out, K, N, t, last, m, 4, 1);
        for (; m + 2 <= M; m += 2) qdot_tiles(codes, qparams, q, totals, steps, out, K, N, t, last, m, 2, 2);
        for (; m < M; m++) qdot_tiles(codes, qparams, q, totals, steps, out, K, N, t, last, m, 1, 4);
    }
#else
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tiles > 1)
    for (int64_t t = 0; t < tiles; t++) {
        int m = 0;
        for (; m + 4 <= M; m += 4) qrows_tile(codes, qparams, q, steps, out, K, N, t, m, 4);
        for (; m + 2 <= M; m += 2) qrows_tile(codes, qparams, q, steps, out, K, N, t, m, 2);
        for (; m < M; m++) qrows_tile(codes, qparams, q, steps, out, K, N, t, m, 1);
    }
#endif
    free(steps);
    return 0;
#else
    (void)x, (void)M, (void)norm, (void)eps, (void)codes, (void)qparams, (void)out, (void)N, (void)K, (void)threads;
    return -1;
#endif
}

#define HEAD_TILE 8            /* code rows widened to float32 together */
#define HEAD_MAX_WIDTH 8192    /* inputs of a row at most */

/* Whether this build computes int8_float_head (else every call returns -1). */
int int8_float_head_served(void) { return FLOAT_HEAD; }

#if FLOAT_HEAD
/* One row `x` (D inputs) against HEAD_TILE code rows widened to float32 (`w`, D each): sums[j] for code row j. Every
   sum has its own accumulator, fed the inputs in order 8 at a time from zero. */
static inline void head_widened(const float *x, const float *w, int D, float *sums) {
    __m256 acc[HEAD_TILE];
    for (int j = 0; j < HEAD_TILE; j++) acc[j] = _mm256_setzero_ps();
    for (int k = 0; k < D; k += 8) {
        const __m256 v = _mm256_loadu_ps(x + k);
        for (int j = 0; j < HEAD_TILE; j++) acc[j] = _mm256_fmadd_ps(_mm256_load_ps(w + j * D + k), v, acc[j]);
    }
    for (int j = 0; j < HEAD_TILE; j++) sums[j] = lanes_sum(acc[j]);
}
#endif

/* out [M, O] = x [M, D] times the int8 `codes` [O, D] (rows `s_code` apart) each times its `scale` [O], float32,
   on `threads` threads over tiles of HEAD_TILE code rows. Returns 0, or -1 when the shapes are beyond what the
   kernel serves (D a multiple of 8, at most HEAD_MAX_WIDTH) or this build has no AVX2 (nothing is written then). */
int int8_float_head(const float *x, int M, const int8_t *codes, int64_t O, int D, int64_t s_code, const float *scale,
                    float *out, int threads) {
#if FLOAT_HEAD
    if (M < 1 || O < 1 || D < 8 || D % 8 || D > HEAD_MAX_WIDTH) return -1;
    const int64_t tiles = (O + HEAD_TILE - 1) / HEAD_TILE;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tiles > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t o0 = t * HEAD_TILE;
        const int count = O - o0 < HEAD_TILE ? (int)(O - o0) : HEAD_TILE;
        float sums[HEAD_TILE];
        float w[HEAD_TILE * D] __attribute__((aligned(32)));
        for (int j = 0; j < HEAD_TILE; j++) {
            const int8_t *c = codes + (o0 + (j < count ? j : 0)) * s_code;
            for (int k = 0; k < D; k += 8) {
                const __m128i bytes = _mm_loadl_epi64((const __m128i *)(c + k));
                _mm256_store_ps(w + j * D + k, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
            }
        }
        for (int m = 0; m < M; m++) {
            head_widened(x + (int64_t)m * D, w, D, sums);
            for (int j = 0; j < count; j++) out[(int64_t)m * O + o0 + j] = sums[j] * scale[o0 + j];
        }
    }
    return 0;
#else
    (void)x, (void)M, (void)codes, (void)O, (void)D, (void)s_code, (void)scale, (void)out, (void)threads;
    return -1;
#endif
}
