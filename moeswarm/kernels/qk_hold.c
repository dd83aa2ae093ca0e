/* A worker's connection held between a decode's DISPATCHes: read, answered and sent in C
 * (moeswarm/worker/hold.py).
 *
 * After the event loop answered a decode step's DISPATCH whole (qk_express.c), the next one on the
 * same connection comes a backbone's attention later. Through the event loop it costs the loop's
 * wake-up, the transport's read, the protocol's callbacks, the lane's lookup and the reply's send in
 * Python, each small step from caches the experts just swept (figures: docs/measured.md, "hold").
 * Here the loop's thread waits in ppoll on the connection and on the loop's own selector;
 * a frame that is one of the learned lanes' (its metadata bytes equal to the lane's, its payload of
 * the lane's size) is read, answered by qk_express_sums / qk_express_rows and sent, and the wait
 * goes on. Anything else ends the hold with nothing of it read: another ready descriptor of the
 * loop, bytes of another frame (the loop's reader takes them and checks everything it checks),
 * the wait's end. Between frames the kernels' helper threads rest (qk_pool.c), as they do whenever
 * the worker's runner is idle. A frame read whose answer the express entry declines (an id not held here) is
 * left whole in `in` for the loop's reader to take (the full path names the fault); a reply the
 * socket could not take whole is left for the loop to write (nothing else is written meanwhile).
 *
 * The frame header and its constants: wire/frames.h. The structs Python fills: qk_hold.h.
 */

#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>

#include "frames.h"
#include "qk_express.h"
#include "qk_hold.h"
#include "qk_pool.h"

#define PARTS_WAIT_NS 5000000 /* the longest a frame's later bytes may take once its first came */

enum {
    HOLD_WAITED = 0,   /* nothing came within the wait */
    HOLD_LOOP = 1,     /* the loop has something else to do (another descriptor, a signal) */
    HOLD_OTHER = 2,    /* the connection's next bytes are not a learned lane's frame: nothing of them read */
    HOLD_DECLINED = 3, /* a frame read and not answered: its bytes are in `in` (out->pending) */
    HOLD_FULL = 4,     /* the last reply partly sent: the rest from out->unsent_at */
    HOLD_CLOSED = 5,   /* the connection failed or ended: the loop finds out itself */
    HOLD_SPENT = 6,    /* the hold's time is up */
};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
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
    if (got < MSW_HEADER_SIZE || !msw_is_header(head) || head[MSW_AT_OPCODE] != MSW_OP_DISPATCH) return NULL;
    int64_t meta_len = (int64_t)msw_get_le(head + MSW_AT_META_LEN, 4);
    int64_t payload_len = (int64_t)msw_get_le(head + MSW_AT_PAYLOAD_LEN, 4);
    if (got < MSW_HEADER_SIZE + meta_len) return NULL;
    for (int64_t i = 0; i < n_lanes; i++) {
        const QkHoldLane *lane = &lanes[i];
        if (lane->meta_len == meta_len && lane->payload_len == payload_len && lane->tokens <= max_tokens &&
            (lane->lane != NULL || answer != NULL) &&
            memcmp(lane->meta, head + MSW_HEADER_SIZE, (size_t)meta_len) == 0)
            return lane;
    }
    return NULL;
}

/* Serve fd (a non-blocking TCP socket, nothing unread in the loop's reader, nothing unsent) for up
 * to limit_s, waiting at most wait_s for each next frame, with the lanes of at most max_tokens;
 * loop_fd: the event loop's selector (its readiness ends the hold when fd has nothing). in
 * [in_cap]: room for the largest such lane's frame; reply [reply_cap]: for its RESULT; answer: the
 * caller's answer to a lane without a QkLane. Returns why it ended (HOLD_*), out: what it did. */
int64_t qk_hold(const QkHold *call) {
    const QkHoldLane *lanes = call->lanes;
    int64_t n_lanes = call->n_lanes, max_tokens = call->max_tokens, in_cap = call->in_cap, reply_cap = call->reply_cap;
    int fd = (int)call->fd, loop_fd = (int)call->loop_fd, threads = (int)call->threads;
    double wait_s = call->wait_s, limit_s = call->limit_s;
    uint8_t *in = call->in, *reply = call->reply;
    QkHoldAnswer answer = call->answer;
    QkHoldOut *out = call->out;
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
        int64_t total = MSW_HEADER_SIZE + lane->meta_len + lane->payload_len;
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
        uint64_t rid = msw_get_le(in + MSW_AT_REQUEST_ID, 8);
        const uint8_t *body = in + MSW_HEADER_SIZE;
        int64_t size = lane->lane == NULL ? answer(lane - lanes, body, total - MSW_HEADER_SIZE, rid, reply, reply_cap)
                       : lane->exact      ? qk_express_rows(lane->lane, body, reply, reply_cap, rid, threads)
                                          : qk_express_sums(lane->lane, body, reply, reply_cap, rid, threads);
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
