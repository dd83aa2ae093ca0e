/* A pool of helper threads for the kernels' row splits (qk_pool.c). */
#ifndef QK_POOL_H
#define QK_POOL_H
#include <stddef.h>

typedef void *(*qk_job_fn)(void *);

/* Run fn on n jobs, args[i] at (char *)args + i * arg_size: job 0 on this thread, the others on the
 * pool's helpers (or on threads of this call's own when another call holds the pool). Returns when
 * every job has run. */
void qk_pool_run(qk_job_fn fn, void *args, size_t arg_size, int n);

/* The helpers stop spinning and sleep until the next call: this process waits for others now. */
void qk_pool_rest(void);

/* How long a wait spins before it sleeps, in ns, as measured on this host at the first call (0 before). */
long long qk_pool_spin_ns(void);

#endif
