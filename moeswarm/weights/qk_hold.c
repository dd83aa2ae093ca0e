/* A worker's connection held between a decode's DISPATCHes: read, answered and sent in C
 * (moeswarm/worker/hold.py).
 *
 * After the event loop answered a decode step's DISPATCH whole (qk_express.c), the next one on the
 * same connection comes a backbone's attention later. Through the event loop it costs the loop's
 * wake-up, the transport's read, the protocol's callbacks, the lane's lookup and the reply's send in
 * Python, each small step from caches the experts just swept: measured on a 2-core VM (OLMoE-shaped
 * Q4_K_M, one worker thread), 50-80 us from epoll's return to the experts and ~30 us from them to
 * the send. Here the loop's thread waits in ppoll on the connection and on the loop's own selector;
 * a frame that is one of the learned lanes' (its metadata bytes equal to the lane's, its payload of
 * the lane's size) is read, answered by qk_express_sums / qk_express_rows and sent, and the wait
 * goes on. Anything else ends the hold with nothing of it read: another ready descriptor of the
 * loop, bytes of another frame (the loop's reader takes them and checks everything it checks),
 * the wait's end. Between frames the kernels' helper threads rest (qk_pool.c), as they do whenever
 * the worker's runner is idle. A frame read whose answer the express entry declines (an id not held here) is
 * left whole in `in` for the loop's reader to take (the full path names the fault); a reply the
 * socket could not take whole is left for the loop to write (nothing else is written meanwhile).
 *
 * Frame header (wire/frames.py, little-endian): magic "MSWM", version u8 (2), opcode u8
 * (2: DISPATCH), flags u16, request id u64, meta_len u32, payload_len u32.
 */

#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>

#include "qk_express.h"
#include "qk_pool.h"

#define HEADER 24
#define PARTS_WAIT_NS 5000000 /* the longest a frame's later bytes may take once its first came */

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

enum {
    HOLD_WAITED = 0,   /* nothing came within the wait */
    HOLD_LOOP = 1,     /* the loop has something else to do (another descriptor, a signal) */
    HOLD_OTHER = 2,    /* the connection's next bytes are not a learned lane's frame: nothing of them read */
    HOLD_DECLINED = 3, /* a frame read and not answered: its bytes are in `in` (out->pending) */
    HOLD_FULL = 4,     /* the last reply partly sent: the rest from out->unsent_at */
    HOLD_CLOSED = 5,   /* the connection failed or ended: the loop finds out itself */
    HOLD_SPENT = 6,    /* the hold's time is up */
};

typedef struct {
    int64_t answered; /* frames read, answered and sent (a HOLD_FULL one's reply partly) */
    int64_t tokens;   /* their tokens */
    int64_t pending;  /* HOLD_DECLINED: the frame's bytes at in[0:pending] */
    int64_t unsent_at, unsent_len; /* HOLD_FULL: reply[unsent_at : unsent_at + unsent_len] */
} QkHoldOut;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static uint64_t get_le(const uint8_t *at, int bytes) {
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; i--) v = v << 8 | at[i];
    return v;
}

/* Bytes readable on fd now (0 on error). */
static int64_t readable(int fd) {
    int n = 0;
    return ioctl(fd, FIONREAD, &n) == 0 && n > 0 ? n : 0;
}

/* The lane of at most max_tokens whose frame starts with `head` (got bytes of it), or NULL (a lane
 * answered by the caller only where `answer` is given). */
static const QkHoldLane *lane_of(const QkHoldLane *lanes, int64_t n_lanes, int64_t max_tokens, QkHoldAnswer answer,
                                 const uint8_t *head, int64_t got) {
    if (got < HEADER || memcmp(head, "MSWM", 4) != 0 || head[4] != 2 || head[5] != 2) return NULL;
    int64_t meta_len = (int64_t)get_le(head + 16, 4), payload_len = (int64_t)get_le(head + 20, 4);
    if (got < HEADER + meta_len) return NULL;
    for (int64_t i = 0; i < n_lanes; i++) {
        const QkHoldLane *lane = &lanes[i];
        if (lane->meta_len == meta_len && lane->payload_len == payload_len && lane->tokens <= max_tokens &&
            (lane->lane != NULL || answer != NULL) &&
            memcmp(lane->meta, head + HEADER, (size_t)meta_len) == 0)
            return lane;
    }
    return NULL;
}

/* Serve fd (a non-blocking TCP socket, nothing unread in the loop's reader, nothing unsent) for up
 * to limit_s, waiting at most wait_s for each next frame, with the lanes of at most max_tokens;
 * loop_fd: the event loop's selector (its readiness ends the hold when fd has nothing). in
 * [in_cap]: room for the largest such lane's frame; reply [reply_cap]: for its RESULT; answer: the
 * caller's answer to a lane without a QkLane. Returns why it ended (HOLD_*), out: what it did. */
int64_t qk_hold(const QkHoldLane *lanes, int64_t n_lanes, int64_t max_tokens, int fd, int loop_fd, double wait_s,
                double limit_s, uint8_t *in, int64_t in_cap, uint8_t *reply, int64_t reply_cap, QkHoldAnswer answer,
                int threads, QkHoldOut *out) {
    memset(out, 0, sizeof *out);
    int64_t end = now_ns() + (int64_t)(limit_s * 1e9), wait_ns = (int64_t)(wait_s * 1e9);
    for (;;) {
        int64_t left = end - now_ns();
        if (left <= 0) return HOLD_SPENT;
        if (left > wait_ns) left = wait_ns;
        struct pollfd p[2] = {{fd, POLLIN, 0}, {loop_fd, POLLIN, 0}};
        struct timespec t = {(time_t)(left / 1000000000), (long)(left % 1000000000)};
        int ready = ppoll(p, 2, &t, NULL);
        if (ready < 0) return errno == EINTR ? HOLD_LOOP : HOLD_CLOSED;
        if (ready == 0) return HOLD_WAITED;
        int64_t avail = readable(fd);
        if (avail == 0) return p[0].revents ? HOLD_CLOSED : HOLD_LOOP;
        /* the frame's header and metadata: peeked, nothing read until it is whole and a lane's */
        ssize_t got = recv(fd, in, (size_t)(avail < in_cap ? avail : in_cap), MSG_PEEK | MSG_DONTWAIT);
        const QkHoldLane *lane = got > 0 ? lane_of(lanes, n_lanes, max_tokens, answer, in, got) : NULL;
        if (lane == NULL) return HOLD_OTHER;
        int64_t total = HEADER + lane->meta_len + lane->payload_len;
        if (total > in_cap) return HOLD_OTHER;
        int64_t parts_end = now_ns() + PARTS_WAIT_NS;
        while (avail < total) { /* a frame in several segments (a LAN): its rest is on its way */
            int64_t rest = parts_end - now_ns();
            if (rest <= 0) return HOLD_OTHER;
            struct pollfd q = {fd, POLLIN, 0};
            struct timespec r = {0, (long)rest};
            if (ppoll(&q, 1, &r, NULL) < 0 && errno != EINTR) return HOLD_CLOSED;
            int64_t more = readable(fd);
            if (more <= avail && (q.revents & (POLLERR | POLLHUP))) return HOLD_CLOSED;
            avail = more;
        }
        got = recv(fd, in, (size_t)total, MSG_DONTWAIT);
        if (got != total) { /* cannot happen with the bytes FIONREAD counted; if it does, the loop reads on */
            out->pending = got > 0 ? got : 0;
            return got > 0 ? HOLD_DECLINED : HOLD_CLOSED;
        }
        uint64_t rid = get_le(in + 8, 8);
        int64_t size = lane->lane == NULL ? answer(lane - lanes, in + HEADER, total - HEADER, rid, reply, reply_cap)
                       : lane->exact      ? qk_express_rows(lane->lane, in + HEADER, reply, reply_cap, rid, threads)
                                          : qk_express_sums(lane->lane, in + HEADER, reply, reply_cap, rid, threads);
        if (size < 0) {
            out->pending = total;
            return HOLD_DECLINED;
        }
        int64_t sent = 0;
        while (sent < size) {
            ssize_t n = send(fd, reply + sent, (size_t)(size - sent), MSG_DONTWAIT | MSG_NOSIGNAL);
            if (n > 0) {
                sent += n;
            } else if (n < 0 && errno == EINTR) {
                continue;
            } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                out->answered++, out->tokens += lane->tokens;
                out->unsent_at = sent, out->unsent_len = size - sent;
                return HOLD_FULL;
            } else {
                out->answered++, out->tokens += lane->tokens;
                return HOLD_CLOSED;
            }
        }
        out->answered++, out->tokens += lane->tokens;
        qk_pool_rest(); /* the kernels' helpers sleep while this thread waits (as the runner's idle does) */
    }
}
