/* The product kernel's layer spans (int4_span, silu_times), built with avx2_products.c into one library, without
   reassociation (kernel_build.EXACT_FLAGS). */

#include "avx2_products.h"

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

