/* A DISPATCH lane's constants and the entries that answer one whole (qk_express.c), for the
 * connection hold that reads, answers and sends decode steps' DISPATCHes itself (qk_hold.c). */
#ifndef QK_EXPRESS_H
#define QK_EXPRESS_H

#include <stdint.h>

#include "qk_calls.h"

typedef struct {
    const QkExpertSet *set; /* the experts (kernels/qk_experts.py ExpertsPlan.set, kept alive with the lane) */
    /* the DISPATCH: its tokens, top-k, ids' width and where x, ids and w lie in its payload */
    int64_t tokens, k, id_bytes, hidden_at, ids_at, weights_at;
    const int64_t *table; /* [table_len]: the store's ids table for the layer */
    int64_t table_len;
    /* scratch: partial: each expert's routed slots [n_experts], the sums [tokens, H]; exact: the hit
     * experts [n_experts] and their rows' counts [n_experts], the pairs' rows [tokens k, H] (aligned) */
    int64_t *counts;
    float *sums;
    /* partial: the RESULT's metadata bytes (timed: all but the value of its last key, "cpu_us");
     * exact: its bytes up to the output tensor's row count */
    const uint8_t *meta;
    int64_t meta_len, timed;
    int64_t *hit;
    int64_t first; /* exact: the id of the module's expert 0 */
    /* [n_experts] or NULL: rows each module expert computed, added to by every answer (the worker's
     * measured load, worker/served.py) */
    int64_t *served;
} QkLane;

int64_t qk_express_sums(const QkLane *lane, const uint8_t *payload, uint8_t *reply, int64_t cap, uint64_t rid,
                        int threads);
int64_t qk_express_rows(const QkLane *lane, const uint8_t *payload, uint8_t *reply, int64_t cap, uint64_t rid,
                        int threads);

#endif
