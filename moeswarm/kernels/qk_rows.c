/* A decoder layer's row operations around its matrices, float32: RMSNorm, the rotary embedding
 * and its tables, and a decode step's attention (one query against its cached keys and values).
 *
 * Each is one C call where transformers' PyTorch code runs 6-10 tensor operations (each a few
 * microseconds of dispatch at a decode step's one row: about a third of a real-dimension backbone's
 * Python time per token). Loaded with ctypes by moeswarm/kernels/row_ops.py and
 * moeswarm/model/attention_threads.py, which say where each is used.
 *
 * Exactness: every output value depends on its own row only (never on the other rows, the batch or a
 * thread count), and both local references and remote paths call the same function.
 * - rope is bit for bit torch's `(x * cos) + (rotate_half(x) * sin)`: elementwise IEEE float32
 *   operations in the same order (built with -ffp-contract=off: no fused multiply-add).
 * - rope_table is not torch's: its cos and sin come from double precision, rounded once, so its bits
 *   are its own (within half a unit in the last place of the exact value, closer than torch's);
 *   only where the reference uses it too.
 * - rms_norm is `w * (x * (1 / sqrt(mean(x^2) + eps)))` with its own fixed sum: the squares added in
 *   16 lanes (lane k mod 16, in the order of k), the lanes by a fixed tree, then / d. torch's sum has
 *   another association (and another per instruction set), so its bits differ from transformers'
 *   in the last place; it is only used where the reference uses it too.
 * - attend_one sums in its own fixed orders too (dot products as rms_norm's sum; the softmax and the
 *   values position by position), so its bits differ from torch's sdpa in the last places; the
 *   same holds: only where the reference uses it too. Its heads are split over the kernels' threads,
 *   each computed whole by one; a float16 cache's values are widened where they are read, giving
 *   the float32 call's bits on the widened values (`--kv-cache f16`, docs/kv-cache.md).
 */

#define _GNU_SOURCE /* sincos */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "qk_pool.h"
#include "qk_vec.h"

/* y[r] = w * (x[r] * (1 / sqrtf(sum(x[r]^2) / d + eps))) for `rows` rows of d values (x's rows
 * ldx apart, y's d apart; w: d values). */
CLONES void qk_rms_norm(const float *x, int64_t rows, int64_t d, int64_t ldx, const float *w, float eps, float *y) {
    for (int64_t r = 0; r < rows; r++, x += ldx, y += d) {
        float scale = 1.0f / sqrtf(fixed_dot(x, x, d) / (float)d + eps);
        for (int64_t k = 0; k < d; k++) y[k] = w[k] * (x[k] * scale);
    }
}

/* The rotary embedding of x [B, H, T, D] (strides xs, in floats; the last one 1) into out (strides
 * os) with cos, sin [B, T, D] (contiguous): per head row, with h = D / 2,
 *   out[i] = x[i] * cos[i] + (-x[i + h]) * sin[i]   (i < h)
 *   out[i] = x[i] * cos[i] + x[i - h] * sin[i]      (i >= h)
 * torch's (x * cos) + (rotate_half(x) * sin), operation by operation. */
CLONES void qk_rope(const float *x, const int64_t *xs, float *out, const int64_t *os, int64_t B, int64_t H, int64_t T,
                    int64_t D, const float *cos, const float *sin) {
    int64_t h = D / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t n = 0; n < H; n++)
            for (int64_t t = 0; t < T; t++) {
                const float *xr = x + b * xs[0] + n * xs[1] + t * xs[2];
                float *o = out + b * os[0] + n * os[1] + t * os[2];
                const float *c = cos + (b * T + t) * D, *s = sin + (b * T + t) * D;
                for (int64_t i = 0; i < h; i++) o[i] = xr[i] * c[i] + (-xr[i + h]) * s[i];
                for (int64_t i = h; i < D; i++) o[i] = xr[i] * c[i] + xr[i - h] * s[i];
            }
}

/* The rotary tables of n positions: for position p = pos[t] and pair j < h (D = 2 h),
 *   a = (float)p * inv[j]   (float32, as torch's position_ids.float() * inv_freq)
 *   cos[t][j] = cos[t][j + h] = (float)cos((double)a) * scale, sin likewise
 * each value from its own position alone, in the calling thread: the same bits in every process,
 * batch and thread count (torch's cos and sin split a prompt's table among its threads). */
void qk_rope_table(const int64_t *pos, int64_t n, const float *inv, int64_t h, float scale, float *cos_out,
                   float *sin_out) {
    for (int64_t t = 0; t < n; t++) {
        float *c = cos_out + t * 2 * h, *s = sin_out + t * 2 * h;
        float p = (float)pos[t];
        for (int64_t j = 0; j < h; j++) {
            double sd, cd;
            sincos((double)(p * inv[j]), &sd, &cd);
            c[j] = c[j + h] = (float)cd * scale;
            s[j] = s[j + h] = (float)sd * scale;
        }
    }
}

/* One query per batch row attending to p keys and values, as scaled_dot_product_attention without
 * a mask: q [B, Hq, 1, D] (strides qs: batch, head), k [B, Hkv, p, D] and v [B, Hkv, p, Dv]
 * (strides ks, vs: batch, head, position; values contiguous), query head h reading key/value head
 * h / (Hq / Hkv); out [B, 1, Hq, Dv] contiguous. Per head, with s_j = dot(q, k_j) * scale:
 *   out = sum_j exp(s_j - max s) v_j / sum_j exp(s_j - max s)
 * each sum over the positions in turn. The heads are split among `threads` threads (qk_pool.c),
 * each head computed whole by one of them, so no output depends on the thread count. scratch:
 * threads * p floats. */
typedef struct {
    const float *q;
    const int64_t *qs, *ks, *vs;
    const void *k, *v;
    int64_t Hq, Hkv, p, D, Dv;
    float scale;
    float *out, *scratch;  /* scratch: this job's p floats */
    int64_t first, last;   /* this job's heads: b * Hq + h in [first, last) */
} AttendJob;

/* A job's heads, over keys and values of type KEY read through DOT(q, key row, D) (fixed_dot's
 * order) and LOADV(address) (8 values as a v8) / VALUE(address) (one): every storage, one order. */
#define ATTEND_HEADS(ARG, KEY, DOT, LOADV, VALUE)                                                       \
    const AttendJob *job = (const AttendJob *)(ARG);                                                    \
    const KEY *k = (const KEY *)job->k, *v = (const KEY *)job->v;                                       \
    const int64_t *qs = job->qs, *ks = job->ks, *vs = job->vs;                                          \
    int64_t Hq = job->Hq, group = Hq / job->Hkv, p = job->p, D = job->D, Dv = job->Dv;                   \
    float *scratch = job->scratch;                                                                      \
    for (int64_t bh = job->first; bh < job->last; bh++) {                                               \
        int64_t b = bh / Hq, h = bh % Hq;                                                               \
        const float *qh = job->q + b * qs[0] + h * qs[1];                                               \
        const KEY *kh = k + b * ks[0] + (h / group) * ks[1];                                            \
        const KEY *vh = v + b * vs[0] + (h / group) * vs[1];                                            \
        float *o = job->out + bh * Dv;                                                                  \
        float top = -INFINITY;                                                                          \
        for (int64_t j = 0; j < p; j++) {                                                               \
            scratch[j] = DOT(qh, kh + j * ks[2], D) * job->scale;                                       \
            if (scratch[j] > top) top = scratch[j];                                                     \
        }                                                                                               \
        float total = 0.0f;                                                                             \
        for (int64_t j = 0; j < p; j++) {                                                               \
            scratch[j] = expf(scratch[j] - top);                                                        \
            total = total + scratch[j];                                                                 \
        }                                                                                               \
        int64_t wide = Dv - Dv % 32, main = Dv - Dv % 8, c = 0;                                         \
        for (; c < wide; c += 32) { /* four accumulators: four additions in flight */                   \
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                                  \
            for (int64_t j = 0; j < p; j++) {                                                           \
                const KEY *vj = vh + j * vs[2] + c;                                                     \
                a0 = a0 + scratch[j] * LOADV(vj);                                                       \
                a1 = a1 + scratch[j] * LOADV(vj + 8);                                                   \
                a2 = a2 + scratch[j] * LOADV(vj + 16);                                                  \
                a3 = a3 + scratch[j] * LOADV(vj + 24);                                                  \
            }                                                                                           \
            *(v8u *)(o + c) = a0 / total;                                                               \
            *(v8u *)(o + c + 8) = a1 / total;                                                           \
            *(v8u *)(o + c + 16) = a2 / total;                                                          \
            *(v8u *)(o + c + 24) = a3 / total;                                                          \
        }                                                                                               \
        for (; c < main; c += 8) {                                                                      \
            v8 acc = {0};                                                                               \
            for (int64_t j = 0; j < p; j++) acc = acc + scratch[j] * LOADV(vh + j * vs[2] + c);         \
            *(v8u *)(o + c) = acc / total;                                                              \
        }                                                                                               \
        for (; c < Dv; c++) {                                                                           \
            float acc = 0.0f;                                                                           \
            for (int64_t j = 0; j < p; j++) acc = acc + scratch[j] * VALUE(vh + j * vs[2] + c);         \
            o[c] = acc / total;                                                                         \
        }                                                                                               \
    }                                                                                                   \
    return NULL;

#define FLOAT_VALUE(address) (*(address))

CLONES static void *attend_float_job(void *arg) { ATTEND_HEADS(arg, float, fixed_dot, load8, FLOAT_VALUE) }

/* Keys and values stored as IEEE half floats (a float16 KV cache): every value is widened to float32
 * (exactly: each half is a float) where it is read, then the same sums in the same order, so the
 * output is the float32 call's on the widened tensors, bit for bit. On a CPU with F16C (every AVX2
 * one here) 8 values are widened by one instruction; elsewhere one at a time. */
typedef _Float16 h8u __attribute__((vector_size(8 * sizeof(_Float16)), aligned(2), may_alias));
static inline __attribute__((always_inline)) v8 load8h(const _Float16 *p) {
    return __builtin_convertvector(*(const h8u *)p, v8);
}
#define HALF_VALUE(address) ((float)*(address))

/* fixed_dot(a, b) of float a and half b, the halves widened by LOAD: the same lanes, order and tree. */
#define HALF_DOT(NAME, LOAD, ATTRIBUTES)                                                               \
    static inline __attribute__((always_inline)) ATTRIBUTES float NAME(const float *a, const _Float16 *b, \
                                                                      int64_t n) {                    \
        v8 lo = {0}, hi = {0};                                                                         \
        int64_t main = n - n % 16;                                                                     \
        for (int64_t k = 0; k < main; k += 16) {                                                       \
            lo = lo + load8(a + k) * LOAD(b + k);                                                      \
            hi = hi + load8(a + k + 8) * LOAD(b + k + 8);                                              \
        }                                                                                              \
        if (main < n) {                                                                                \
            float tail[16] = {0};                                                                      \
            for (int64_t k = main; k < n; k++) tail[k % 16] = a[k] * (float)b[k];                      \
            lo = lo + load8(tail);                                                                     \
            hi = hi + load8(tail + 8);                                                                 \
        }                                                                                              \
        return tree16(lo, hi);                                                                         \
    }

HALF_DOT(half_dot, load8h, )
static void *attend_half_job(void *arg) { ATTEND_HEADS(arg, _Float16, half_dot, load8h, HALF_VALUE) }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

/* GCC 12 widens a vector of _Float16 one lane at a time even with F16C: the instruction, 8 at once.
 * (target_clones cannot ask for F16C, and GCC 12's resolver takes "arch=x86-64-v3" for an Intel
 * model name: chosen at run time instead.) */
static inline __attribute__((always_inline, target("avx2,f16c"))) v8 load8h_f16c(const _Float16 *p) {
    return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
HALF_DOT(half_dot_f16c, load8h_f16c, __attribute__((target("avx2,f16c"))))
__attribute__((target("avx2,f16c"))) static void *attend_half_f16c_job(void *arg) {
    ATTEND_HEADS(arg, _Float16, half_dot_f16c, load8h_f16c, HALF_VALUE)
}

int qk_isa(void); /* qkernels.c: the implementation in use; 0 (scalar) where a test forces it (qk_use_isa) */

static qk_job_fn half_job(void) {
    static int f16c = -1;
    if (f16c < 0) {
        __builtin_cpu_init();
        f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    }
    return f16c && qk_isa() != 0 ? attend_half_f16c_job : attend_half_job;
}
#else
static qk_job_fn half_job(void) { return attend_half_job; }
#endif

#define ATTEND_MAX_THREADS 64

/* The B * Hq heads split into `threads` runs of whole heads, one job each (qk_pool.c). */
static void attend(qk_job_fn fn, const float *q, const int64_t *qs, const void *k, const int64_t *ks, const void *v,
                   const int64_t *vs, int64_t B, int64_t Hq, int64_t Hkv, int64_t p, int64_t D, int64_t Dv,
                   float scale, float *out, float *scratch, int threads) {
    int64_t heads = B * Hq;
    int n = threads < 1 ? 1 : threads > ATTEND_MAX_THREADS ? ATTEND_MAX_THREADS : threads;
    if (n > heads) n = (int)heads;
    AttendJob jobs[ATTEND_MAX_THREADS];
    for (int i = 0; i < n; i++)
        jobs[i] = (AttendJob){q, qs, ks, vs, k, v, Hq, Hkv, p, D, Dv, scale, out, scratch + (int64_t)i * p,
                              heads * i / n, heads * (i + 1) / n};
    qk_pool_run(fn, jobs, sizeof(AttendJob), n);
}

void qk_attend_one(const float *q, const int64_t *qs, const float *k, const int64_t *ks, const float *v,
                   const int64_t *vs, int64_t B, int64_t Hq, int64_t Hkv, int64_t p, int64_t D, int64_t Dv,
                   float scale, float *out, float *scratch, int threads) {
    attend(attend_float_job, q, qs, k, ks, v, vs, B, Hq, Hkv, p, D, Dv, scale, out, scratch, threads);
}

void qk_attend_one_h(const float *q, const int64_t *qs, const _Float16 *k, const int64_t *ks, const _Float16 *v,
                     const int64_t *vs, int64_t B, int64_t Hq, int64_t Hkv, int64_t p, int64_t D, int64_t Dv,
                     float scale, float *out, float *scratch, int threads) {
    attend(half_job(), q, qs, k, ks, v, vs, B, Hq, Hkv, p, D, Dv, scale, out, scratch, threads);
}
