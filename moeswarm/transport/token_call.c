/* A decode step's layer call on plain TCP sockets, in C: one call sends a holder its DISPATCH, one
 * takes its RESULT, checks it and adds it into the step's output (moeswarm/dispatch/lane.py).
 *
 * Why C: between two layer calls a holder's kernels sweep the shared caches, and the Python that
 * frames, checks and adds one token's answer runs from cold memory at several times its hot cost
 * (docs/measured.md, "lane"). These functions touch a few cache
 * lines instead. They know nothing the Python side did not tell them: the frame to send is a
 * template made by the full path's encoder (wire/messages.py) with the token's values written in,
 * and a RESULT is taken only when its metadata bytes are the ones the full path's decoder accepted
 * for the same request (else it is left whole in `buf` for that decoder to judge).
 *
 * The frame header and its constants: wire/frames.h; the functions' argument structs: token_call.h.
 * tc_layout reports the structs' layout and the constants this library was built with
 * (moeswarm/native.h), checked at load against transport/token_call.py.
 *
 * Legend: d = hidden size, k = router top-k, E = routed experts, n = rows of a RESULT.
 */

#define _GNU_SOURCE /* ppoll */
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "frames.h"
#include "native.h"
#include "token_call.h"

/* Outcomes below zero. A frame read whole (tc_take's buf holds it) is TC_OTHER_FRAME or
 * TC_MISMATCH; after any other the stream is out of step and the caller closes the socket. */
enum {
    TC_TIMEOUT = -1,       /* the deadline passed (part of a frame may have been read) */
    TC_CLOSED = -2,        /* the peer closed the connection */
    TC_BAD_HEADER = -3,    /* not a frame of this protocol version */
    TC_OTHER_REQUEST = -4, /* a header for another request id (only the header was read) */
    TC_TOO_BIG = -5,       /* a body over the caller's capacity (only the header was read) */
    TC_OTHER_FRAME = -6,   /* a whole frame that is not a RESULT (an ERROR) */
    TC_MISMATCH = -7,      /* a whole RESULT not as expected (metadata, size, or non-finite values) */
    TC_IO = -8,            /* a socket error */
    TC_BAD_ID = -9         /* an expert id outside [0, E) */
};

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);  /* Python's time.monotonic() on Linux */
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Wait until fd is ready for `events` or `deadline` (monotonic seconds) passes. */
static int wait_ready(int fd, short events, double deadline) {
    for (;;) {
        double left = deadline - now_s();
        if (left <= 0) return TC_TIMEOUT;
        struct pollfd p = {fd, events, 0};
        int ms = (int)(left * 1e3) + 1;
        int got = poll(&p, 1, ms);
        if (got > 0) return 0;
        if (got < 0 && errno != EINTR) return TC_IO;
    }
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Spin up to `spin` seconds for fd to have bytes to read (a few microseconds between looks), so
 * that this thread is running, on a core that is awake, when they come (dispatch/wait.py says
 * when that pays). */
static void spin_ready(int fd, double spin) {
    double until = now_s() + spin;
    do {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, 0) != 0) return;  /* ready, or an error the read reports */
        for (int i = 0; i < 64; i++) relax();
    } while (now_s() < until);
}

/* Sleep up to `doze` seconds for fd to have bytes to read (woken by them), at the timer's own
 * resolution rather than poll's milliseconds: a backbone sleeps through most of a reply's expected
 * wait and spins for the rest (dispatch/wait.py's DOZE), awake when it comes. */
static void doze_ready(int fd, double doze) {
    struct pollfd p = {fd, POLLIN, 0};
    struct timespec t = {(time_t)doze, (long)((doze - (double)(time_t)doze) * 1e9)};
    ppoll(&p, 1, &t, NULL);  /* ready, an error the read reports, EINTR or the time up: go on */
}

/* Exactly `size` bytes into `to` from non-blocking fd before `deadline`. */
static int read_exactly(int fd, uint8_t *to, int64_t size, double deadline) {
    int64_t got = 0;
    while (got < size) {
        ssize_t n = recv(fd, to + got, (size_t)(size - got), 0);
        if (n > 0) {
            got += n;
        } else if (n == 0) {
            return TC_CLOSED;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int waited = wait_ready(fd, POLLIN, deadline);
            if (waited) return waited;
        } else if (errno != EINTR) {
            return errno == ECONNRESET ? TC_CLOSED : TC_IO;
        }
    }
    return 0;
}

/* Send `frame` [len] on non-blocking fd, its request id set to `rid`, and the token's values
 * written at the template's offsets:
 *   x    [d] float32 at x_at
 *   ids  [k] the router's experts at ids_at, in `id_bytes` (1: u8 with 255 for -1; 2: i16; 4: i32):
 *        this holder's (owner[e] == me) as they are, the others -1
 *   w    [k] float32 at w_at
 * 0 once every byte is with the kernel, else an outcome below zero (TC_TIMEOUT: the peer takes
 * no bytes; part of the frame may be out). */
int tc_send(const TcSend *call) {
    int fd = (int)call->fd, id_bytes = (int)call->id_bytes;
    uint8_t *frame = call->frame;
    int64_t len = call->len, x_at = call->x_at, d = call->d, ids_at = call->ids_at, k = call->k;
    int64_t num_experts = call->num_experts, me = call->me, w_at = call->w_at;
    uint64_t rid = call->rid;
    const float *x = call->x, *w = call->w;
    const int64_t *ids = call->ids, *owner = call->owner;
    double deadline = call->deadline;
    msw_put_le(frame + MSW_AT_REQUEST_ID, rid, 8);
    memcpy(frame + x_at, x, (size_t)d * sizeof(float));
    memcpy(frame + w_at, w, (size_t)k * sizeof(float));
    for (int64_t j = 0; j < k; j++) {
        int64_t e = ids[j];
        if (e < 0 || e >= num_experts) return TC_BAD_ID;
        int64_t v = owner[e] == me ? e : -1;
        uint8_t *at = frame + ids_at + j * id_bytes;
        if (id_bytes == MSW_ID_BYTES_U8) {
            at[0] = (uint8_t)(v < 0 ? MSW_ID_NONE_U8 : v);
        } else {
            for (int b = 0; b < id_bytes; b++) at[b] = (uint8_t)((uint64_t)v >> (8 * b));
        }
    }
    int64_t sent = 0;
    while (sent < len) {
        ssize_t n = send(fd, frame + sent, (size_t)(len - sent), MSG_NOSIGNAL);
        if (n >= 0) {
            sent += n;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int waited = wait_ready(fd, POLLOUT, deadline);
            if (waited) return waited;
        } else if (errno != EINTR) {
            return errno == EPIPE || errno == ECONNRESET ? TC_CLOSED : TC_IO;
        }
    }
    return 0;
}

/* Whether `got` [got_len] is `want` [want_len] with "cpu_us": <unsigned int> added as the last key
 * of its map (a timed RESULT: wire/messages.py Result.to_frame); the int into *cpu_us. */
static int timed_meta(const uint8_t *got, int64_t got_len, const uint8_t *want, int64_t want_len, int64_t *cpu_us) {
    static const uint8_t key[7] = {0xa6, 'c', 'p', 'u', '_', 'u', 's'};
    if (want_len < 1 || (want[0] & 0xf0) != 0x80 || (want[0] & 0x0f) == 0x0f) return 0;  /* a fixmap of < 15 keys */
    if (got_len < want_len + 8 || got[0] != want[0] + 1 || memcmp(got + 1, want + 1, (size_t)(want_len - 1))) return 0;
    const uint8_t *p = got + want_len;
    if (memcmp(p, key, sizeof key)) return 0;
    p += sizeof key;
    int64_t left = got_len - (p - got), size;
    uint64_t v = 0;
    if (p[0] < 0x80) {
        v = p[0], size = 1;
    } else if (p[0] >= 0xcc && p[0] <= 0xcf) {
        size = 1 + (1 << (p[0] - 0xcc));
        if (left != size) return 0;
        for (int64_t i = 1; i < size; i++) v = v << 8 | p[i];
    } else {
        return 0;
    }
    if (left != size || v > (uint64_t)INT64_MAX) return 0;
    *cpu_us = (int64_t)v;
    return 1;
}

/* Take the RESULT of request `rid` from non-blocking fd before `deadline` into buf [cap] (header,
 * then body), check it and add it into out [d]:
 *   meta [meta_len]  the RESULT's metadata bytes as the full path encodes them for this request
 *                    (timed: without its "cpu_us", which must come last)
 *   rows             its rows: its payload must be rows x d float32, every value finite
 *   first            1: out = y + 0.0 (the token's lowest experts' sum, one row); 0: each row added
 *                    to out in order (IEEE single adds, as dispatch/combine.py makes them)
 * info [3] gets the frame's opcode, meta_len and body length (once its header is read), top the
 * largest |value| of its rows (the plausibility gate's measure: dispatch/plausible.py). `doze`:
 * seconds to sleep for the reply first (0: none), woken by it; `spin`: seconds to spin for it next,
 * before sleeping in poll (0: none). Returns the RESULT's cpu_us (0
 * when not timed), or an outcome below zero; out is changed only on success. */
int64_t tc_take(const TcTake *call) {
    int fd = (int)call->fd, timed = (int)call->timed, first = (int)call->first;
    uint64_t rid = call->rid;
    uint8_t *buf = call->buf;
    const uint8_t *meta = call->meta;
    int64_t cap = call->cap, meta_len = call->meta_len, rows = call->rows, d = call->d, *info = call->info;
    float *out = call->out;
    double deadline = call->deadline, *top = call->top, doze = call->doze, spin = call->spin;
    if (doze > 0) doze_ready(fd, doze);
    if (spin > 0) spin_ready(fd, spin);
    int failed = read_exactly(fd, buf, MSW_HEADER_SIZE, deadline);
    if (failed) return failed;
    if (!msw_is_header(buf)) return TC_BAD_HEADER;
    int64_t got_meta = (int64_t)msw_get_le(buf + MSW_AT_META_LEN, 4);
    int64_t body = got_meta + (int64_t)msw_get_le(buf + MSW_AT_PAYLOAD_LEN, 4);
    info[0] = buf[MSW_AT_OPCODE], info[1] = got_meta, info[2] = body;
    if (msw_get_le(buf + MSW_AT_REQUEST_ID, 8) != rid) return TC_OTHER_REQUEST;
    if (got_meta > MSW_MAX_META || body > cap - MSW_HEADER_SIZE) return TC_TOO_BIG;
    failed = read_exactly(fd, buf + MSW_HEADER_SIZE, body, deadline);
    if (failed) return failed;
    if (buf[MSW_AT_OPCODE] != MSW_OP_RESULT) return TC_OTHER_FRAME;
    const uint8_t *m = buf + MSW_HEADER_SIZE;
    int64_t cpu_us = 0;
    if (timed ? !timed_meta(m, got_meta, meta, meta_len, &cpu_us) : got_meta != meta_len || memcmp(m, meta, (size_t)meta_len))
        return TC_MISMATCH;
    if (body - got_meta != rows * d * (int64_t)sizeof(float)) return TC_MISMATCH;
    const uint8_t *y = m + got_meta;  /* [rows, d] float32, at any alignment */
    int finite = 1;
    float peak = 0.0f;
    for (int64_t i = 0; i < rows * d; i++) {
        float v;
        memcpy(&v, y + i * sizeof(float), sizeof v);
        finite &= isfinite(v) != 0;
        v = fabsf(v);
        peak = v > peak ? v : peak;
    }
    if (!finite) return TC_MISMATCH;  /* the full path's checks judge it (finite inputs or not) */
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = y + r * d * (int64_t)sizeof(float);
        for (int64_t j = 0; j < d; j++) {
            float v;
            memcpy(&v, row + j * sizeof(float), sizeof v);
            out[j] = first && r == 0 ? v + 0.0f : out[j] + v;
        }
    }
    *top = peak;
    return cpu_us;
}

/* The layout and constants this library was built with, for moeswarm/native.py's check against
 * transport/token_call.py (the structs' mirrors, the outcomes) and wire/frames.py (the frame's). */
static const MswLayoutEntry layout[] = {
    MSW_SIZE(TcSend), MSW_FIELD(TcSend, fd), MSW_FIELD(TcSend, frame), MSW_FIELD(TcSend, len), MSW_FIELD(TcSend, rid),
    MSW_FIELD(TcSend, x_at), MSW_FIELD(TcSend, x), MSW_FIELD(TcSend, d), MSW_FIELD(TcSend, ids_at),
    MSW_FIELD(TcSend, id_bytes), MSW_FIELD(TcSend, ids), MSW_FIELD(TcSend, k), MSW_FIELD(TcSend, owner),
    MSW_FIELD(TcSend, num_experts), MSW_FIELD(TcSend, me), MSW_FIELD(TcSend, w_at), MSW_FIELD(TcSend, w),
    MSW_FIELD(TcSend, deadline),
    MSW_SIZE(TcTake), MSW_FIELD(TcTake, fd), MSW_FIELD(TcTake, rid), MSW_FIELD(TcTake, buf), MSW_FIELD(TcTake, cap),
    MSW_FIELD(TcTake, meta), MSW_FIELD(TcTake, meta_len), MSW_FIELD(TcTake, timed), MSW_FIELD(TcTake, rows),
    MSW_FIELD(TcTake, d), MSW_FIELD(TcTake, first), MSW_FIELD(TcTake, out), MSW_FIELD(TcTake, deadline),
    MSW_FIELD(TcTake, info), MSW_FIELD(TcTake, top), MSW_FIELD(TcTake, doze), MSW_FIELD(TcTake, spin),
    MSW_FRAME_CONSTANTS, MSW_CONSTANT(TC_TIMEOUT), MSW_CONSTANT(TC_CLOSED), MSW_CONSTANT(TC_BAD_HEADER),
    MSW_CONSTANT(TC_OTHER_REQUEST), MSW_CONSTANT(TC_TOO_BIG), MSW_CONSTANT(TC_OTHER_FRAME), MSW_CONSTANT(TC_MISMATCH),
    MSW_CONSTANT(TC_IO), MSW_CONSTANT(TC_BAD_ID),
    {NULL, 0},
};

const MswLayoutEntry *tc_layout(void) { return layout; }
