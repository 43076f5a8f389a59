/* One Llama block for n new tokens of one sequence, in one call: the decode and verify step without PyTorch's
   per-operator cost (a 30-layer step issues ~900 small operators in PyTorch; here it is 30 calls).

   x [n, H] is the residual stream, updated in place:
     x += wo(attention(rope(q), rope(k), v over the cache and the new tokens))   (q|k|v = wqkv(rmsnorm(x)))
     x += w2(silu(gate) * up)                                                     (gate|up = w13(rmsnorm(x)))
   The new keys and values are written into the layer's cache at start..start+n. Who sees whom among the new
   tokens: a causal chain (mask NULL), a tree (mask [n, n], 1 where token i may attend to new token j), or any
   pattern over all keys (full_mask [n, start + n], for sliding windows). Every token's numbers come from the
   same operations in the same order whatever n is (see qmatmul.c), so a tree verifies bit for bit what
   one-token steps would compute.

   Numerics follow the PyTorch model (models/llama.py): RMSNorm in float32 with the weight applied after the
   normalisation, rotate-half RoPE from the given cos/sin tables, softmax with the max subtracted. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

enum { W_F32 = 0, W_Q4 = 1, W_Q8 = 2, W_Q4A8 = 3, W_Q8A8 = 4 };

typedef struct {
    int kind, n_out, n_in;
    const void *qs;       /* f32: the weight [n_out, n_in]; q4: nibbles; q8: int8 */
    const uint16_t *d, *m; /* block scales and mins (float16 bits) */
    const float *bias;     /* or NULL */
} Weight;

void specdecode_q4_matmul(const float *x, float *xsum, int M, int K, const uint8_t *qs, const uint16_t *d,
                          const uint16_t *m, float *y, int N);
void specdecode_q8_matmul(const float *x, int M, int K, const int8_t *qs, const uint16_t *d, float *y, int N);
void specdecode_f32_matmul(const float *x, int M, int K, const float *w, float *y, int N);
int specdecode_a8_matmul(int kind, const float *x, int M, int K, const void *qs, const uint16_t *d,
                         const uint16_t *m, float *y, int N);

static void linear(const Weight *w, const float *x, int M, float *y, float *scratch) {
    if (w->kind == W_Q4A8 || w->kind == W_Q8A8)
        specdecode_a8_matmul(w->kind == W_Q4A8 ? 1 : 2, x, M, w->n_in, w->qs, w->d, w->m, y, w->n_out);
    else if (w->kind == W_Q4)
        specdecode_q4_matmul(x, scratch, M, w->n_in, (const uint8_t *)w->qs, w->d, w->m, y, w->n_out);
    else if (w->kind == W_Q8)
        specdecode_q8_matmul(x, M, w->n_in, (const int8_t *)w->qs, w->d, y, w->n_out);
    else
        specdecode_f32_matmul(x, M, w->n_in, (const float *)w->qs, y, w->n_out);
    if (w->bias)
        for (int r = 0; r < M; r++)
            for (int j = 0; j < w->n_out; j++) y[(int64_t)r * w->n_out + j] += w->bias[j];
}

static inline float dot(const float *a, const float *b, int len) {
    int e = 0;
    float total = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; e + 8 <= len; e += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), _mm256_loadu_ps(b + e), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    total = _mm_cvtss_f32(s);
#endif
    for (; e < len; e++) total += a[e] * b[e];
    return total;
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

int specdecode_block(float *x, int n, int H, const float *attn_norm, const float *mlp_norm, float eps,
                     const Weight *wqkv, const Weight *wo, const Weight *w13, const Weight *w2,
                     float *k_cache, float *v_cache, int max_len, int start,
                     const float *cos, const float *sin, const uint8_t *mask, const uint8_t *full_mask,
                     int n_heads, int n_kv, int hd, int inter) {
    const int q_dim = n_heads * hd, kv_dim = n_kv * hd, qkv_dim = q_dim + 2 * kv_dim, L = start + n;
    const int widest = qkv_dim > 2 * inter ? qkv_dim : 2 * inter;
    float *xn = malloc(sizeof(float) * (size_t)n * (H > inter ? H : inter));
    float *big = malloc(sizeof(float) * (size_t)n * widest);
    float *att = malloc(sizeof(float) * (size_t)n * q_dim);
    float *scratch = malloc(sizeof(float) * (size_t)n * (inter > H ? inter : H) / 32 + 64);
    float *out = malloc(sizeof(float) * (size_t)n * H);
    if (!xn || !big || !att || !scratch || !out) {
        free(xn); free(big); free(att); free(scratch); free(out);
        return 1;
    }

    /* attention */
    rmsnorm(x, attn_norm, eps, n, H, xn);
    linear(wqkv, xn, n, big, scratch);
    for (int i = 0; i < n; i++) {
        float *row = big + (int64_t)i * qkv_dim;
        const float *c = cos + (int64_t)i * hd, *s = sin + (int64_t)i * hd;
        for (int h = 0; h < n_heads; h++) rope(row + h * hd, c, s, hd);
        for (int g = 0; g < n_kv; g++) {
            float *k = row + q_dim + g * hd;
            rope(k, c, s, hd);
            memcpy(k_cache + ((int64_t)g * max_len + start + i) * hd, k, sizeof(float) * hd);
            memcpy(v_cache + ((int64_t)g * max_len + start + i) * hd, row + q_dim + kv_dim + g * hd,
                   sizeof(float) * hd);
        }
    }
    const float scale = 1.0f / sqrtf((float)hd);
    const int group = n_heads / n_kv;
#pragma omp parallel
    {
        float *p = malloc(sizeof(float) * (size_t)L);
#pragma omp for schedule(static)
        for (int task = 0; task < n_heads * n; task++) {
            const int h = task / n, i = task % n, g = h / group;
            const float *q = big + (int64_t)i * qkv_dim + h * hd;
            const float *keys = k_cache + (int64_t)g * max_len * hd, *vals = v_cache + (int64_t)g * max_len * hd;
            float best = -INFINITY;
            for (int j = 0; j < L; j++) {
                int visible;
                if (full_mask) visible = full_mask[(int64_t)i * L + j];
                else if (j < start) visible = 1;
                else visible = mask ? mask[(int64_t)i * n + (j - start)] : (j - start <= i);
                if (!visible) { p[j] = -INFINITY; continue; }
                p[j] = dot(q, keys + (int64_t)j * hd, hd) * scale;
                if (p[j] > best) best = p[j];
            }
            float total = 0.0f;
            for (int j = 0; j < L; j++) {
                p[j] = p[j] == -INFINITY ? 0.0f : expf(p[j] - best);
                total += p[j];
            }
            float *o = att + (int64_t)i * q_dim + h * hd;
            for (int e = 0; e < hd; e++) o[e] = 0.0f;
            for (int j = 0; j < L; j++) {
                if (p[j] == 0.0f) continue;
                const float pj = p[j] / total, *vj = vals + (int64_t)j * hd;
                for (int e = 0; e < hd; e++) o[e] += pj * vj[e];
            }
        }
        free(p);
    }
    linear(wo, att, n, out, scratch);
    for (int64_t j = 0; j < (int64_t)n * H; j++) x[j] += out[j];

    /* MLP */
    rmsnorm(x, mlp_norm, eps, n, H, xn);
    linear(w13, xn, n, big, scratch);
    for (int i = 0; i < n; i++) {
        const float *gate = big + (int64_t)i * 2 * inter, *up = gate + inter;
        float *hmid = xn + (int64_t)i * inter;
        for (int j = 0; j < inter; j++) hmid[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
    }
    linear(w2, xn, n, out, scratch);
    for (int64_t j = 0; j < (int64_t)n * H; j++) x[j] += out[j];

    free(xn); free(big); free(att); free(scratch); free(out);
    return 0;
}
