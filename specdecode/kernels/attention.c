/* Scaled dot-product attention over a layer's KV cache (float32, float16 or int8 rows, contiguous or paged), for
   the blocks (block.c) and the PyTorch models: scores q . k * scale, softmax with the max subtracted, the weighted sum
   of the values; every number of a query computed by the same operations in the same order whatever the call holds.
   Over int8 rows each query head is quantized as a row is, a score is an exact integer dot product times the two
   scales (as llama.cpp scores a Q8_0 cache), and a value row enters its sums with weight p * s_v (the totals sum p
   alone). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "simd.h"


#if SPECDECODE_AVX2
/* 8 elements of a cache row from element `at` on, as floats (exact): float32, float16 widened, or int8 unscaled */
static inline __attribute__((always_inline)) __m256 load_kv8(const void *base, int64_t at, const int kind) {
    if (kind == KV_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + at))));
    return kind == KV_F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + at)))
                          : _mm256_loadu_ps((const float *)base + at);
}

/* out[h] lane t: q_h . k_t for H heads' queries (rows of hd floats from q) and the 8 keys k_0..k_7 (rows of hd float32
   or float16 elements from element `at` of k, hd a multiple of 8), each key vector widened once for all the heads:
   lane t of a head holds key t's product, from the same additions whatever the other lanes and heads hold */
static inline __attribute__((always_inline)) void dot8(const float *q, const void *k, int64_t at, int hd,
                                                       const int kind, const int H, __m256 *out) {
    __m256 a[3][8];
    for (int h = 0; h < H; h++)
        for (int t = 0; t < 8; t++) a[h][t] = _mm256_setzero_ps();
    for (int e = 0; e < hd; e += 8) {
        __m256 kv[8];
        for (int t = 0; t < 8; t++) kv[t] = load_kv8(k, at + (int64_t)t * hd + e, kind);
        for (int h = 0; h < H; h++) {
            const __m256 qv = _mm256_loadu_ps(q + h * hd + e);
            for (int t = 0; t < 8; t++) a[h][t] = _mm256_fmadd_ps(qv, kv[t], a[h][t]);
        }
    }
    for (int h = 0; h < H; h++) {
        const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[h][0], a[h][1]), _mm256_hadd_ps(a[h][2], a[h][3]));
        const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[h][4], a[h][5]), _mm256_hadd_ps(a[h][6], a[h][7]));
        out[h] = _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
    }
}
/* dot8 for H heads, the kind a constant */
static inline __attribute__((always_inline)) void dot8_kinds(const float *q, const void *k, int64_t at, int hd,
                                                             int kind, const int H, __m256 *out) {
    if (kind == KV_F16) dot8(q, k, at, hd, KV_F16, H, out);
    else dot8(q, k, at, hd, KV_F32, H, out);
}

/* The values pass's vectors: 16 floats where the build has AVX-512 (half the instructions a key), else 8; each
   element's sum is the same chain of fmas either way, so both give the same numbers */
#if SPECDECODE_AVX512
typedef __m512 vfloat;
#define VF 16
static inline __attribute__((always_inline)) vfloat load_vals(const void *base, int64_t at, const int kind) {
    if (kind == KV_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)base + at))));
    return kind == KV_F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at)))
                          : _mm512_loadu_ps((const float *)base + at);
}
#define vf_set1 _mm512_set1_ps
#define vf_fmadd _mm512_fmadd_ps
#define vf_loadu _mm512_loadu_ps
#define vf_storeu _mm512_storeu_ps
#else
typedef __m256 vfloat;
#define VF 8
#define load_vals load_kv8
#define vf_set1 _mm256_set1_ps
#define vf_fmadd _mm256_fmadd_ps
#define vf_loadu _mm256_loadu_ps
#define vf_storeu _mm256_storeu_ps
#endif

/* Whether keys j..j+7 have a nonzero weight for each of the H heads (rows of p, p_stride apart) */
static inline int every_head_sees8(const float *p, size_t p_stride, int j, int H) {
    __m256 seen = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int h = 0; h < H; h++)
        seen = _mm256_and_ps(seen, _mm256_cmp_ps(_mm256_loadu_ps(p + (size_t)h * p_stride + j), _mm256_setzero_ps(),
                                                 _CMP_NEQ_UQ));
    return _mm256_movemask_ps(seen) == 0xff;
}

/* Keys j0..j1 of o_h = sum_j p_hj v_j / sum_j p_hj for H heads (weights p + h * p_stride), over VF NV floats of the
   keys' value rows from element `at` of a row: the sums carried in acc (H rows, acc_stride floats apart, of VF NV
   floats) and totals (H) from the keys before, in registers over the range (H, NV and kind constants at each call:
   the loops unroll, each value vector is widened once for the H heads; an int8 row's scale multiplies each head's
   weight, not the totals; runs of 8 keys every head sees skip the per-key tests). Both sums run over the visible keys
   (p_hj != 0) in cache order, one at a time: a tree's path lies elsewhere in the cache than single steps put it, so
   sums by lane (j % 8) would round apart. A head's sums are the same whatever ranges its keys are taken in (a range
   stores and reloads them exactly), whatever heads and elements share the call (an element's sum is its own). */
static inline __attribute__((always_inline)) void weigh_values(const float *p, size_t p_stride, const void *vals,
                                                               int64_t at, const Rows *rows, int hd, int j0, int j1,
                                                               float *acc_mem, int acc_stride, float *totals,
                                                               const int H, const int NV, const int kind) {
    const int rs = kv_row(hd, kind);
    vfloat acc[16];
    float sum[4];
    for (int h = 0; h < H; h++) {
        sum[h] = totals[h];
        for (int e = 0; e < NV; e++) acc[h * NV + e] = vf_loadu(acc_mem + (size_t)h * acc_stride + VF * e);
    }
    for (int j = j0; j < j1;) {  /* a run of keys whose rows are contiguous (a block, or the whole range) at a time */
        int end = rows->table ? ((j >> rows->shift) + 1) << rows->shift : j1;
        if (end > j1) end = j1;
        const int64_t first = at + row_at(rows, j, rs) - (int64_t)j * rs;
        while (j < end) {
            if (j + 8 <= end && every_head_sees8(p, p_stride, j, H)) {  /* the usual case: no test a key */
                if (!rows->table || j + PREFETCH_KEYS + 8 <= end)  /* past a block's end the rows lie elsewhere */
                    prefetch_bytes((const char *)vals + (first + (int64_t)(j + PREFETCH_KEYS) * rs) * kv_esize(kind),
                                   8 * rs * kv_esize(kind));
                for (int t = j; t < j + 8; t++) {
                    const int64_t vj = first + (int64_t)t * rs;
                    const float sj = kind == KV_I8 ? kv_scale(vals, vj - at, rs) : 1.0f;
                    vfloat w[4];
                    for (int h = 0; h < H; h++) {
                        const float pj = p[(size_t)h * p_stride + t];
                        sum[h] += pj;
                        w[h] = vf_set1(kind == KV_I8 ? pj * sj : pj);
                    }
                    for (int e = 0; e < NV; e++) {
                        const vfloat v = load_vals(vals, vj + VF * e, kind);
                        for (int h = 0; h < H; h++) acc[h * NV + e] = vf_fmadd(w[h], v, acc[h * NV + e]);
                    }
                }
                j += 8;
                continue;
            }
            const int64_t vj = first + (int64_t)j * rs;
            float pj[4];
            int any = 0;
            for (int h = 0; h < H; h++) {
                pj[h] = p[(size_t)h * p_stride + j];
                any |= pj[h] != 0.0f;
            }
            j++;
            if (!any) continue;
            int all = 1;
            for (int h = 0; h < H; h++) {
                sum[h] += pj[h];  /* + 0 is exact */
                all &= pj[h] != 0.0f;
            }
            float wj[4];
            const float sj = kind == KV_I8 ? kv_scale(vals, vj - at, rs) : 1.0f;
            for (int h = 0; h < H; h++) wj[h] = kind == KV_I8 ? pj[h] * sj : pj[h];
            for (int e = 0; e < NV; e++) {
                const vfloat v = load_vals(vals, vj + VF * e, kind);
                for (int h = 0; h < H; h++)  /* a hidden key's value never enters a sum (it may be anything) */
                    if (all || pj[h] != 0.0f)
                        acc[h * NV + e] = vf_fmadd(vf_set1(wj[h]), v, acc[h * NV + e]);
            }
        }
    }
    for (int h = 0; h < H; h++) {
        totals[h] = sum[h];
        for (int e = 0; e < NV; e++) vf_storeu(acc_mem + (size_t)h * acc_stride + VF * e, acc[h * NV + e]);
    }
}
#endif

/* Element `at` of a cache row, as a float (exact; int8 unscaled) */
static inline float kv_at(const void *base, int64_t at, int kind) {
    return kind == KV_I8    ? (float)((const int8_t *)base)[at]
           : kind == KV_F16 ? half_to_float(((const uint16_t *)base)[at])
                            : ((const float *)base)[at];
}

/* count consecutive float32 or float16 cache rows (hd elements each) from element `at` into out as floats (exact) */
static void widen_rows(const void *base, int64_t at, int count, int hd, int kind, float *out) {
    if (kind == KV_F32) {
        memcpy(out, (const float *)base + at, sizeof(float) * (size_t)count * hd);
        return;
    }
    int64_t e = 0;
#if SPECDECODE_AVX2
    for (; e + 8 <= (int64_t)count * hd; e += 8) _mm256_storeu_ps(out + e, load_kv8(base, at + e, KV_F16));
#endif
    for (; e < (int64_t)count * hd; e++) out[e] = kv_at(base, at + e, KV_F16);
}

/* Scores of `heads` query heads (rows of q, hd floats apart) over float32 or float16 keys (head h's p[h * p_stride + j]
   = q_h . k_j * scale for j < L), every key's by dot8 where it applies (a key's number never depends on L, n or the
   heads beside it), padding rows of zeros where the cache ends inside a group of 8 (pad: 8 * hd floats) */
static void scores(const float *q, int heads, const void *keys, const Rows *rows, int kind, int L, int max_len, int hd,
                   float scale, float *p, size_t p_stride, float *pad, int j0, int j1) {
#if SPECDECODE_AVX2
    if (hd % 8 == 0) {
        for (int h0 = 0; h0 < heads; h0 += 3) {  /* up to three heads at a time: their sums fill the registers */
            const int H = heads - h0 < 3 ? heads - h0 : 3;
            const float *qh = q + (int64_t)h0 * hd;
            float *ph = p + h0 * p_stride;
            for (int j = j0; j < j1; j += 8) {
                __m256 s[3];
                const void *k = keys;
                int64_t at = row_at(rows, j, hd);
                if (j + PREFETCH_KEYS + 8 <= (rows->table ? L : max_len))  /* a group's 8 rows: contiguous */
                    prefetch_bytes((const char *)keys + row_at(rows, j + PREFETCH_KEYS, hd) * kv_esize(kind),
                                   8 * hd * kv_esize(kind));
                int k_kind = kind;
                if (!rows->table && j + 8 > max_len) {  /* the cache ends inside this group: zero rows past its end */
                    memset(pad, 0, sizeof(float) * 8 * (size_t)hd);
                    widen_rows(keys, at, max_len - j, hd, kind, pad);
                    k = pad, at = 0, k_kind = KV_F32;
                }
                if (H == 3) dot8_kinds(qh, k, at, hd, k_kind, 3, s);
                else if (H == 2) dot8_kinds(qh, k, at, hd, k_kind, 2, s);
                else dot8_kinds(qh, k, at, hd, k_kind, 1, s);
                for (int h = 0; h < H; h++)
                    _mm256_storeu_ps(ph + h * p_stride + j, _mm256_mul_ps(s[h], _mm256_set1_ps(scale)));
            }
        }
        return;
    }
#endif
    for (int h = 0; h < heads; h++)
        for (int j = j0; j < j1 && j < L; j++) {
            const float *k = (const float *)keys + row_at(rows, j, hd);
            if (kind == KV_F16) {  /* widened into pad first: dot reads floats */
                widen_rows(keys, row_at(rows, j, hd), 1, hd, KV_F16, pad);
                k = pad;
            }
            p[h * p_stride + j] = dot(q + (int64_t)h * hd, k, hd) * scale;
        }
}

/* One past the last key query i of the call sees (its own, in a chain; a tree's or a window's mask may say
   otherwise): keys from there on are neither scored nor weighed, which changes no number (each key's score, weight
   and place in the sums is its own), and halves a prefill's attention */
static int visible_end(int L, int start, int n, int i, const uint8_t *mask, const uint8_t *full_mask) {
    int end = full_mask ? L : mask ? start + n : start + i + 1;
    while (end > 0 && (full_mask ? !full_mask[(int64_t)i * L + end - 1]
                                 : mask && end > start && !mask[(int64_t)i * n + end - 1 - start]))
        end--;
    return end;
}

/* Whether query i of the call sees key j (a Span's visibility: full_mask [n, L]; else every cached key and, among
   the call's, mask [n, n]'s or a causal chain's) */
static inline int sees(int L, int start, int n, int i, int j, const uint8_t *mask, const uint8_t *full_mask) {
    if (full_mask) return full_mask[(int64_t)i * L + j];
    if (j < start) return 1;
    return mask ? mask[(int64_t)i * n + (j - start)] : j - start <= i;
}

/* p (the scores of query i of the call over keys 0..end) -> e^(p - max) over the keys it sees, 0 elsewhere; padded
   with zeros to a multiple of 8 */
static void softmax_weights(float *p, int L, int end, int start, int n, int i, const uint8_t *mask,
                            const uint8_t *full_mask) {
    float best = -INFINITY;
    int j0 = 0;
#if SPECDECODE_AVX2
    if (!full_mask) {  /* the cached keys are all visible: their max 8 at a time */
        __m256 m8 = _mm256_set1_ps(-INFINITY);
        for (; j0 + 8 <= start && j0 + 8 <= end; j0 += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(p + j0));
        float lanes[8];
        _mm256_storeu_ps(lanes, m8);
        for (int t = 0; t < 8; t++) best = lanes[t] > best ? lanes[t] : best;
    }
#endif
    for (int j = j0; j < end; j++) {
        if (!sees(L, start, n, i, j, mask, full_mask)) p[j] = -INFINITY;
        else if (p[j] > best) best = p[j];
    }
    for (int j = end; j < ((end + 7) & ~7); j++) p[j] = -INFINITY;
#if SPECDECODE_AVX2
    int j = 0;
#ifdef __AVX512F__
    for (; j + 16 <= ((end + 7) & ~7); j += 16) {
        const __m512 v = _mm512_loadu_ps(p + j);
        const __mmask16 hidden = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
        _mm512_storeu_ps(p + j, _mm512_maskz_mov_ps(~hidden, exp16(_mm512_sub_ps(v, _mm512_set1_ps(best)))));
    }
#endif
    for (; j < end; j += 8) {
        const __m256 v = _mm256_loadu_ps(p + j);
        const __m256 hidden = _mm256_cmp_ps(v, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
        const __m256 e = exp8(_mm256_sub_ps(v, _mm256_set1_ps(best)));
        _mm256_storeu_ps(p + j, _mm256_andnot_ps(hidden, e));
    }
#else
    for (int j = 0; j < end; j++)  /* 0 below -87.3, as exp8 (subnormal weights take the CPU's slow path) */
        p[j] = p[j] == -INFINITY || p[j] - best < EXP_LOWEST ? 0.0f : expf(p[j] - best);
#endif
}

#define KEY_BLOCK 32   /* keys whose rows a task's query heads take in turn: they stay in L1 */
#define SHARED_KEYS 64      /* keys a shared scoring task takes (a multiple of 8) */
#define SHARED_FROM 512     /* cached keys from which a step's passes are shared out (shared_attention) */
#define SHARED_WEIGHTS (4 << 20) /* weights (floats) the shared passes may hold at once: 16 MB */
#define VALUE_CHUNK 256 /* visible keys a values sum takes at a time (see chunk_bounds) */

/* The sums of `heads` heads (weights: rows of p, p_stride apart) over the values of keys j0..j1, from zero: acc (rows
   of hd floats) and totals. In passes of up to four heads and NV vectors of each head's elements, each value vector
   widened once for the pass's heads (weigh_values); without the fast path, each head's sums one at a time. Either
   way, each sum over the range's visible keys (p != 0) in cache order. */
static void weigh_range(const float *p, size_t p_stride, int heads, const void *vals, const Rows *rows, int hd,
                        int kind, int j0, int j1, float *acc, float *totals) {
    memset(acc, 0, sizeof(float) * (size_t)heads * hd);
    memset(totals, 0, sizeof(float) * (size_t)heads);
#if SPECDECODE_AVX2
    const int NV = hd % (4 * VF) == 0 ? 4 : hd % (2 * VF) == 0 ? 2 : hd % VF == 0 ? 1 : 0;
    if (NV) {
        for (int h0 = 0; h0 < heads; h0 += 4) {
            const int H = heads - h0 < 4 ? heads - h0 : 4;
            const float *ph = p + (size_t)h0 * p_stride;
            for (int e = 0; e < hd; e += NV * VF) {
                float *acc_e = acc + (size_t)h0 * hd + e, again[4] = {0};  /* totals: the first pass's */
                float *tot = e == 0 ? totals + h0 : again;
#define WEIGH(h, n, k) weigh_values(ph, p_stride, vals, e, rows, hd, j0, j1, acc_e, hd, tot, h, n, k)
#define KINDS(h, n) if (kind == KV_I8) WEIGH(h, n, KV_I8); else if (kind == KV_F16) WEIGH(h, n, KV_F16); \
                    else WEIGH(h, n, KV_F32)
#define WIDTHS(h) if (NV == 4) { KINDS(h, 4); } else if (NV == 2) { KINDS(h, 2); } else { KINDS(h, 1); }
                switch (H) {  /* constants at each call: the loops unroll, the loads fold */
                    case 1: WIDTHS(1); break;
                    case 2: WIDTHS(2); break;
                    case 3: WIDTHS(3); break;
                    default: WIDTHS(4); break;
                }
#undef WIDTHS
#undef KINDS
#undef WEIGH
            }
        }
        return;
    }
#endif
    const int rs = kv_row(hd, kind);
    for (int h = 0; h < heads; h++) {
        const float *w = p + (size_t)h * p_stride;
        float *o = acc + (size_t)h * hd;
        for (int j = j0; j < j1; j++) {
            if (w[j] == 0.0f) continue;
            const int64_t vj = row_at(rows, j, rs);
            const float pj = kind == KV_I8 ? w[j] * kv_scale(vals, vj, rs) : w[j];
            totals[h] += w[j];
            for (int e = 0; e < hd; e++) o[e] += pj * kv_at(vals, vj + e, kind);
        }
    }
}

/* Where query i of the call cuts its visible keys into the chunks whose sums add up to its outputs: chunk c holds
   the visible keys of ranks c * VALUE_CHUNK on (a key's rank: the visible keys before it), keys bounds[c] to
   bounds[c + 1] (hidden ones among them weigh nothing). A tree's query sees the same keys in the same order as the
   one-token steps that compute its token (the cached keys, then its path's), so it cuts them in the same places:
   chunks keep trees bit for bit what steps compute, and share a long cache's values out among threads. Returns the
   number of chunks (bounds: room for L / VALUE_CHUNK + 2). */
static int chunk_bounds(int L, int start, int n, int i, int end, const uint8_t *mask, const uint8_t *full_mask,
                        int *bounds) {
    int chunks = 0, rank = 0, j = 0;
    if (!full_mask) {  /* the cached keys all visible: rank = index */
        for (; chunks * VALUE_CHUNK < start && chunks * VALUE_CHUNK < end; chunks++)
            bounds[chunks] = chunks * VALUE_CHUNK;
        rank = j = start < end ? start : end;
    }
    for (; j < end; j++) {
        if (!sees(L, start, n, i, j, mask, full_mask)) continue;
        if (rank % VALUE_CHUNK == 0) bounds[chunks++] = j;
        rank++;
    }
    if (chunks == 0) bounds[chunks++] = 0;
    bounds[chunks] = end;
    return chunks;
}

/* acc (rows of hd floats) and totals += one chunk's sums, element by element */
static void add_chunk(float *acc, float *totals, const float *part, const float *part_totals, int heads, int hd) {
    for (int e = 0; e < heads * hd; e++) acc[e] += part[e];
    for (int h = 0; h < heads; h++) totals[h] += part_totals[h];
}

/* out (rows of hd floats, for `heads` heads) = acc / totals */
static void normalize(const float *acc, const float *totals, int heads, int hd, float *out) {
    for (int h = 0; h < heads; h++) {
        const float inv = 1.0f / totals[h];
        for (int e = 0; e < hd; e++) out[(size_t)h * hd + e] = acc[(size_t)h * hd + e] * inv;
    }
}

/* Queries over a short cache, or many of them (a prefill's chunk): a task per (kv head, token), holding the heads
   that share the kv head: they score the keys in blocks of KEY_BLOCK in turn, so each block is read from L2 (or
   memory) once for all of them, and weigh each value vector once for all of them; the next task (the next token)
   finds the kv head's keys and values in L2. q8, q8_scales: the queries quantized (int8 keys), else NULL. */
static int verify_attention(const float *qs, int q_stride, float *att, int att_stride, const void *k_cache,
                            const void *v_cache, int max_len, int start, int n, const uint8_t *mask,
                            const uint8_t *full_mask, int n_heads, int n_kv, int hd, float scale, int kind,
                            const int32_t *table, int64_t bstride, int shift, const int8_t *q8,
                            const float *q8_scales) {
    const int L = start + n, Lp = (L + 7) & ~7, group = n_heads / n_kv, rs = kv_row(hd, kind);
    const size_t stride = (size_t)Lp + 8, sums = (size_t)group * (hd + 1);  /* a group's sums: hd each, a total */
    int failed = 0;
#pragma omp parallel
    {
        float *p = malloc(sizeof(float) * (group * stride + 2 * sums + 8 * (size_t)hd));
        int *bounds = malloc(sizeof(int) * (size_t)(L / VALUE_CHUNK + 2));
        float *acc = p ? p + group * stride : NULL, *part = p ? acc + sums : NULL, *pad = p ? part + sums : NULL;
        if (!p || !bounds) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int task = 0; task < n_kv * n; task++) {
            if (!p || !bounds) continue;  /* this thread's scratch is missing: `failed` says so */
            const int g = task / n, i = task % n;
            const Rows rows = {table, bstride, (int64_t)g * max_len * rs, shift};
            const float *q = qs + (int64_t)i * q_stride + (int64_t)g * group * hd;
            const int end = visible_end(L, start, n, i, mask, full_mask), ends = (end + 7) & ~7;
            const int64_t first_head = (int64_t)i * n_heads + (int64_t)g * group;
            for (int j = 0; j < ends; j += KEY_BLOCK) {
                const int j1 = j + KEY_BLOCK < ends ? j + KEY_BLOCK : ends;
                if (q8)
                    attention_int8_scores(q8 + first_head * hd, q8_scales + first_head, group, k_cache, &rows,
                                          max_len, hd, scale, p, stride, j, j1);
                else
                    scores(q, group, k_cache, &rows, kind, end, max_len, hd, scale, p, stride, pad, j, j1);
            }
            for (int h = 0; h < group; h++) softmax_weights(p + h * stride, L, end, start, n, i, mask, full_mask);
            const int chunks = chunk_bounds(L, start, n, i, end, mask, full_mask, bounds);
            memset(acc, 0, sizeof(float) * sums);
            for (int c = 0; c < chunks; c++) {
                weigh_range(p, stride, group, v_cache, &rows, hd, kind, bounds[c], bounds[c + 1], part,
                            part + group * hd);
                add_chunk(acc, acc + group * hd, part, part + group * hd, group, hd);
            }
            normalize(acc, acc + group * hd, group, hd, att + (int64_t)i * att_stride + (int64_t)g * group * hd);
        }
        free(p);
        free(bounds);
    }
    return failed;
}

/* A decode step, or a verification of a few tokens, over a long cache: four passes, each shared out among the
   threads so that both cores stream the cache, and each reading a key or value once for all the queries and query
   heads that share it (grouped-query attention; a tree's tokens):
   1. scores, a task per (kv head, SHARED_KEYS keys): every query and head of the group scored against them, each
      key vector loaded (and widened) once for a query's heads (the scores a query computes alone: each key's are);
   2. weights, a task per (query, head): the max over its keys and e^(s - max), exact whatever the split;
   3. values, a task per (kv head, chunk of VALUE_CHUNK visible keys: chunk_bounds): each query's sums over the
      chunk's values (the chunk's rows stay in L2 from one query to the next);
   4. a task per (query, kv head): the chunks' sums added in order, over the totals.
   Query i's weights are the row (i * n_heads + h) of p. Returns 1 when memory ran out. */
static int shared_attention(const float *qs, int q_stride, float *att, int att_stride, const void *k_cache,
                            const void *v_cache, int max_len, int start, int n, const uint8_t *mask,
                            const uint8_t *full_mask, int n_heads, int n_kv, int hd, float scale, int kind,
                            const int32_t *table, int64_t bstride, int shift, const int8_t *q8,
                            const float *q8_scales) {
    const int L = start + n, Lp = (L + 7) & ~7, group = n_heads / n_kv, chunks = (L + SHARED_KEYS - 1) / SHARED_KEYS;
    const int rs = kv_row(hd, kind), most = L / VALUE_CHUNK + 2;  /* most: room for a query's chunk bounds */
    const size_t stride = (size_t)Lp + 8, sums = (size_t)n_heads * (hd + 1);  /* a query's sums: hd a head, totals */
    float *p = malloc(sizeof(float) * (size_t)n * n_heads * stride);
    int *ends = malloc(sizeof(int) * (size_t)n * (most + 2)), *counts = ends ? ends + n : NULL;
    int *bounds = counts ? counts + n : NULL, widest = 1;
    for (int i = 0; ends && i < n; i++) {
        ends[i] = visible_end(L, start, n, i, mask, full_mask);
        counts[i] = chunk_bounds(L, start, n, i, ends[i], mask, full_mask, bounds + (size_t)i * most);
        widest = counts[i] > widest ? counts[i] : widest;
    }
    float *parts = ends ? malloc(sizeof(float) * (size_t)n * widest * sums) : NULL;  /* each chunk's sums */
    if (!p || !ends || !parts) {
        free(p);
        free(ends);
        free(parts);
        return 1;
    }
    int failed = 0;
#define WEIGHTS(i, h) (p + ((size_t)(i) * n_heads + (h)) * stride)
#define PART(i, c) (parts + ((size_t)(i) * widest + (c)) * sums)  /* heads' sums, then their totals */
#pragma omp parallel
    {
        float *pad = malloc(sizeof(float) * (8 * (size_t)hd + sums));
        if (!pad) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int task = 0; task < n_kv * chunks; task++) {
            if (!pad) continue;
            const int g = task / chunks, j0 = (task % chunks) * SHARED_KEYS;
            const int count = L - j0 < SHARED_KEYS ? L - j0 : SHARED_KEYS, padded = (count + 7) & ~7;
            const Rows rows = {table, bstride, (int64_t)g * max_len * rs, shift};
            if (q8) {
                for (int i = 0; i < n; i++) {
                    const int seen = (ends[i] + 7) & ~7, j1 = j0 + padded < seen ? j0 + padded : seen;
                    const int64_t first_head = (int64_t)i * n_heads + (int64_t)g * group;
                    if (j0 < j1)
                        attention_int8_scores(q8 + first_head * hd, q8_scales + first_head, group, k_cache, &rows,
                                              max_len, hd, scale, WEIGHTS(i, g * group), stride, j0, j1);
                }
                continue;
            }
            for (int i = 0; i < n; i++) {
                const int seen = (ends[i] + 7) & ~7, j1 = j0 + padded < seen ? j0 + padded : seen;
                if (j0 < j1)
                    scores(qs + (int64_t)i * q_stride + (int64_t)g * group * hd, group, k_cache, &rows, kind, ends[i],
                           max_len, hd, scale, WEIGHTS(i, g * group), stride, pad, j0, j1);
            }
        }
#pragma omp for schedule(static)
        for (int task = 0; task < n * n_heads; task++)
            softmax_weights(WEIGHTS(task / n_heads, task % n_heads), L, ends[task / n_heads], start, n,
                            task / n_heads, mask, full_mask);
#pragma omp for schedule(static)
        for (int task = 0; task < n_kv * widest; task++) {
            if (!pad) continue;
            const int g = task / widest, c = task % widest;
            const Rows rows = {table, bstride, (int64_t)g * max_len * rs, shift};
            for (int i = 0; i < n; i++) {
                const int *b = bounds + (size_t)i * most;
                float *part = PART(i, c);
                if (c < counts[i])
                    weigh_range(WEIGHTS(i, g * group), stride, group, v_cache, &rows, hd, kind, b[c], b[c + 1],
                                part + (size_t)g * group * hd, part + (size_t)n_heads * hd + g * group);
            }
        }
#pragma omp for schedule(static)
        for (int task = 0; task < n * n_kv; task++) {  /* each query's chunks added in order */
            if (!pad) continue;
            const int i = task / n_kv, g = task % n_kv;
            float *acc = pad + 8 * hd, *totals = acc + (size_t)group * hd;
            memset(acc, 0, sizeof(float) * (size_t)group * (hd + 1));
            for (int c = 0; c < counts[i]; c++)
                add_chunk(acc, totals, PART(i, c) + (size_t)g * group * hd,
                          PART(i, c) + (size_t)n_heads * hd + g * group, group, hd);
            normalize(acc, totals, group, hd, att + (int64_t)i * att_stride + (int64_t)g * group * hd);
        }
        free(pad);
    }
#undef PART
#undef WEIGHTS
    free(p);
    free(ends);
    free(parts);
    return failed;
}

/* Attention of n new queries (rows of q, `q_stride` floats apart, heads side by side, RoPE applied) over the
   layer's cache, whose keys and values for the new tokens are already at start..start+n: out rows `att_stride`
   apart (kv_kind: KV_F32, KV_F16 or KV_I8). Visibility as in a Span (mask: [n, n] among the new tokens, NULL: a
   causal chain; full_mask: [n, start + n]). table (NULL: each kv head's rows contiguous, max_len of them): the
   sequence's block table, blocks of max_len rows (a power of two >= 8) `bstride` elements apart; same numbers
   either way (only where a row lies changes). A query's numbers never depend on n, nor on the threads: the decode
   and verification paths compute each score, weight and sum by the same operations in the same order, so that a
   tree verifies bit for bit what one-token steps compute. Returns 1 when scratch memory ran out. */
int specdecode_attention_rows(const float *qs, int q_stride, float *att, int att_stride, const void *k_cache,
                              const void *v_cache, int max_len, int start, int n, const uint8_t *mask,
                              const uint8_t *full_mask, int n_heads, int n_kv, int hd, float scale, int kv_kind,
                              const int32_t *table, int64_t bstride) {
    int shift = 0;
    while (table && (1 << shift) < max_len) shift++;
    int8_t *q8 = NULL;  /* int8 keys: each query head quantized once for every key it meets */
    float *q8_scales = NULL;
    if (kv_kind == KV_I8) {
        q8 = malloc((size_t)n * n_heads * hd);
        q8_scales = malloc(sizeof(float) * (size_t)n * n_heads);
        if (!q8 || !q8_scales) {
            free(q8);
            free(q8_scales);
            return 1;
        }
        for (int i = 0; i < n; i++)
            for (int h = 0; h < n_heads; h++)
                q8_scales[i * n_heads + h] = attention_quantize_row(qs + (int64_t)i * q_stride + (int64_t)h * hd,
                                                                      hd, q8 + ((int64_t)i * n_heads + h) * hd);
    }
    int failed;
    /* the shared passes where the cache is long and the queries few (a step, a tree): shorter, their hand-overs cost
       more than they share out; more queries (a prefill's chunk), each task's keys stay in L2 for the next */
    if (start >= SHARED_FROM && (size_t)n * n_heads * (start + n + 8) <= SHARED_WEIGHTS)
        failed = shared_attention(qs, q_stride, att, att_stride, k_cache, v_cache, max_len, start, n, mask, full_mask,
                                  n_heads, n_kv, hd, scale, kv_kind, table, bstride, shift, q8, q8_scales);
    else
        failed = verify_attention(qs, q_stride, att, att_stride, k_cache, v_cache, max_len, start, n, mask, full_mask,
                                  n_heads, n_kv, hd, scale, kv_kind, table, bstride, shift, q8, q8_scales);
    free(q8);
    free(q8_scales);
    return failed;
}

/* The same over contiguous rows: the kernel the PyTorch blocks call (where a layer keeps them out of the native
   path) */
int specdecode_attention(const float *qs, int q_stride, float *att, int att_stride, const void *k_cache,
                         const void *v_cache, int max_len, int start, int n, const uint8_t *mask,
                         const uint8_t *full_mask, int n_heads, int n_kv, int hd, float scale, int kv_kind) {
    return specdecode_attention_rows(qs, q_stride, att, att_stride, k_cache, v_cache, max_len, start, n, mask,
                                     full_mask, n_heads, n_kv, hd, scale, kv_kind, NULL, 0);
}
