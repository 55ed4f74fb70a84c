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
#include <stddef.h>
#include <stdint.h>

#define MAX_RB 12

#define KERN(RB)                                                                                                  \
    static void kern##RB(const float *x, int K, const uint16_t *pw, float *acc) {                                \
        __m512 a0[RB], a1[RB];                                                                                    \
        for (int m = 0; m < RB; m++) {                                                                            \
            a0[m] = _mm512_setzero_ps();                                                                          \
            a1[m] = _mm512_setzero_ps();                                                                          \
        }                                                                                                         \
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
        for (int m = 0; m < RB; m++) {                                                                            \
            _mm512_storeu_ps(acc + m * 32, a0[m]);                                                                \
            _mm512_storeu_ps(acc + m * 32 + 16, a1[m]);                                                           \
        }                                                                                                         \
    }

KERN(1) KERN(2) KERN(3) KERN(4) KERN(5) KERN(6) KERN(7) KERN(8) KERN(9) KERN(10) KERN(11) KERN(12)

typedef void (*kern_fn)(const float *, int, const uint16_t *, float *);
static const kern_fn KERNS[MAX_RB + 1] = {0,     kern1, kern2, kern3,  kern4,  kern5, kern6,
                                          kern7, kern8, kern9, kern10, kern11, kern12};

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

/* x [M][K] float32 (contiguous), packed W, bias [N] or NULL -> y [M][N] float32 (contiguous). */
void bf16w_linear(const float *x, int M, int K, const uint16_t *wp, int N, const float *bias, float *y) {
    int panels = (N + 31) / 32;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++) {
        float acc[MAX_RB * 32];
        const uint16_t *pw = wp + (size_t)p * K * 32;
        int n0 = p * 32, nn = N - n0 < 32 ? N - n0 : 32;
        for (int m0 = 0; m0 < M; m0 += MAX_RB) {
            int rb = M - m0 < MAX_RB ? M - m0 : MAX_RB;
            KERNS[rb](x + (size_t)m0 * K, K, pw, acc);
            for (int m = 0; m < rb; m++) {
                float *row = y + (size_t)(m0 + m) * N + n0;
                for (int j = 0; j < nn; j++)
                    row[j] = bias ? acc[m * 32 + j] + bias[n0 + j] : acc[m * 32 + j];
            }
        }
    }
}
