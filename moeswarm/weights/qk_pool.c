/* A pool of helper threads kept for the kernels' row splits (qkernels.c: run_rows).
 *
 * A decode step makes hundreds of small products (a one-token expert is three of them, a few
 * microseconds each): starting and joining a thread per product cost as much as the product.
 * The helpers stay alive between calls: a call hands out its jobs by bumping a generation counter,
 * runs job 0 itself, and waits for the others. A helper spins briefly on the counter (back-to-back
 * products follow each other within microseconds) and then sleeps on a condition variable, so an
 * idle pool takes no CPU.
 *
 * A process about to wait for something else (a backbone for its layer call's replies, a worker for
 * its next request) tells the pool to rest (`qk_pool_rest`): the helpers stop spinning at once and
 * sleep until the next call. Spinning then would only take the cores from the processes that do the
 * work meanwhile: with a backbone and two workers on two cores, two workers of two threads each
 * whose helpers rest after every answer split each layer's experts over both cores as they come
 * free (measured, OLMoE-shaped experts: 0.4 ms less per layer call than workers of one thread).
 *
 * One call uses the pool at a time; a call that finds it taken (another Python thread inside the
 * kernels: ctypes drops the GIL) starts threads of its own for that call, as before. The split of
 * rows into jobs is the caller's, so the bits of every output are unchanged. After fork() the child
 * starts with an empty pool (its helpers are not copied). Every helper answers every call (a call
 * waits for all of them), so the pool is sized by the largest thread count asked for.
 */
#include "qk_pool.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define POOL_MAX 255
#define SPINS 3000  /* ~50 us of pause instructions (17 ns each on this Xeon) before sleeping */

static struct {
    pthread_mutex_t busy;  /* held by the one call using the pool */
    pthread_mutex_t lock;  /* guards generation and the condition variables */
    pthread_cond_t wake, done;
    int size;              /* helpers started */
    unsigned generation;   /* bumped once per call: helpers run when it changes */
    int jobs;              /* jobs of the current call, 0 included */
    int pending;           /* helpers' jobs not finished yet */
    unsigned born[POOL_MAX + 1];  /* each helper's first generation */
    int resting;           /* set by qk_pool_rest: helpers sleep instead of spinning until the next call */
    qk_job_fn fn;
    char *args;
    size_t arg_size;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *helper(void *arg) {
    int me = (int)(intptr_t)arg;  /* 1..size */
    /* The generation when this helper was started (grow runs with pool.busy held, before the
     * call that needs it bumps the counter): loaded here, a helper starting late would take that
     * call's generation for one already answered. */
    unsigned seen = pool.born[me];
    for (;;) {
        unsigned now;
        int spins = 0;
        while ((now = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE)) == seen && spins < SPINS
               && !__atomic_load_n(&pool.resting, __ATOMIC_RELAXED)) {
            relax();
            spins++;
        }
        if (now == seen) {
            pthread_mutex_lock(&pool.lock);
            while ((now = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE)) == seen)
                pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = now;
        if (me < pool.jobs) pool.fn(pool.args + (size_t)me * pool.arg_size);
        /* Every helper answers every call, with a job or without: the next call may then rewrite
         * the job fields, as no helper can still be reading them. */
        if (__atomic_sub_fetch(&pool.pending, 1, __ATOMIC_ACQ_REL) == 0) {
            pthread_mutex_lock(&pool.lock);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.lock);
        }
    }
    return NULL;
}

/* Start helpers up to `count` (pool.busy held). Returns how many there are. */
static int grow(int count) {
    if (count > POOL_MAX) count = POOL_MAX;
    while (pool.size < count) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pool.born[pool.size + 1] = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE);
        int ok = pthread_create(&id, &attr, helper, (void *)(intptr_t)(pool.size + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        pool.size++;
    }
    return pool.size;
}

/* Threads of this call's own, as before the pool: for a call that finds the pool taken. */
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
    int helpers = grow(n - 1);
    int handed = helpers < n - 1 ? helpers : n - 1;  /* jobs 1..handed go to helpers */
    pool.fn = fn;
    pool.args = args;
    pool.arg_size = arg_size;
    pool.jobs = handed + 1;
    __atomic_store_n(&pool.pending, helpers, __ATOMIC_RELEASE);
    __atomic_store_n(&pool.resting, 0, __ATOMIC_RELAXED);
    pthread_mutex_lock(&pool.lock);
    __atomic_add_fetch(&pool.generation, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    fn(args);
    for (int i = handed + 1; i < n; i++) fn((char *)args + (size_t)i * arg_size);  /* no helper for these */
    int spins = 0;
    while (__atomic_load_n(&pool.pending, __ATOMIC_ACQUIRE) != 0 && spins < SPINS) {
        relax();
        spins++;
    }
    if (__atomic_load_n(&pool.pending, __ATOMIC_ACQUIRE) != 0) {
        pthread_mutex_lock(&pool.lock);
        while (__atomic_load_n(&pool.pending, __ATOMIC_ACQUIRE) != 0) pthread_cond_wait(&pool.done, &pool.lock);
        pthread_mutex_unlock(&pool.lock);
    }
    pthread_mutex_unlock(&pool.busy);
}

void qk_pool_rest(void) {
    __atomic_store_n(&pool.resting, 1, __ATOMIC_RELAXED);
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
    pool.pending = 0;
}

__attribute__((constructor)) static void install_fork_handler(void) {
    pthread_atfork(NULL, NULL, after_fork_child);
}
