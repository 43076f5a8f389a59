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
/* A true VNNI instruction takes the keys once for every head: k + 128 (unsigned) times q, less 128 * sum(q) after;
   without one (maddubs would saturate at 255 * 127 * 2) each head takes |q| times k with q's sign. The same
   integers either way. */
#define KEYS_OFFSET (SPECDECODE_VNNI == 1 || SPECDECODE_VNNI == 2)

/* lane t: the sum of the 8 lanes of a[t] */
static inline __m256i hsum8_epi32(const __m256i *a) {
    const __m256i s0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    const __m256i s1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31));
}

/* dots[h] lane t: the integer dot product of head h's query (C chunks of 32 bytes each: q_vec, and q_abs its
   absolute values) and key t's row (rows rs apart from k), for H heads, each key chunk loaded once for all of them */
static inline __attribute__((always_inline)) void int8_dot8(const __m256i *q_abs, const __m256i *q_vec,
                                                           const int32_t *q_sums, const int8_t *k, int64_t rs,
                                                           const int C, const int H, __m256i *dots) {
    __m256i a[4][8];
    for (int t = 0; t < 8; t++) {
        for (int h = 0; h < H; h++) a[h][t] = _mm256_setzero_si256();
        for (int c = 0; c < C; c++) {
            const __m256i kv = _mm256_loadu_si256((const __m256i *)(k + t * rs + 32 * c));
#if KEYS_OFFSET
            const __m256i ku = _mm256_xor_si256(kv, _mm256_set1_epi8((char)0x80));
            for (int h = 0; h < H; h++) a[h][t] = dpbusd(a[h][t], ku, q_vec[h * C + c]);
#else
            for (int h = 0; h < H; h++) {
                const __m256i signed_k = _mm256_sign_epi8(kv, q_vec[h * C + c]);
#if SPECDECODE_VNNI
                a[h][t] = dpbusd(a[h][t], q_abs[h * C + c], signed_k);
#else
                a[h][t] = _mm256_add_epi32(a[h][t], _mm256_madd_epi16(_mm256_maddubs_epi16(q_abs[h * C + c], signed_k),
                                                                      _mm256_set1_epi16(1)));
#endif
            }
#endif
        }
    }
    for (int h = 0; h < H; h++) dots[h] = _mm256_sub_epi32(hsum8_epi32(a[h]), _mm256_set1_epi32(q_sums[h]));
}

/* int8_scores' vector part for H (<= 4) heads with C chunks each: keys j..(a multiple of 8 before j1); returns the
   key it stopped at */
static inline __attribute__((always_inline)) int int8_scores8(const int8_t *q8, const float *qscales,
                                                             const int8_t *base, const Rows *rows, int max_len, int hd,
                                                             float scale, float *p, size_t p_stride, int j, int j1,
                                                             const int C, const int H) {
    const int rs = kv_row(hd, KV_I8);
    __m256i q_abs[4 * 8], q_vec[4 * 8];
    int32_t q_sums[4];
    for (int h = 0; h < H; h++) {
        int32_t total = 0;
        for (int e = 0; e < hd; e++) total += q8[h * hd + e];
        q_sums[h] = KEYS_OFFSET ? 128 * total : 0;
        for (int c = 0; c < C; c++) {
            q_vec[h * C + c] = _mm256_loadu_si256((const __m256i *)(q8 + h * hd + 32 * c));
            q_abs[h * C + c] = _mm256_abs_epi8(q_vec[h * C + c]);
        }
    }
    for (; j + 8 <= j1 && (rows->table || j + 8 <= max_len); j += 8) {
        const int8_t *k = base + row_at(rows, j, rs);  /* the group's 8 rows are contiguous (attention.h) */
        if (j + PREFETCH_KEYS + 8 <= (rows->table ? j1 : max_len))
            prefetch_bytes(base + row_at(rows, j + PREFETCH_KEYS, rs), 8 * rs);
        __m256i dots[4];
        int8_dot8(q_abs, q_vec, q_sums, k, rs, C, H, dots);
        float k_scales[8];
        for (int t = 0; t < 8; t++) k_scales[t] = kv_scale(k, (int64_t)t * rs, rs);
        const __m256 ks = _mm256_loadu_ps(k_scales);
        for (int h = 0; h < H; h++) {
            const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(dots[h]), _mm256_set1_ps(qscales[h]));
            _mm256_storeu_ps(p + h * p_stride + j, _mm256_mul_ps(_mm256_mul_ps(s, ks), _mm256_set1_ps(scale)));
        }
    }
    return j;
}
#endif

/* Scores of `heads` quantized query heads (rows of q8, hd bytes apart; their scales qscales) over int8 keys j0..j1:
   p[h * p_stride + j] = ((q8_h . k_j) * qscale_h) * s_j * scale, the dot an exact integer (so its order of additions
   cannot matter: every path and build gets the same bits); keys past a contiguous cache's end score 0 (their rows
   are not read) */
void attention_int8_scores(const int8_t *q8, const float *qscales, int heads, const void *keys, const Rows *rows,
                           int max_len, int hd, float scale, float *p, size_t p_stride, int j0, int j1) {
    const int rs = kv_row(hd, KV_I8);
    const int8_t *base = (const int8_t *)keys;
    for (int h0 = 0; h0 < heads; h0 += 4) {
        const int H = heads - h0 < 4 ? heads - h0 : 4;
        const int8_t *q = q8 + (int64_t)h0 * hd;
        const float *qs = qscales + h0;
        float *ph = p + h0 * p_stride;
        int j = j0;
#if SPECDECODE_AVX2
        if (hd % 32 == 0 && hd <= 256) {
#define SCORES(c, h) j = int8_scores8(q, qs, base, rows, max_len, hd, scale, ph, p_stride, j, j1, c, h)
#define HEADS(c) if (H == 1) SCORES(c, 1); else if (H == 2) SCORES(c, 2); else if (H == 3) SCORES(c, 3); \
                 else SCORES(c, 4)
            if (hd == 64) HEADS(2);  /* constants: the loops unroll */
            else if (hd == 128) HEADS(4);
            else HEADS(hd / 32);
#undef HEADS
#undef SCORES
        }
#endif
        for (int h = 0; h < H; h++)
            for (int t = j; t < j1; t++) {
                if (!rows->table && t >= max_len) {
                    ph[h * p_stride + t] = 0.0f;
                    continue;
                }
                const int64_t row = row_at(rows, t, rs);
                int32_t dot_q = 0;
                for (int e = 0; e < hd; e++) dot_q += (int32_t)q[h * hd + e] * base[row + e];
                ph[h * p_stride + t] = (float)dot_q * qs[h] * kv_scale(base, row, rs) * scale;
            }
    }
}
