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

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
/* int4_qrows, the layer spans and SiLU on a build with AVX2 and FMA */
#if defined(__AVX2__) && defined(__FMA__)
#define AVX2 1
#else
#define AVX2 0
#endif
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
        const int64_t t = 4 * b;
        const int whole = t + 4 <= tiles;
        int m = 0;
        for (; m + 4 <= M; m += 4)
            for (int64_t u = t; u < t + 4 && u < tiles; u++)
                qdot_tile(codes, qparams, q, totals, steps, out, K, N, u, m, 4, 1);
        for (; m + 2 <= M; m += 2) {
            if (whole) {
                qdot_tile(codes, qparams, q, totals, steps, out, K, N, t, m, 2, 2);
                qdot_tile(codes, qparams, q, totals, steps, out, K, N, t + 2, m, 2, 2);
            } else
                for (int64_t u = t; u < tiles; u++) qdot_tile(codes, qparams, q, totals, steps, out, K, N, u, m, 2, 1);
        }
        for (; m < M; m++) {
            if (whole)
                qdot_tile(codes, qparams, q, totals, steps, out, K, N, t, m, 1, 4);
            else
                for (int64_t u = t; u < tiles; u++) qdot_tile(codes, qparams, q, totals, steps, out, K, N, u, m, 1, 1);
        }
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

/* A decoder layer's work between two attentions in one call (`int4_span`), every product an int4 one over quantized
   rows (int4_qrows, the norms before them computed by it): the earlier layer's output projection, residual, SiLU-gated
   MLP and residual, then the next layer's Q/K/V and rotary embedding, each row on its own, so a row's values do not
   depend on the rows beside it. The element-wise steps are written out (mul, then add: no fma), the rotary embedding
   as `q × cos + rotate_half(q) × sin` computes it; SiLU is x / (1 + exp(-x)) with the exponential below. */

/* One int4 product held for int4_qrows, and its bias (or NULL). */
typedef struct {
    const uint8_t *codes;
    const uint16_t *qparams;
    const float *bias;
    int64_t outputs;
} QProduct;

/* A layer's output span: output projection of its heads × head_dim attention outputs, residual, RMS norm (`norm`,
   `eps`), gate and up (one product of both stacked, `parts` 1, or two), SiLU(gate) × up, down, residual. */
typedef struct {
    QProduct wo;
    const float *norm;
    float eps;
    int parts;
    QProduct gate_up[2];
    QProduct down;
    int heads, head_dim, inter;
} SpanOutput;

/* A layer's input span: RMS norm (`norm`, `eps`), Q/K/V (one stacked product, `parts` 1, or three), rotary embedding
   of Q and K. */
typedef struct {
    const float *norm;
    float eps;
    int parts;
    QProduct qkv[3];
    int q_heads, kv_heads, head_dim;
} SpanInputs;

#if AVX2
/* A product and a sum stay two roundings here (the compiler fuses none into an fma). */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

/* exp(x) of 8 values, to about 2 ulp, from -88 (0 below) up to 88 (clamped): the polynomial of attention_kernel.h's
   exp_nonpositive8 over the whole range. */
static inline __m256 exp8(__m256 x) {
    const __m256 c = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.0f));
    const __m256 k = _mm256_floor_ps(_mm256_fmadd_ps(c, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    const __m256 r =
        _mm256_fmadd_ps(k, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), c));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* times 2^k, k from -127 (a power of 0: the result 0) to 127 */
    const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(power)), _mm256_cmp_ps(x, _mm256_set1_ps(-88.0f),
                                                                                     _CMP_GE_OQ));
}

/* out[i] = SiLU(gate[i]) × up[i] for `count` values (a multiple of 8): SiLU(x) = x / (1 + exp(-x)) with exp8's
   exponential (a gate below -88 gives x / e^88, about 0). Returns 0, or -1 where this build has no AVX2. */
int silu_times(const float *gate, const float *up, int64_t count, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t j = 0; j + 8 <= count; j += 8) {
        const __m256 x = _mm256_loadu_ps(gate + j);
        const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, sign))));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(silu, _mm256_loadu_ps(up + j)));
    }
    return 0;
}

/* out[m] = x[m] times `p` (+ its bias) for M rows of K inputs (under the RMS norm `norm`, `eps` where given). */
static int span_product(const float *x, int M, int K, const float *norm, float eps, const QProduct *p, float *out,
                        int threads) {
    const int status = int4_qrows(x, M, norm, eps, p->codes, p->qparams, out, p->outputs, K, threads);
    if (status != 0 || p->bias == NULL) return status;
    for (int m = 0; m < M; m++)
        for (int64_t j = 0; j < p->outputs; j += 8) {
            float *o = out + (int64_t)m * p->outputs + j;
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_loadu_ps(p->bias + j)));
        }
    return 0;
}

/* One head's D values `x` under the rotary embedding (`cos`, `sin` [D]): x × cos + rotate_half(x) × sin, where
   rotate_half(x) = (-x[D/2:], x[:D/2]); each product rounded, then the sum. */
static inline void rotated(const float *x, const float *cos, const float *sin, int D, float *out) {
    const int half = D / 2;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int d = 0; d < D; d += 8) {
        const __m256 turned =
            d < half ? _mm256_xor_ps(_mm256_loadu_ps(x + d + half), sign) : _mm256_loadu_ps(x + d - half);
        const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x + d), _mm256_loadu_ps(cos + d));
        const __m256 b = _mm256_mul_ps(turned, _mm256_loadu_ps(sin + d));
        _mm256_storeu_ps(out + d, _mm256_add_ps(a, b));
    }
}

/* Floats of scratch a thread keeps between spans at most (16 MiB); a larger block's is freed after it. */
#define SPAN_KEPT (1 << 22)
static __thread float *span_scratch;
static __thread size_t span_floats;

static float *scratch_of(size_t floats) {
    if (floats > span_floats) {
        free(span_scratch);
        span_scratch = malloc(floats * sizeof(float));
        span_floats = span_scratch != NULL ? floats : 0;
    }
    return span_scratch;
}

static void scratch_done(void) {
    if (span_floats > SPAN_KEPT) {
        free(span_scratch);
        span_scratch = NULL;
        span_floats = 0;
    }
}

static int output_span(const SpanOutput *w, const float *hidden, const float *attended, float *hidden_out, int B,
                       int n, int H, int threads, float *scratch) {
    const int M = B * n, width = w->heads * w->head_dim, I = w->inter, D = w->head_dim;
    float *rows = scratch, *gate_up = rows + (int64_t)M * (width > H ? width : H);
    float *act = gate_up + (int64_t)M * 2 * I, *down = act + (int64_t)M * I;
    /* the attention's output [B, heads, n, D] as rows [B·n, heads·D] */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M >= 16)
    for (int m = 0; m < M; m++)
        for (int h = 0; h < w->heads; h++)
            memcpy(rows + (int64_t)m * width + h * D, attended + (((int64_t)(m / n) * w->heads + h) * n + m % n) * D,
                   sizeof(float) * D);
    int status = span_product(rows, M, width, NULL, 0.0f, &w->wo, hidden_out, threads);
    if (status != 0) return status;
    for (int64_t i = 0; i < (int64_t)M * H; i += 8)
        _mm256_storeu_ps(hidden_out + i, _mm256_add_ps(_mm256_loadu_ps(hidden + i), _mm256_loadu_ps(hidden_out + i)));
    status = span_product(hidden_out, M, H, w->norm, w->eps, &w->gate_up[0], gate_up, threads);
    if (status == 0 && w->parts == 2) /* up after gate, each normalising the rows itself */
        status = span_product(hidden_out, M, H, w->norm, w->eps, &w->gate_up[1], gate_up + (int64_t)M * I, threads);
    if (status != 0) return status;
    /* SiLU(gate) × up: a stacked product's row holds gate then up; two products' outputs lie one after the other */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M >= 16)
    for (int m = 0; m < M; m++) {
        const float *g = w->parts == 1 ? gate_up + (int64_t)m * 2 * I : gate_up + (int64_t)m * I;
        silu_times(g, w->parts == 1 ? g + I : gate_up + (int64_t)M * I + (int64_t)m * I, I, act + (int64_t)m * I);
    }
    status = span_product(act, M, I, NULL, 0.0f, &w->down, down, threads);
    if (status != 0) return status;
    for (int64_t i = 0; i < (int64_t)M * H; i += 8)
        _mm256_storeu_ps(hidden_out + i, _mm256_add_ps(_mm256_loadu_ps(hidden_out + i), _mm256_loadu_ps(down + i)));
    return 0;
}

static int input_span(const SpanInputs *w, const float *hidden, const float *cos, const float *sin, float *q,
                      float *k, float *v, int B, int n, int H, int threads, float *scratch) {
    const int M = B * n, D = w->head_dim, sizes[3] = {w->q_heads * D, w->kv_heads * D, w->kv_heads * D};
    const int width = sizes[0] + sizes[1] + sizes[2];
    float *qkv = scratch;
    int status = 0;
    if (w->parts == 1)
        status = span_product(hidden, M, H, w->norm, w->eps, &w->qkv[0], qkv, threads);
    else
        for (int p = 0, offset = 0; p < 3 && status == 0; offset += sizes[p], p++)
            status = span_product(hidden, M, H, w->norm, w->eps, &w->qkv[p], qkv + (int64_t)M * offset, threads);
    if (status != 0) return status;
    /* row m's heads into [B, heads, n, D], Q and K rotated by position m's cos and sin */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M >= 16)
    for (int m = 0; m < M; m++) {
        const int64_t b = m / n, i = m % n;
        const float *c = cos + (int64_t)m * D, *s = sin + (int64_t)m * D;
        const float *from[3];
        if (w->parts == 1) { /* a row holds its Q, K and V side by side */
            from[0] = qkv + (int64_t)m * width;
            from[1] = from[0] + sizes[0];
            from[2] = from[1] + sizes[1];
        } else { /* three products' outputs one after the other */
            from[0] = qkv + (int64_t)m * sizes[0];
            from[1] = qkv + (int64_t)M * sizes[0] + (int64_t)m * sizes[1];
            from[2] = qkv + (int64_t)M * (sizes[0] + sizes[1]) + (int64_t)m * sizes[2];
        }
        for (int h = 0; h < w->q_heads; h++)
            rotated(from[0] + h * D, c, s, D, q + ((b * w->q_heads + h) * n + i) * D);
        for (int h = 0; h < w->kv_heads; h++) {
            rotated(from[1] + h * D, c, s, D, k + ((b * w->kv_heads + h) * n + i) * D);
            memcpy(v + ((b * w->kv_heads + h) * n + i) * D, from[2] + h * D, sizeof(float) * D);
        }
    }
    return 0;
}
#pragma GCC pop_options
#else
int silu_times(const float *gate, const float *up, int64_t count, float *out) {
    (void)gate, (void)up, (void)count, (void)out;
    return -1;
}
#endif

/* A decoder's work between two attentions for B × n rows of H values (float32, contiguous): with `out_w`, the
   earlier layer's output from its input `hidden` [B, n, H] and its attention's output `attended` [B, heads, n, D]
   into `hidden_out` [B, n, H]; with `in_w`, the next layer's Q [B, q_heads, n, D], K and V [B, kv_heads, n, D] from
   `hidden_out` (or, without `out_w`, from `hidden`), rotated by `cos` and `sin` [B, n, D]. Every width a multiple of
   8 and the head size of 16. Returns 0; -1 where a product declines its shapes or this build has no AVX2, -2 where
   the scratch cannot be allocated. */
int int4_span(const SpanOutput *out_w, const SpanInputs *in_w, const float *hidden, const float *attended,
              float *hidden_out, const float *cos, const float *sin, float *q, float *k, float *v, int B, int n, int H,
              int threads) {
#if AVX2
    const int64_t M = (int64_t)B * n;
    size_t floats = 0;
    if (out_w != NULL) {
        const int64_t width = (int64_t)out_w->heads * out_w->head_dim;
        floats = (size_t)(M * ((width > H ? width : H) + 3 * (int64_t)out_w->inter + H));
    }
    if (in_w != NULL) {
        const size_t qkv = (size_t)(M * (int64_t)(in_w->q_heads + 2 * in_w->kv_heads) * in_w->head_dim);
        floats = qkv > floats ? qkv : floats;
    }
    float *scratch = scratch_of(floats);
    if (scratch == NULL) return -2;
    int status = 0;
    if (out_w != NULL) {
        status = output_span(out_w, hidden, attended, hidden_out, B, n, H, threads, scratch);
        hidden = hidden_out;
    }
    if (status == 0 && in_w != NULL) status = input_span(in_w, hidden, cos, sin, q, k, v, B, n, H, threads, scratch);
    scratch_done();
    return status;
#else
    (void)out_w, (void)in_w, (void)hidden, (void)attended, (void)hidden_out, (void)cos, (void)sin, (void)q, (void)k;
    (void)v, (void)B, (void)n, (void)H, (void)threads;
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
