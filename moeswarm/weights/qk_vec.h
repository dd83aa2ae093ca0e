/* What the float kernels share (qkernels.c, qk_rows.c): one clone per instruction set, and 16-lane
 * float vectors (GCC's vector extension; two AVX2 registers, one AVX-512). */
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

#endif
