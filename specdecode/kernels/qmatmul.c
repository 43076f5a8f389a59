/* Weight-only quantized matmuls for the few-row shapes of decoding and tree verification.

   y[M, N] = x[M, K] @ W[N, K]^T with W stored in blocks of 32 weights along K (GGUF's block size):
     q4: w = d * q + m, q in 0..15, 16 bytes per block (byte j: weight j in its low nibble, weight j + 16 in
         its high nibble: GGUF's Q4_0 / Q4_1 order; Q4_0 is m = -8 d), d and m in float16;
     q8: w = d * q, q in -128..127, 32 bytes per block, d in float16 (GGUF's Q8_0).
   Activations stay float32: each block's weights are widened to float32 in registers and meet x in FMAs,
   so the result is dequantize-then-matmul up to float32 rounding. Per block, sum(q * x) is formed first and
   scaled by d once (and m * sum(x) added at the end), which is where the summation order differs.

   Every output y[r, n] is computed by the same instruction sequence whatever M is (rows are tiled in groups
   of up to 4 and each row's accumulator sees the same operations in the same order), so a row's result does
   not depend on how many rows share the call: verifying a tree gives bit for bit the numbers a one-token step
   would, which keeps speculation lossless at this precision.

   Built at first use for the CPU it runs on (-march=native): AVX2 + FMA + F16C where the CPU has them, plain
   C otherwise. Threads: OpenMP over output tiles (the process's OpenMP runtime, the one torch loaded). */

#include "simd.h"

#define TILE_N 16

int specdecode_simd(void) {
#if SPECDECODE_VNNI
    return 2 + SPECDECODE_VNNI;  /* 3 AVX-VNNI, 4 AVX512-VNNI, 5 emulated (tests) */
#elif SPECDECODE_AVX2
    return 2;
#else
    return 0;
#endif
}

#if SPECDECODE_AVX2
/* sum over blocks of m[b] * s[b] (m in float16 bits): int4's min term, 8 blocks at a time */
static inline float mins_dot(const uint16_t *m, const float *s, int nb) {
    __m256 acc = _mm256_setzero_ps();
    int b = 0;
    for (; b + 8 <= nb; b += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + b))), _mm256_loadu_ps(s + b), acc);
    float total = hsum(acc);
    for (; b < nb; b++) total += half_to_float(m[b]) * s[b];
    return total;
}

static inline __m256 widen(__m128i bytes8, int is_signed) {  /* the low 8 bytes -> 8 floats */
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
}

/* sum over one block of 32 of q * x, the block's weights widened into q0..q3 (8 each) */
static inline __m256 block_dot(__m256 q0, __m256 q1, __m256 q2, __m256 q3, const float *x) {
    __m256 s = _mm256_mul_ps(q0, _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(q1, _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(q2, _mm256_loadu_ps(x + 16), s);
    return _mm256_fmadd_ps(q3, _mm256_loadu_ps(x + 24), s);
}

/* rows r0..r0+R of one output n; R is a constant at every call site, so the loops unroll */
static inline __attribute__((always_inline)) void q4_rows(
    const float *x, const float *xsum, int K, const uint8_t *q, const uint16_t *d, const uint16_t *m,
    float *y, int N, int R) {
    const int nb = K / QK;
    const __m128i low = _mm_set1_epi8(0x0f);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int b = 0; b < nb; b++) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(q + 16 * b));
        const __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        const __m256 q0 = widen(lo, 0), q1 = widen(_mm_srli_si128(lo, 8), 0);
        const __m256 q2 = widen(hi, 0), q3 = widen(_mm_srli_si128(hi, 8), 0);
        const __m256 scale = _mm256_set1_ps(half_to_float(d[b]));
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(block_dot(q0, q1, q2, q3, x + (int64_t)r * K + QK * b), scale, acc[r]);
    }
    for (int r = 0; r < R; r++) y[(int64_t)r * N] = hsum(acc[r]) + mins_dot(m, xsum + (int64_t)r * nb, nb);
}

static inline __attribute__((always_inline)) void q8_rows(
    const float *x, int K, const int8_t *q, const uint16_t *d, float *y, int N, int R) {
    const int nb = K / QK;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int b = 0; b < nb; b++) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(q + QK * b));
        const __m128i c = _mm_loadu_si128((const __m128i *)(q + QK * b + 16));
        const __m256 q0 = widen(a, 1), q1 = widen(_mm_srli_si128(a, 8), 1);
        const __m256 q2 = widen(c, 1), q3 = widen(_mm_srli_si128(c, 8), 1);
        const __m256 scale = _mm256_set1_ps(half_to_float(d[b]));
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(block_dot(q0, q1, q2, q3, x + (int64_t)r * K + QK * b), scale, acc[r]);
    }
    for (int r = 0; r < R; r++) y[(int64_t)r * N] = hsum(acc[r]);
}

static inline __attribute__((always_inline)) void f32_rows(
    const float *x, int K, const float *w, float *y, int N, int R) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 wk = _mm256_loadu_ps(w + k);
        for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + (int64_t)r * K + k), acc[r]);
    }
    for (int r = 0; r < R; r++) {
        float total = hsum(acc[r]);
        for (int j = k; j < K; j++) total += w[j] * x[(int64_t)r * K + j];
        y[(int64_t)r * N] = total;
    }
}
#else
static inline void q4_rows(const float *x, const float *xsum, int K, const uint8_t *q, const uint16_t *d,
                           const uint16_t *m, float *y, int N, int R) {
    const int nb = K / QK;
    for (int r = 0; r < R; r++) {
        const float *xr = x + (int64_t)r * K;
        float total = 0.0f;
        for (int b = 0; b < nb; b++) {
            float s = 0.0f;
            for (int j = 0; j < 16; j++) {
                const uint8_t byte = q[16 * b + j];
                s += (float)(byte & 0x0f) * xr[QK * b + j] + (float)(byte >> 4) * xr[QK * b + j + 16];
            }
            total += s * half_to_float(d[b]) + half_to_float(m[b]) * xsum[(int64_t)r * nb + b];
        }
        y[(int64_t)r * N] = total;
    }
}

static inline void q8_rows(const float *x, int K, const int8_t *q, const uint16_t *d, float *y, int N, int R) {
    const int nb = K / QK;
    for (int r = 0; r < R; r++) {
        const float *xr = x + (int64_t)r * K;
        float total = 0.0f;
        for (int b = 0; b < nb; b++) {
            float s = 0.0f;
            for (int j = 0; j < QK; j++) s += (float)q[QK * b + j] * xr[QK * b + j];
            total += s * half_to_float(d[b]);
        }
        y[(int64_t)r * N] = total;
    }
}

static inline void f32_rows(const float *x, int K, const float *w, float *y, int N, int R) {
    for (int r = 0; r < R; r++) {
        float total = 0.0f;
        for (int k = 0; k < K; k++) total += w[k] * x[(int64_t)r * K + k];
        y[(int64_t)r * N] = total;
    }
}
#endif

/* Every output of y[M, N]: tiles of TILE_N outputs shared out among the threads, rows in groups of up to 4.
   ROWS(R) computes rows r0..r0+R-1 of output n, with R a constant, so each kernel's row loop unrolls. */
#define FOR_EACH_TILE(M, N, ROWS)                                                                          \
    _Pragma("omp parallel for schedule(static)")                                                         \
    for (int t = 0; t < ((N) + TILE_N - 1) / TILE_N; t++)                                                \
        for (int r0 = 0; r0 < (M); r0 += 4)                                                              \
            for (int n = t * TILE_N; n < ((t + 1) * TILE_N < (N) ? (t + 1) * TILE_N : (N)); n++)         \
                switch ((M) - r0 < 4 ? (M) - r0 : 4) {                                                   \
                    case 4: ROWS(4); break;                                                              \
                    case 3: ROWS(3); break;                                                              \
                    case 2: ROWS(2); break;                                                              \
                    default: ROWS(1); break;                                                             \
                }

/* y[M, N] = x[M, K] @ dequant(W)^T; W: qs [N, K / 2], d and m [N, K / 32]. xsum: scratch of M * K / 32 floats. */
void specdecode_q4_matmul(const float *x, float *xsum, int M, int K, const uint8_t *qs, const uint16_t *d,
                          const uint16_t *m, float *y, int N) {
    const int nb = K / QK;
    for (int r = 0; r < M; r++)
        for (int b = 0; b < nb; b++) {
            float s = 0.0f;
            for (int j = 0; j < QK; j++) s += x[(int64_t)r * K + QK * b + j];
            xsum[(int64_t)r * nb + b] = s;
        }
#define Q4_ROWS(R) q4_rows(x + (int64_t)r0 * K, xsum + (int64_t)r0 * nb, K, qs + (int64_t)n * (K / 2), \
                          d + (int64_t)n * nb, m + (int64_t)n * nb, y + (int64_t)r0 * N + n, N, R)
    FOR_EACH_TILE(M, N, Q4_ROWS)
#undef Q4_ROWS
}

/* y[M, N] = x[M, K] @ dequant(W)^T; W: qs [N, K] int8, d [N, K / 32]. */
void specdecode_q8_matmul(const float *x, int M, int K, const int8_t *qs, const uint16_t *d, float *y, int N) {
    const int nb = K / QK;
#define Q8_ROWS(R) q8_rows(x + (int64_t)r0 * K, K, qs + (int64_t)n * K, d + (int64_t)n * nb, y + (int64_t)r0 * N + n, N, R)
    FOR_EACH_TILE(M, N, Q8_ROWS)
#undef Q8_ROWS
}

/* y[M, N] = x[M, K] @ W[N, K]^T in float32 (the native step's float path). */
void specdecode_f32_matmul(const float *x, int M, int K, const float *w, float *y, int N) {
#define F32_ROWS(R) f32_rows(x + (int64_t)r0 * K, K, w + (int64_t)n * K, y + (int64_t)r0 * N + n, N, R)
    FOR_EACH_TILE(M, N, F32_ROWS)
#undef F32_ROWS
}
