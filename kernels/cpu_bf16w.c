/* Mechanism bf16w-matmul: y[M, N] = x[M, K] @ W^T (+ bias), x float32, W stored as bfloat16 (AVX-512F/BW).
 *
 * A float32 deployment of a bfloat16 checkpoint holds every weight as an exact bf16 value in 4 bytes. At the
 * few rows of a decode or verify step the matmuls read the weights once per call and are bound by memory, so
 * holding them in 2 bytes halves what they read; the widening bf16 -> f32 is a shift, exact. Each output is one
 * float32 FMA chain over k = 0..K-1 in order, the same chain at any row count M (row m's result does not depend
 * on the other rows in the call), so a verify of k rows scores each row exactly as a one-row step would.
 *
 * W is packed once into panels of 32 outputs: panel p is [K][32] bf16 (outputs p*32 .. p*32+31, zero past N),
 * so one k step loads one 64-byte line and widens it to two vectors of 16 float32 weights; up to 12 rows are
 * accumulated per pass over a panel (24 accumulators). Panels are split across the OpenMP threads of the
 * process (torch's own runtime: the library is loaded after torch).
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_RB 12

/* The RB rows' accumulators of one 32-output panel (two vectors a row), zeroed, then stored to acc [RB][32]. */
#define ACC_ZERO(RB)                                                                                              \
    __m512 a0[RB], a1[RB];                                                                                        \
    for (int m = 0; m < RB; m++) {                                                                                \
        a0[m] = _mm512_setzero_ps();                                                                              \
        a1[m] = _mm512_setzero_ps();                                                                              \
    }
#define ACC_STORE(RB)                                                                                             \
    for (int m = 0; m < RB; m++) {                                                                                \
        _mm512_storeu_ps(acc + m * 32, a0[m]);                                                                    \
        _mm512_storeu_ps(acc + m * 32 + 16, a1[m]);                                                               \
    }

#define KERN(RB)                                                                                                  \
    static void kern##RB(const float *x, int K, const uint16_t *pw, float *acc) {                                \
        ACC_ZERO(RB)                                                                                              \
        for (int k = 0; k < K; k++) {                                                                             \
            __m512i w16 = _mm512_loadu_si512((const void *)(pw + (size_t)k * 32));                                \
            __m512 w0 = _mm512_castsi512_ps(                                                                      \
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w16)), 16));                      \
            __m512 w1 = _mm512_castsi512_ps(                                                                      \
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w16, 1)), 16));                \
            for (int m = 0; m < RB; m++) {                                                                        \
                __m512 xb = _mm512_set1_ps(x[(size_t)m * K + k]);                                                 \
                a0[m] = _mm512_fmadd_ps(xb, w0, a0[m]);                                                           \
                a1[m] = _mm512_fmadd_ps(xb, w1, a1[m]);                                                           \
            }                                                                                                     \
        }                                                                                                         \
        ACC_STORE(RB)                                                                                             \
    }

KERN(1) KERN(2) KERN(3) KERN(4) KERN(5) KERN(6) KERN(7) KERN(8) KERN(9) KERN(10) KERN(11) KERN(12)

typedef void (*kern_fn)(const float *, int, const uint16_t *, float *);
static const kern_fn KERNS[MAX_RB + 1] = {0,     kern1, kern2, kern3,  kern4,  kern5, kern6,
                                          kern7, kern8, kern9, kern10, kern11, kern12};

#ifdef BF16W_DP
/* A bfloat16 deployment on a CPU with AVX512-BF16 dot products: bfloat16 rows times W packed in pairs of k
 * (`bf16w_pack_pairs`), 32 products a k pair per row in one instruction where the loop above widens and issues
 * two FMAs a k. Each lane adds x[2i+1] w[2i+1], then x[2i] w[2i], to its float32 sum (products of bf16 values are
 * exact in float32): one float32 chain per output, in another order than the FMA chain, the same at any M. */
#define DPKERN(RB)                                                                                                \
    __attribute__((target("avx512f,avx512bw,avx512bf16"))) static void dpkern##RB(const uint16_t *x, int K,      \
                                                                                 const uint16_t *pw, float *acc) { \
        ACC_ZERO(RB)                                                                                              \
        for (int kp = 0; kp < K / 2; kp++) {                                                                      \
            __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(pw + (size_t)kp * 64));                     \
            __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(pw + (size_t)kp * 64 + 32));                \
            for (int m = 0; m < RB; m++) {                                                                        \
                uint32_t pr;                                                                                      \
                memcpy(&pr, x + (size_t)m * K + 2 * kp, 4);                                                       \
                __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pr);                                               \
                a0[m] = _mm512_dpbf16_ps(a0[m], xb, w0);                                                          \
                a1[m] = _mm512_dpbf16_ps(a1[m], xb, w1);                                                          \
            }                                                                                                     \
        }                                                                                                         \
        ACC_STORE(RB)                                                                                             \
    }

DPKERN(1) DPKERN(2) DPKERN(3) DPKERN(4) DPKERN(5) DPKERN(6) DPKERN(7) DPKERN(8) DPKERN(9) DPKERN(10) DPKERN(11)
DPKERN(12)

typedef void (*dpkern_fn)(const uint16_t *, int, const uint16_t *, float *);
static const dpkern_fn DPKERNS[MAX_RB + 1] = {0,       dpkern1, dpkern2, dpkern3,  dpkern4,  dpkern5, dpkern6,
                                              dpkern7, dpkern8, dpkern9, dpkern10, dpkern11, dpkern12};
#endif

/* 1 when this build has the AVX512-BF16 kernels (compiled with -DBF16W_DP), else 0. */
int bf16w_has_pairs(void) {
#ifdef BF16W_DP
    return 1;
#else
    return 0;
#endif
}

/* w [N][K] bf16 bits, K even -> out [ceil(N/32)][K/2][32][2]: panel p, k pair kp, output j holds w[p*32+j][2kp]
 * then w[p*32+j][2kp+1] (outputs past N zero); the same size as `bf16w_pack`'s panels. */
void bf16w_pack_pairs(const uint16_t *w, int N, int K, uint16_t *out) {
    int panels = (N + 31) / 32;
    for (int p = 0; p < panels; p++)
        for (int kp = 0; kp < K / 2; kp++)
            for (int j = 0; j < 32; j++)
                for (int e = 0; e < 2; e++) {
                    int n = p * 32 + j;
                    out[(((size_t)p * (K / 2) + kp) * 32 + j) * 2 + e] = n < N ? w[(size_t)n * K + 2 * kp + e] : 0;
                }
}

/* w [N][K] bf16 bits -> out [ceil(N/32)][K][32], outputs past N zero. */
void bf16w_pack(const uint16_t *w, int N, int K, uint16_t *out) {
    int panels = (N + 31) / 32;
    for (int p = 0; p < panels; p++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < 32; j++) {
                int n = p * 32 + j;
                out[((size_t)p * K + k) * 32 + j] = n < N ? w[(size_t)n * K + k] : 0;
            }
}

/* float32 -> bfloat16 bits, nearest with ties to even (torch's conversion; a NaN stays a NaN). */
static inline uint16_t to_bf16(float v) {
    uint32_t b;
    memcpy(&b, &v, 4);
    return (uint16_t)(isnan(v) ? 0x7fc0 : (b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float v;
    memcpy(&v, &b, 4);
    return v;
}

/* v rounded to the nearest bfloat16 value, kept as float32: where a bfloat16 torch op rounds its result. */
static inline float rb(float v) { return from_bf16(to_bf16(v)); }

/* x [M][K] (float32 xf for W packed by k, bfloat16 bits xb for W packed in pairs), bias [N] or NULL -> y [M][N]:
 * float32 into yf (each rounded to a bfloat16 value when round_f), or (yf NULL) each output rounded to bfloat16
 * (nearest, ties to even, as torch's conversion) into yb after the bias is added in float32. */
static void linear_rows(const float *x, const uint16_t *xb, int M, int K, const uint16_t *wp, int pairs, int N,
                        const float *bias, float *yf, uint16_t *yb, int round_f) {
    int panels = (N + 31) / 32;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++) {
        float acc[MAX_RB * 32];
        const uint16_t *pw = wp + (size_t)p * K * 32;
        int n0 = p * 32, nn = N - n0 < 32 ? N - n0 : 32;
        for (int m0 = 0; m0 < M; m0 += MAX_RB) {
            int nb = M - m0 < MAX_RB ? M - m0 : MAX_RB;
#ifdef BF16W_DP
            if (pairs)
                DPKERNS[nb](xb + (size_t)m0 * K, K, pw, acc);
            else
#endif
                KERNS[nb](x + (size_t)m0 * K, K, pw, acc);
            for (int m = 0; m < nb; m++) {
                size_t at = (size_t)(m0 + m) * N + n0;
                for (int j = 0; j < nn; j++) {
                    float v = bias ? acc[m * 32 + j] + bias[n0 + j] : acc[m * 32 + j];
                    if (yf)
                        yf[at + j] = round_f ? rb(v) : v;
                    else
                        yb[at + j] = to_bf16(v);
                }
            }
        }
    }
}

/* x [M][K] float32 (contiguous), packed W, bias [N] or NULL -> y [M][N] float32 (contiguous). */
void bf16w_linear(const float *x, int M, int K, const uint16_t *wp, int N, const float *bias, float *y) {
    linear_rows(x, NULL, M, K, wp, 0, N, bias, y, NULL, 0);
}

/* A bfloat16 deployment: x [M][K] bfloat16 bits (widened exactly into xf [M][K], the caller's scratch, unless W
 * is packed in pairs), float32 bias [N] or NULL -> y [M][N] bfloat16 bits, each output one float32 chain rounded
 * once, as a bfloat16 matmul that accumulates in float32 rounds it. */
void bf16w_linear_bf16(const uint16_t *x, int M, int K, float *xf, const uint16_t *wp, int pairs, int N,
                       const float *bias, uint16_t *y) {
    if (!pairs)
        for (size_t i = 0; i < (size_t)M * K; i++) xf[i] = from_bf16(x[i]);
    linear_rows(xf, x, M, K, wp, pairs, N, bias, NULL, y, 0);
}

/* Mechanism bf16w-fused-layer: a decoder layer's work around attention in two calls instead of ~25 torch ops.
 *
 * At the few rows of a decode or verify step each torch op costs a few microseconds of dispatch whatever its size,
 * and a Llama-style layer runs ~25 of them besides attention (norms, RoPE, residual adds, SiLU and product, the
 * splits). `bf16w_pre_attn` runs norm -> QKV projection -> RoPE on q and k; `bf16w_post_attn` runs output
 * projection -> residual -> norm -> gate/up projection -> SiLU(g) * u -> down projection -> residual. Every step
 * is per row, so a row's result does not depend on the other rows of the call (as `bf16w_linear`). */

/* exp(x) for float32 lanes: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 Taylor polynomial (error under one ulp of
 * float32 on that range), scaled by 2^n. Inputs clamped to [-87, 88] (SiLU only needs exp(-g) to over/underflow
 * gracefully: g / (1 + exp(-g)) is then ~0 or g). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.9841270e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3888889e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333333e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666667e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666667e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* out[d] = w[d] * (x[d] / sqrt(mean(x^2) + eps)), as Llama's RMSNorm in float32. */
/* 1 / sqrt(mean(x^2) + eps) of one row. */
static float rms_scale(const float *x, int D, float eps) {
    __m512 acc = _mm512_setzero_ps();
    int d = 0;
    for (; d + 16 <= D; d += 16) {
        __m512 v = _mm512_loadu_ps(x + d);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    float ss = _mm512_reduce_add_ps(acc);
    for (; d < D; d++) ss += x[d] * x[d];
    return 1.0f / sqrtf(ss / (float)D + eps);
}

static void rms_row(const float *x, int D, const float *w, float eps, float *out) {
    float r = rms_scale(x, D, eps);
    for (int d = 0; d < D; d++) out[d] = w[d] * (x[d] * r);
}

/* One head's rotary embedding in place: with half = hd / 2, (a, b) = (x[i], x[i + half]) becomes
 * (a cos[i] - b sin[i], b cos[i + half] + a sin[i + half]), as x * cos + rotate_half(x) * sin. */
static void rope_head(float *x, const float *c, const float *s, int hd) {
    int half = hd / 2;
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * c[i] + -b * s[i];
        x[i + half] = b * c[i + half] + a * s[i + half];
    }
}

/* a[i] = g[i] / (1 + exp(-g[i])) * u[i] for gu = [g (I) | u (I)]. */
static void silu_mul_row(const float *gu, int I, float *a) {
    int i = 0;
    for (; i + 16 <= I; i += 16) {
        __m512 g = _mm512_loadu_ps(gu + i), u = _mm512_loadu_ps(gu + I + i);
        __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_storeu_ps(a + i, _mm512_mul_ps(s, u));
    }
    for (; i < I; i++) a[i] = gu[i] / (1.0f + expf(-gu[i])) * gu[I + i];
}

/* The same steps one at a time for a prefill's many rows, whose matmuls run faster in the BLAS than in the
 * few-row kernel above: each a single pass over its rows, split over the OpenMP threads. */

/* gu [T][2I] -> a [T][I] = silu(g) * u. */
void bf16w_silu_mul(const float *gu, int T, int I, float *a) {
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) silu_mul_row(gu + (size_t)t * 2 * I, I, a + (size_t)t * I);
}

/* x [T][D] -> out [T][D] = rms(x) * w. */
void bf16w_rms(const float *x, int T, int D, const float *w, float eps, float *out) {
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) rms_row(x + (size_t)t * D, D, w, eps, out + (size_t)t * D);
}

/* y = x + o, h = rms(y) * w, all [T][D]. */
void bf16w_add_rms(const float *x, const float *o, int T, int D, const float *w, float eps, float *y, float *h) {
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        size_t r = (size_t)t * D;
        for (int d = 0; d < D; d++) y[r + d] = x[r + d] + o[r + d];
        rms_row(y + r, D, w, eps, h + r);
    }
}

/* RoPE in place on qkv [T][N]: the first nq + nk heads of hd values of row t, with cos/sin [T][hd]. */
void bf16w_rope(float *qkv, int T, int N, const float *cos, const float *sin, int nheads, int hd) {
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++)
        for (int j = 0; j < nheads; j++)
            rope_head(qkv + (size_t)t * N + (size_t)j * hd, cos + (size_t)t * hd, sin + (size_t)t * hd, hd);
}

/* x [T][D] -> qkv [T][N] = rope(rms(x) Wqkv^T + b): the first nq heads (q) and the next nk (k) of hd values each
 * rotated with row t's cos/sin [T][hd]; the rest of the row (v) as projected. h [T][D] is scratch. */
void bf16w_pre_attn(const float *x, int T, int D, const float *ln, float eps, const uint16_t *wqkv, int N,
                    const float *bias, const float *cos, const float *sin, int nq, int nk, int hd, float *h,
                    float *qkv) {
    bf16w_rms(x, T, D, ln, eps, h);
    bf16w_linear(h, T, D, wqkv, N, bias, qkv);
    bf16w_rope(qkv, T, N, cos, sin, nq + nk, hd);
}

/* The layer after attention: y = x + att Wo^T + bo; y += down(silu(g) * u) where [g | u] = rms(y) Wgu^T + bgu.
 * x [T][D], att [T][QS] -> y [T][D]; h [T][D], gu [T][2I], a [T][I] are scratch. */
void bf16w_post_attn(const float *x, const float *att, int T, int D, int QS, const uint16_t *wo, const float *bo,
                     const float *ln, float eps, const uint16_t *wgu, const float *bgu, int I, const uint16_t *wd,
                     const float *bd, float *y, float *h, float *gu, float *a) {
    size_t n = (size_t)T * D;
    bf16w_linear(att, T, QS, wo, D, bo, y);
    for (size_t i = 0; i < n; i++) y[i] = x[i] + y[i];
    for (int t = 0; t < T; t++) rms_row(y + (size_t)t * D, D, ln, eps, h + (size_t)t * D);
    bf16w_linear(h, T, D, wgu, 2 * I, bgu, gu);
    for (int t = 0; t < T; t++) silu_mul_row(gu + (size_t)t * 2 * I, I, a + (size_t)t * I);
    bf16w_linear(a, T, I, wd, D, bd, h);
    for (size_t i = 0; i < n; i++) y[i] += h[i];
}

/* The fused layer of a bfloat16 deployment: the same steps in float32, each result rounded to a bfloat16 value
 * where the op-by-op bfloat16 layer rounds it (torch's bfloat16 ops compute in float32 and round once): the norm's
 * normalised row, then its product with the weight; each projection after its bias; RoPE's two products and
 * their sum; the residual sums; SiLU, then its product with u. The remaining differences are float32 summation
 * orders (the norm's sum of squares, the matmuls), which move a result to the neighbouring bfloat16 value only
 * where it lies within float32 rounding of a rounding boundary. x, qkv, att and y are bfloat16 bits. */

/* rb for 16 lanes. */
static inline __m512 rb512(__m512 v) {
    __m512i b = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(r), _mm512_set1_ps(NAN));
}

/* a[i] = rb(rb(silu(g[i])) * u[i]): torch's bfloat16 SiLU, then the bfloat16 product. */
static void silu_mul_row_bf(const float *gu, int I, float *a) {
    int i = 0;
    for (; i + 16 <= I; i += 16) {
        __m512 g = _mm512_loadu_ps(gu + i), u = _mm512_loadu_ps(gu + I + i);
        __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 sl = rb512(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        _mm512_storeu_ps(a + i, rb512(_mm512_mul_ps(sl, u)));
    }
    for (; i < I; i++) a[i] = rb(rb(gu[i] / (1.0f + expf(-gu[i]))) * gu[I + i]);
}

/* y [M][N] = x W^T + bias rounded to bfloat16 values, x [M][K] float32 holding bfloat16 values (exactly narrowed
 * into xb [M][K], scratch, for W packed in pairs). */
static void mm_bf(const float *x, uint16_t *xb, int M, int K, const uint16_t *wp, int pairs, int N, const float *bias,
                  float *y) {
    if (pairs)
        for (size_t i = 0; i < (size_t)M * K; i++) xb[i] = to_bf16(x[i]);
    linear_rows(x, xb, M, K, wp, pairs, N, bias, y, NULL, 1);
}

static void rms_row_bf(const float *x, int D, const float *w, float eps, float *out) {
    float r = rms_scale(x, D, eps);
    for (int d = 0; d < D; d++) out[d] = rb(w[d] * rb(x[d] * r));
}

static void rope_head_bf(float *x, const float *c, const float *s, int hd) {
    int half = hd / 2;
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = rb(rb(a * c[i]) + rb(-b * s[i]));
        x[i + half] = rb(rb(b * c[i + half]) + rb(a * s[i + half]));
    }
}

/* x [T][D] bf16 -> out [T][N] bf16 = rope(rms(x) Wqkv^T + b) as bf16_pre_attn's float32 twin rounds it; h [T][D]
 * and q32 [T][N] float32 scratch. */
void bf16w_pre_attn_bf16(const uint16_t *x, int T, int D, const float *ln, float eps, const uint16_t *wqkv,
                         int pairs, int N, const float *bias, const float *cos, const float *sin, int nq, int nk,
                         int hd, float *h, uint16_t *hb, float *q32, uint16_t *out) {
    for (int t = 0; t < T; t++) {
        float *row = h + (size_t)t * D;
        for (int d = 0; d < D; d++) row[d] = from_bf16(x[(size_t)t * D + d]);
        rms_row_bf(row, D, ln, eps, row);
    }
    mm_bf(h, hb, T, D, wqkv, pairs, N, bias, q32);
    for (int t = 0; t < T; t++) {
        for (int j = 0; j < nq + nk; j++)
            rope_head_bf(q32 + (size_t)t * N + (size_t)j * hd, cos + (size_t)t * hd, sin + (size_t)t * hd, hd);
        for (int n = 0; n < N; n++) out[(size_t)t * N + n] = to_bf16(q32[(size_t)t * N + n]);
    }
}

/* x [T][D], att [T][QS] bf16 -> y [T][D] bf16, as bf16w_post_attn rounded where the bfloat16 layer rounds;
 * att32 [T][QS], y32 and h [T][D], gu [T][2I], a [T][I] float32 scratch. */
void bf16w_post_attn_bf16(const uint16_t *x, const uint16_t *att, int T, int D, int QS, const uint16_t *wo,
                          const float *bo, const float *ln, float eps, const uint16_t *wgu, const float *bgu, int I,
                          const uint16_t *wd, const float *bd, int pairs, uint16_t *y, float *att32, float *y32,
                          float *h, float *gu, float *a, uint16_t *xs) {
    size_t n = (size_t)T * D;
    if (!pairs)
        for (size_t i = 0; i < (size_t)T * QS; i++) att32[i] = from_bf16(att[i]);
    linear_rows(att32, att, T, QS, wo, pairs, D, bo, y32, NULL, 1);
    for (size_t i = 0; i < n; i++) y32[i] = rb(from_bf16(x[i]) + y32[i]);
    for (int t = 0; t < T; t++) rms_row_bf(y32 + (size_t)t * D, D, ln, eps, h + (size_t)t * D);
    mm_bf(h, xs, T, D, wgu, pairs, 2 * I, bgu, gu);
    for (int t = 0; t < T; t++) silu_mul_row_bf(gu + (size_t)t * 2 * I, I, a + (size_t)t * I);
    mm_bf(a, xs, T, I, wd, pairs, D, bd, h);
    for (size_t i = 0; i < n; i++) y[i] = to_bf16(y32[i] + h[i]);
}
