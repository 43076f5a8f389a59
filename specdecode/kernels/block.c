/* A model's blocks for n new tokens of one sequence, in one call: the decode and verify step without PyTorch's
   per-operator cost (a 30-layer step issues ~900 small operators in PyTorch; here one call, specdecode_blocks,
   runs them all).

   x [n, H] is the residual stream, updated in place, by the Llama block:
     x += wo(attention(rope(q), rope(k), v over the cache and the new tokens))   (q|k|v = wqkv(rmsnorm(x)))
     x += w2(silu(gate) * up)                                                     (gate|up = w13(rmsnorm(x)))
   or Gemma 3's (the options of a Layer): q and k RMS-normalized per head before RoPE, the attention's and the
   MLP's outputs normalized before each add ("sandwich"), a tanh-GELU gate, and per layer one of two Views (RoPE
   table and mask: the sliding-window layers' and the full ones').
   The new keys and values are written into the layer's cache at start..start+n. Who sees whom among the new
   tokens: a causal chain (mask NULL), a tree (mask [n, n], 1 where token i may attend to new token j), or any
   pattern over all keys (full_mask [n, start + n], for sliding windows). Every token's numbers come from the
   same operations in the same order whatever n is (see qmatmul.c), so a tree verifies bit for bit what
   one-token steps would compute.

   Numerics follow the PyTorch model (models/llama.py): RMSNorm in float32 with the weight applied after the
   normalisation, rotate-half RoPE from the given cos/sin tables, softmax with the max subtracted. The attention
   itself is attention.c's (specdecode_attention, exported: the PyTorch blocks of other families call it too).

   The cache holds float32, float16 or int8 keys and values (kv_kind): a token's key and value are rounded (or
   quantized) once, when they are written, and every query (its own token's included) reads what is stored; so a
   query's numbers still never depend on how many tokens share the call. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* float activations: W_F32, W_Q4, W_Q8, W_F16, W_BF16 (f16matmul.c); int8 activations: W_A8 + the a8 kernel's
   kind (specdecode_a8_matmul);
   W_STACK: outputs stacked from parts stored differently (a fused q|k|v whose v is Q6_K and q, k Q4_K, as GGUF's
   Q4_K_M files have them): qs points to the parts (Weights, none stacked, no bias), ended by one with n_out 0 */
enum { W_F32 = 0, W_Q4 = 1, W_Q8 = 2, W_F16 = 3, W_BF16 = 4, W_STACK = 9, W_A8 = 10 };

typedef struct {
    int kind, n_out, n_in;
    const void *qs;       /* f32: the weight [n_out, n_in]; q4: nibbles; q8: int8; f16, bf16: 16-bit words */
    const uint16_t *d, *m; /* block scales and mins (float16 bits; float32 for the a8 kernel's kinds 5 and 6) */
    const float *bias;     /* or NULL */
} Weight;

void specdecode_q4_matmul(const float *x, float *xsum, int M, int K, const uint8_t *qs, const uint16_t *d,
                          const uint16_t *m, float *y, int N);
void specdecode_q8_matmul(const float *x, int M, int K, const int8_t *qs, const uint16_t *d, float *y, int N);
void specdecode_f32_matmul(const float *x, int M, int K, const float *w, float *y, int N);
void specdecode_h_matmul(int bf16, const float *x, int M, int K, const uint16_t *w, float *y, int N);
int specdecode_a8_matmul(int kind, const float *x, int M, int K, const void *qs, const void *d, const void *m,
                         float *y, int N);

/* returns 1 when the int8-activation kernel's scratch memory ran out */
static int linear(const Weight *w, const float *x, int M, float *y, float *scratch) {
    if (w->kind == W_STACK) {  /* each part into a scratch block, then its columns into y: a row's numbers are
                                  the part's own, whatever the other parts or rows */
        const Weight *parts = (const Weight *)w->qs;
        int widest = 0;
        for (const Weight *p = parts; p->n_out; p++) widest = p->n_out > widest ? p->n_out : widest;
        float *part = malloc(sizeof(float) * (size_t)M * widest + 1);
        if (!part) return 1;
        int first = 0;
        for (const Weight *p = parts; p->n_out; first += p->n_out, p++) {
            if (linear(p, x, M, part, scratch)) {
                free(part);
                return 1;
            }
            for (int r = 0; r < M; r++)
                memcpy(y + (int64_t)r * w->n_out + first, part + (int64_t)r * p->n_out, sizeof(float) * p->n_out);
        }
        free(part);
    } else if (w->kind > W_A8) {
        if (specdecode_a8_matmul(w->kind - W_A8, x, M, w->n_in, w->qs, w->d, w->m, y, w->n_out)) return 1;
    } else if (w->kind == W_Q4)
        specdecode_q4_matmul(x, scratch, M, w->n_in, (const uint8_t *)w->qs, w->d, w->m, y, w->n_out);
    else if (w->kind == W_Q8)
        specdecode_q8_matmul(x, M, w->n_in, (const int8_t *)w->qs, w->d, y, w->n_out);
    else if (w->kind == W_F16 || w->kind == W_BF16)
        specdecode_h_matmul(w->kind == W_BF16, x, M, w->n_in, (const uint16_t *)w->qs, y, w->n_out);
    else
        specdecode_f32_matmul(x, M, w->n_in, (const float *)w->qs, y, w->n_out);
    if (w->bias)
        for (int r = 0; r < M; r++)
            for (int j = 0; j < w->n_out; j++) y[(int64_t)r * w->n_out + j] += w->bias[j];
    return 0;
}



static void rmsnorm(const float *x, const float *w, float eps, int n, int H, float *out) {
    for (int i = 0; i < n; i++) {
        const float *xi = x + (int64_t)i * H;
        const float ss = dot(xi, xi, H);
        const float scale = 1.0f / sqrtf(ss / H + eps);
        for (int j = 0; j < H; j++) out[(int64_t)i * H + j] = w[j] * (xi[j] * scale);
    }
}

static void rope(float *v, const float *cos, const float *sin, int hd) {
    const int half = hd / 2;
    for (int j = 0; j < half; j++) {
        const float a = v[j], b = v[j + half];
        v[j] = a * cos[j] - b * sin[j];
        v[j + half] = b * cos[j + half] + a * sin[j + half];
    }
}

/* f rounded to float16, to nearest even (IEEE's default, F16C's and PyTorch's): overflow to infinity, subnormals
   kept, NaN stays NaN */
static inline uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);  /* >= 65520: rounds past the largest half, 65504 */
    if (ax < 0x38800000u) {  /* under 2^-14: a subnormal half, a multiple of 2^-24 (the scaling is exact) */
        float a;
        memcpy(&a, &ax, 4);
        return (uint16_t)(sign | (uint32_t)rintf(a * 16777216.0f));
    }
    const uint32_t mant = ax & 0x7fffff, rest = mant & 0x1fff;
    uint32_t h = ((((ax >> 23) - 127 + 15) << 10) | (mant >> 13));
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;  /* a carry into the exponent is the right result */
    return (uint16_t)(sign | h);
}

/* out = gelu(gate) * up, tanh-GELU: 0.5 g (1 + tanh(y)), y = sqrt(2/pi) (g + 0.044715 g^3), tanh from e^(-2|y|) <= 1
   (the range exp8 serves); an element's number never depends on the others */
static void gelu_gate(const float *gate, const float *up, float *out, int len) {
    int j = 0;
#if SPECDECODE_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
    for (; j + 8 <= len; j += 8) {
        const __m256 g = _mm256_loadu_ps(gate + j);
        const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608f),
                                       _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f),
                                                                      _mm256_mul_ps(g, _mm256_mul_ps(g, g)))));
        const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(sign, y)));
        const __m256 t = _mm256_or_ps(_mm256_and_ps(sign, y), _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, t)),
                                                _mm256_loadu_ps(up + j)));
    }
#endif
    for (; j < len; j++) {
        const float g = gate[j], y = 0.7978845608f * (g + 0.044715f * (g * (g * g)));
        const float e = expf(-2.0f * fabsf(y)), t = copysignf((1.0f - e) / (1.0f + e), y);
        out[j] = ((0.5f * g) * (1.0f + t)) * up[j];
    }
}

/* The RoPE table of one attention type (Gemma: sliding or full), a row per token of the call */
typedef struct {
    const float *cos, *sin; /* [n, hd] */
} View;

/* One sequence's tokens in the call (a batch's row): tokens first..first+n, cached after `start` in the row whose
   keys start kv_offset floats after the layer's, seen through masks[view] / full_masks[view] (see
   specdecode_attention; index: the layer's View) */
typedef struct {
    int first, n, start;
    int64_t kv_offset;
    const uint8_t *masks[2], *full_masks[2];
    const int32_t *table;  /* NULL: the row's [kv_heads, max_len, head_dim] at kv_offset; else its block table */
} Span;

typedef struct {
    const float *attn_norm, *mlp_norm;
    float eps;
    const Weight *wqkv, *wo, *w13, *w2;
    const float *q_norm, *k_norm;              /* Gemma: RMSNorm over each head's queries and keys, or NULL */
    const float *post_attn_norm, *post_mlp_norm; /* Gemma: on the attention's and the MLP's outputs, or NULL */
    int gelu;                                  /* the MLP gate: 0 silu (SwiGLU), 1 tanh-GELU (GeGLU) */
    int view;                                  /* index of the layer's View (Gemma: sliding or full) */
    int wide;                                  /* 1: q/k/v read the call's wide rows [n, wqkv->n_in], normed by the
                                                  caller (EAGLE-3's token embedding | feature), not rmsnorm(x) */
} Layer;

/* A step's working memory, allocated once for all its layers */
typedef struct {
    float *xn, *big, *att, *scratch, *out;
} Scratch;

static void add_output(float *x, float *out, const float *norm, float eps, int n, int H) {
    if (norm) rmsnorm(out, norm, eps, n, H, out);  /* in place: each row's sum is taken before it is written */
    for (int64_t j = 0; j < (int64_t)n * H; j++) x[j] += out[j];
}

#define GATE_PARTS 4

/* One layer on the n tokens of every span: the norms, matmuls and activations over all of them at once (each token's
   numbers independent of the others), RoPE, the cache writes and the attention span by span */
/* row (hd floats) into element `at` of a cache block: float32; float16 rounded to nearest even (as PyTorch's
   conversion rounds, so both paths store the same bits); or int8, as models/cache.py's store_rows computes it
   (attention_int8.c's quantization, which the queries meet the keys with: scale = max |x| / 127, q = x / scale
   rounded to nearest even, IEEE division and rounding: the same bits; all 0 with scale 0 where the row is zeros) */
static void store_kv(void *base, int64_t at, const float *row, int hd, int kind) {
    if (kind == KV_F32) {
        memcpy((float *)base + at, row, sizeof(float) * hd);
        return;
    }
    if (kind == KV_I8) {  /* the row's values, zeros to its padding, its scale */
        int8_t *out = (int8_t *)base + at;
        const int rs = kv_row(hd, KV_I8);
        memset(out + hd, 0, (size_t)(rs - 4 - hd));
        const float scale = attention_quantize_row(row, hd, out);
        memcpy(out + rs - 4, &scale, sizeof scale);
        return;
    }
    uint16_t *out = (uint16_t *)base + at;
    int e = 0;
#if SPECDECODE_AVX2
    for (; e + 8 <= hd; e += 8)
        _mm_storeu_si128((__m128i *)(out + e), _mm256_cvtps_ph(_mm256_loadu_ps(row + e), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; e < hd; e++) out[e] = float_to_half(row[e]);
}

static int block(float *x, const float *wide, int n, int H, const Layer *l, const View *v, const Span *spans,
                 int n_spans, void *k_layer, void *v_layer, int kv_kind, int max_len, int n_heads, int n_kv, int hd,
                 int inter, float scale, const Scratch *s, int64_t bstride) {
    int shift = 0;
    while ((1 << shift) < max_len) shift++;
    const int64_t esize = kv_esize(kv_kind), rs = kv_row(hd, kv_kind);
    const int q_dim = n_heads * hd, kv_dim = n_kv * hd, qkv_dim = q_dim + 2 * kv_dim;

    /* attention */
    if (!l->wide) rmsnorm(x, l->attn_norm, l->eps, n, H, s->xn);
    if (linear(l->wqkv, l->wide ? wide : s->xn, n, s->big, s->scratch)) return 1;
    for (int r = 0; r < n_spans; r++) {
        const Span *sp = spans + r;
        void *k_cache = (char *)k_layer + sp->kv_offset * (int64_t)esize;
        void *v_cache = (char *)v_layer + sp->kv_offset * (int64_t)esize;
        const Rows rows0 = {sp->table, bstride, 0, shift};
        for (int i = 0; i < sp->n; i++) {
            const int t = sp->first + i;
            float *row = s->big + (int64_t)t * qkv_dim;
            const float *c = v->cos + (int64_t)t * hd, *sn = v->sin + (int64_t)t * hd;
            if (l->q_norm) {
                rmsnorm(row, l->q_norm, l->eps, n_heads, hd, row);
                rmsnorm(row + q_dim, l->k_norm, l->eps, n_kv, hd, row + q_dim);
            }
            for (int h = 0; h < n_heads; h++) rope(row + h * hd, c, sn, hd);
            for (int g = 0; g < n_kv; g++) {
                float *k = row + q_dim + g * hd;
                rope(k, c, sn, hd);
                const int64_t at = (int64_t)g * max_len * rs + row_at(&rows0, sp->start + i, rs);
                store_kv(k_cache, at, k, hd, kv_kind);
                store_kv(v_cache, at, row + q_dim + kv_dim + g * hd, hd, kv_kind);
            }
        }
        if (specdecode_attention_rows(s->big + (int64_t)sp->first * qkv_dim, qkv_dim, s->att + (int64_t)sp->first * q_dim, q_dim,
                      k_cache, v_cache, max_len, sp->start, sp->n, sp->masks[l->view], sp->full_masks[l->view],
                      n_heads, n_kv, hd, scale, kv_kind, sp->table, bstride))
            return 1;
    }
    if (linear(l->wo, s->att, n, s->out, s->scratch)) return 1;
    add_output(x, s->out, l->post_attn_norm, l->eps, n, H);

    /* MLP */
    rmsnorm(x, l->mlp_norm, l->eps, n, H, s->xn);
    if (linear(l->w13, s->xn, n, s->big, s->scratch)) return 1;
    /* the gate shared out among the threads in GATE_PARTS parts a token (a verification's gates, an expf each, took
       8% of its time on one thread while the other waited); a part starts at a multiple of 8 and the last ends the
       row, so every element is computed by the same instructions as in one pass over the row */
    const int part = (inter / GATE_PARTS) & ~7;
#pragma omp parallel for schedule(static) if (n > 1)
    for (int task = 0; task < n * GATE_PARTS; task++) {
        const int i = task / GATE_PARTS, j0 = (task % GATE_PARTS) * part;
        const int j1 = task % GATE_PARTS == GATE_PARTS - 1 ? inter : j0 + part;
        const float *gate = s->big + (int64_t)i * 2 * inter, *up = gate + inter;
        float *hmid = s->xn + (int64_t)i * inter;
        if (l->gelu) gelu_gate(gate + j0, up + j0, hmid + j0, j1 - j0);
        else
            for (int j = j0; j < j1; j++) hmid[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
    }
    if (linear(l->w2, s->xn, n, s->out, s->scratch)) return 1;
    add_output(x, s->out, l->post_mlp_norm, l->eps, n, H);
    return 0;
}

/* The model's last norm and output layer, run after the blocks on rows first..first+n of x into logits [n, n_out]
   (a forward's logits in the same call: their PyTorch operators came after the blocks had evicted their code from
   the caches) */
typedef struct {
    const float *norm;
    float eps;
    const Weight *w;
    int first, n;
    float *logits;
    int32_t *argmax; /* or NULL: each row's greedy token, read while its logits are in the cache */
} Output;

/* The index of the first maximum of x[0..len), a NaN counting as the maximum (its first one): NumPy's argmax, and
   torch.argmax's. Right after the output layer, from the cache (a greedy step's NumPy argmax read the row cold). */
int specdecode_argmax(const float *x, int len) {
    int j = 0, best_at = 0;
    float best = len > 0 ? x[0] : 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    if (len >= 16) {
        /* lane t keeps the first maximum among x[t], x[t + 8], ...: a later index replaces it only when greater */
        __m256 top = _mm256_loadu_ps(x), nan = _mm256_cmp_ps(top, top, _CMP_UNORD_Q);
        __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i index = at;
        const __m256i eight = _mm256_set1_epi32(8);
        for (j = 8; j + 8 <= len; j += 8) {
            const __m256 v = _mm256_loadu_ps(x + j);
            index = _mm256_add_epi32(index, eight);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            const __m256 greater = _mm256_cmp_ps(v, top, _CMP_GT_OQ);
            top = _mm256_blendv_ps(top, v, greater);
            at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(index), greater));
        }
        if (_mm256_movemask_ps(nan)) {  /* a NaN in the vector part: the first one wins, found in order */
            for (int i = 0; i < len; i++)
                if (x[i] != x[i]) return i;
        }
        float tops[8];
        int32_t ats[8];
        _mm256_storeu_ps(tops, top);
        _mm256_storeu_si256((__m256i *)ats, at);
        best = tops[0], best_at = ats[0];
        for (int t = 1; t < 8; t++)  /* the greatest; of equals, the first index */
            if (tops[t] > best || (tops[t] == best && ats[t] < best_at)) best = tops[t], best_at = ats[t];
    }
#endif
    for (; j < len; j++) {  /* the rest (all of a short row): no NaN came before j */
        if (x[j] != x[j]) return j;
        if (x[j] > best) best = x[j], best_at = j;
    }
    return best_at;
}

/* A step's layers in one call: a ctypes call costs Python several microseconds, and one per layer was ~3% of a
   decode step. x [n, H]: the tokens of every span (one sequence, or each row of a batch: the same numbers as each
   alone). Layer i's keys start at kv + i * layer_stride (a span's row kv_offset elements further), its values
   v_offset elements after them (one [kv_heads, max_len, row] block per row, kv_kind KV_F32, KV_F16 or KV_I8:
   attention.h's kv_row gives a row's elements; a span with a block table: blocks of max_len rows, block_stride
   elements apart), and it reads views[layer.view]; scale: the attention scores' (Llama: hd^-0.5); states[i], where
   given (not NULL), receives x after layer i; output, where given, the logits of some rows (x itself stays the last
   block's output); wide: the q/k/v inputs of the layers that read their own (Layer.wide), [n, their wqkv's n_in],
   or NULL. Returns 1 when memory ran out. */
int specdecode_blocks(float *x, int n, int H, const Layer *layers, int n_layers, void *kv, int64_t layer_stride,
                      int64_t v_offset, int max_len, int kv_kind, const View *views, const Span *spans, int n_spans, int n_heads,
                      int n_kv, int hd, int inter, float scale, float *const *states, const Output *output,
                      int64_t block_stride, const float *wide) {
    const int q_dim = n_heads * hd, qkv_dim = q_dim + 2 * n_kv * hd;
    const int widest = qkv_dim > 2 * inter ? qkv_dim : 2 * inter;
    int widest_in = inter > H ? inter : H;  /* the widest input a matmul reads (its per-block sums: scratch) */
    for (int i = 0; i < n_layers; i++)
        if (layers[i].wide && layers[i].wqkv->n_in > widest_in) widest_in = layers[i].wqkv->n_in;
    Scratch s = {malloc(sizeof(float) * (size_t)n * (H > inter ? H : inter)), malloc(sizeof(float) * (size_t)n * widest),
                 malloc(sizeof(float) * (size_t)n * q_dim), malloc(sizeof(float) * (size_t)n * widest_in / 32 + 64),
                 malloc(sizeof(float) * (size_t)n * H)};
    int failed = !s.xn || !s.big || !s.att || !s.scratch || !s.out;
    for (int i = 0; i < n_layers; i++) failed |= layers[i].wide && !wide;
    for (int i = 0; i < n_layers && !failed; i++) {
        const int64_t esize = kv_esize(kv_kind);
        char *k = (char *)kv + (int64_t)i * layer_stride * esize;
        failed = block(x, wide, n, H, layers + i, views + layers[i].view, spans, n_spans, k,
                       k + v_offset * esize, kv_kind, max_len, n_heads, n_kv, hd, inter, scale, &s,
                       block_stride);
        if (!failed && states && states[i]) memcpy(states[i], x, sizeof(float) * (size_t)n * H);
    }
    if (!failed && output && output->n > 0) {
        rmsnorm(x + (int64_t)output->first * H, output->norm, output->eps, output->n, H, s.xn);
        failed = linear(output->w, s.xn, output->n, output->logits, s.scratch);
        if (!failed && output->argmax)
            for (int r = 0; r < output->n; r++)
                output->argmax[r] = specdecode_argmax(output->logits + (int64_t)r * output->w->n_out, output->w->n_out);
    }
    free(s.xn); free(s.big); free(s.att); free(s.scratch); free(s.out);
    return failed;
}
