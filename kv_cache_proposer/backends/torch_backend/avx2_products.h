/* What avx2_products.c and layer_spans.c share, built together into one library (products.py loads it): the
   includes, whether the build has AVX2 with FMA, and the int4 product over quantized rows the spans call. */

#ifndef KAKEYA_AVX2_PRODUCTS_H
#define KAKEYA_AVX2_PRODUCTS_H

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

/* out [M, N] = x [M, K] times int4 codes held for the product over quantized rows (avx2_products.c). */
int int4_qrows(const float *x, int M, const float *norm, float eps, const uint8_t *codes, const uint16_t *qparams,
               float *out, int64_t N, int K, int threads);

#endif
