/* What the kernels may use on this CPU, decided when they are compiled for it (-march=native, at first use on
   each machine: kernels/__init__.py keys the build by the CPU's flags, so this is the runtime dispatch).

   SPECDECODE_AVX2: AVX2 + FMA + F16C (256-bit vectors); without it every kernel runs as plain C.
   SPECDECODE_VNNI: the int8 dot product in one instruction (vpdpbusd on 256-bit vectors) where the CPU has
     AVX-VNNI (1) or AVX512-VNNI with AVX512-VL (2); 3 is a test build on a CPU without it, where dpbusd()
     is maddubs + madd + add. The int8-activation kernels give the same integers either way (their operands
     never saturate maddubs), hence the same floats: a VNNI machine computes bit for bit what an AVX2 one does. */

#ifndef SPECDECODE_SIMD_H
#define SPECDECODE_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECDECODE_AVX2 1
#include <immintrin.h>
#else
#define SPECDECODE_AVX2 0
#endif

#if SPECDECODE_AVX2 && defined(SPECDECODE_EMULATE_VNNI)
#define SPECDECODE_VNNI 3
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#elif SPECDECODE_AVX2 && defined(__AVXVNNI__)
#define SPECDECODE_VNNI 1
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#elif SPECDECODE_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SPECDECODE_VNNI 2
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#else
#define SPECDECODE_VNNI 0
#endif

/* SPECDECODE_AVX512: 512-bit vectors with byte operations and VNNI (the int8-activation kernel meets tiles of 16
   outputs: one broadcast of a row's activations serves 16), also where AVX-VNNI came first above (CPUs with both).
   Not with emulated VNNI (tests), so those builds check the 256-bit path against this one, bit for bit. */
#if (SPECDECODE_VNNI == 1 || SPECDECODE_VNNI == 2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)
#define SPECDECODE_AVX512 1
#else
#define SPECDECODE_AVX512 0
#endif

#define QK 32 /* weights per quantization block (GGUF's) */

static inline float half_to_float(uint16_t h) {
#if SPECDECODE_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
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

#if SPECDECODE_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* exp8's and exp16's constants, written once: the lowest argument kept (also the plain-C softmax's), log2(e), ln 2
   in two parts, the polynomial's coefficients */
#define EXP_LOWEST -87.3f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P5 1.9875691500e-4f
#define EXP_P4 1.3981999507e-3f
#define EXP_P3 8.3334519073e-3f
#define EXP_P2 4.1665795894e-2f
#define EXP_P1 1.6666665459e-1f
#define EXP_P0 5.0000001201e-1f

#if SPECDECODE_AVX2
/* e^x for x <= 0, 8 at a time (Cephes' expf: range reduction by ln 2, a degree-5 polynomial), to ~2 ulp; 0 below
   -87.3, where e^x leaves float's normal range: an attention weight of ~1e-38 makes its products with the values
   subnormal, and each multiply-add on a subnormal takes the CPU's slow path */
static inline __m256 exp8(__m256 x) {
    const __m256 normal = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LOWEST), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LOWEST));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_HI)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_LO)));
    __m256 y = _mm256_set1_ps(EXP_P5);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P4));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P3));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P2));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P1));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P0));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(normal, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2)));
}
#endif

#if SPECDECODE_AVX2 && defined(__AVX512F__)
/* exp8's numbers 16 at a time (each lane by the same operations and constants: the same bits) */
static inline __m512 exp16(__m512 x) {
    const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LOWEST), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_LOWEST));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(EXP_LN2_HI)));
    x = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(EXP_LN2_LO)));
    __m512 y = _mm512_set1_ps(EXP_P5);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_P4));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_P3));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_P2));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_P1));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_P0));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i pow2 = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(normal, _mm512_mul_ps(y, _mm512_castsi512_ps(pow2)));
}
#endif

/* a . b over len floats: 8 lanes of fused multiply-adds, then hsum's tree (the same order for any a and b) */
static inline float dot(const float *a, const float *b, int len) {
    int e = 0;
    float total = 0.0f;
#if SPECDECODE_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; e + 8 <= len; e += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), _mm256_loadu_ps(b + e), acc);
    total = hsum(acc);
#endif
    for (; e < len; e++) total += a[e] * b[e];
    return total;
}

#endif
