/* float16 and bfloat16 weights as GGUF files store them (F16, BF16): y[M, N] = x[M, K] @ W[N, K]^T with W kept at
   its 16 bits and widened to float32 in registers (F16C / AVX-512 vcvtph2ps; bfloat16 by a 16-bit shift, exact),
   activations float32 (these are float files: nothing is rounded to int8).

   The order of the sums is fixed, the same in every build (AVX-512, AVX2, plain C) and for every M:
     lane l (0..15) of an output's accumulator adds, for k = l, l + 16, ... below K16 = K - K % 16,
       acc[l] = acc[l] + w[k] * x[k]          (the product rounded to float32, then the sum: no fused multiply-add)
     then the lanes are summed as a tree, s8[i] = acc[i] + acc[i + 8], s4[i] = s8[i] + s8[i + 4],
       s2[i] = s4[i] + s4[i + 2], total = s2[0] + s2[1],
     and the tail k = K16 .. K - 1 added in order, total = total + w[k] * x[k].
   So a batch's row computes bit for bit what it computes alone (lossless verification depends on it), threads
   (OpenMP over tiles of outputs, never splitting an output's sum) change nothing, and a NumPy float32 reference
   summing in this order equals the kernel exactly (tests/test_f16_weights.py). */

#include <stdlib.h>

#include "simd.h"

#define H_TILE 16 /* outputs a thread takes at a time */

/* 512-bit vectors where the CPU has AVX-512F; not in the emulated-VNNI test build, which so checks the 256-bit
   path against this one (the same numbers: the order above is the vectors' lanes either way) */
#if SPECDECODE_AVX2 && defined(__AVX512F__) && SPECDECODE_VNNI != 3
#define H_WIDE 1
#else
#define H_WIDE 0
#endif

#if H_WIDE
static inline __m512 widen16(const uint16_t *w, int bf16) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)w);
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)) : _mm512_cvtph_ps(raw);
}

/* rows r0..r0+R of one output; R is a constant at every call site, so the loops unroll */
static inline __attribute__((always_inline)) void h_rows(const float *x, int K, const uint16_t *w, int bf16,
                                                         float *y, int N, int R) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m512 wk = widen16(w + k, bf16);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(wk, _mm512_loadu_ps(x + (int64_t)r * K + k)));
    }
    for (int r = 0; r < R; r++) {
        const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1));
        float total = hsum(_mm256_add_ps(_mm512_castps512_ps256(acc[r]), high));  /* s8, then simd.h's tree */
        for (int j = k; j < K; j++) {
            const uint16_t h = w[j];
            uint32_t bits = (uint32_t)h << 16;
            float wj;
            memcpy(&wj, &bits, 4);
            total = total + (bf16 ? wj : half_to_float(h)) * x[(int64_t)r * K + j];
        }
        y[(int64_t)r * N] = total;
    }
}
#elif SPECDECODE_AVX2
static inline __m256 widen8(const uint16_t *w, int bf16) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)w);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)) : _mm256_cvtph_ps(raw);
}

static inline __attribute__((always_inline)) void h_rows(const float *x, int K, const uint16_t *w, int bf16,
                                                         float *y, int N, int R) {
    __m256 lo[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 hi[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256 w0 = widen8(w + k, bf16), w1 = widen8(w + k + 8, bf16);
        for (int r = 0; r < R; r++) {
            const float *xr = x + (int64_t)r * K + k;
            lo[r] = _mm256_add_ps(lo[r], _mm256_mul_ps(w0, _mm256_loadu_ps(xr)));
            hi[r] = _mm256_add_ps(hi[r], _mm256_mul_ps(w1, _mm256_loadu_ps(xr + 8)));
        }
    }
    for (int r = 0; r < R; r++) {
        float total = hsum(_mm256_add_ps(lo[r], hi[r]));  /* s8, then simd.h's tree */
        for (int j = k; j < K; j++) {
            const uint16_t h = w[j];
            uint32_t bits = (uint32_t)h << 16;
            float wj;
            memcpy(&wj, &bits, 4);
            total = total + (bf16 ? wj : half_to_float(h)) * x[(int64_t)r * K + j];
        }
        y[(int64_t)r * N] = total;
    }
}
#else
static inline float widen1(uint16_t h, int bf16) {
    if (!bf16) return half_to_float(h);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline void h_rows(const float *x, int K, const uint16_t *w, int bf16, float *y, int N, int R) {
    for (int r = 0; r < R; r++) {
        const float *xr = x + (int64_t)r * K;
        float acc[16] = {0};
        int k = 0;
        for (; k + 16 <= K; k += 16)
            for (int l = 0; l < 16; l++) {
                const float p = widen1(w[k + l], bf16) * xr[k + l];
                acc[l] = acc[l] + p;
            }
        for (int width = 8; width >= 1; width /= 2)
            for (int i = 0; i < width; i++) acc[i] = acc[i] + acc[i + width];
        float total = acc[0];
        for (int j = k; j < K; j++) {
            const float p = widen1(w[j], bf16) * xr[j];
            total = total + p;
        }
        y[(int64_t)r * N] = total;
    }
}
#endif

/* y[M, N] = x[M, K] @ W^T, W [N, K] of float16 (bf16 0) or bfloat16 (bf16 1) bits, rows in groups of up to 4 */
void specdecode_h_matmul(int bf16, const float *x, int M, int K, const uint16_t *w, float *y, int N) {
#define H_ROWS(R) h_rows(x + (int64_t)r0 * K, K, w + (int64_t)n * K, bf16, y + (int64_t)r0 * N + n, N, R)
#pragma omp parallel for schedule(static)
    for (int t = 0; t < (N + H_TILE - 1) / H_TILE; t++)
        for (int r0 = 0; r0 < M; r0 += 4)
            for (int n = t * H_TILE; n < ((t + 1) * H_TILE < N ? (t + 1) * H_TILE : N); n++)
                switch (M - r0 < 4 ? M - r0 : 4) {
                    case 4: H_ROWS(4); break;
                    case 3: H_ROWS(3); break;
                    case 2: H_ROWS(2); break;
                    default: H_ROWS(1); break;
                }
#undef H_ROWS
}
