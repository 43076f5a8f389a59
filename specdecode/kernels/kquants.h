/* The K-quant kinds of the int8-activation kernel (specdecode_a8_matmul), run by kquants.c. */

#ifndef SPECDECODE_KQUANTS_H
#define SPECDECODE_KQUANTS_H

#include <stdint.h>

#define QK_K 256 /* weights per super-block */

/* Q4_K, Q5_K, Q6_K, Q5_1, Q3_K, IQ4_XS in tiles of 8 outputs; K_WIDE + 0..5: the same in tiles of 16 */
enum { K_Q4 = 11, K_Q5 = 12, K_Q6 = 13, K_Q51 = 14, K_Q3 = 15, K_IQ4 = 16, K_WIDE = 21 };

/* y[M, N] from the rows' int8 blocks (qx, dx, sx as a8matmul.c rounds them; s16: each row's sums of qx per 16,
   read by Q6_K) and the weights in QuantLinear's K-quant tiles (see kquants.c) */
void specdecode_k_matmul(int kind, const int8_t *xq, const float *dx, const float *sx, const int32_t *s16, int M,
                         int K, const void *qs, const void *d, const void *m, float *y, int N);

#endif
