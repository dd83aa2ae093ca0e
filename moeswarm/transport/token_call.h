/* The arguments of a decode step's layer call in C (token_call.c), one struct per function: mirrored
 * in moeswarm/transport/token_call.py and checked at load against tc_layout's report (native.h).
 * Integers are int64_t so that the mirrors need no padding rules. */
#ifndef TOKEN_CALL_H
#define TOKEN_CALL_H

#include <stdint.h>

/* tc_send: the template frame [len] sent on fd with request id rid, the token's x [d] float32 at
 * x_at, ids [k] at ids_at in id_bytes each (holder me's by owner [num_experts], the others -1) and
 * w [k] float32 at w_at; deadline: CLOCK_MONOTONIC seconds. */
typedef struct {
    int64_t fd;
    uint8_t *frame;
    int64_t len;
    uint64_t rid;
    int64_t x_at;
    const float *x;
    int64_t d, ids_at, id_bytes;
    const int64_t *ids;
    int64_t k;
    const int64_t *owner;
    int64_t num_experts, me, w_at;
    const float *w;
    double deadline;
} TcSend;

/* tc_take: request rid's RESULT from fd into buf [cap], checked against meta [meta_len] (timed: a
 * last "cpu_us" besides), its rows x d float32 added into out [d] (first: out = y + 0.0); info [3]
 * and top [1] what was read; doze, spin: how it waits (seconds); deadline as tc_send's. */
typedef struct {
    int64_t fd;
    uint64_t rid;
    uint8_t *buf;
    int64_t cap;
    const uint8_t *meta;
    int64_t meta_len, timed, rows, d, first;
    float *out;
    double deadline;
    int64_t *info;
    double *top;
    double doze, spin;
} TcTake;

int tc_send(const TcSend *call);
int64_t tc_take(const TcTake *call);

#endif
