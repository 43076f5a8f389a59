/* GGUF's K-quants (Q4_K, Q5_K, Q6_K, Q3_K), IQ4_XS and Q5_1 at the file's own bytes per weight, with int8
   activations.

   A super-block of 256 weights is 8 blocks of 32 (the activations' blocks: a8matmul.c rounds each row per block
   of 32). QuantLinear repacks a tensor once at load, to exactly the file's size, into tiles of 8 or 16 outputs
   (as a8matmul.c's kinds 3-10): per block of 32, for each group g of 4 weights, a vector holding 4 bytes of each
   output of the tile, so a block unpacks with loads, masks and shifts:
     groups 0-3: byte i of output c = weight 4g + i (low nibble) | weight 16 + 4g + i (high nibble) << 4;
     Q5_K, group 4: byte i's bit f = the fifth bit of weight 4f + i (f < 4) or 16 + 4(f - 4) + i;
     Q6_K, groups 4 and 5: byte i's bits 2f, 2f + 1 = the top 2 bits of weight 4f + i (group 4) or 16 + 4f + i
       (group 5);
     Q3_K (no nibbles): groups 0 and 1: byte i's bits 2f, 2f + 1 = the low 2 bits of weight 4f + i (group 0) or
       16 + 4f + i (group 1); group 2: byte i's bit f = the third bit of weight 4f + i (f < 4) or 16 + 4(f - 4) + i.
   So a block is 16, 20, 24 or 12 bytes an output (4, 5, 6, 3 bits a weight). The scales stay as the file packs them,
   transposed into the tile ([super-block][field][output]): Q4_K and Q5_K: float16 d and dmin, and 12 bytes of
   6-bit scales and mins (get_scale_min_k4 in llama.cpp's ggml-quants.c); Q6_K: float16 d and 16 int8 scales;
   Q3_K: float16 d and 12 bytes of 16 6-bit scales (less 32; dequantize_row_q3_K's unpacking); IQ4_XS: float16
   d and 6 bytes of 8 6-bit scales (less 32), its nibbles indices into IQ4_NL's 16 int8 values (a shuffle).
   Per super-block and tile they are decoded once into float32: d * scale and -(dmin * min), products of a
   float16 and a 6- or 8-bit integer, exact in float32 (the `gguf` package's dequantization rounds the same way).
   Q5_1 (blocks of 32: float16 d and m, 5-bit weights) is Q5_K's blocks with a8matmul.c's int4 scales: float16 d
   and m per block, [block][output] in the tile, read as they are (a8matmul.c's kind 3 arithmetic).

   The arithmetic per output and row is a8matmul.c's for the widened K-quants (kinds 5 and 6), in the same
   order: the block's exact integer sum, times (d * dx) in one FMA, then for Q4_K / Q5_K the min times the row's
   block sum (dx * sum(qx)); Q6_K and Q3_K keep each half block's sum apart, their weights stored as u = q + 32
   in 0..63 (Q3_K: q + 4 in 0..7; unsigned, as the int8 dot product wants them) and 32 (4) times the row's
   half-block sum of qx taken off the integer sum. Same integers, same float operations: the same bits as the widened layout, at 4.5 / 5.5 / 6.56 bits a
   weight instead of 6 / 6 / 10.

   Row independence (lossless speculation): a row's result comes from the same instructions in the same order
   whatever the number of rows in the call; integer sums are exact in any order. */

#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "kquants.h"
#include "simd.h"

#define SUBS (QK_K / QK) /* blocks of 32 per super-block */

static inline int block_bytes(int kind) {  /* an output's bytes a block of 32 */
    return kind == K_Q4 || kind == K_IQ4 ? 16 : kind == K_Q6 ? 24 : kind == K_Q3 ? 12 : 20;
}
static inline int scale_fields(int kind) { return kind == K_Q6 ? 16 : kind == K_IQ4 ? 6 : 12; } /* sub-scale bytes */
static inline int halves(int kind) { return kind == K_Q6 || kind == K_Q3; } /* a scale for each 16 weights */
static inline int offset(int kind) { return kind == K_Q3 ? 4 : 32; }       /* stored u = q + offset (halves) */
static inline int d_fields(int kind) { return halves(kind) || kind == K_IQ4 ? 1 : 2; } /* float16 scales an sb */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* Super-block s of outputs c0..c0 + cols - 1 of a tile of lw: ds[j * cols + c] (block j's scale; Q6_K: [16]
   half blocks), ms[j * cols + c] (block j's min, Q4_K and Q5_K). dt: the tile's float16 d (and dmin), mt: its
   sub-scale bytes. Plain loops over the outputs: the compiler vectorizes them. */
static inline __attribute__((always_inline)) void decode_scales(const int kind, const uint16_t *dt,
                                                                 const uint8_t *mt, int lw, int s, int c0,
                                                                 const int cols, float *ds, float *ms) {
    float d[16], dmin[16];
    if (kind == K_IQ4) {  /* block j: low 4 bits in byte 2 + j / 2 (odd j: its high nibble), high 2 in the bytes 0-1 */
        for (int c = 0; c < cols; c++) d[c] = half_to_float(dt[(int64_t)s * lw + c0 + c]);
        const uint8_t *q = mt + (int64_t)6 * s * lw + c0;
        for (int j = 0; j < 8; j++)
            for (int c = 0; c < cols; c++) {
                const int sc = ((q[(2 + j / 2) * lw + c] >> (4 * (j % 2))) & 15) |
                               (((q[(j / 4) * lw + c] >> (2 * (j % 4))) & 3) << 4);
                ds[j * cols + c] = d[c] * (float)(sc - 32);
            }
        return;
    }
    if (kind == K_Q3) {  /* scale j: low 4 bits in byte j % 8 (j >= 8: its high nibble), high 2 in byte 8 + j % 4 */
        for (int c = 0; c < cols; c++) d[c] = half_to_float(dt[(int64_t)s * lw + c0 + c]);
        const uint8_t *q = mt + (int64_t)12 * s * lw + c0;
        for (int j = 0; j < 16; j++)
            for (int c = 0; c < cols; c++) {
                const int sc = ((q[(j % 8) * lw + c] >> (j < 8 ? 0 : 4)) & 15) |
                               (((q[(8 + j % 4) * lw + c] >> (2 * (j / 4))) & 3) << 4);
                ds[j * cols + c] = d[c] * (float)(sc - 32);
            }
        return;
    }
    if (kind == K_Q6) {
        for (int c = 0; c < cols; c++) d[c] = half_to_float(dt[(int64_t)s * lw + c0 + c]);
        const int8_t *sc = (const int8_t *)mt + (int64_t)16 * s * lw + c0;
        for (int j = 0; j < 16; j++)
            for (int c = 0; c < cols; c++) ds[j * cols + c] = d[c] * (float)sc[j * lw + c];
        return;
    }
    for (int c = 0; c < cols; c++) {
        d[c] = half_to_float(dt[(int64_t)2 * s * lw + c0 + c]);
        dmin[c] = half_to_float(dt[(int64_t)(2 * s + 1) * lw + c0 + c]);
    }
    const uint8_t *q = mt + (int64_t)12 * s * lw + c0;
    for (int j = 0; j < 4; j++)
        for (int c = 0; c < cols; c++) {
            ds[j * cols + c] = d[c] * (float)(q[j * lw + c] & 63);
            ms[j * cols + c] = -(dmin[c] * (float)(q[(j + 4) * lw + c] & 63));
        }
    for (int j = 4; j < 8; j++)
        for (int c = 0; c < cols; c++) {
            const int sc = (q[(j + 4) * lw + c] & 15) | ((q[(j - 4) * lw + c] >> 6) << 4);
            const int mn = (q[(j + 4) * lw + c] >> 4) | ((q[j * lw + c] >> 6) << 4);
            ds[j * cols + c] = d[c] * (float)sc;
            ms[j * cols + c] = -(dmin[c] * (float)mn);
        }
}

#if SPECDECODE_AVX2
#define COLS 8
#define ROWS 4
#define PREFETCH_BLOCKS 32

/* decode_scales for 8 outputs in vectors (the same products, each exact: the same floats); -(dmin * m) as
   (-dmin) * m, equal in IEEE arithmetic (rounding is symmetric in sign) */
static inline void decode_scales8(const int kind, const uint16_t *dt, const uint8_t *mt, int lw, int s, int c0,
                                  float *ds, float *ms) {
    if (kind == K_IQ4) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dt + (int64_t)s * lw + c0)));
        const uint8_t *q = mt + (int64_t)6 * s * lw + c0;
        __m256i b[6];
        for (int j = 0; j < 6; j++) b[j] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + j * lw)));
        for (int j = 0; j < 8; j++) {
            const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(b[2 + j / 2], 4 * (j % 2)), _mm256_set1_epi32(15));
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(b[j / 4], 2 * (j % 4)), _mm256_set1_epi32(3));
            const __m256i sc = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
            _mm256_storeu_ps(ds + 8 * j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
        }
        return;
    }
    if (kind == K_Q3) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dt + (int64_t)s * lw + c0)));
        const uint8_t *q = mt + (int64_t)12 * s * lw + c0;
        __m256i b[12];
        for (int j = 0; j < 12; j++) b[j] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + j * lw)));
        for (int j = 0; j < 16; j++) {
            const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(b[j % 8], j < 8 ? 0 : 4), _mm256_set1_epi32(15));
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(b[8 + j % 4], 2 * (j / 4)), _mm256_set1_epi32(3));
            const __m256i sc = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
            _mm256_storeu_ps(ds + 8 * j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
        }
        return;
    }
    if (kind == K_Q6) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dt + (int64_t)s * lw + c0)));
        const int8_t *sc = (const int8_t *)mt + (int64_t)16 * s * lw + c0;
        for (int j = 0; j < 16; j++)
            _mm256_storeu_ps(ds + 8 * j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                              _mm_loadl_epi64((const __m128i *)(sc + j * lw))))));
        return;
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dt + (int64_t)2 * s * lw + c0)));
    const __m256 nmin = _mm256_xor_ps(_mm256_set1_ps(-0.0f), _mm256_cvtph_ps(_mm_loadu_si128(
                                                                  (const __m128i *)(dt + (int64_t)(2 * s + 1) * lw + c0))));
    const uint8_t *q = mt + (int64_t)12 * s * lw + c0;
    __m256i b[12];
    for (int j = 0; j < 12; j++) b[j] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + j * lw)));
    const __m256i six = _mm256_set1_epi32(63), four = _mm256_set1_epi32(15);
    for (int j = 0; j < 8; j++) {
        __m256i sc, mn;
        if (j < 4) {
            sc = _mm256_and_si256(b[j], six);
            mn = _mm256_and_si256(b[j + 4], six);
        } else {
            sc = _mm256_or_si256(_mm256_and_si256(b[j + 4], four), _mm256_slli_epi32(_mm256_srli_epi32(b[j - 4], 6), 4));
            mn = _mm256_or_si256(_mm256_srli_epi32(b[j + 4], 4), _mm256_slli_epi32(_mm256_srli_epi32(b[j], 6), 4));
        }
        _mm256_storeu_ps(ds + 8 * j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
        _mm256_storeu_ps(ms + 8 * j, _mm256_mul_ps(nmin, _mm256_cvtepi32_ps(mn)));
    }
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* the int8 dot product of unsigned weights (at most 63) and signed activations, 4 products a lane */
static inline __m256i dp(__m256i acc, __m256i u, __m256i s) {
#if SPECDECODE_VNNI
    return dpbusd(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* group g's high bits (Q5_K: `bit` 1, from h; Q6_K: 2 bits, from h) moved to bits 4 (and 5) of each byte */
static inline __m256i high5(__m256i h, int shift_right) {  /* bit `shift_right` (0..7) of each byte to bit 4 */
    return _mm256_and_si256(shift_right <= 4 ? _mm256_slli_epi16(h, 4 - shift_right)
                                             : _mm256_srli_epi16(h, shift_right - 4), _mm256_set1_epi8(0x10));
}
static inline __m256i low2(__m256i h, int g) {  /* Q3_K: bits 2g, 2g + 1 of each byte to bits 0, 1 */
    return _mm256_and_si256(_mm256_srli_epi16(h, 2 * g), _mm256_set1_epi8(0x03));
}
static inline __m256i third(__m256i h, int f) {  /* Q3_K: bit f of each byte to bit 2 */
    return _mm256_and_si256(f <= 2 ? _mm256_slli_epi16(h, 2 - f) : _mm256_srli_epi16(h, f - 2), _mm256_set1_epi8(0x04));
}
static inline __m256i high6(__m256i h, int g) {  /* bits 2g, 2g + 1 of each byte to bits 4, 5 */
    return _mm256_and_si256(g <= 2 ? _mm256_slli_epi16(h, 4 - 2 * g) : _mm256_srli_epi16(h, 2), _mm256_set1_epi8(0x30));
}

/* Rows r..r+R (R constant at each call) of 8 outputs: w, the 8 outputs' bytes in the tile's first block (the tile
   of lw outputs' second half: 32 bytes on), dt, mt: the tile's scales, c0: the 8 outputs' first column in it. */
static inline __attribute__((always_inline)) void k_tile_rows(
    const int KIND, const uint8_t *w, const uint16_t *dt, const uint8_t *mt, int lw, int c0, int ncols,
    const int8_t *xq, const float *dx, const float *sx, const int32_t *s16, int K, float *y, int N, const int R) {
    const int nb = K / QK, bb = block_bytes(KIND);
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 acc[ROWS];
    float ds[16 * COLS], ms[SUBS * COLS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const int j = b % SUBS;
        if (j == 0 && KIND != K_Q51) decode_scales8(KIND, dt, mt, lw, b / SUBS, c0, ds, ms);
        const uint8_t *p = w + (int64_t)bb * lw * b;
        for (int line = 0; line < bb * COLS; line += 64)
            _mm_prefetch((const char *)p + PREFETCH_BLOCKS * bb * lw + line, _MM_HINT_T0);
        __m256i isum[ROWS], isum2[ROWS];
        for (int r = 0; r < R; r++) isum[r] = isum2[r] = _mm256_setzero_si256();
        const __m256i h0 = KIND == K_Q4 ? _mm256_setzero_si256()
                         : _mm256_loadu_si256((const __m256i *)(p + (KIND == K_Q3 ? 8 : 16) * lw));
        const __m256i h1 = KIND == K_Q6 ? _mm256_loadu_si256((const __m256i *)(p + 20 * lw)) : h0;
        const __m256i a3 = KIND == K_Q3 ? _mm256_loadu_si256((const __m256i *)p) : h0;  /* Q3_K: low bit pairs */
        const __m256i b3 = KIND == K_Q3 ? _mm256_loadu_si256((const __m256i *)(p + 4 * lw)) : h0;
        for (int g = 0; g < 4; g++) {
            __m256i lo, hi;
            if (KIND == K_Q3) {
                lo = _mm256_or_si256(low2(a3, g), third(h0, g));
                hi = _mm256_or_si256(low2(b3, g), third(h0, 4 + g));
            } else {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 4 * lw * g));
                lo = _mm256_and_si256(raw, low);
                hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            }
            if (KIND == K_Q5 || KIND == K_Q51) {
                lo = _mm256_or_si256(lo, high5(h0, g));
                hi = _mm256_or_si256(hi, high5(h0, 4 + g));
            } else if (KIND == K_Q6) {
                lo = _mm256_or_si256(lo, high6(h0, g));
                hi = _mm256_or_si256(hi, high6(h1, g));
            }
            if (KIND == K_IQ4) {  /* the values (signed): |w| times x with w's sign, as a8matmul.c's int8 */
                const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_VALUES));
                const __m256i wl = _mm256_shuffle_epi8(table, lo), wh = _mm256_shuffle_epi8(table, hi);
                const __m256i al = _mm256_abs_epi8(wl), ah = _mm256_abs_epi8(wh);
                for (int r = 0; r < R; r++) {
                    const int8_t *x = xq + (int64_t)r * K + QK * b;
                    isum[r] = dp(isum[r], al, _mm256_sign_epi8(bcast4(x + 4 * g), wl));
                    isum[r] = dp(isum[r], ah, _mm256_sign_epi8(bcast4(x + 16 + 4 * g), wh));
                }
                continue;
            }
            for (int r = 0; r < R; r++) {
                const int8_t *x = xq + (int64_t)r * K + QK * b;
                isum[r] = dp(isum[r], lo, bcast4(x + 4 * g));
                if (halves(KIND)) isum2[r] = dp(isum2[r], hi, bcast4(x + 16 + 4 * g));
                else isum[r] = dp(isum[r], hi, bcast4(x + 16 + 4 * g));
            }
        }
        if (halves(KIND)) {
            const __m256 d = _mm256_loadu_ps(ds + COLS * 2 * j), d2 = _mm256_loadu_ps(ds + COLS * (2 * j + 1));
            for (int r = 0; r < R; r++) {
                const int32_t *s = s16 + (int64_t)r * (K / 16) + 2 * b;
                isum[r] = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(offset(KIND) * s[0]));
                isum2[r] = _mm256_sub_epi32(isum2[r], _mm256_set1_epi32(offset(KIND) * s[1]));
                const __m256 xd = _mm256_set1_ps(dx[(int64_t)r * nb + b]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, xd), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum2[r]), _mm256_mul_ps(d2, xd), acc[r]);
            }
        } else if (KIND == K_IQ4) {
            const __m256 d = _mm256_loadu_ps(ds + COLS * j);
            for (int r = 0; r < R; r++) {
                const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[(int64_t)r * nb + b]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
            }
        } else {
            const __m256 d = KIND == K_Q51 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dt + (int64_t)lw * b + c0)))
                                           : _mm256_loadu_ps(ds + COLS * j);
            const __m256 m = KIND == K_Q51 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mt + 2 * ((int64_t)lw * b + c0))))
                                           : _mm256_loadu_ps(ms + COLS * j);
            for (int r = 0; r < R; r++) {
                const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[(int64_t)r * nb + b]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
                acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[(int64_t)r * nb + b]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float out[COLS];
        _mm256_storeu_ps(out, acc[r]);
        memcpy(y + (int64_t)r * N, out, sizeof(float) * ncols);
    }
}

#if SPECDECODE_AVX512
/* A whole tile of 16 outputs in 512-bit vectors: every lane runs k_tile_rows's operations in its order (the
   same bits); each broadcast of a row's 4 activations meets 16 outputs. */
static inline __m512i high5_16(__m512i h, int shift_right) {
    return _mm512_and_si512(shift_right <= 4 ? _mm512_slli_epi16(h, 4 - shift_right)
                                             : _mm512_srli_epi16(h, shift_right - 4), _mm512_set1_epi8(0x10));
}
static inline __m512i low2_16(__m512i h, int g) {
    return _mm512_and_si512(_mm512_srli_epi16(h, 2 * g), _mm512_set1_epi8(0x03));
}
static inline __m512i third16(__m512i h, int f) {
    return _mm512_and_si512(f <= 2 ? _mm512_slli_epi16(h, 2 - f) : _mm512_srli_epi16(h, f - 2), _mm512_set1_epi8(0x04));
}
static inline __m512i high6_16(__m512i h, int g) {
    return _mm512_and_si512(g <= 2 ? _mm512_slli_epi16(h, 4 - 2 * g) : _mm512_srli_epi16(h, 2), _mm512_set1_epi8(0x30));
}
/* decode_scales8 for a tile of 16 */
static inline void decode_scales16(const int kind, const uint16_t *dt, const uint8_t *mt, int s, float *ds,
                                   float *ms) {
    const int lw = 16;
    if (kind == K_IQ4) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dt + (int64_t)s * lw)));
        const uint8_t *q = mt + (int64_t)6 * s * lw;
        __m512i b[6];
        for (int j = 0; j < 6; j++) b[j] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + j * lw)));
        for (int j = 0; j < 8; j++) {
            const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(b[2 + j / 2], 4 * (j % 2)), _mm512_set1_epi32(15));
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(b[j / 4], 2 * (j % 4)), _mm512_set1_epi32(3));
            const __m512i sc = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
            _mm512_storeu_ps(ds + 16 * j, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
        }
        return;
    }
    if (kind == K_Q3) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dt + (int64_t)s * lw)));
        const uint8_t *q = mt + (int64_t)12 * s * lw;
        __m512i b[12];
        for (int j = 0; j < 12; j++) b[j] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + j * lw)));
        for (int j = 0; j < 16; j++) {
            const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(b[j % 8], j < 8 ? 0 : 4), _mm512_set1_epi32(15));
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(b[8 + j % 4], 2 * (j / 4)), _mm512_set1_epi32(3));
            const __m512i sc = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
            _mm512_storeu_ps(ds + 16 * j, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
        }
        return;
    }
    if (kind == K_Q6) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dt + (int64_t)s * lw)));
        const int8_t *sc = (const int8_t *)mt + (int64_t)16 * s * lw;
        for (int j = 0; j < 16; j++)
            _mm512_storeu_ps(ds + 16 * j, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                                _mm_loadu_si128((const __m128i *)(sc + j * lw))))));
        return;
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dt + (int64_t)2 * s * lw)));
    const __m512 nmin = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_set1_epi32((int)0x80000000u), _mm512_castps_si512(
        _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dt + (int64_t)(2 * s + 1) * lw))))));
    const uint8_t *q = mt + (int64_t)12 * s * lw;
    __m512i b[12];
    for (int j = 0; j < 12; j++) b[j] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + j * lw)));
    const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15);
    for (int j = 0; j < 8; j++) {
        __m512i sc, mn;
        if (j < 4) {
            sc = _mm512_and_si512(b[j], six);
            mn = _mm512_and_si512(b[j + 4], six);
        } else {
            sc = _mm512_or_si512(_mm512_and_si512(b[j + 4], four), _mm512_slli_epi32(_mm512_srli_epi32(b[j - 4], 6), 4));
            mn = _mm512_or_si512(_mm512_srli_epi32(b[j + 4], 4), _mm512_slli_epi32(_mm512_srli_epi32(b[j], 6), 4));
        }
        _mm512_storeu_ps(ds + 16 * j, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
        _mm512_storeu_ps(ms + 16 * j, _mm512_mul_ps(nmin, _mm512_cvtepi32_ps(mn)));
    }
}

static inline __m512i bcast4_16(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

#define WIDE_ROWS_MAX 8  /* rows a tile's blocks are unpacked for at once: 32 registers hold 8 rows' sums */

static inline __attribute__((always_inline)) void k_wide_rows(
    const int KIND, const uint8_t *w, const uint16_t *dt, const uint8_t *mt, const int8_t *xq, const float *dx,
    const float *sx, const int32_t *s16, int K, float *y, int N, const int R) {
    const int nb = K / QK, bb = block_bytes(KIND), lw = 16;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[WIDE_ROWS_MAX];
    float ds[16 * 16], ms[SUBS * 16];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const int j = b % SUBS;
        if (j == 0 && KIND != K_Q51) decode_scales16(KIND, dt, mt, b / SUBS, ds, ms);
        const uint8_t *p = w + (int64_t)bb * lw * b;
        for (int line = 0; line < bb * lw; line += 64)
            _mm_prefetch((const char *)p + PREFETCH_BLOCKS * bb * COLS + line, _MM_HINT_T0);
        __m512i isum[WIDE_ROWS_MAX], isum2[WIDE_ROWS_MAX];
        for (int r = 0; r < R; r++) isum[r] = isum2[r] = _mm512_setzero_si512();
        const __m512i h0 = KIND == K_Q4 ? _mm512_setzero_si512()
                         : _mm512_loadu_si512((const void *)(p + (KIND == K_Q3 ? 8 : 16) * lw));
        const __m512i h1 = KIND == K_Q6 ? _mm512_loadu_si512((const void *)(p + 20 * lw)) : h0;
        const __m512i a3 = KIND == K_Q3 ? _mm512_loadu_si512((const void *)p) : h0;
        const __m512i b3 = KIND == K_Q3 ? _mm512_loadu_si512((const void *)(p + 4 * lw)) : h0;
        for (int g = 0; g < 4; g++) {
            __m512i lo, hi;
            if (KIND == K_Q3) {
                lo = _mm512_or_si512(low2_16(a3, g), third16(h0, g));
                hi = _mm512_or_si512(low2_16(b3, g), third16(h0, 4 + g));
            } else {
                const __m512i raw = _mm512_loadu_si512((const void *)(p + 4 * lw * g));
                lo = _mm512_and_si512(raw, low);
                hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            }
            if (KIND == K_Q5 || KIND == K_Q51) {
                lo = _mm512_or_si512(lo, high5_16(h0, g));
                hi = _mm512_or_si512(hi, high5_16(h0, 4 + g));
            } else if (KIND == K_Q6) {
                lo = _mm512_or_si512(lo, high6_16(h0, g));
                hi = _mm512_or_si512(hi, high6_16(h1, g));
            }
            if (KIND == K_IQ4) {  /* the values + 128 (unsigned) times x; 128 * sum(x) taken off after the block */
                const __m512i table = _mm512_broadcast_i32x4(_mm_xor_si128(
                    _mm_loadu_si128((const __m128i *)IQ4_VALUES), _mm_set1_epi8((char)0x80)));
                const __m512i ul = _mm512_shuffle_epi8(table, lo), uh = _mm512_shuffle_epi8(table, hi);
                for (int r = 0; r < R; r++) {
                    const int8_t *x = xq + (int64_t)r * K + QK * b;
                    isum[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[r], ul, bcast4_16(x + 4 * g)), uh,
                                                  bcast4_16(x + 16 + 4 * g));
                }
                continue;
            }
            for (int r = 0; r < R; r++) {
                const int8_t *x = xq + (int64_t)r * K + QK * b;
                isum[r] = _mm512_dpbusd_epi32(isum[r], lo, bcast4_16(x + 4 * g));
                if (halves(KIND)) isum2[r] = _mm512_dpbusd_epi32(isum2[r], hi, bcast4_16(x + 16 + 4 * g));
                else isum[r] = _mm512_dpbusd_epi32(isum[r], hi, bcast4_16(x + 16 + 4 * g));
            }
        }
        if (halves(KIND)) {
            const __m512 d = _mm512_loadu_ps(ds + 16 * 2 * j), d2 = _mm512_loadu_ps(ds + 16 * (2 * j + 1));
            for (int r = 0; r < R; r++) {
                const int32_t *s = s16 + (int64_t)r * (K / 16) + 2 * b;
                isum[r] = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(offset(KIND) * s[0]));
                isum2[r] = _mm512_sub_epi32(isum2[r], _mm512_set1_epi32(offset(KIND) * s[1]));
                const __m512 xd = _mm512_set1_ps(dx[(int64_t)r * nb + b]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, xd), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum2[r]), _mm512_mul_ps(d2, xd), acc[r]);
            }
        } else if (KIND == K_IQ4) {
            const __m512 d = _mm512_loadu_ps(ds + 16 * j);
            for (int r = 0; r < R; r++) {
                const int32_t *s = s16 + (int64_t)r * (K / 16) + 2 * b;
                isum[r] = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(128 * (s[0] + s[1])));
                const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[(int64_t)r * nb + b]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), scale, acc[r]);
            }
        } else {
            const __m512 d = KIND == K_Q51 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dt + (int64_t)lw * b)))
                                           : _mm512_loadu_ps(ds + 16 * j);
            const __m512 m = KIND == K_Q51 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mt + 2 * (int64_t)lw * b)))
                                           : _mm512_loadu_ps(ms + 16 * j);
            for (int r = 0; r < R; r++) {
                const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[(int64_t)r * nb + b]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), scale, acc[r]);
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[(int64_t)r * nb + b]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (int64_t)r * N, acc[r]);
}
#endif

#define BY_ROWS(CALL, KIND) do { if (rows >= 4) CALL(KIND, 4); else if (rows == 3) CALL(KIND, 3); \
                                 else if (rows == 2) CALL(KIND, 2); else CALL(KIND, 1); } while (0)

void specdecode_k_matmul(int kind, const int8_t *xq, const float *dx, const float *sx, const int32_t *s16, int M,
                         int K, const void *qs, const void *d, const void *m, float *y, int N) {
    const int lw = kind >= K_WIDE ? 16 : COLS;
    kind = kind >= K_WIDE ? kind - (K_WIDE - K_Q4) : kind;
    const int nb = K / QK, nsb = K / QK_K, bb = block_bytes(kind);
    /* an output's float16 scales and sub-scale bytes */
    const int64_t d_count = kind == K_Q51 ? nb : (int64_t)nsb * d_fields(kind);
    const int64_t m_bytes = kind == K_Q51 ? 2 * nb : (int64_t)nsb * scale_fields(kind);
#pragma omp parallel for schedule(static)
    for (int t = 0; t < (N + lw - 1) / lw; t++) {
        const int n0 = t * lw;
        const uint8_t *w = (const uint8_t *)qs + (int64_t)n0 * nb * bb;
        const uint16_t *dt = (const uint16_t *)d + n0 * d_count;
        const uint8_t *mt = (const uint8_t *)m + n0 * m_bytes;
#if SPECDECODE_AVX512
        if (lw == 16 && N - n0 >= 16) {
            /* 8 rows a pass where there are 8 (a verification's tree), else 4, 3, 2 or 1: each row's numbers are the
               same in any pass, a row's operations never mixing with another's */
            for (int r0 = 0, rows; r0 < M; r0 += rows) {
                rows = M - r0 >= WIDE_ROWS_MAX ? WIDE_ROWS_MAX : M - r0 >= 4 ? 4 : M - r0;
#define WIDE_ROWS(KIND, R) k_wide_rows(KIND, w, dt, mt, xq + (int64_t)r0 * K, dx + (int64_t)r0 * nb, \
                                       sx + (int64_t)r0 * nb, s16 + (int64_t)r0 * (K / 16), K, \
                                       y + (int64_t)r0 * N + n0, N, R)
#define WIDE_BY_ROWS(KIND) do { if (rows == WIDE_ROWS_MAX) WIDE_ROWS(KIND, WIDE_ROWS_MAX); \
                                else BY_ROWS(WIDE_ROWS, KIND); } while (0)
                switch (kind) {
                    case K_Q4: WIDE_BY_ROWS(K_Q4); break;
                    case K_Q5: WIDE_BY_ROWS(K_Q5); break;
                    case K_Q51: WIDE_BY_ROWS(K_Q51); break;
                    case K_Q3: WIDE_BY_ROWS(K_Q3); break;
                    case K_IQ4: WIDE_BY_ROWS(K_IQ4); break;
                    default: WIDE_BY_ROWS(K_Q6); break;
                }
#undef WIDE_BY_ROWS
#undef WIDE_ROWS
            }
            continue;
        }
#endif
        for (int half = 0; half < lw / COLS && n0 + COLS * half < N; half++) {
            const int n1 = n0 + COLS * half, ncols = N - n1 < COLS ? N - n1 : COLS;
            const uint8_t *wh = w + 32 * half;
            for (int r0 = 0; r0 < M; r0 += ROWS) {
#define TILE_ROWS(KIND, R) k_tile_rows(KIND, wh, dt, mt, lw, COLS * half, ncols, xq + (int64_t)r0 * K, \
                                       dx + (int64_t)r0 * nb, sx + (int64_t)r0 * nb, s16 + (int64_t)r0 * (K / 16), \
                                       K, y + (int64_t)r0 * N + n1, N, R)
                const int rows = M - r0 < ROWS ? M - r0 : ROWS;
                switch (kind) {
                    case K_Q4: BY_ROWS(TILE_ROWS, K_Q4); break;
                    case K_Q5: BY_ROWS(TILE_ROWS, K_Q5); break;
                    case K_Q51: BY_ROWS(TILE_ROWS, K_Q51); break;
                    case K_Q3: BY_ROWS(TILE_ROWS, K_Q3); break;
                    case K_IQ4: BY_ROWS(TILE_ROWS, K_IQ4); break;
                    default: BY_ROWS(TILE_ROWS, K_Q6); break;
                }
#undef TILE_ROWS
            }
        }
    }
}
#else
/* plain C: one output at a time, each row on its own (the tile's bytes read where they lie) */
void specdecode_k_matmul(int kind, const int8_t *xq, const float *dx, const float *sx, const int32_t *s16, int M,
                         int K, const void *qs, const void *d, const void *m, float *y, int N) {
    const int lw = kind >= K_WIDE ? 16 : 8;
    kind = kind >= K_WIDE ? kind - (K_WIDE - K_Q4) : kind;
    const int nb = K / QK, nsb = K / QK_K, bb = block_bytes(kind);
    const int64_t d_count = kind == K_Q51 ? nb : (int64_t)nsb * d_fields(kind);
    const int64_t m_bytes = kind == K_Q51 ? 2 * nb : (int64_t)nsb * scale_fields(kind);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const int t = n / lw, c = n % lw;
        const uint16_t *dt = (const uint16_t *)d + (int64_t)t * lw * d_count;
        const uint8_t *mt = (const uint8_t *)m + (int64_t)t * lw * m_bytes;
        for (int r = 0; r < M; r++) {
            const int8_t *xr = xq + (int64_t)r * K;
            float total = 0.0f, ds[16], ms[SUBS];
            for (int b = 0; b < nb; b++) {
                if (kind == K_Q51) {  /* [block][output] float16 d and m */
                    ds[b % SUBS] = half_to_float(dt[(int64_t)lw * b + c]);
                    ms[b % SUBS] = half_to_float(((const uint16_t *)mt)[(int64_t)lw * b + c]);
                } else if (b % SUBS == 0) {
                    decode_scales(kind, dt, mt, lw, b / SUBS, c, 1, ds, ms);
                }
                /* block b of output c: group g's bytes at 4 lw g + 4 c */
                const uint8_t *p = (const uint8_t *)qs + ((int64_t)t * nb + b) * bb * lw + 4 * c;
                int s = 0, s2 = 0; /* s2: the second half block's (Q6_K) */
                for (int i = 0; i < 16; i++) {
                    const uint8_t byte = p[4 * lw * (i / 4) + i % 4];
                    int lo = byte & 15, hi = byte >> 4;
                    if (kind == K_IQ4) {
                        lo = IQ4_VALUES[lo];
                        hi = IQ4_VALUES[hi];
                    } else if (kind == K_Q3) {  /* weights i and 16 + i: bit pairs in groups 0 and 1, third bits in 2 */
                        const uint8_t h = p[8 * lw + i % 4];
                        lo = ((p[i % 4] >> (2 * (i / 4))) & 3) | (((h >> (i / 4)) & 1) << 2);
                        hi = ((p[4 * lw + i % 4] >> (2 * (i / 4))) & 3) | (((h >> (4 + i / 4)) & 1) << 2);
                    } else if (kind == K_Q5 || kind == K_Q51) {
                        const uint8_t h = p[16 * lw + i % 4];
                        lo |= ((h >> (i / 4)) & 1) << 4;
                        hi |= ((h >> (4 + i / 4)) & 1) << 4;
                    } else if (kind == K_Q6) {
                        lo |= ((p[16 * lw + i % 4] >> (2 * (i / 4))) & 3) << 4;
                        hi |= ((p[20 * lw + i % 4] >> (2 * (i / 4))) & 3) << 4;
                    }
                    s += lo * xr[QK * b + i];
                    if (halves(kind)) s2 += hi * xr[QK * b + 16 + i];
                    else s += hi * xr[QK * b + 16 + i];
                }
                const float xd = dx[(int64_t)r * nb + b];
                const int j = b % SUBS;
                if (halves(kind)) {
                    s -= offset(kind) * s16[(int64_t)r * (K / 16) + 2 * b];
                    s2 -= offset(kind) * s16[(int64_t)r * (K / 16) + 2 * b + 1];
                    total += (float)s * (ds[2 * j] * xd);
                    total += (float)s2 * (ds[2 * j + 1] * xd);
                } else if (kind == K_IQ4) {
                    total += (float)s * (ds[j] * xd);
                } else {
                    total += (float)s * (ds[j] * xd);
                    total += ms[j] * sx[(int64_t)r * nb + b];
                }
            }
            y[(int64_t)r * N + n] = total;
        }
    }
}
#endif
