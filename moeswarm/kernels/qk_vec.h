/* What the float kernels share (qkernels.c, qk_rows.c): one clone per instruction set, 16-lane
 * float vectors (GCC's vector extension; two AVX2 registers, one AVX-512), and 8-lane ones.
 *
 * On AVX2, GCC 12 keeps a 16-lane accumulator in memory (stored and reloaded every iteration), and
 * a vector indexed by a variable too: a loop's accumulators are pairs of 8-lane vectors instead
 * (lanes 0-7 and 8-15 of the same 16 lanes, so the same sums), loaded through a may_alias pointer. */
#ifndef QK_VEC_H
#define QK_VEC_H
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

#define LANES 16
typedef float v16 __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

static inline __attribute__((always_inline)) v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }

typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
typedef float v8u __attribute__((vector_size(8 * sizeof(float)), aligned(4), may_alias));  /* any float address */
typedef float v4 __attribute__((vector_size(4 * sizeof(float))));
static inline __attribute__((always_inline)) v8 load8(const float *p) { return *(const v8u *)p; }

/* 16 lanes (0-7 in lo, 8-15 in hi) added by the fixed tree: +8, +4, +2, +1. */
static inline __attribute__((always_inline)) float tree16(v8 lo, v8 hi) {
    v8 half = lo + hi;
    v4 quarter = __builtin_shufflevector(half, half, 0, 1, 2, 3) + __builtin_shufflevector(half, half, 4, 5, 6, 7);
    float pair0 = quarter[0] + quarter[2], pair1 = quarter[1] + quarter[3];
    return pair0 + pair1;
}

/* Lane k mod 16 of (lo, hi) += a[k] * b[k] for main <= k < n, n - main < 16 (at most one value a
 * lane; a lane that gets none adds +0.0, which changes no sum that starts from +0.0). */
static inline __attribute__((always_inline)) void add_tail(v8 *lo, v8 *hi, const float *a, const float *b,
                                                           int64_t main, int64_t n) {
    if (main >= n) return;
    float tail[16] = {0};
    for (int64_t k = main; k < n; k++) tail[k % 16] = a[k] * b[k];
    *lo = *lo + load8(tail);
    *hi = *hi + load8(tail + 8);
}

/* Dot product of a and b (n values) with a fixed association: lane k mod 16 gets a[k] * b[k] in
 * the order of k, then tree16. */
static inline __attribute__((always_inline)) float fixed_dot(const float *a, const float *b, int64_t n) {
    v8 lo = {0}, hi = {0};
    int64_t main = n - n % 16;
    for (int64_t k = 0; k < main; k += 16) {
        lo = lo + load8(a + k) * load8(b + k);
        hi = hi + load8(a + k + 8) * load8(b + k + 8);
    }
    add_tail(&lo, &hi, a, b, main, n);
    return tree16(lo, hi);
}

#endif
