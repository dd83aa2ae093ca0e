/* A DISPATCH answered in one call, its RESULT frame included (moeswarm/worker/quant_lane.py).
 *
 * The worker's express lane computes a DISPATCH whose metadata bytes it has answered before from
 * the frame's bytes (qk_dispatch_sums, qk_dispatch_rows). These entries do that and then write the
 * whole RESULT frame the full path would send: the header, the metadata as the full path packs it
 * (timed: "cpu_us", the experts' CPU microseconds on this thread, as its last key) and the
 * outputs. Partial: the metadata is the lane's bytes; exact: the lane's bytes up to the tensor's
 * row count, then the count, the hidden size, "experts" and "counts" (the hit experts ascending,
 * their rows), each int and array as msgpack packs them (the smallest form). Everything constant per lane
 * comes in one struct (QkLane, mirrored by ctypes), so a call passes five values: the Python
 * around a decode step's DISPATCH runs between kernels that sweep the caches, where each argument
 * it converts costs.
 *
 * The frame header, its constants and its writer: wire/frames.h.
 */

#include <stdint.h>
#include <string.h>
#include <time.h>

#include "frames.h"
#include "qk_express.h"

/* v as msgpack packs a non-negative int (the smallest form); its length. */
static int64_t pack_uint(uint8_t *at, uint64_t v) {
    if (v < 0x80) {
        at[0] = (uint8_t)v;
        return 1;
    }
    int bytes = v < 0x100 ? 1 : v < 0x10000 ? 2 : v < 0x100000000ull ? 4 : 8;
    at[0] = (uint8_t)(bytes == 1 ? 0xcc : bytes == 2 ? 0xcd : bytes == 4 ? 0xce : 0xcf);
    for (int i = 0; i < bytes; i++) at[1 + i] = (uint8_t)(v >> (8 * (bytes - 1 - i)));  /* big-endian */
    return 1 + bytes;
}

/* An array header of n items as msgpack packs it; its length. */
static int64_t pack_array(uint8_t *at, int64_t n) {
    if (n < 16) {
        at[0] = (uint8_t)(0x90 | n);
        return 1;
    }
    at[0] = 0xdc, at[1] = (uint8_t)(n >> 8), at[2] = (uint8_t)n;  /* n < 65536: rows of one DISPATCH */
    return 3;
}

static int64_t thread_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);  /* Python's time.thread_time() */
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* The RESULT frame answering request `rid`, whose payload (x, ids, w as the lane says) is at
 * `payload`, into reply [cap]: its length, or below zero with nothing to send (-3: an id not held
 * here or no slot routed, the full path names the fault; -2: reply too small; else
 * qk_dispatch_sums's failure). */
int64_t qk_express_sums(const QkLane *lane, const uint8_t *payload, uint8_t *reply, int64_t cap, uint64_t rid,
                        int threads) {
    int64_t values = lane->tokens * lane->set->H, body = values * (int64_t)sizeof(float);
    int64_t meta_room = lane->meta_len + (lane->timed ? 9 : 0);
    if (cap < MSW_HEADER_SIZE + meta_room + body) return -2;
    int64_t started = lane->timed ? thread_ns() : 0;
    memset(lane->sums, 0, (size_t)body);
    QkDispatch call = {lane->set, (const float *)(payload + lane->hidden_at), lane->tokens, payload + lane->ids_at,
                       lane->id_bytes, lane->k, payload + lane->weights_at, lane->table, lane->table_len, lane->sums,
                       0, lane->counts, NULL, NULL, threads, 1};
    int status = qk_dispatch_sums_call(&call);
    if (status != 0) return status < 0 ? status : -status;
    if (lane->served)
        for (int64_t i = 0; i < lane->set->n_experts; i++) lane->served[i] += lane->counts[i];
    uint8_t *meta = reply + MSW_HEADER_SIZE;
    memcpy(meta, lane->meta, (size_t)lane->meta_len);
    int64_t meta_len = lane->meta_len;
    if (lane->timed) meta_len += pack_uint(meta + meta_len, (uint64_t)((thread_ns() - started) / 1000));
    msw_put_header(reply, MSW_OP_RESULT, rid, (uint64_t)meta_len, (uint64_t)body);
    memcpy(meta + meta_len, lane->sums, (size_t)body);
    return MSW_HEADER_SIZE + meta_len + body;
}

/* The RESULT frame answering the exact DISPATCH at `payload` (as qk_express_sums): the routed
 * pairs' rows w * E(x), experts ascending, each slot-major then token (qk_dispatch_rows), under
 * the metadata the full path packs for them. cap must hold MSW_HEADER_SIZE + meta_len + 40 + 18 tokens k +
 * 4 tokens k H bytes. Its length, or below zero as qk_express_sums. */
int64_t qk_express_rows(const QkLane *lane, const uint8_t *payload, uint8_t *reply, int64_t cap, uint64_t rid,
                        int threads) {
    int64_t pairs = lane->tokens * lane->k, n_hit = 0;
    if (cap < MSW_HEADER_SIZE + lane->meta_len + 40 + 18 * pairs + pairs * lane->set->H * (int64_t)sizeof(float)) return -2;
    int64_t started = lane->timed ? thread_ns() : 0;
    memset(lane->sums, 0, (size_t)(pairs * lane->set->H) * sizeof(float));
    QkDispatch call = {lane->set, (const float *)(payload + lane->hidden_at), lane->tokens, payload + lane->ids_at,
                       lane->id_bytes, lane->k, payload + lane->weights_at, lane->table, lane->table_len, lane->sums,
                       pairs, lane->counts, lane->hit, &n_hit, threads, 1};
    int status = qk_dispatch_rows_call(&call);
    if (status != 0) return status < 0 ? status : -status;
    int64_t rows = 0;
    for (int64_t i = 0; i < n_hit; i++) rows += lane->counts[i];
    if (lane->served)
        for (int64_t i = 0; i < n_hit; i++) lane->served[lane->hit[i]] += lane->counts[i];
    uint8_t *meta = reply + MSW_HEADER_SIZE, *at = meta;
    memcpy(at, lane->meta, (size_t)lane->meta_len);
    at += lane->meta_len;
    at += pack_uint(at, (uint64_t)rows);
    at += pack_uint(at, (uint64_t)lane->set->H);
    static const uint8_t experts[8] = {0xa7, 'e', 'x', 'p', 'e', 'r', 't', 's'};
    static const uint8_t counts[7] = {0xa6, 'c', 'o', 'u', 'n', 't', 's'};
    memcpy(at, experts, sizeof experts);
    at += sizeof experts;
    at += pack_array(at, n_hit);
    for (int64_t i = 0; i < n_hit; i++) at += pack_uint(at, (uint64_t)(lane->first + lane->hit[i]));
    memcpy(at, counts, sizeof counts);
    at += sizeof counts;
    at += pack_array(at, n_hit);
    for (int64_t i = 0; i < n_hit; i++) at += pack_uint(at, (uint64_t)lane->counts[i]);
    if (lane->timed) {
        static const uint8_t key[7] = {0xa6, 'c', 'p', 'u', '_', 'u', 's'};
        int64_t cpu_us = (thread_ns() - started) / 1000;
        memcpy(at, key, sizeof key);
        at += sizeof key;
        at += pack_uint(at, (uint64_t)cpu_us);
    }
    int64_t meta_len = at - meta, body = rows * lane->set->H * (int64_t)sizeof(float);
    msw_put_header(reply, MSW_OP_RESULT, rid, (uint64_t)meta_len, (uint64_t)body);
    memcpy(at, lane->sums, (size_t)body);
    return MSW_HEADER_SIZE + meta_len + body;
}
