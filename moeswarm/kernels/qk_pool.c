/* A pool of helper threads kept for the kernels' row splits (qkernels.c: run_rows).
 *
 * A decode step makes hundreds of small products (a one-token expert is three of them, a few
 * microseconds each): starting and joining a thread per product cost as much as the product.
 * The helpers stay alive between calls. A call publishes its jobs (one atomic ticket: the call's
 * generation, its job count, the next job to claim), runs job 0 itself, then claims and runs any job
 * no helper has claimed yet, and waits only for the jobs helpers did claim. A job is run by whoever
 * claims it, so a helper that is not running (its core taken by another process, or by this very
 * call's thread when both share one core) never holds a call up: the call runs its job instead.
 *
 * Waits are measured, not counted: at the first call the pool times a pause instruction and a
 * helper's wake-up on this host, and spins (checking the clock) for about as long as a wake-up costs
 * before it sleeps; past the first microseconds a spinning thread yields its core to any other
 * thread that wants it (sched_yield), so a spin never keeps a helper of the same call, or another
 * process, off the core it shares. A process allowed fewer CPUs than a call's jobs (taskset, a
 * cgroup's cpuset) gets no more helpers than it has CPUs beside the caller's.
 *
 * A process about to wait for something else (a backbone for its layer call's replies, a worker for
 * its next request) tells the pool to rest (`qk_pool_rest`): the helpers stop spinning at once and
 * sleep until the next call. Spinning then would only take the cores from the processes that do the
 * work meanwhile.
 *
 * One call uses the pool at a time; a call that finds it taken (another Python thread inside the
 * kernels: ctypes drops the GIL) starts threads of its own for that call. The split of rows into
 * jobs is the caller's, and which thread runs a job changes none of its bits. After fork() the child
 * starts with an empty pool (its helpers are not copied).
 */
#define _GNU_SOURCE
#include "qk_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define POOL_MAX 255
#define SPIN_MIN_NS 2000     /* the least a wait spins before it sleeps */
#define SPIN_MAX_NS 100000   /* the most, whatever a wake-up costs here */
#define YIELD_AFTER_NS 1500  /* past this, a spinning thread yields its core between looks */
#define LOOK_EVERY 16        /* pauses between two looks at the clock */

static struct {
    pthread_mutex_t busy;  /* held by the one call using the pool */
    pthread_mutex_t lock;  /* guards the sleepers' waits on the condition variables */
    pthread_cond_t wake, done;
    int size;              /* helpers started */
    unsigned generation;   /* bumped once per call: sleeping helpers wake when it changes */
    uint64_t ticket;       /* generation << 32 | jobs << 16 | next job to claim */
    int finished;          /* jobs 1.. of the current call run to the end */
    int resting;           /* set by qk_pool_rest: helpers sleep instead of spinning until the next call */
    int64_t spin_ns;       /* how long a wait spins before it sleeps (measured: `calibrate`) */
    qk_job_fn fn;
    char *args;
    size_t arg_size;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Spin until done(arg) or the pool's spin time has passed; returns whether done. Yields the core
 * between looks once YIELD_AFTER_NS have passed. */
static int spin_until(int (*done)(const void *), const void *arg, int64_t budget_ns) {
    int64_t start = now_ns(), elapsed = 0;
    while (!done(arg)) {
        if (elapsed > budget_ns) return 0;
        for (int i = 0; i < LOOK_EVERY; i++) relax();
        elapsed = now_ns() - start;
        if (elapsed > YIELD_AFTER_NS) sched_yield();
    }
    return 1;
}

/* Claim the next unclaimed job of the call whose ticket is in force: its index, or -1 when none is left. */
static int claim(int *jobs) {
    uint64_t t = __atomic_load_n(&pool.ticket, __ATOMIC_ACQUIRE);
    for (;;) {
        int next = (int)(t & 0xffff), count = (int)((t >> 16) & 0xffff);
        if (next >= count) return -1;
        if (__atomic_compare_exchange_n(&pool.ticket, &t, t + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            *jobs = count;
            return next;
        }
    }
}

/* Job `index` of `jobs` run, then counted; the last one wakes a caller asleep on `done`. */
static void run_claimed(int index, int jobs) {
    pool.fn(pool.args + (size_t)index * pool.arg_size);
    if (__atomic_add_fetch(&pool.finished, 1, __ATOMIC_ACQ_REL) == jobs - 1) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_signal(&pool.done);
        pthread_mutex_unlock(&pool.lock);
    }
}

static int generation_moved(const void *seen) {
    return __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE) != *(const unsigned *)seen ||
           __atomic_load_n(&pool.resting, __ATOMIC_RELAXED);
}

static void *helper(void *arg) {
    (void)arg;
    unsigned seen = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE);
    for (;;) {
        if (!spin_until(generation_moved, &seen, __atomic_load_n(&pool.spin_ns, __ATOMIC_RELAXED)) ||
            __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE) == seen) {
            pthread_mutex_lock(&pool.lock);
            while (__atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE) == seen)
                pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE);
        int jobs, index;
        while ((index = claim(&jobs)) >= 0) run_claimed(index, jobs);
    }
    return NULL;
}

/* The CPUs this process may run on (taskset, a cpuset), at least 1. */
static int allowed_cpus(void) {
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int count = CPU_COUNT(&set);
        return count > 0 ? count : 1;
    }
#endif
    return POOL_MAX + 1;
}

/* A thread's wake-up on this host -> pool.spin_ns: a wait spins about as long as sleeping and being
 * woken would cost it (twice the quickest of a few wake-ups of a sleeping thread, signal to running),
 * within [SPIN_MIN_NS, SPIN_MAX_NS]. Spins are timed by the clock, so a pause's own length (which
 * differs between CPUs several-fold) does not matter. Called with pool.busy held, before the first
 * helper starts. */
static struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int round, asleep;
    int64_t woken_at;
} probe = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

#define PROBE_ROUNDS 5

static void *sleeper(void *arg) {
    (void)arg;
    pthread_mutex_lock(&probe.lock);
    for (int round = 1; round <= PROBE_ROUNDS; round++) {
        probe.asleep = round;
        while (probe.round < round) pthread_cond_wait(&probe.cond, &probe.lock);
        __atomic_store_n(&probe.woken_at, now_ns(), __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&probe.lock);
    return NULL;
}

static void calibrate(void) {
    pthread_t id;
    int64_t best = SPIN_MAX_NS;
    if (pthread_create(&id, NULL, sleeper, NULL) != 0) {
        pool.spin_ns = SPIN_MIN_NS;
        return;
    }
    for (int round = 1; round <= PROBE_ROUNDS; round++) {
        for (;;) {  /* until the sleeper waits on the condition (it holds the lock until it does) */
            pthread_mutex_lock(&probe.lock);
            int waiting = probe.asleep == round;
            pthread_mutex_unlock(&probe.lock);
            if (waiting) break;
            sched_yield();
        }
        struct timespec nap = {0, 200000};
        nanosleep(&nap, NULL);  /* asleep for good, not still on its way into the wait */
        __atomic_store_n(&probe.woken_at, 0, __ATOMIC_RELEASE);
        int64_t start = now_ns();
        pthread_mutex_lock(&probe.lock);
        probe.round = round;
        pthread_cond_signal(&probe.cond);
        pthread_mutex_unlock(&probe.lock);
        int64_t woken;
        while ((woken = __atomic_load_n(&probe.woken_at, __ATOMIC_ACQUIRE)) == 0) sched_yield();
        if (woken - start < best) best = woken - start;
    }
    pthread_join(id, NULL);
    probe.round = probe.asleep = 0;
    int64_t spin = 2 * best;
    pool.spin_ns = spin < SPIN_MIN_NS ? SPIN_MIN_NS : spin > SPIN_MAX_NS ? SPIN_MAX_NS : spin;
}

/* Start helpers up to `count` (pool.busy held). Returns how many there are. */
static int grow(int count) {
    if (count > POOL_MAX) count = POOL_MAX;
    if (pool.spin_ns == 0) calibrate();
    while (pool.size < count) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int ok = pthread_create(&id, &attr, helper, NULL) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        pool.size++;
    }
    return pool.size;
}

/* Threads of this call's own: for a call that finds the pool taken. */
static void run_own_threads(qk_job_fn fn, char *args, size_t arg_size, int n) {
    pthread_t ids[POOL_MAX + 1];
    int started[POOL_MAX + 1] = {0};
    for (int i = 1; i < n; i++) started[i] = pthread_create(&ids[i], NULL, fn, args + (size_t)i * arg_size) == 0;
    fn(args);
    for (int i = 1; i < n; i++) {
        if (started[i]) pthread_join(ids[i], NULL);
        else fn(args + (size_t)i * arg_size);  /* no thread to be had: run it here */
    }
}

static int all_finished(const void *jobs) {
    return __atomic_load_n(&pool.finished, __ATOMIC_ACQUIRE) == *(const int *)jobs - 1;
}

void qk_pool_run(qk_job_fn fn, void *args, size_t arg_size, int n) {
    if (n <= 1) {
        if (n == 1) fn(args);
        return;
    }
    if (n > POOL_MAX + 1) n = POOL_MAX + 1;
    if (pthread_mutex_trylock(&pool.busy) != 0) {
        run_own_threads(fn, args, arg_size, n);
        return;
    }
    int cpus = allowed_cpus();
    if (cpus < 2) {  /* one CPU: a helper could only take it from this thread */
        for (int i = 0; i < n; i++) fn((char *)args + (size_t)i * arg_size);
        pthread_mutex_unlock(&pool.busy);
        return;
    }
    grow((n < cpus ? n : cpus) - 1);
    pool.fn = fn;
    pool.args = args;
    pool.arg_size = arg_size;
    __atomic_store_n(&pool.finished, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.resting, 0, __ATOMIC_RELAXED);
    /* the ticket before the generation: a helper that sees the generation move finds its jobs */
    unsigned generation = pool.generation + 1;
    __atomic_store_n(&pool.ticket, (uint64_t)generation << 32 | (uint64_t)n << 16 | 1, __ATOMIC_RELEASE);
    __atomic_store_n(&pool.generation, generation, __ATOMIC_RELEASE);
    pthread_mutex_lock(&pool.lock);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    fn(args);
    int jobs, index;
    while ((index = claim(&jobs)) >= 0) run_claimed(index, jobs);  /* what no helper took yet */
    if (!spin_until(all_finished, &n, pool.spin_ns)) {
        pthread_mutex_lock(&pool.lock);
        while (!all_finished(&n)) pthread_cond_wait(&pool.done, &pool.lock);
        pthread_mutex_unlock(&pool.lock);
    }
    pthread_mutex_unlock(&pool.busy);
}

void qk_pool_rest(void) {
    __atomic_store_n(&pool.resting, 1, __ATOMIC_RELAXED);
}

long long qk_pool_spin_ns(void) {
    return pool.spin_ns;
}

/* The child of a fork has none of the helpers: start again from an empty pool. */
static void after_fork_child(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cond = PTHREAD_COND_INITIALIZER;
    pool.busy = fresh;
    pool.lock = fresh;
    pool.wake = fresh_cond;
    pool.done = fresh_cond;
    pool.size = 0;
    pool.finished = 0;
    pool.ticket = 0;
}

__attribute__((constructor)) static void install_fork_handler(void) {
    pthread_atfork(NULL, NULL, after_fork_child);
}
