/* AVX512-VNNI's Q4_K product for many tokens: 16 rows side by side, one row a lane.
 *
 * Included once, from qkernels.c's QK_PASS == 3 part (its S(), AI, QX, tuning and helpers in scope).
 *
 * The row-at-a-time kernels (wide_q45k, wide16_q4k) keep one row's sums for a token in the 16 lanes
 * of a register and add them up once per super-block, row and token (sum8z's shuffles). Here a super-block of 16 rows is first repacked in L1 (repack16): its quants unpacked to
 * bytes and transposed so that register (j, k) holds values 32j + 4k .. 32j + 4k + 3 of sub-block j
 * of every row, lane r for row r, next to the 16 rows' scales and mins as int32 lanes and d, dmin as
 * floats. Each token then takes, per 4 values, one vpdpbusd with those 4 x quants broadcast from
 * memory, and a row's sums stay in its lane from the first value to the last: no reduction, and
 * the super-block's float steps run on 16 rows at once.
 *
 * Exactness: lane r's integers are row r's sumi and summ as dot_q45k forms them (the quant-times-x
 * sums of each 16 values, at most 16 * 15 * 127 = 30480, fit an int16 and are scaled by vpdpwssd
 * with the word pair (scale, 0); the mins times the 16-sum pairs as q45k_block's madd), exact in any
 * order; then per super-block the float steps acc = acc + (d * dx) * sumi, acc = acc - (dmin * dx) *
 * summ of dot_q45k, per lane the same IEEE operations in the same order: the bits of the one-row
 * kernel for every row, whatever the batch. */

#define Q4K16_ROWS 16
#define Q4K16_TOKENS 64  /* tokens per pass over the rows: their float sums ([64][16]) stay in L1 */
#define Q4K16_TILE 8     /* tokens dotted with one repacked register while it is in a register */

typedef int32_t Q4K16_X4 __attribute__((may_alias, aligned(1)));  /* 4 bytes read in place, for a broadcast */

/* *s + the 4-product sums of q's bytes (unsigned) with the 4 bytes at x (signed) in every lane: vpdpbusd with
 * x broadcast from memory ({1to16}: a load, where GCC 12 would move them through a general register
 * and broadcast that on the shuffle port). */
static inline AI void S(dpbusd_x4)(__m512i *s, __m512i q, const Q4K16_X4 *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(*s) : "v"(q), "m"(*x));
}

/* A super-block of 16 rows, repacked (repack16). */
typedef struct {
    __m512i q[8 * 8];  /* [sub-block j][k]: lane r = row r's values 32j + 4k .. + 3, one byte each (0..15) */
    __m512i scale[8];  /* [j]: lane r = row r's scale of sub-block j (the word pair (scale, 0)) */
    __m512i min[8];    /* [j]: lane r = the word pair (min, min) of row r's sub-block j */
    __m512 d, dmin;    /* lane r = row r's d, dmin */
} S(Q4K16);

/* The 16 bytes at src + (4L + g) * row_bytes in 128-bit lane L of z[g], g < 4, then each lane's 4 x 4
 * dwords transposed: lane 4L + g of z[i] = dword i of those bytes of row 4L + g. Broadcasts (loads)
 * and masked ones (blends, on either vector port) arrange the lanes, where a 16 x 16 transpose
 * took twice the shuffles, all on one port. */
static inline AI void S(rows_to_lanes)(const uint8_t *src, int64_t row_bytes, __m512i z[4]) {
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
        const uint8_t *row = src + g * row_bytes;
        z[g] = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)row));
#pragma GCC unroll 4
        for (int L = 1; L < 4; L++)
            z[g] = _mm512_mask_broadcast_i32x4(z[g], (__mmask16)(0xf << 4 * L), _mm_loadu_si128((const __m128i *)(row + 4 * L * row_bytes)));
    }
    __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    z[0] = _mm512_unpacklo_epi64(t0, t2);
    z[1] = _mm512_unpackhi_epi64(t0, t2);
    z[2] = _mm512_unpacklo_epi64(t1, t3);
    z[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* Super-block b of rows w, w + row_bytes, .. (16) into *p; pf: the next rows to prefetch (or NULL).
 * Out of line: *p stays in memory (L1) for the token tiles that read it. */
static __attribute__((noinline)) void S(repack16)(const uint8_t *w, int64_t row_bytes, int64_t b, S(Q4K16) *p, const uint8_t *pf) {
    const int64_t bytes = 144;
    w += b * bytes;
    if (pf)
#pragma GCC unroll 16
        for (int r = 0; r < Q4K16_ROWS; r++) S(prefetch)(pf + r * row_bytes + b * bytes, bytes);  /* into L2 */
    /* d, dmin and the 12 scale bytes: 4 dwords a row, one register each */
    __m512i head[4];
    S(rows_to_lanes)(w, row_bytes, head);
    const __m512i halves = head[0], a0 = head[1], a1 = head[2], a2 = head[3];
    p->d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(halves));
    p->dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(halves, 16)));
    /* k_scales_mins on 16 rows at once: u[0], u[1] the scales 0-3, 4-7; u[2], u[3] the mins */
    const __m512i m6 = _mm512_set1_epi32(0x3f3f3f3f), m4 = _mm512_set1_epi32(0x0f0f0f0f), m2 = _mm512_set1_epi32(0x03030303);
    __m512i u[4];
    u[0] = _mm512_and_si512(a0, m6);
    u[1] = _mm512_or_si512(_mm512_and_si512(a2, m4), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(a0, 6), m2), 4));
    u[2] = _mm512_and_si512(a1, m6);
    u[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(a2, 4), m4),
                           _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(a1, 6), m2), 4));
    const __m512i byte = _mm512_set1_epi32(0xff);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        p->scale[j] = _mm512_and_si512(_mm512_srli_epi32(u[j / 4], 8 * (j % 4)), byte);
        __m512i m = _mm512_and_si512(_mm512_srli_epi32(u[2 + j / 4], 8 * (j % 4)), byte);
        p->min[j] = _mm512_or_si512(m, _mm512_slli_epi32(m, 16));
    }
    /* the quants, 16 bytes of each row at a time to lanes, then split into low and high nibbles */
    const __m512i nibble = _mm512_set1_epi8(0x0f);
#pragma GCC unroll 8
    for (int piece = 0; piece < 8; piece++) {  /* 16 bytes a row: dwords 4 (piece % 2) .. + 3 of chunk c = piece / 2 */
        __m512i q[4];
        S(rows_to_lanes)(w + 16 + 16 * piece, row_bytes, q);
        int c = piece / 2;
        for (int i = 0; i < 4; i++) {  /* low nibbles: sub-block 2c; high: 2c + 1 */
            int k = 4 * (piece % 2) + i;
            p->q[16 * c + k] = _mm512_and_si512(q[i], nibble);
            p->q[16 * c + 8 + k] = _mm512_and_si512(_mm512_srli_epi16(q[i], 4), nibble);
        }
    }
}

/* Tokens t0 .. t0 + NT of super-block b (repacked in *p) into acc[0..NT) (16 rows each). */
static inline AI void S(tokens16)(const S(Q4K16) *p, const QX *qx, int64_t b, int64_t t0, const int NT, float *acc) {
    const int64_t K = qx->K, nb = K / 256;
    __m512i sumi[Q4K16_TILE], summ[Q4K16_TILE];
    for (int i = 0; i < NT; i++) sumi[i] = summ[i] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
        for (int half = 0; half < 2; half++) {  /* 16 values: each lane's sum fits an int16 */
            const __m512i *q = p->q + 8 * j + 4 * half;
            __m512i q0 = q[0], q1 = q[1], q2 = q[2], q3 = q[3];
            for (int i = 0; i < NT; i++) {
                const Q4K16_X4 *x = (const Q4K16_X4 *)(qx->q + (t0 + i) * K + 256 * b + 32 * j + 16 * half);
                __m512i s;
                __asm__ volatile("vpxord %0, %0, %0" : "=v"(s));  /* a zeroing idiom: no move from a zero register */
                S(dpbusd_x4)(&s, q0, x);  /* 4 x quants broadcast from memory */
                S(dpbusd_x4)(&s, q1, x + 1);
                S(dpbusd_x4)(&s, q2, x + 2);
                S(dpbusd_x4)(&s, q3, x + 3);
                sumi[i] = _mm512_dpwssd_epi32(sumi[i], s, p->scale[j]);
            }
        }
    }
    for (int i = 0; i < NT; i++) {
        const int16_t *bs = qx->sums + (t0 + i) * (K / 16) + 16 * b;
        for (int j = 0; j < 8; j++) {  /* the 16-sum pair (2j, 2j + 1) times (min j, min j) */
            summ[i] = _mm512_dpwssd_epi32(summ[i], p->min[j], _mm512_set1_epi32(((const Q4K16_X4 *)bs)[j]));
        }
        __m512 dx = _mm512_set1_ps(qx->d[(t0 + i) * nb + b]);
        __m512 a = _mm512_loadu_ps(acc + 16 * i);
        a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_mul_ps(p->d, dx), _mm512_cvtepi32_ps(sumi[i])));
        a = _mm512_sub_ps(a, _mm512_mul_ps(_mm512_mul_ps(p->dmin, dx), _mm512_cvtepi32_ps(summ[i])));
        _mm512_storeu_ps(acc + 16 * i, a);
    }
}

/* The driver of a 16-row kernel, NAME over rows [0, rows) (a multiple of 16) of a matrix of
 * PACKED super-blocks with the n tokens of qx: y[t * ldy + r]. Per group of 16 rows and block of
 * Q4K16_TOKENS tokens, each super-block is repacked once (REPACK) and applied to tiles of up to
 * Q4K16_TILE tokens (TOKENS, called with constant tile sizes). */
#define QK_ROWS16(NAME, PACKED, REPACK, TOKENS)                                                                  \
    static void NAME(const uint8_t *w, int64_t row_bytes, int64_t rows, const QX *qx, int64_t n, float *y,     \
                     int64_t ldy) {                                                                            \
        const int64_t nb = qx->K / 256;                                                                        \
        PACKED packed __attribute__((aligned(64)));                                                            \
        float acc[Q4K16_TOKENS * Q4K16_ROWS] __attribute__((aligned(64)));                                     \
        for (int64_t r0 = 0; r0 + Q4K16_ROWS <= rows; r0 += Q4K16_ROWS) {                                     \
            const uint8_t *group = w + r0 * row_bytes;                                                         \
            for (int64_t t0 = 0; t0 < n; t0 += Q4K16_TOKENS) {                                                 \
                int64_t nt = n - t0 < Q4K16_TOKENS ? n - t0 : Q4K16_TOKENS;                                    \
                const uint8_t *pf = t0 == 0 && r0 + 2 * Q4K16_ROWS <= rows ? group + Q4K16_ROWS * row_bytes    \
                                                                           : NULL;                             \
                memset(acc, 0, sizeof acc);                                                                    \
                for (int64_t b = 0; b < nb; b++) {                                                             \
                    REPACK(group, row_bytes, b, &packed, pf);                                                  \
                    for (int64_t t = 0; t < nt; t += Q4K16_TILE) {                                             \
                        float *a = acc + 16 * t;                                                               \
                        switch (nt - t < Q4K16_TILE ? nt - t : Q4K16_TILE) {                                   \
                        case 1: TOKENS(&packed, qx, b, t0 + t, 1, a); break;                                   \
                        case 2: TOKENS(&packed, qx, b, t0 + t, 2, a); break;                                   \
                        case 3: TOKENS(&packed, qx, b, t0 + t, 3, a); break;                                   \
                        case 4: TOKENS(&packed, qx, b, t0 + t, 4, a); break;                                   \
                        case 5: TOKENS(&packed, qx, b, t0 + t, 5, a); break;                                   \
                        case 6: TOKENS(&packed, qx, b, t0 + t, 6, a); break;                                   \
                        case 7: TOKENS(&packed, qx, b, t0 + t, 7, a); break;                                   \
                        default: TOKENS(&packed, qx, b, t0 + t, 8, a); break;                                  \
                        }                                                                                      \
                    }                                                                                          \
                }                                                                                              \
                for (int64_t t = 0; t < nt; t++)                                                               \
                    _mm512_storeu_ps(y + (t0 + t) * ldy + r0, _mm512_loadu_ps(acc + 16 * t));                  \
            }                                                                                                  \
        }                                                                                                      \
    }

/* Rows [0, rows) (a multiple of 16) of a Q4_K matrix with the n tokens of qx: y[t * ldy + r]. */
QK_ROWS16(S(rows16_q4k), S(Q4K16), S(repack16), S(tokens16))
