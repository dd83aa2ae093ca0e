/* A DISPATCH's experts straight from its frame's bytes (moeswarm/kernels/qkernels.c), for the
 * entries that also write its RESULT frame (qk_express.c). */
#ifndef QK_DISPATCH_H
#define QK_DISPATCH_H

#include <stdint.h>

int qk_dispatch_sums(int64_t n_experts, const int64_t *gate, const int64_t *up, const int64_t *down,
                     int gate_type, int up_type, int down_type, int64_t H, int64_t I,
                     const float *hidden, int64_t S, const void *ids, int id_bytes, int64_t k, const void *weights,
                     const int64_t *table, int64_t table_len,
                     const float *gate_bias, const float *up_bias, const float *down_bias,
                     int activation, float alpha, float limit, float *final, int64_t *counts, int threads, int int8);

int qk_dispatch_rows(int64_t n_experts, const int64_t *gate, const int64_t *up, const int64_t *down,
                     int gate_type, int up_type, int down_type, int64_t H, int64_t I,
                     const float *hidden, int64_t S, const void *ids, int id_bytes, int64_t k, const void *weights,
                     const int64_t *table, int64_t table_len,
                     const float *gate_bias, const float *up_bias, const float *down_bias,
                     int activation, float alpha, float limit, float *rows, int64_t rows_cap,
                     int64_t *hit, int64_t *counts, int64_t *n_hit, int threads, int int8);

#endif
