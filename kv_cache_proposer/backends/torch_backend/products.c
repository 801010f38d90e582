/* Linear layers' products for the torch backend on a CPU, each giving exactly the values of the PyTorch kernel it
   stands in for, so a token's values are the same whichever computes them (products.py):

   - int8_row_sums: integer sums of a few int8 rows against a matrix of int8 codes, on the CPU's 512-bit integer dot
     products (AVX512-VNNI), reading the codes once, in place: the int8 LM head's product for a decode step or a
     short block. Exact integers, so equal to those of any other exact product (PyTorch's `_int_mm`), whatever the
     thread count. The dot-product instruction multiplies unsigned by signed bytes, so each row is read shifted by
     128 (unsigned) and 128 times the code row's sum (`offsets`, computed once per matrix) is taken off its sums.
   - int4_rows: bfloat16 rows times int4 weights packed for PyTorch's `_weight_int4pack_mm_for_cpu`, with that
     kernel's layout and arithmetic for every output, as it runs on AVX-512: blocks of 64 outputs, each weight
     dequantized as fma(code - 8, scale, zero) in float32, the products summed by fma in input order from 0 and the
     sum rounded to bfloat16 to nearest even. But each block's weights are dequantized once for all the rows instead
     of once per 4: a verify block, a batched step or a prefill chunk reads them at a fraction of the cost. (On a CPU
     with AVX2 only, int4 layers multiply quantized rows instead: avx2_products.c.)

   Built without reassociation (kernel_build.EXACT_FLAGS): the order written here is the order computed. */

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define AVX512 1
#else
#define AVX512 0
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
