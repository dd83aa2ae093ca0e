/* The kernels' entries for ctypes: one struct of arguments each (qk_calls.h), passed on field by
 * field to the positional functions that C callers use (qkernels.c, qk_rows.c). A call through
 * ctypes converts one pointer instead of a dozen or more arguments, and the struct's fields that do
 * not change between calls are written once by their owner (moeswarm/kernels/qk_*.py). */
#include <stdint.h>

#include "qk_calls.h"
#include "qk_dispatch.h"

int qk_matmul(int type, const void *w, int64_t rows, int64_t K, int64_t row_bytes, const float *x, int64_t n,
              int64_t ldx, float *y, int64_t ldy, int threads, int int8);
int qk_matmul_heads(int type, const void *w, int64_t heads, int64_t head_bytes, int64_t rows, int64_t K,
                    int64_t row_bytes, const float *x, int64_t n, int64_t ldx, float *y, int64_t ldy, int threads,
                    int int8);
int qk_expert(int gate_type, const void *gate, int up_type, const void *up, int down_type, const void *down,
              int64_t H, int64_t I, const float *x, int64_t n, int64_t ldx, const float *gate_bias,
              const float *up_bias, const float *down_bias, int activation, float alpha, float limit, float *out,
              int64_t ldo, int threads, int int8);
int qk_experts(int64_t n_experts, const int64_t *gate, const int64_t *up, const int64_t *down, int gate_type,
               int up_type, int down_type, int64_t H, int64_t I, const float *hidden, int64_t S, int64_t ldx,
               const int64_t *index, int64_t k, const float *weights, const float *gate_bias, const float *up_bias,
               const float *down_bias, int activation, float alpha, float limit, float *final, int threads, int int8);
void qk_rope(const float *x, const int64_t *xs, float *out, const int64_t *os, int64_t B, int64_t H, int64_t T,
             int64_t D, const float *cos, const float *sin);
void qk_attend_one(const float *q, const int64_t *qs, const float *k, const int64_t *ks, const float *v,
                   const int64_t *vs, int64_t B, int64_t Hq, int64_t Hkv, int64_t p, int64_t D, int64_t Dv,
                   float scale, float *out, float *scratch, int threads);
void qk_attend_one_h(const float *q, const int64_t *qs, const _Float16 *k, const int64_t *ks, const _Float16 *v,
                     const int64_t *vs, int64_t B, int64_t Hq, int64_t Hkv, int64_t p, int64_t D, int64_t Dv,
                     float scale, float *out, float *scratch, int threads);

int qk_matmul_call(const QkMatmul *c) {
    return qk_matmul((int)c->type, c->w, c->rows, c->K, c->row_bytes, c->x, c->n, c->ldx, c->y, c->ldy,
                     (int)c->threads, (int)c->int8);
}

int qk_matmul_heads_call(const QkMatmulHeads *c) {
    return qk_matmul_heads((int)c->type, c->w, c->heads, c->head_bytes, c->rows, c->K, c->row_bytes, c->x, c->n,
                           c->ldx, c->y, c->ldy, (int)c->threads, (int)c->int8);
}

int qk_expert_call(const QkExpert *c) {
    return qk_expert((int)c->gate_type, c->gate, (int)c->up_type, c->up, (int)c->down_type, c->down, c->H, c->I,
                     c->x, c->n, c->ldx, c->gate_bias, c->up_bias, c->down_bias, (int)c->activation, c->alpha,
                     c->limit, c->out, c->ldo, (int)c->threads, (int)c->int8);
}

int qk_experts_call(const QkExperts *c) {
    const QkExpertSet *e = c->set;
    return qk_experts(e->n_experts, e->gate, e->up, e->down, (int)e->gate_type, (int)e->up_type, (int)e->down_type,
                      e->H, e->I, c->hidden, c->S, c->ldx, c->index, c->k, c->weights, e->gate_bias, e->up_bias,
                      e->down_bias, (int)e->activation, e->alpha, e->limit, c->final, (int)c->threads, (int)c->int8);
}

int qk_dispatch_sums_call(const QkDispatch *c) {
    const QkExpertSet *e = c->set;
    return qk_dispatch_sums(e->n_experts, e->gate, e->up, e->down, (int)e->gate_type, (int)e->up_type,
                            (int)e->down_type, e->H, e->I, c->hidden, c->S, c->ids, (int)c->id_bytes, c->k, c->weights,
                            c->table, c->table_len, e->gate_bias, e->up_bias, e->down_bias, (int)e->activation,
                            e->alpha, e->limit, c->out, c->counts, (int)c->threads, (int)c->int8);
}

int qk_dispatch_rows_call(const QkDispatch *c) {
    const QkExpertSet *e = c->set;
    return qk_dispatch_rows(e->n_experts, e->gate, e->up, e->down, (int)e->gate_type, (int)e->up_type,
                            (int)e->down_type, e->H, e->I, c->hidden, c->S, c->ids, (int)c->id_bytes, c->k, c->weights,
                            c->table, c->table_len, e->gate_bias, e->up_bias, e->down_bias, (int)e->activation,
                            e->alpha, e->limit, c->out, c->out_rows, c->hit, c->counts, c->n_hit, (int)c->threads,
                            (int)c->int8);
}

void qk_rope_call(const QkRope *c) {
    const int64_t xs[3] = {c->xs0, c->xs1, c->xs2}, os[3] = {c->os0, c->os1, c->os2};
    qk_rope(c->x, xs, c->out, os, c->B, c->H, c->T, c->D, c->cos, c->sin);
}

void qk_attend_one_call(const QkAttend *c) {
    const int64_t qs[3] = {c->qs0, c->qs1, c->qs2}, ks[3] = {c->ks0, c->ks1, c->ks2}, vs[3] = {c->vs0, c->vs1, c->vs2};
    if (c->half)
        qk_attend_one_h(c->q, qs, c->k, ks, c->v, vs, c->B, c->Hq, c->Hkv, c->p, c->D, c->Dv, c->scale,
                        c->out, c->scratch, (int)c->threads);
    else
        qk_attend_one(c->q, qs, c->k, ks, c->v, vs, c->B, c->Hq, c->Hkv, c->p, c->D, c->Dv, c->scale, c->out,
                      c->scratch, (int)c->threads);
}
