/* The kernels' entries for ctypes (qk_calls.c): each takes one struct of its arguments, mirrored in
 * moeswarm/kernels/qk_mirrors.py and checked at load against the library's layout report
 * (qk_layout.c). Integers are int64_t and flags 0 or 1 so that the mirrors need no padding rules;
 * each entry passes its fields on to the positional C function of the same name without `_call`
 * (qkernels.c, qk_rows.c), which C callers use directly. */
#ifndef QK_CALLS_H
#define QK_CALLS_H

#include <stdint.h>

/* qk_matmul: y [n, rows] (row stride ldy) = x [n, K] (row stride ldx) times W^T, W [rows, row_bytes]
 * of `type`'s blocks. Every field but x, n, ldx, y and ldy is the weight's (kept per weight). */
typedef struct {
    int64_t type;
    const void *w;
    int64_t rows, K, row_bytes;
    const float *x;
    int64_t n, ldx;
    float *y;
    int64_t ldy, threads, int8;
} QkMatmul;

/* qk_matmul_heads: per head h < heads, y[:, h] = x[:, h] times W_h^T, W_h at w + h * head_bytes. */
typedef struct {
    int64_t type;
    const void *w;
    int64_t heads, head_bytes, rows, K, row_bytes;
    const float *x;
    int64_t n, ldx;
    float *y;
    int64_t ldy, threads, int8;
} QkMatmulHeads;

/* qk_expert: out [n, H] (row stride ldo) = one expert on x [n, H] (row stride ldx). */
typedef struct {
    int64_t gate_type;
    const void *gate;
    int64_t up_type;
    const void *up;
    int64_t down_type;
    const void *down;
    int64_t H, I;
    const float *x;
    int64_t n, ldx;
    const float *gate_bias, *up_bias, *down_bias;
    int64_t activation;
    float alpha, limit;
    float *out;
    int64_t ldo, threads, int8;
} QkExpert;

/* A layer's n_experts experts as qk_experts takes them (kernels/qk_experts.py ExpertsPlan: made once per plan):
 * each expert's matrices' addresses in gate, up, down [n_experts], one type per role, biases
 * [n_experts, I], [n_experts, I], [n_experts, H] or NULL. */
typedef struct {
    int64_t n_experts;
    const int64_t *gate, *up, *down;
    int64_t gate_type, up_type, down_type, H, I;
    const float *gate_bias, *up_bias, *down_bias;
    int64_t activation;
    float alpha, limit;
} QkExpertSet;

/* qk_experts: the set's experts on S rows hidden [S, H] (row stride ldx), routed by index [S, k]
 * with weights [S, k], summed into final [S, H] (zeros). */
typedef struct {
    const QkExpertSet *set;
    const float *hidden;
    int64_t S, ldx;
    const int64_t *index;
    int64_t k;
    const float *weights;
    float *final;
    int64_t threads, int8;
} QkExperts;

/* qk_dispatch_sums and qk_dispatch_rows: a DISPATCH's experts from its frame's bytes (hidden [S, H],
 * ids [S, k] of id_bytes each, weights [S, k] as they travel), ids mapped through table [table_len].
 * sums: out [S, H] the sums, counts [n_experts] the routed slots (hit, n_hit, out_rows unused).
 * rows: out [out_rows, H] the pairs' rows, hit and counts [n_experts] the hit experts and their rows'
 * counts, *n_hit how many. */
typedef struct {
    const QkExpertSet *set;
    const float *hidden;
    int64_t S;
    const void *ids;
    int64_t id_bytes, k;
    const void *weights;
    const int64_t *table;
    int64_t table_len;
    float *out;
    int64_t out_rows;
    int64_t *counts, *hit, *n_hit;
    int64_t threads, int8;
} QkDispatch;

/* qk_rope: out = x * cos + rotate_half(x) * sin, x and out [B, H, T, D] (the last dimension
 * contiguous) with the strides of their first three dimensions in xs0..xs2 and os0..os2 (scalars:
 * ctypes sets an array field far slower than three numbers), cos and sin [B, T, D]. */
typedef struct {
    const float *x;
    int64_t xs0, xs1, xs2;
    float *out;
    int64_t os0, os1, os2;
    int64_t B, H, T, D;
    const float *cos, *sin;
} QkRope;

/* qk_attend_one (half 0: k and v float32) and qk_attend_one_h (half 1: float16): one query's
 * attention per batch row, q [B, Hq, 1, D], k [B, Hkv, p, D], v [B, Hkv, p, Dv] (the strides of
 * their first three dimensions in qs0..qs2, ks0..ks2, vs0..vs2) -> out [B, 1, Hq, Dv]; scratch
 * [threads * p]. */
typedef struct {
    const float *q;
    int64_t qs0, qs1, qs2;
    const void *k;
    int64_t ks0, ks1, ks2;
    const void *v;
    int64_t vs0, vs1, vs2;
    int64_t B, Hq, Hkv, p, D, Dv;
    float scale;
    float *out, *scratch;
    int64_t threads, half;
} QkAttend;

int qk_matmul_call(const QkMatmul *c);
int qk_matmul_heads_call(const QkMatmulHeads *c);
int qk_expert_call(const QkExpert *c);
int qk_experts_call(const QkExperts *c);
int qk_dispatch_sums_call(const QkDispatch *c);
int qk_dispatch_rows_call(const QkDispatch *c);
void qk_rope_call(const QkRope *c);
void qk_attend_one_call(const QkAttend *c);

#endif
