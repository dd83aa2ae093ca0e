/* A worker's connection held between a decode's DISPATCHes (qk_hold.c): the structs Python fills
 * and reads (mirrored in moeswarm/kernels/qk_mirrors.py, checked at load: qk_layout.c). */
#ifndef QK_HOLD_H
#define QK_HOLD_H

#include <stdint.h>

#include "qk_express.h"

typedef struct {
    const uint8_t *meta; /* a DISPATCH's metadata bytes, as the lane was learned from */
    int64_t meta_len, payload_len;
    const QkLane *lane; /* NULL: answered by the caller's `answer` (float experts: a torch module) */
    int64_t exact;      /* 1: qk_express_rows; 0: qk_express_sums */
    int64_t tokens;     /* the DISPATCH's */
} QkHoldLane;

/* The RESULT frame answering the DISPATCH of lane `index` (its frame's body, body_len bytes, request
 * rid) into reply [cap]: its length, or below zero where declined. */
typedef int64_t (*QkHoldAnswer)(int64_t index, const uint8_t *body, int64_t body_len, uint64_t rid, uint8_t *reply,
                                int64_t cap);

typedef struct {
    int64_t answered; /* frames read, answered and sent (a HOLD_FULL one's reply partly) */
    int64_t tokens;   /* their tokens */
    int64_t pending;  /* HOLD_DECLINED: the frame's bytes at in[0:pending] */
    int64_t unsent_at, unsent_len; /* HOLD_FULL: reply[unsent_at : unsent_at + unsent_len] */
} QkHoldOut;

/* qk_hold's arguments: serve fd (a non-blocking TCP socket) for up to limit_s, waiting at most wait_s
 * for each next frame, with lanes [n_lanes] of at most max_tokens; loop_fd: the event loop's
 * selector; in [in_cap]: room for the largest lane's frame; reply [reply_cap]: for its RESULT;
 * answer: the caller's answer to a lane without a QkLane; out: what the hold did. */
typedef struct {
    const QkHoldLane *lanes;
    int64_t n_lanes, max_tokens, fd, loop_fd;
    double wait_s, limit_s;
    uint8_t *in;
    int64_t in_cap;
    uint8_t *reply;
    int64_t reply_cap;
    QkHoldAnswer answer;
    int64_t threads;
    QkHoldOut *out;
} QkHold;

/* Why it ended (HOLD_* in qk_hold.c; worker/hold.py's outcomes); call->out: what it did. */
int64_t qk_hold(const QkHold *call);

#endif
