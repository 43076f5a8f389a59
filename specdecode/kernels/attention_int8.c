/* The scores over an int8 KV cache (attention.c calls them): each query head quantized as a cache row is, so that its
   products with the int8 keys are exact integers (VNNI's dpbusd where the CPU has it, maddubs otherwise, plain C in
   the portable build: the same integers, hence the same floats, on every path and build). */

#include <math.h>
#include <stdint.h>

#include "attention.h"
#include "simd.h"

/* hd floats quantized as an int8 cache row is (models/cache.py's rule: scale max |q| / 127, q / scale rounded to
   nearest even; block.c's store_kv writes keys and values with it), so that a query's products with int8 keys are
   integers: returns the scale */
float attention_quantize_row(const float *q, int hd, int8_t *out) {
    float amax = 0.0f;
    for (int e = 0; e < hd; e++) amax = fabsf(q[e]) > amax ? fabsf(q[e]) : amax;
    const float qscale = amax / 127.0f;
    for (int e = 0; e < hd; e++) {
        const float r = qscale > 0.0f ? nearbyintf(q[e] / qscale) : 0.0f;
        out[e] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
    return qscale;
}

#if SPECDECODE_AVX2
/* acc + the products of 32 int8 pairs, 4 to a lane: |q| (unsigned) times k with q's sign (never saturates: at most
   2 * 127 * 127 a pair) */
static inline __m256i dot_i8(__m256i acc, __m256i q_abs, __m256i q, __m256i k) {
    const __m256i signed_k = _mm256_sign_epi8(k, q);
#if SPECDECODE_VNNI
    return dpbusd(acc, q_abs, signed_k);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q_abs, signed_k), _mm256_set1_epi16(1)));
#endif
}

/* lane t: the sum of the 8 lanes of a[t] */
static inline __m256i hsum8_epi32(const __m256i *a) {
    const __m256i s0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    const __m256i s1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31));
}

/* lane t: the integer dot product of q (C chunks of 32: its absolute values and signs) and key t's row (rows rs
   apart from k) */
static inline __attribute__((always_inline)) __m256i int8_dot8(const __m256i *q_abs, const __m256i *q_vec,
                                                              const int8_t *k, int64_t rs, const int C) {
    __m256i a[8];
    for (int t = 0; t < 8; t++) {
        a[t] = _mm256_setzero_si256();
        for (int c = 0; c < C; c++)
            a[t] = dot_i8(a[t], q_abs[c], q_vec[c], _mm256_loadu_si256((const __m256i *)(k + t * rs + 32 * c)));
    }
    return hsum8_epi32(a);
}
#endif

/* Scores of one quantized query head (q8, its scale qscale) over int8 keys j0..j1: p[j] = ((q8 . k_j) * qscale) * s_j
   * scale, the dot an exact integer (so its order of additions cannot matter: every path and build gets the same
   bits); keys past a contiguous cache's end score 0 (their rows are not read) */
void attention_int8_scores(const int8_t *q8, float qscale, const void *keys, const Rows *rows, int max_len, int hd,
                           float scale, float *p, int j0, int j1) {
    const int rs = kv_row(hd, KV_I8);
    const int8_t *base = (const int8_t *)keys;
    int j = j0;
#if SPECDECODE_AVX2
    if (hd % 32 == 0 && hd <= 256) {
        __m256i q_abs[8], q_vec[8];
        for (int c = 0; c < hd / 32; c++) {
            q_vec[c] = _mm256_loadu_si256((const __m256i *)(q8 + 32 * c));
            q_abs[c] = _mm256_abs_epi8(q_vec[c]);
        }
        for (; j + 8 <= j1 && (rows->table || j + 8 <= max_len); j += 8) {
            const int8_t *k = base + row_at(rows, j, rs);  /* the group's 8 rows are contiguous (attention.h) */
            const __m256i dots = hd == 64    ? int8_dot8(q_abs, q_vec, k, rs, 2)  /* constants: the loops unroll */
                                 : hd == 128 ? int8_dot8(q_abs, q_vec, k, rs, 4)
                                             : int8_dot8(q_abs, q_vec, k, rs, hd / 32);
            float k_scales[8];
            for (int t = 0; t < 8; t++) k_scales[t] = kv_scale(k, (int64_t)t * rs, rs);
            const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(dots), _mm256_set1_ps(qscale));
            _mm256_storeu_ps(p + j, _mm256_mul_ps(_mm256_mul_ps(s, _mm256_loadu_ps(k_scales)), _mm256_set1_ps(scale)));
        }
    }
#endif
    for (; j < j1; j++) {
        if (!rows->table && j >= max_len) {
            p[j] = 0.0f;
            continue;
        }
        const int64_t row = row_at(rows, j, rs);
        int32_t dot_q = 0;
        for (int e = 0; e < hd; e++) dot_q += (int32_t)q8[e] * base[row + e];
        p[j] = (float)dot_q * qscale * kv_scale(base, row, rs) * scale;
    }
}
