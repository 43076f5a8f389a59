/* Quantized weights with int8 activations (llama.cpp's arithmetic for GGUF models: Q4_1 x Q8_1, Q8_0 x Q8_0).

   Each row of x is rounded per block of 32 to dx * qx (qx in -127..127, dx = max |x| / 127); then a block's dot
   product is an exact integer sum, scaled once: dw * dx * sum(qw * qx) (+ mw * dx * sum(qx) for int4). A model
   of its own ("int4-a8", "int8-a8"), several times less arithmetic per weight than float activations.

   Speculation verifies 2-16 rows against weights read once, so the AVX2 kernel is built for several rows per
   weight load: a tile of 8 outputs has its weights unpacked once, transposed so that one 32-byte vector holds 4
   consecutive weights of each of the 8 outputs; a row then broadcasts 4 of its activations and meets all 8
   outputs in one maddubs (integer products, no per-row unpacking, no horizontal sums: output c is lane c). A
   block's integer sums turn into floats once per row and 8 outputs: one convert, one multiply, two FMAs.
   QuantLinear stores its weights already in that order (kinds 3 and 4, "tiles"), so a block costs a few loads
   and masks and each weight vector meets every row while in a register; kinds 1 and 2 read GGUF's row order
   and transpose per block (the reference the tiles are tested against). Where the build has AVX-512, QuantLinear
   tiles 16 outputs instead (kinds 7-10: kinds 3-6 in tiles of 16, each group of a block one 64-byte line) and a
   row meets all 16 in 512-bit vectors: with 8, a row's broadcasts and scaling were as many instructions as its
   dot products. Every build reads both widths (a tile of 16 as two halves of 8 without AVX-512).

   Row independence (what keeps speculation lossless): every row's result comes from the same instructions in
   the same order whatever the number of rows in the call or beside it in its group of 4; the integer sums are
   exact in any order. So a tree verifies bit for bit the numbers one-token steps compute.

   Two more tiled kinds take float32 scales: Q4_K widened (a super-block's float16 scale times a 6-bit one per
   block of 32: 17 significant bits, exact in float32, not in float16) as kind 5, int4 with float32 scales and
   mins; Q6_K widened (6-bit weights with an 8-bit scale per 16) as kind 6, int8 with a float32 scale for each
   half block, whose two integer sums are kept apart. GGUF files' K-quants load at their own size instead
   (kinds 11-16 and 21-26, kquants.c), computing these kinds' numbers bit for bit; QuantLinear.widened makes
   these (the reference). */

#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "kquants.h"
#include "simd.h"

#define INT8(KIND) ((KIND) == 2 || (KIND) == 4 || (KIND) == 6)
#define TILED(KIND) ((KIND) >= 3) /* 3, 4: int4, int8 in tiles of 8 outputs; 5, 6: the same with float32 scales */
#define F32_SCALES(KIND) ((KIND) >= 5)
#define HALVES(KIND) ((KIND) == 6) /* a scale for each 16 weights of a block */
#define WIDE(KIND) ((KIND) >= 7) /* 7-10: kinds 3-6 in tiles of 16 outputs (what AVX-512 builds tile for) */

static void quantize_rows(const float *x, int M, int K, int8_t *qx, float *dx, float *sx) {
    const int nb = K / QK;
    for (int r = 0; r < M; r++)
        for (int b = 0; b < nb; b++) {
            const float *v = x + (int64_t)r * K + QK * b;
#if SPECDECODE_AVX2  /* the same operations 8 lanes at a time (round to nearest even, as nearbyintf): same bytes */
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 f[4], m = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                f[j] = _mm256_loadu_ps(v + 8 * j);
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, f[j]));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float d = _mm_cvtss_f32(m4) / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            __m256i q[4];
            for (int j = 0; j < 4; j++)
                q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(f[j], _mm256_set1_ps(inv)),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
            t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
            t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
            /* 32 values in -127..127: pack to 16 then 8 bits, then undo the packs' lane interleave */
            const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
            const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                           _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(qx + (int64_t)r * K + QK * b), p8);
            dx[(int64_t)r * nb + b] = d;
            sx[(int64_t)r * nb + b] = d * (float)_mm_cvtsi128_si32(t4);
#else
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
#endif
        }
}

#if SPECDECODE_AVX2
#define COLS 8 /* outputs per tile: one float lane each */
#define ROWS 4 /* rows per pass over a tile's weights */
#define PREFETCH_BLOCKS 32 /* how far ahead a tiled stream asks for its weights */

/* A tile's weights, one block (p: its first output's, stride: bytes per output): vector g (of 8) holds weights
   4g..4g+3 of each output, output c in bytes 4c..4c+3. */
static inline void unpack_q4(const uint8_t *p, int64_t stride, __m256i *out) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256i a[4];
    for (int c = 0; c < 4; c++)  /* output c in the low 128 bits, output c + 4 in the high */
        a[c] = _mm256_loadu2_m128i((const __m128i *)(p + (c + 4) * stride), (const __m128i *)(p + c * stride));
    const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
    const __m256i raw[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                            _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
    for (int g = 0; g < 4; g++) {  /* byte j holds weight j (low nibble) and weight j + 16 (high nibble) */
        out[g] = _mm256_and_si256(raw[g], low);
        out[g + 4] = _mm256_and_si256(_mm256_srli_epi16(raw[g], 4), low);
    }
}

/* int8 weights, one block, in the same order: signed in out[0..7], their absolute values in out[8..15] */
static inline void unpack_q8(const int8_t *p, int64_t stride, __m256i *out) {
    __m256i a[8], t[8], u[8];
    for (int c = 0; c < 8; c++) a[c] = _mm256_loadu_si256((const __m256i *)(p + c * stride));
    for (int c = 0; c < 8; c += 2) {
        t[c] = _mm256_unpacklo_epi32(a[c], a[c + 1]);
        t[c + 1] = _mm256_unpackhi_epi32(a[c], a[c + 1]);
    }
    for (int c = 0; c < 8; c += 4) {
        u[c] = _mm256_unpacklo_epi64(t[c], t[c + 2]);
        u[c + 1] = _mm256_unpackhi_epi64(t[c], t[c + 2]);
        u[c + 2] = _mm256_unpacklo_epi64(t[c + 1], t[c + 3]);
        u[c + 3] = _mm256_unpackhi_epi64(t[c + 1], t[c + 3]);
    }
    for (int g = 0; g < 4; g++) {
        out[g] = _mm256_permute2x128_si256(u[g], u[g + 4], 0x20);
        out[g + 4] = _mm256_permute2x128_si256(u[g], u[g + 4], 0x31);
    }
    for (int g = 0; g < 8; g++) out[g + 8] = _mm256_abs_epi8(out[g]);
}

/* The tile's float16 scales (output c's at h + c * stride), as floats out[8 * b + c] for its nb blocks */
static inline void unpack_scales(const uint16_t *h, int64_t stride, int nb, int ncols, float *out) {
    int b = 0;
    for (; ncols == COLS && b + 8 <= nb; b += 8) {  /* 8 blocks at a time: an 8 x 8 transpose of 16-bit values */
        __m128i r[8], a[8], t[8];
        for (int c = 0; c < 8; c++) r[c] = _mm_loadu_si128((const __m128i *)(h + c * stride + b));
        for (int c = 0; c < 8; c += 2) {
            a[c] = _mm_unpacklo_epi16(r[c], r[c + 1]);      /* blocks b..b+3 of outputs c, c + 1 */
            a[c + 1] = _mm_unpackhi_epi16(r[c], r[c + 1]);  /* blocks b+4..b+7 */
        }
        for (int c = 0; c < 8; c += 4)
            for (int half = 0; half < 2; half++) {
                t[c + 2 * half] = _mm_unpacklo_epi32(a[c + half], a[c + 2 + half]);
                t[c + 2 * half + 1] = _mm_unpackhi_epi32(a[c + half], a[c + 2 + half]);
            }
        for (int j = 0; j < 4; j++) {  /* t[j]: blocks b+2j, b+2j+1 of outputs 0..3; t[4 + j]: of outputs 4..7 */
            _mm256_storeu_ps(out + COLS * (b + 2 * j), _mm256_cvtph_ps(_mm_unpacklo_epi64(t[j], t[4 + j])));
            _mm256_storeu_ps(out + COLS * (b + 2 * j + 1), _mm256_cvtph_ps(_mm_unpackhi_epi64(t[j], t[4 + j])));
        }
    }
    for (; b < nb; b++)
        for (int c = 0; c < COLS; c++) out[COLS * b + c] = half_to_float(h[(c < ncols ? c : ncols - 1) * stride + b]);
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Rows r..r+R of 8 outputs (KIND 1: int4, 2: int8, 3 and 4: the same in tiles; KIND and R constants at each call,
   so the loops unroll): each block's weights unpacked once for the R rows. w: the first output (tiled kinds: its
   bytes in the tile's first block), stride: bytes per output; tiled kinds read their scales dh, mh ([block][lw],
   kind 6: [block][half][lw]; float16 for kinds 3 and 4, float32 for 5 and 6; the 8 outputs' first) where kinds 1
   and 2 read the floats dw, mw unpacked for the tile. lw: outputs per tile (8, or 16: these 8 are half of it). */
static inline __attribute__((always_inline)) void a8_tile_rows(
    const int KIND, const uint8_t *w, int64_t stride, int ncols, const float *dw, const float *mw,
    const void *dh, const void *mh, const int8_t *xq, const float *dx, const float *sx, int K, float *y,
    int N, const int R, int lw) {
    const int nb = K / QK, block_bytes = INT8(KIND) ? QK : QK / 2;
    __m256 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i isum[ROWS], isum2[ROWS]; /* isum2: the second half block's (kind 6) */
        if (TILED(KIND)) {  /* weights in registers, each met by every row in turn (no unpacked copy to reload) */
            const uint8_t *p = w + (int64_t)block_bytes * lw * b;
            for (int line = 0; line < block_bytes * COLS; line += 64)  /* one stream: lines a few blocks ahead */
                _mm_prefetch((const char *)p + PREFETCH_BLOCKS * block_bytes * lw + line, _MM_HINT_T0);
            for (int r = 0; r < R; r++) isum[r] = isum2[r] = _mm256_setzero_si256();
            if (!INT8(KIND)) {
                const __m256i low = _mm256_set1_epi8(0x0f);
                for (int g = 0; g < 4; g++) {  /* vector g: weights 4g..4g+3 (low nibbles), 16+4g.. (high) */
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 4 * lw * g));
                    const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                    for (int r = 0; r < R; r++) {
                        const int8_t *x = xq + (int64_t)r * K + QK * b;
#if SPECDECODE_VNNI
                        isum[r] = dpbusd(dpbusd(isum[r], lo, bcast4(x + 4 * g)), hi, bcast4(x + 16 + 4 * g));
#else  /* 16-bit sums: 8 products of 4 bits x 7 bits and sign, at most 8 * 3810 */
                        isum[r] = _mm256_add_epi16(isum[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(x + 4 * g)),
                                                                             _mm256_maddubs_epi16(hi, bcast4(x + 16 + 4 * g))));
#endif
                    }
                }
#if !SPECDECODE_VNNI
                for (int r = 0; r < R; r++) isum[r] = _mm256_madd_epi16(isum[r], _mm256_set1_epi16(1));
#endif
            } else {
                for (int g = 0; g < 8; g++) {  /* |w| * (x * sign(w)): maddubs wants its first side unsigned */
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 4 * lw * g)), a = _mm256_abs_epi8(v);
                    for (int r = 0; r < R; r++) {
                        const __m256i xs = _mm256_sign_epi8(bcast4(xq + (int64_t)r * K + QK * b + 4 * g), v);
                        __m256i *sum = HALVES(KIND) && g >= 4 ? isum2 + r : isum + r;
#if SPECDECODE_VNNI
                        *sum = dpbusd(*sum, a, xs);
#else
                        *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(_mm256_maddubs_epi16(a, xs),
                                                                        _mm256_set1_epi16(1)));
#endif
                    }
                }
            }
        } else {
            __m256i unpacked[16] __attribute__((aligned(32)));
            const uint8_t *p = w + (int64_t)block_bytes * b;
            int64_t step = stride;
            /* the next tile's weights (8 outputs, 8 lines apart: the prefetchers miss this order) */
            for (int line = 0; line < block_bytes * COLS; line += 64)
                _mm_prefetch((const char *)w + COLS * stride + (int64_t)block_bytes * COLS * b + line, _MM_HINT_T0);
            uint8_t part[COLS * QK];
            if (ncols < COLS) {  /* a last, partial tile: its outputs side by side, the last one repeated */
                for (int c = 0; c < COLS; c++)
                    memcpy(part + c * block_bytes, p + (c < ncols ? c : ncols - 1) * stride, block_bytes);
                p = part;
                step = block_bytes;
            }
            if (KIND == 1) unpack_q4(p, step, unpacked);
            else unpack_q8((const int8_t *)p, step, unpacked);
#pragma GCC unroll 1
            for (int r = 0; r < R; r++) {  /* one row at a time (unrolled, the compiler interleaves them and spills) */
                const __m256i *v = unpacked;
                __asm__("" : "+r"(v));  /* each row reads the block from L1: 16 registers cannot hold it and 4 rows' sums */
                const int8_t *x = xq + (int64_t)r * K + QK * b;
                __m256i sum = _mm256_setzero_si256();
                for (int g = 0; g < 8; g++) {
                    const __m256i xg = bcast4(x + 4 * g);
                    if (!INT8(KIND)) {
#if SPECDECODE_VNNI
                        sum = dpbusd(sum, v[g], xg);
#else
                        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(v[g], xg));
#endif
                    } else {
#if SPECDECODE_VNNI
                        sum = dpbusd(sum, v[8 + g], _mm256_sign_epi8(xg, v[g]));
#else
                        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(v[8 + g], _mm256_sign_epi8(xg, v[g])),
                                                                      _mm256_set1_epi16(1)));
#endif
                    }
                }
#if !SPECDECODE_VNNI
                if (!INT8(KIND)) sum = _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
#endif
                isum[r] = sum;
            }
        }
        const __m256 d = F32_SCALES(KIND) ? _mm256_loadu_ps((const float *)dh + lw * (HALVES(KIND) ? 2 * b : b))
                       : TILED(KIND) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)dh + lw * b)))
                                     : _mm256_loadu_ps(dw + COLS * b);
        for (int r = 0; r < R; r++) {
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[(int64_t)r * nb + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
        }
        if (HALVES(KIND)) {
            const __m256 d2 = _mm256_loadu_ps((const float *)dh + lw * (2 * b + 1));
            for (int r = 0; r < R; r++) {
                const __m256 scale = _mm256_mul_ps(d2, _mm256_set1_ps(dx[(int64_t)r * nb + b]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum2[r]), scale, acc[r]);
            }
        }
        if (!INT8(KIND)) {
            const __m256 m = KIND == 5 ? _mm256_loadu_ps((const float *)mh + lw * b)
                           : KIND == 3 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)mh + lw * b)))
                                       : _mm256_loadu_ps(mw + COLS * b);
            for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[(int64_t)r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float out[COLS];
        _mm256_storeu_ps(out, acc[r]);
        memcpy(y + (int64_t)r * N, out, sizeof(float) * ncols);
    }
}

#if SPECDECODE_AVX512
/* Rows r..r+R of a whole tile of 16 outputs (tiled kinds in tiles of 16): the same per-output arithmetic as
   a8_tile_rows in 512-bit vectors, so each broadcast of a row's 4 activations meets 16 outputs in one vpdpbusd
   (with 8, broadcasts and scaling were as many instructions as the dot products), and a block's group of weights
   is one 64-byte line. Every output lane runs the operations a8_tile_rows gives it, in the same order: the same
   floats, bit for bit. w: the tile; dh, mh: its scales ([block][16], kind 6: [block][half][16]). */
static inline __m512 scales16(const int KIND, const void *s, int64_t at) {
    return F32_SCALES(KIND) ? _mm512_loadu_ps((const float *)s + at)
                            : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s + at)));
}

static inline __attribute__((always_inline)) void a8_wide_rows(
    const int KIND, const uint8_t *w, const void *dh, const void *mh, const int8_t *xq, const float *dx,
    const float *sx, int K, float *y, int N, const int R) {
    const int nb = K / QK, block_bytes = INT8(KIND) ? QK : QK / 2;
    __m512 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i isum[ROWS], isum2[ROWS];
        const uint8_t *p = w + (int64_t)block_bytes * 16 * b;
        for (int line = 0; line < block_bytes * 16; line += 64)  /* as far ahead in bytes as a tile of 8 asks */
            _mm_prefetch((const char *)p + PREFETCH_BLOCKS * block_bytes * 8 + line, _MM_HINT_T0);
        for (int r = 0; r < R; r++) isum[r] = isum2[r] = _mm512_setzero_si512();
        if (!INT8(KIND)) {
            const __m512i low = _mm512_set1_epi8(0x0f);
            for (int g = 0; g < 4; g++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(p + 64 * g));
                const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                for (int r = 0; r < R; r++) {
                    const int8_t *x = xq + (int64_t)r * K + QK * b;
                    int32_t a, c;
                    memcpy(&a, x + 4 * g, 4);
                    memcpy(&c, x + 16 + 4 * g, 4);
                    isum[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(a)), hi,
                                                  _mm512_set1_epi32(c));
                }
            }
        } else {  /* (x + 128) * w, less 128 * sum(w): the same integers as |w| * (x * sign(w)), with no sign per row */
            __m512i wsum = _mm512_setzero_si512(), wsum2 = _mm512_setzero_si512();
            for (int g = 0; g < 8; g++) {
                const __m512i v = _mm512_loadu_si512((const void *)(p + 64 * g));
                __m512i *ws = HALVES(KIND) && g >= 4 ? &wsum2 : &wsum;
                *ws = _mm512_dpbusd_epi32(*ws, _mm512_set1_epi8(1), v);
                for (int r = 0; r < R; r++) {
                    uint32_t x4;
                    memcpy(&x4, xq + (int64_t)r * K + QK * b + 4 * g, 4);
                    __m512i *sum = HALVES(KIND) && g >= 4 ? isum2 + r : isum + r;
                    *sum = _mm512_dpbusd_epi32(*sum, _mm512_set1_epi32((int)(x4 ^ 0x80808080u)), v);
                }
            }
            const __m512i bias = _mm512_slli_epi32(wsum, 7), bias2 = _mm512_slli_epi32(wsum2, 7);
            for (int r = 0; r < R; r++) {
                isum[r] = _mm512_sub_epi32(isum[r], bias);
                if (HALVES(KIND)) isum2[r] = _mm512_sub_epi32(isum2[r], bias2);
            }
        }
        const __m512 d = scales16(KIND, dh, (int64_t)16 * (HALVES(KIND) ? 2 * b : b));
        for (int r = 0; r < R; r++) {
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[(int64_t)r * nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), scale, acc[r]);
        }
        if (HALVES(KIND)) {
            const __m512 d2 = scales16(KIND, dh, (int64_t)16 * (2 * b + 1));
            for (int r = 0; r < R; r++) {
                const __m512 scale = _mm512_mul_ps(d2, _mm512_set1_ps(dx[(int64_t)r * nb + b]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum2[r]), scale, acc[r]);
            }
        }
        if (!INT8(KIND)) {
            const __m512 m = scales16(KIND, mh, (int64_t)16 * b);
            for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[(int64_t)r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (int64_t)r * N, acc[r]);
}
#endif

/* CALL(KIND, R) for the `rows` (1..ROWS) of this pass, KIND and R constants at each call: every (kind, rows) pair
   gets its own unrolled copy */
#define BY_ROWS(CALL, KIND) do { if (rows >= 4) CALL(KIND, 4); else if (rows == 3) CALL(KIND, 3); \
                                 else if (rows == 2) CALL(KIND, 2); else CALL(KIND, 1); } while (0)

/* returns nonzero when scratch memory is short */
static int a8_matmul(int kind, const int8_t *xq, const float *dx, const float *sx, int M, int K, const void *qs,
                     const void *d, const void *m, float *y, int N) {
    const int lw = WIDE(kind) ? 16 : COLS;  /* outputs per tile (tiled kinds) */
    kind = WIDE(kind) ? kind - 4 : kind;
    const int nb = K / QK;
    const int64_t stride = (int64_t)nb * (INT8(kind) ? QK : QK / 2);  /* bytes per output */
    const int threads = omp_get_max_threads();
    const size_t s_size = (size_t)COLS * nb;
    float *s_all = TILED(kind) ? NULL : malloc(sizeof(float) * 2 * s_size * threads);
    if (!TILED(kind) && !s_all) return 1;
#pragma omp parallel num_threads(threads)
    {
        float *dw = s_all ? s_all + 2 * s_size * omp_get_thread_num() : NULL, *mw = dw ? dw + s_size : NULL;
#pragma omp for schedule(static)
        for (int t = 0; t < (N + lw - 1) / lw; t++) {
            const int n0 = t * lw;
            const uint8_t *w = (const uint8_t *)qs + n0 * stride;  /* in tiles too: a tile is its outputs' bytes */
            const size_t scale_bytes = F32_SCALES(kind) ? 4 : 2;  /* an output's scales: nb (kind 6: 2 nb) */
            const void *dh = (const char *)d + (size_t)n0 * nb * (HALVES(kind) ? 2 : 1) * scale_bytes;
            const void *mh = m ? (const char *)m + (size_t)n0 * nb * scale_bytes : NULL;
#if SPECDECODE_AVX512
            if (lw == 16 && N - n0 >= 16) {  /* a whole tile of 16: 512-bit vectors */
                for (int r0 = 0; r0 < M; r0 += ROWS) {
#define WIDE_ROWS(KIND, R) a8_wide_rows(KIND, w, dh, mh, xq + (int64_t)r0 * K, dx + (int64_t)r0 * nb, \
                                        sx + (int64_t)r0 * nb, K, y + (int64_t)r0 * N + n0, N, R)
                    const int rows = M - r0 < ROWS ? M - r0 : ROWS;
                    switch (kind) {
                        case 3: BY_ROWS(WIDE_ROWS, 3); break;
                        case 4: BY_ROWS(WIDE_ROWS, 4); break;
                        case 5: BY_ROWS(WIDE_ROWS, 5); break;
                        default: BY_ROWS(WIDE_ROWS, 6); break;
                    }
#undef WIDE_ROWS
                }
                continue;
            }
#endif
            /* 8 outputs at a time: a tile of 8, or each half of a tile of 16 (its bytes 32 on in every group of a
               block, its scales 8 on) */
            for (int half = 0; half < lw / COLS && n0 + COLS * half < N; half++) {
                const int n1 = n0 + COLS * half, ncols = N - n1 < COLS ? N - n1 : COLS;
                const size_t scale_at = (size_t)COLS * half * scale_bytes;
                const uint8_t *wh = TILED(kind) ? w + 32 * half : w;
                const void *dhh = (const char *)dh + scale_at, *mhh = mh ? (const char *)mh + scale_at : NULL;
                if (!TILED(kind)) {
                    unpack_scales(dh, nb, nb, ncols, dw);
                    if (kind == 1) unpack_scales(mh, nb, nb, ncols, mw);
                }
                for (int r0 = 0; r0 < M; r0 += ROWS) {
#define TILE_ROWS(KIND, R) a8_tile_rows(KIND, wh, stride, ncols, dw, mw, dhh, mhh, xq + (int64_t)r0 * K, \
                                        dx + (int64_t)r0 * nb, sx + (int64_t)r0 * nb, K, y + (int64_t)r0 * N + n1, N, R, \
                                        lw)
                    const int rows = M - r0 < ROWS ? M - r0 : ROWS;
                    switch (kind) {
                        case 1: BY_ROWS(TILE_ROWS, 1); break;
                        case 3: BY_ROWS(TILE_ROWS, 3); break;
                        case 4: BY_ROWS(TILE_ROWS, 4); break;
                        case 5: BY_ROWS(TILE_ROWS, 5); break;
                        case 6: BY_ROWS(TILE_ROWS, 6); break;
                        default: BY_ROWS(TILE_ROWS, 2); break;
                    }
#undef TILE_ROWS
                }
            }
        }
    }
    free(s_all);
    return 0;
}
#else
/* plain C: one output at a time, each row on its own */
static int a8_matmul(int kind, const int8_t *xq, const float *dx, const float *sx, int M, int K, const void *qs,
                      const void *d, const void *m, float *y, int N) {
    const int lw = WIDE(kind) ? 16 : 8;  /* outputs per tile (tiled kinds) */
    kind = WIDE(kind) ? kind - 4 : kind;
    const int nb = K / QK;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        for (int r = 0; r < M; r++) {
            const int8_t *xr = xq + (int64_t)r * K;
            float total = 0.0f;
            for (int b = 0; b < nb; b++) {
                int s = 0, s2 = 0; /* s2: the second half block's sum (kind 6) */
                if (kind == 1) {
                    const uint8_t *q = (const uint8_t *)qs + (int64_t)n * (K / 2) + 16 * b;
                    for (int j = 0; j < 16; j++) s += (q[j] & 0x0f) * xr[QK * b + j] + (q[j] >> 4) * xr[QK * b + j + 16];
                } else if (kind == 3 || kind == 5) {  /* tile n / lw, block b: byte j of output n % lw at 4 lw (j / 4) + 4 (n % lw) + j % 4 */
                    const uint8_t *q = (const uint8_t *)qs + ((int64_t)(n / lw) * nb + b) * 16 * lw + 4 * (n % lw);
                    for (int j = 0; j < 16; j++) {
                        const uint8_t byte = q[4 * lw * (j / 4) + j % 4];
                        s += (byte & 0x0f) * xr[QK * b + j] + (byte >> 4) * xr[QK * b + j + 16];
                    }
                } else if (kind == 4 || kind == 6) {  /* byte j of output n % lw at 4 lw (j / 4) + 4 (n % lw) + j % 4 */
                    const int8_t *q = (const int8_t *)qs + ((int64_t)(n / lw) * nb + b) * QK * lw + 4 * (n % lw);
                    for (int j = 0; j < QK; j++) {
                        const int product = q[4 * lw * (j / 4) + j % 4] * xr[QK * b + j];
                        if (HALVES(kind) && j >= QK / 2) s2 += product;
                        else s += product;
                    }
                } else {
                    const int8_t *q = (const int8_t *)qs + (int64_t)n * K + QK * b;
                    for (int j = 0; j < QK; j++) s += q[j] * xr[QK * b + j];
                }
                /* in tiles, the scales too: [tile][block][lw] */
                const int64_t at = TILED(kind) ? ((int64_t)(n / lw) * nb + b) * lw + n % lw : (int64_t)n * nb + b;
                const float xd = dx[(int64_t)r * nb + b];
                if (HALVES(kind)) {  /* [tile][block][half][lw] */
                    const float *ds = (const float *)d + ((int64_t)(n / lw) * nb + b) * 2 * lw + n % lw;
                    total += (float)s * (ds[0] * xd);
                    total += (float)s2 * (ds[lw] * xd);
                } else {
                    total += (float)s * ((F32_SCALES(kind) ? ((const float *)d)[at] : half_to_float(((const uint16_t *)d)[at])) * xd);
                }
                if (!INT8(kind))
                    total += (F32_SCALES(kind) ? ((const float *)m)[at] : half_to_float(((const uint16_t *)m)[at])) *
                             sx[(int64_t)r * nb + b];
            }
            y[(int64_t)r * N + n] = total;
        }
    return 0;
}
#endif

/* y[M, N] = round(x) @ dequant(W)^T; kind 1: int4 weights (qs [N, K / 2], needs m), kind 2: int8 (qs [N, K]),
   kinds 3 and 4: int4 and int8 in tiles of 8 outputs (N padded to a multiple of 8; see QuantLinear.tile), kinds 5
   and 6: the same with float32 scales (kind 6: one for each half block), kinds 7-10: kinds 3-6 in tiles of 16
   (N padded to a multiple of 16). d, m: float16 bits or float32. Kinds 11-13 and 15-17: Q4_K, Q5_K, Q6_K at the
   file's bytes (kquants.h).
   Returns nonzero when scratch memory is short. */
/* Outputs per tile this build prefers (QuantLinear.tile): 16 where a row meets 16 at once */
int specdecode_tile_width(void) { return SPECDECODE_AVX512 ? 16 : 8; }

int specdecode_a8_matmul(int kind, const float *x, int M, int K, const void *qs, const void *d, const void *m,
                         float *y, int N) {
    const int nb = K / QK;
    int8_t *xq = malloc((size_t)M * K + 4);
    float *dx = malloc(sizeof(float) * (size_t)M * nb), *sx = malloc(sizeof(float) * (size_t)M * nb);
    if (!xq || !dx || !sx) {
        free(xq); free(dx); free(sx);
        return 1;
    }
    quantize_rows(x, M, K, xq, dx, sx);
    if (kind >= K_Q4) {  /* the K-quants at the file's bytes (kquants.c); Q6_K reads each row's sums per 16 */
        int32_t *s16 = malloc(sizeof(int32_t) * ((size_t)M * K / 16 + 1));
        if (!s16) {
            free(xq); free(dx); free(sx);
            return 1;
        }
        for (int64_t i = 0; i < (int64_t)M * K / 16; i++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += xq[16 * i + j];
            s16[i] = s;
        }
        specdecode_k_matmul(kind, xq, dx, sx, s16, M, K, qs, d, m, y, N);
        free(s16);
        free(xq); free(dx); free(sx);
        return 0;
    }
    const int failed = a8_matmul(kind, xq, dx, sx, M, K, qs, d, m, y, N);
    free(xq); free(dx); free(sx);
    return failed;
}
