/* Linear layers' products for the torch backend on a CPU, each of the first two giving exactly the values of the
   PyTorch kernel it stands in for, so a token's values are the same whichever computes them (products.py):

   - int8_row_sums: integer sums of a few int8 rows against a matrix of int8 codes, on the CPU's 512-bit integer dot
     products (AVX512-VNNI), reading the codes once, in place: the int8 LM head's product for a decode step or a
     short block. Exact integers, so equal to those of any other exact product (PyTorch's `_int_mm`), whatever the
     thread count. The dot-product instruction multiplies unsigned by signed bytes, so each row is read shifted by
     128 (unsigned) and 128 times the code row's sum (`offsets`, computed once per matrix) is taken off its sums.
   - int4_rows: bfloat16 rows times int4 weights packed for PyTorch's `_weight_int4pack_mm_for_cpu`, with that
     kernel's layout and arithmetic for every output, as it runs on AVX-512: blocks of 64 outputs, each weight
     dequantized as fma(code - 8, scale, zero) in float32, the products summed by fma in input order from 0 and the
     sum rounded to bfloat16 to nearest even. But each block's weights are dequantized once for all the rows instead
     of once per 4: a verify block, a batched step or a prefill chunk reads them at a fraction of the cost. (The AVX2
     build multiplies int4 layers by quantized rows instead: int4_qrows.)

   - int8_float_head: float32 rows times int8 codes with one float32 scale per code row, the codes widened to
     float32 in the kernel: the int8 LM head's product on a CPU without int8 dot products (AVX2 or AVX-512 without
     VNNI), reading a quarter of the bytes of the codes' float32 values. Its own arithmetic, not a PyTorch kernel's:
     each sum runs over the inputs in order, 8 at a time in 8 lanes, its lanes added in one fixed order, then
     scaled, the same instructions for a row whatever rows and threads share the call.
   - int4_qrows: float32 rows times int4 codes, each row quantized per group of 32 inputs to integers of 8 bits of
     magnitude and a sign, multiplied by the codes with the CPU's byte products (AVX2): the int4 layers' product for
     every row count on a CPU without AVX-512. Its own arithmetic too (close to a GGUF Q4_1 product's as llama.cpp
     computes it, with a bit more for each input and the zero points meeting the float32 input sums): exact integer
     sums per group, then one float32 order per output, whatever rows and threads share the call.

   Built without reassociation (kernel_build.EXACT_FLAGS): the order written here is the order computed. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define AVX512 1
#else
#define AVX512 0
#endif
#if !AVX512 && defined(__AVX2__) && defined(__FMA__)
#define AVX2 1
#else
#define AVX2 0
#endif
#if AVX512 && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define VNNI 1
#else
#define VNNI 0
#endif

#define MAX_ROWS 64         /* input rows of one call at most */
#define MAX_SHIFTED 65536   /* bytes of one call's rows at most (held shifted in a per-thread buffer) */

/* Whether this build computes the int8 sums (else every call returns -1). */
int int8_rows_served(void) { return VNNI; }

/* Outputs of one packed block of int4 weights: PyTorch's `BLOCK_N` on AVX-512 (4 float vectors). */
#define INT4_BLOCK 64

/* The outputs of one packed block this build computes int4 rows in (64: AVX-512), or 0 where it computes none
   (every call returns -1). */
int int4_rows_served(void) { return AVX512 ? INT4_BLOCK : 0; }

#if VNNI
/* Sums of G shifted rows `x` (each `D` long, one after another) against one code row `c`, into out[0..G). */
#define ROW_GROUP(G)                                                                                               \
    static inline void row_group_##G(const int8_t *c, const uint8_t *x, int D, int chunks, __mmask64 tail,         \
                                     int32_t *out) {                                                               \
        __m512i acc[G];                                                                                            \
        for (int k = 0; k < G; k++) acc[k] = _mm512_setzero_si512();                                               \
        for (int j = 0; j < chunks; j++) {                                                                         \
            __mmask64 m = j == chunks - 1 ? tail : ~0ULL;                                                          \
            __m512i b = _mm512_maskz_loadu_epi8(m, c + 64 * j);                                                    \
            for (int k = 0; k < G; k++)                                                                            \
                acc[k] = _mm512_dpbusd_epi32(acc[k], _mm512_maskz_loadu_epi8(m, x + (int64_t)k * D + 64 * j), b);  \
        }                                                                                                          \
        for (int k = 0; k < G; k++) out[k] = _mm512_reduce_add_epi32(acc[k]);                                      \
    }
ROW_GROUP(1)
ROW_GROUP(2)
ROW_GROUP(4)
#endif

/* sums[o * P + p] = sum_k rows[p * D + k] * codes[o * s_code + k] for P int8 rows of D values (each in [-127, 127])
   and O code rows; `offsets[o]` = 128 * sum_k codes[o * s_code + k]. Returns 0, or -1 when the shapes are beyond
   what the kernel serves or this build has no VNNI (nothing is written then). */
int int8_row_sums(const int8_t *rows, int P, const int8_t *codes, int64_t O, int D, int64_t s_code,
                  const int32_t *offsets, int32_t *sums, int threads) {
#if VNNI
    if (P < 1 || P > MAX_ROWS || D < 1 || (int64_t)P * D > MAX_SHIFTED) return -1;
    static __thread uint8_t shifted[MAX_SHIFTED] __attribute__((aligned(64)));
    for (int64_t i = 0; i < (int64_t)P * D; i++) shifted[i] = (uint8_t)(rows[i] + 128);
    const uint8_t *x = shifted;
    const int chunks = (D + 63) / 64;
    const __mmask64 tail = D % 64 ? ~0ULL >> (64 - D % 64) : ~0ULL;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t o = 0; o < O; o++) {
        const int8_t *c = codes + o * s_code;
        int32_t *out = sums + o * P;
        int p = 0;
        for (; p + 4 <= P; p += 4) row_group_4(c, x + (int64_t)p * D, D, chunks, tail, out + p);
        for (; p + 2 <= P; p += 2) row_group_2(c, x + (int64_t)p * D, D, chunks, tail, out + p);
        for (; p < P; p++) row_group_1(c, x + (int64_t)p * D, D, chunks, tail, out + p);
        for (int k = 0; k < P; k++) out[k] -= offsets[o];
    }
    return 0;
#else
    (void)rows, (void)P, (void)codes, (void)O, (void)D, (void)s_code, (void)offsets, (void)sums, (void)threads;
    return -1;
#endif
}

#define INT4_MAX_ROWS 64     /* rows of one call at most */
#define INT4_MAX_GROUP 256   /* inputs sharing a scale and zero point at most */

#if AVX512
static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, NaN to a quiet NaN: PyTorch's float32 to bfloat16 conversion. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#endif

#if AVX512
/* R rows' accumulators (64 outputs each) += their inputs `a` (G each) times the dequantized weights [G][64], the
   inputs in order. */
static inline __attribute__((always_inline)) void int4_rows_fma(float *acc, const float *a, const float *weights,
                                                               int G, const int R) {
    __m512 c[6][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) c[r][j] = _mm512_load_ps(acc + r * INT4_BLOCK + 16 * j);
    for (int k = 0; k < G; k++) {
        const float *w = weights + k * INT4_BLOCK;
        const __m512 w0 = _mm512_load_ps(w), w1 = _mm512_load_ps(w + 16);
        const __m512 w2 = _mm512_load_ps(w + 32), w3 = _mm512_load_ps(w + 48);
        for (int r = 0; r < R; r++) {
            const __m512 x = _mm512_set1_ps(a[r * G + k]);
            c[r][0] = _mm512_fmadd_ps(x, w0, c[r][0]);
            c[r][1] = _mm512_fmadd_ps(x, w1, c[r][1]);
            c[r][2] = _mm512_fmadd_ps(x, w2, c[r][2]);
            c[r][3] = _mm512_fmadd_ps(x, w3, c[r][3]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) _mm512_store_ps(acc + r * INT4_BLOCK + 16 * j, c[r][j]);
}

/* The G inputs' weights of one block, dequantized [G][64]: packed byte j of an input holds output j in its low
   nibble and output j + 32 in its high one (j < 32: outputs 0-15 and 32-47 in bytes 0-15, 16-31 and 48-63 in bytes
   16-31). */
static inline void int4_dequantize(const uint8_t *packed, const uint16_t *scales_zeros, int64_t n0, int G,
                                   float *weights) {
    const __m512 codes = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
    __m512 scale[4], zero[4];
    for (int part = 0; part < 4; part++) {
        float s[16], z[16];
        for (int j = 0; j < 16; j++) {
            s[j] = from_bf16(scales_zeros[(n0 + 16 * part + j) * 2]);
            z[j] = from_bf16(scales_zeros[(n0 + 16 * part + j) * 2 + 1]);
        }
        scale[part] = _mm512_loadu_ps(s);
        zero[part] = _mm512_loadu_ps(z);
    }
    for (int k = 0; k < G; k++) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(packed + (int64_t)k * 32));
        float *w = weights + k * INT4_BLOCK;
        __m512i low = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(bytes)); /* outputs 0-15 | 32-47 */
        _mm512_store_ps(w, _mm512_fmadd_ps(_mm512_permutexvar_ps(low, codes), scale[0], zero[0]));
        _mm512_store_ps(w + 32, _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(low, 4), codes), scale[2],
                                                zero[2]));
        __m512i high = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(bytes, 1)); /* outputs 16-31 | 48-63 */
        _mm512_store_ps(w + 16, _mm512_fmadd_ps(_mm512_permutexvar_ps(high, codes), scale[1], zero[1]));
        _mm512_store_ps(w + 48, _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(high, 4), codes), scale[3],
                                                zero[3]));
    }
}
#endif

/* out [M, N] bfloat16 = rows [M, K] bfloat16 times the int4 weights `packed` ([N / INT4_BLOCK][K][INT4_BLOCK / 2]
   bytes) with their scales and zero points `scales_zeros` ([K / G][N][2] bfloat16), on `threads` threads over the
   blocks of INT4_BLOCK outputs. Returns 0, or -1 when the shapes are beyond what the kernel serves or this build
   has no AVX-512 (nothing is written then). */
int int4_rows(const uint16_t *rows, int M, const uint8_t *packed, const uint16_t *scales_zeros, uint16_t *out,
              int64_t N, int K, int G, int threads) {
#if AVX512
    if (M < 1 || M > INT4_MAX_ROWS || N < INT4_BLOCK || N % INT4_BLOCK || G < 1 || G > INT4_MAX_GROUP || K < G ||
        K % G)
        return -1;
    const int64_t blocks = N / INT4_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && blocks > 1)
    for (int64_t b = 0; b < blocks; b++) {
        float weights[INT4_MAX_GROUP * INT4_BLOCK] __attribute__((aligned(64)));
        float acc[INT4_MAX_ROWS * INT4_BLOCK] __attribute__((aligned(64)));
        float inputs[INT4_MAX_ROWS * INT4_MAX_GROUP] __attribute__((aligned(64)));
        memset(acc, 0, sizeof(float) * INT4_BLOCK * M);
        for (int k0 = 0; k0 < K; k0 += G) {
            int4_dequantize(packed + (b * K + k0) * (INT4_BLOCK / 2), scales_zeros + (int64_t)(k0 / G) * N * 2,
                            b * INT4_BLOCK, G, weights);
            for (int m = 0; m < M; m++)
                for (int k = 0; k < G; k++) inputs[m * G + k] = from_bf16(rows[(int64_t)m * K + k0 + k]);
            int m = 0;
            for (; m + 6 <= M; m += 6) int4_rows_fma(acc + m * INT4_BLOCK, inputs + m * G, weights, G, 6);
            for (; m + 4 <= M; m += 4) int4_rows_fma(acc + m * INT4_BLOCK, inputs + m * G, weights, G, 4);
            for (; m + 2 <= M; m += 2) int4_rows_fma(acc + m * INT4_BLOCK, inputs + m * G, weights, G, 2);
            for (; m < M; m++) int4_rows_fma(acc + m * INT4_BLOCK, inputs + m * G, weights, G, 1);
        }
        for (int m = 0; m < M; m++)
            for (int j = 0; j < INT4_BLOCK; j++)
                out[(int64_t)m * N + b * INT4_BLOCK + j] = to_bf16(acc[m * INT4_BLOCK + j]);
    }
    return 0;
#else
    (void)rows, (void)M, (void)packed, (void)scales_zeros, (void)out, (void)N, (void)K, (void)G, (void)threads;
    return -1;
#endif
}

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

/* int4 codes times rows quantized to 9-bit integers, on the AVX2 build: the int4 layers' product for any row count. */
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

/* The codes of Q_TILE outputs for 4 inputs as signed bytes (code - 8): byte i of `packed` holds element i in its
   low nibble and element 16 + i in its high one; element e is output e / 4's code for input e % 4. */
static inline __m256i tile_codes(const uint8_t *packed) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)packed);
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(bytes, nibble), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    return _mm256_sub_epi8(_mm256_set_m128i(high, low), _mm256_set1_epi8(8));
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
        const __m256 scale = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
        const __m256 zero = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + Q_TILE))), 16));
        for (int r = 0; r < R; r++) {
            const float *group = steps + ((int64_t)(m0 + r) * groups + g) * 2;
            const __m256 whole = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r], ones));
            acc[r] = _mm256_fmadd_ps(whole, _mm256_mul_ps(scale, _mm256_set1_ps(group[0])), acc[r]);
            acc[r] = _mm256_fmadd_ps(zero, _mm256_set1_ps(group[1]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + (int64_t)(m0 + r) * N + t * Q_TILE, acc[r]);
}
#endif

/* out [M, N] float32 = x [M, K] float32 times int4 weights (code - 8) × scale + zero, with each row's inputs
   quantized per group of Q_GROUP (`quantized_row`). `codes`: [N / Q_TILE][K / 4][16] bytes (`tile_codes`);
   `qparams`: bfloat16 [N / Q_TILE][K / Q_GROUP][2][Q_TILE] (the tile's scales, then its zero points). On `threads`
   threads over tiles. Returns 0; -1 when the shapes are beyond what the kernel serves or this build has no AVX2, -2
   when its row buffer cannot be allocated (nothing is written then). */
int int4_qrows(const float *x, int M, const uint8_t *codes, const uint16_t *qparams, float *out, int64_t N, int K,
               int threads) {
#if AVX2
    if (M < 1 || N < Q_TILE || N % Q_TILE || K < Q_GROUP || K % Q_GROUP) return -1;
    const int groups = K / Q_GROUP;
    float *steps = malloc((size_t)M * groups * 2 * sizeof(float) + (size_t)M * K * 2);
    if (steps == NULL) return -2;
    uint8_t *q = (uint8_t *)(steps + (size_t)M * groups * 2);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M > 1)
    for (int m = 0; m < M; m++)
        quantized_row(x + (int64_t)m * K, K, q + (int64_t)m * 2 * K, steps + (int64_t)m * groups * 2);
    const int64_t tiles = N / Q_TILE;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tiles > 1)
    for (int64_t t = 0; t < tiles; t++) {
        int m = 0;
        for (; m + 4 <= M; m += 4) qrows_tile(codes, qparams, q, steps, out, K, N, t, m, 4);
        for (; m + 2 <= M; m += 2) qrows_tile(codes, qparams, q, steps, out, K, N, t, m, 2);
        for (; m < M; m++) qrows_tile(codes, qparams, q, steps, out, K, N, t, m, 1);
    }
    free(steps);
    return 0;
#else
    (void)x, (void)M, (void)codes, (void)qparams, (void)out, (void)N, (void)K, (void)threads;
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
