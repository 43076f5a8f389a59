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

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECDECODE_AVX2 1
#include <immintrin.h>
#endif

#define QK 32
#define TILE_N 16

static inline float half_to_float(uint16_t h) {
#if SPECDECODE_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

int specdecode_simd(void) {
#if SPECDECODE_AVX2
    return 2;
#else
    return 0;
#endif
}

#if SPECDECODE_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

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

/* ------------------------------------------------------------------------------------------------------------
   The same weights with int8 activations (llama.cpp's arithmetic for GGUF models: Q4_1 x Q8_1, Q8_0 x Q8_0).
   Each row of x is rounded per block of 32 to dx * qx (qx in -127..127, dx = max |x| / 127); then a block's
   dot product is an exact integer sum, scaled once: dw * dx * sum(qw * qx) (+ mw * dx * sum(qx) for int4).
   Three times less arithmetic per weight than widening the weights to float32, at the cost of rounding the
   activations: a model of its own ("int4-a8", "int8-a8"), rows still independent of each other. */

#include <math.h>
#include <stdlib.h>

static void quantize_rows(const float *x, int M, int K, int8_t *qx, float *dx, float *sx) {
    const int nb = K / QK;
    for (int r = 0; r < M; r++)
        for (int b = 0; b < nb; b++) {
            const float *v = x + (int64_t)r * K + QK * b;
            float amax = 0.0f;
            for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int j = 0; j < QK; j++) {
                const int q = (int)nearbyintf(v[j] * inv);
                qx[(int64_t)r * K + QK * b + j] = (int8_t)q;
                sum += q;
            }
            dx[(int64_t)r * nb + b] = d;
            sx[(int64_t)r * nb + b] = d * (float)sum;
        }
}

#if SPECDECODE_AVX2
static inline __attribute__((always_inline)) void q4a8_rows(
    const int8_t *xq, const float *dx, const float *sx, int K, const uint8_t *q, const uint16_t *d,
    const uint16_t *m, float *y, int N, int R) {
    const int nb = K / QK;
    const __m128i low = _mm_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int b = 0; b < nb; b++) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(q + 16 * b));
        const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
        const float dw = half_to_float(d[b]);
        for (int r = 0; r < R; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (int64_t)r * K + QK * b));
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones));
            acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * dx[(int64_t)r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[(int64_t)r * N] = hsum(acc[r]) + mins_dot(m, sx + (int64_t)r * nb, nb);
}

static inline __attribute__((always_inline)) void q8a8_rows(
    const int8_t *xq, const float *dx, int K, const int8_t *q, const uint16_t *d, float *y, int N, int R) {
    const int nb = K / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int b = 0; b < nb; b++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(q + QK * b));
        const __m256i wabs = _mm256_sign_epi8(w, w);  /* maddubs wants one unsigned side: |w| * (x * sign(w)) */
        const float dw = half_to_float(d[b]);
        for (int r = 0; r < R; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (int64_t)r * K + QK * b));
            const __m256i prod = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, w));
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
            acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * dx[(int64_t)r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[(int64_t)r * N] = hsum(acc[r]);
}
#else
static inline void q4a8_rows(const int8_t *xq, const float *dx, const float *sx, int K, const uint8_t *q,
                             const uint16_t *d, const uint16_t *m, float *y, int N, int R) {
    const int nb = K / QK;
    for (int r = 0; r < R; r++) {
        float total = 0.0f;
        for (int b = 0; b < nb; b++) {
            int s = 0;
            for (int j = 0; j < 16; j++) {
                const uint8_t byte = q[16 * b + j];
                s += (byte & 0x0f) * xq[(int64_t)r * K + QK * b + j] + (byte >> 4) * xq[(int64_t)r * K + QK * b + j + 16];
            }
            total += (float)s * (half_to_float(d[b]) * dx[(int64_t)r * nb + b])
                     + half_to_float(m[b]) * sx[(int64_t)r * nb + b];
        }
        y[(int64_t)r * N] = total;
    }
}

static inline void q8a8_rows(const int8_t *xq, const float *dx, int K, const int8_t *q, const uint16_t *d, float *y,
                             int N, int R) {
    const int nb = K / QK;
    for (int r = 0; r < R; r++) {
        float total = 0.0f;
        for (int b = 0; b < nb; b++) {
            int s = 0;
            for (int j = 0; j < QK; j++) s += q[QK * b + j] * xq[(int64_t)r * K + QK * b + j];
            total += (float)s * (half_to_float(d[b]) * dx[(int64_t)r * nb + b]);
        }
        y[(int64_t)r * N] = total;
    }
}
#endif

/* kind 1: int4 weights (needs m), kind 2: int8 weights. Returns nonzero when scratch memory is short. */
int specdecode_a8_matmul(int kind, const float *x, int M, int K, const void *qs, const uint16_t *d,
                         const uint16_t *m, float *y, int N) {
    const int nb = K / QK;
    int8_t *xq = malloc((size_t)M * K);
    float *dx = malloc(sizeof(float) * (size_t)M * nb), *sx = malloc(sizeof(float) * (size_t)M * nb);
    if (!xq || !dx || !sx) {
        free(xq); free(dx); free(sx);
        return 1;
    }
    quantize_rows(x, M, K, xq, dx, sx);
    if (kind == 1) {
#define Q4A8_ROWS(R) q4a8_rows(xq + (int64_t)r0 * K, dx + (int64_t)r0 * nb, sx + (int64_t)r0 * nb, K,              \
                               (const uint8_t *)qs + (int64_t)n * (K / 2), d + (int64_t)n * nb, m + (int64_t)n * nb, \
                               y + (int64_t)r0 * N + n, N, R)
        FOR_EACH_TILE(M, N, Q4A8_ROWS)
#undef Q4A8_ROWS
    } else {
#define Q8A8_ROWS(R) q8a8_rows(xq + (int64_t)r0 * K, dx + (int64_t)r0 * nb, K, (const int8_t *)qs + (int64_t)n * K, \
                               d + (int64_t)n * nb, y + (int64_t)r0 * N + n, N, R)
        FOR_EACH_TILE(M, N, Q8A8_ROWS)
#undef Q8A8_ROWS
    }
    free(xq); free(dx); free(sx);
    return 0;
}
