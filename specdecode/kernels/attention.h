/* The attention over a layer's KV cache (attention.c), as the blocks (block.c) call it, and where a cache row lies. */

#ifndef SPECDECODE_ATTENTION_H
#define SPECDECODE_ATTENTION_H

#include <stdint.h>
#include <string.h>

/* A cache row's elements (kv_kind): float32, float16, or int8 (the row's values padded to a multiple of 4, then the
   row's float32 scale: value e is q_e * scale, q_e in -127..127). One tensor keeps a row's numbers together, so
   copying, paging and gathering rows need not know the kind. */
enum { KV_F32 = 0, KV_F16 = 1, KV_I8 = 2 };

/* elements (of the kind's size) from one row to the next */
static inline int kv_row(int hd, int kind) { return kind == KV_I8 ? ((hd + 3) & ~3) + 4 : hd; }

static inline int kv_esize(int kind) { return kind == KV_F32 ? 4 : kind == KV_F16 ? 2 : 1; }

/* the scale of the int8 row starting at element `row` of base (rows rs elements apart) */
static inline float kv_scale(const void *base, int64_t row, int rs) {
    float s;
    memcpy(&s, (const int8_t *)base + row + rs - 4, sizeof s);
    return s;
}

/* Where a sequence's key (or value) rows lie for one kv head: contiguous (table NULL: row j at head + j * rs, rs the
   elements of a row), or paged (row j in block table[j >> shift], `bstride` elements apart, at head + (j & mask) * rs
   within it; blocks hold a power of two >= 8 rows, so the 8 rows a group of keys reads are contiguous) */
typedef struct {
    const int32_t *table;
    int64_t bstride, head;
    int shift;
} Rows;

static inline int64_t row_at(const Rows *r, int j, int rs) {
    if (!r->table) return r->head + (int64_t)j * rs;
    return (int64_t)r->table[j >> r->shift] * r->bstride + r->head + (int64_t)(j & ((1 << r->shift) - 1)) * rs;
}

/* Key (or value) rows a pass reads PREFETCH_KEYS keys ahead are asked for now: a key's row is loaded 16 or 32 bytes
   at a time across the heads' loops, and those loads otherwise wait on the cache, which the hardware's prefetchers
   fill too late for passes of a few dozen keys (`bytes` bytes from `first` on) */
#define PREFETCH_KEYS 32
static inline void prefetch_bytes(const void *first, int bytes) {
    for (int line = 0; line < bytes; line += 64) __builtin_prefetch((const char *)first + line, 0, 3);
}

/* attention_int8.c: hd floats quantized as an int8 row is (a key, a value, a query head; out: hd bytes; returns the
   scale), and `heads` quantized query heads' scores over int8 keys j0..j1 (rows of q8 hd bytes apart, their scales
   qscales; head h's p[h * p_stride + j]; keys past a contiguous cache's max_len score 0) */
float attention_quantize_row(const float *q, int hd, int8_t *out);
void attention_int8_scores(const int8_t *q8, const float *qscales, int heads, const void *keys, const Rows *rows,
                           int max_len, int hd, float scale, float *p, size_t p_stride, int j0, int j1);

/* Attention of n new queries over the layer's cache (see attention.c); table NULL: each kv head's rows contiguous.
   Returns 1 when scratch memory ran out. */
int specdecode_attention_rows(const float *qs, int q_stride, float *att, int att_stride, const void *k_cache,
                              const void *v_cache, int max_len, int start, int n, const uint8_t *mask,
                              const uint8_t *full_mask, int n_heads, int n_kv, int hd, float scale, int kv_kind,
                              const int32_t *table, int64_t bstride);

#endif
