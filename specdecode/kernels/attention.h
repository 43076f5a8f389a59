/* The attention over a layer's KV cache (attention.c), as the blocks (block.c) call it, and where a cache row lies. */

#ifndef SPECDECODE_ATTENTION_H
#define SPECDECODE_ATTENTION_H

#include <stdint.h>

/* Where a sequence's key (or value) rows lie for one kv head: contiguous (table NULL: row j at head + j * hd), or
   paged (row j in block table[j >> shift], `bstride` elements apart, at head + (j & mask) * hd within it; blocks hold
   a power of two >= 8 rows, so the 8 rows a group of keys reads are contiguous) */
typedef struct {
    const int32_t *table;
    int64_t bstride, head;
    int shift;
} Rows;

static inline int64_t row_at(const Rows *r, int j, int hd) {
    if (!r->table) return r->head + (int64_t)j * hd;
    return (int64_t)r->table[j >> r->shift] * r->bstride + r->head + (int64_t)(j & ((1 << r->shift) - 1)) * hd;
}

/* Attention of n new queries over the layer's cache (see attention.c); table NULL: each kv head's rows contiguous.
   Returns 1 when scratch memory ran out. */
int specdecode_attention_rows(const float *qs, int q_stride, float *att, int att_stride, const void *k_cache,
                              const void *v_cache, int max_len, int start, int n, const uint8_t *mask,
                              const uint8_t *full_mask, int n_heads, int n_kv, int hd, float scale, int kv_half,
                              const int32_t *table, int64_t bstride);

#endif
