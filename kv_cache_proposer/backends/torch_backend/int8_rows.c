/* Integer sums of a few int8 rows against a matrix of int8 codes, on the CPU's 512-bit integer dot products
   (AVX512-VNNI), reading the codes once, in place: the int8 LM head's product for a decode step or a short block
   (int8_rows.py). The sums are exact integers, so they equal those of any other exact product (PyTorch's
   `_int_mm`) bit for bit, whatever the thread count.

   The dot-product instruction multiplies unsigned by signed bytes, so each row is read shifted by 128 (unsigned)
   and 128 times the code row's sum (`offsets`, computed once per matrix) is taken off its sums. */

#include <stdint.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define VNNI 1
#else
#define VNNI 0
#endif

#define MAX_ROWS 64         /* input rows of one call at most */
#define MAX_SHIFTED 65536   /* bytes of one call's rows at most (held shifted in a per-thread buffer) */

/* Whether this build computes the sums (else every call returns -1). */
int int8_rows_served(void) { return VNNI; }

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
