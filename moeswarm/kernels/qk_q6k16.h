/* AVX512-VNNI's Q6_K product for many tokens: 16 rows side by side, one row a lane (qk_q4k16.h's
 * scheme for Q4_K, and its helpers: rows_to_lanes, dpbusd_x4, Q4K16_X4).
 *
 * Included once, from qkernels.c's QK_PASS == 3 part, after qk_q4k16.h.
 *
 * A super-block of 16 rows is first repacked in L1 (repack_q6k16): its ql and qh bytes transposed to
 * lanes, then each row's quants (0..63) decoded there, bytewise, so that register g holds values
 * 4g .. 4g + 3 of every row, lane r for row r; next to them the 16 rows' sub-block scales as
 * int32 lanes, their scale pairs as word pairs, and d as floats. Each token takes, per 4 values, one
 * vpdpbusd with those 4 x quants broadcast from memory, and a row's sums stay in its lane.
 *
 * Exactness: lane r's integers are row r's as dot_q6k forms them: per sub-block of 16 values the sum
 * of quant times x (at most 16 * 63 * 127 = 128016: an int32, so scaled by vpmulld, where Q4_K's fit
 * an int16 for vpdpwssd), times its scale, added up; less 32 times the scales times the 16-sums
 * (vpdpwssd on the scale pairs); exact in any order (|sum| < 2^31: 16 * 128016 * 128 + 32 * 16 *
 * 128 * 2032). Then per super-block the float step acc = acc + (d * dx) * isum of dot_q6k, per lane
 * the same IEEE operations in the same order: the bits of the one-row kernel for every row,
 * whatever the batch. */

#define Q6K_BYTES 210

/* A super-block of 16 rows, repacked (repack_q6k16). */
typedef struct {
    __m512i q[64];      /* [g]: lane r = row r's quants 4g .. 4g + 3, one byte each (0..63) */
    __m512i scale[16];  /* [j]: lane r = row r's scale of sub-block j (int32) */
    __m512i pair[8];    /* [k]: lane r = the word pair (scale 2k, scale 2k + 1) of row r */
    __m512 d;           /* lane r = row r's d */
} S(Q6K16);

/* Super-block b of rows w, w + row_bytes, .. (16) into *p; pf: the next rows to prefetch (or NULL).
 * Out of line: *p stays in memory (L1) for the token tiles that read it. */
static __attribute__((noinline)) void S(repack_q6k16)(const uint8_t *w, int64_t row_bytes, int64_t b, S(Q6K16) *p,
                                                      const uint8_t *pf) {
    uint16_t halves[Q4K16_ROWS];
    w += b * Q6K_BYTES;
    for (int r = 0; r < Q4K16_ROWS; r++) {
        if (pf) S(prefetch)(pf + r * row_bytes + b * Q6K_BYTES, Q6K_BYTES);  /* into L2 */
        memcpy(&halves[r], w + r * row_bytes + 208, 2);
    }
    p->d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)halves));
    /* The quants decoded in lanes: value 128h + 32s + l (l < 32) of a row is nibble s / 2 of ql byte
     * 64h + 32 (s % 2) + l, with bits 2s, 2s + 1 of qh byte 32h + l on top (q6k_block's steps), so value
     * group 32h + 8s + i (values 4 at a time) is built from ql dword 16h + 8 (s % 2) + i and qh dword
     * 8h + i, bytewise. */
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(0x03);
    for (int h = 0; h < 2; h++) {
        __m512i ql[16], qh[8];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) S(rows_to_lanes)(w + 64 * h + 16 * c, row_bytes, ql + 4 * c);
#pragma GCC unroll 2
        for (int c = 0; c < 2; c++) S(rows_to_lanes)(w + 128 + 32 * h + 16 * c, row_bytes, qh + 4 * c);
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++)
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                __m512i low = _mm512_and_si512(_mm512_srli_epi32(ql[8 * (s % 2) + i], 4 * (s / 2)), m4);
                __m512i high = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh[i], 2 * s), m2), 4);
                p->q[32 * h + 8 * s + i] = _mm512_or_si512(low, high);
            }
    }
    __m512i sc[4];  /* [i]: lane r = row r's scale bytes 4i .. 4i + 3 */
    S(rows_to_lanes)(w + 192, row_bytes, sc);
    for (int j = 0; j < 16; j++)  /* byte j % 4 of dword j / 4, sign-extended */
        p->scale[j] = _mm512_srai_epi32(_mm512_slli_epi32(sc[j / 4], 24 - 8 * (j % 4)), 24);
    for (int k = 0; k < 8; k++)
        p->pair[k] = _mm512_or_si512(_mm512_and_si512(p->scale[2 * k], _mm512_set1_epi32(0xffff)),
                                     _mm512_slli_epi32(p->scale[2 * k + 1], 16));
}

/* Tokens t0 .. t0 + NT of super-block b (repacked in *p) into acc[0..NT) (16 rows each). */
static inline AI void S(tokens_q6k16)(const S(Q6K16) *p, const QX *qx, int64_t b, int64_t t0, const int NT, float *acc) {
    const int64_t K = qx->K, nb = K / 256;
    __m512i sumi[Q4K16_TILE];
    for (int i = 0; i < NT; i++) sumi[i] = _mm512_setzero_si512();
    for (int j = 0; j < 16; j++) {  /* sub-block j: values 16j .. 16j + 15 */
        const __m512i *q = p->q + 4 * j;
        __m512i q0 = q[0], q1 = q[1], q2 = q[2], q3 = q[3], scale = p->scale[j];
        for (int i = 0; i < NT; i++) {
            const Q4K16_X4 *x = (const Q4K16_X4 *)(qx->q + (t0 + i) * K + 256 * b + 16 * j);
            __m512i s;
            __asm__ volatile("vpxord %0, %0, %0" : "=v"(s));  /* a zeroing idiom: no move from a zero register */
            S(dpbusd_x4)(&s, q0, x);
            S(dpbusd_x4)(&s, q1, x + 1);
            S(dpbusd_x4)(&s, q2, x + 2);
            S(dpbusd_x4)(&s, q3, x + 3);
            sumi[i] = _mm512_add_epi32(sumi[i], _mm512_mullo_epi32(s, scale));
        }
    }
    for (int i = 0; i < NT; i++) {
        const int16_t *bs = qx->sums + (t0 + i) * (K / 16) + 16 * b;
        __m512i offset = _mm512_setzero_si512();
        for (int k = 0; k < 8; k++)  /* the 16-sum pair (2k, 2k + 1) times the scale pair */
            offset = _mm512_dpwssd_epi32(offset, p->pair[k], _mm512_set1_epi32(((const Q4K16_X4 *)bs)[k]));
        __m512i isum = _mm512_sub_epi32(sumi[i], _mm512_slli_epi32(offset, 5));
        __m512 dx = _mm512_set1_ps(qx->d[(t0 + i) * nb + b]);
        __m512 a = _mm512_loadu_ps(acc + 16 * i);
        a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_mul_ps(p->d, dx), _mm512_cvtepi32_ps(isum)));
        _mm512_storeu_ps(acc + 16 * i, a);
    }
}

/* Rows [0, rows) (a multiple of 16) of a Q6_K matrix with the n tokens of qx: y[t * ldy + r]
 * (qk_q4k16.h's driver). */
QK_ROWS16(S(rows16_q6k), S(Q6K16), S(repack_q6k16), S(tokens_q6k16))
