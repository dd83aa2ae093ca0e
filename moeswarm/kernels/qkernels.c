/* Matrix products read straight from GGUF blocks: y[t, r] = dot(row r of W, x[t]), float32.
 *
 * W is a [rows, K] matrix kept in its GGUF encoding (row r is row_bytes bytes of blocks).
 *
 * Integer path (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; the section "Integer path" below):
 * each token's x is quantized once per call to int8 blocks with a float scale, as llama.cpp does,
 * and each (row, token) is a sum of integer dots of weight quants with x quants (AVX2 maddubs/madd,
 * AVX-VNNI and AVX512-VNNI vpdpbusd/vpdpwssd), the float scales applied once per block. Rows go by
 * in groups of 8, tokens in tiles of 4 that share each unpacked weight block (AVX512-VNNI's Q4_K
 * with several tokens: 16 rows side by side, one a lane, qk_q4k16.h).
 *
 * Float path (F32, F16, BF16, MXFP4): a tile of ROW_TILE rows is decoded into a small float32
 * scratch (a few KiB: it stays in L1), then dotted with every token's x: each decoded row is used by
 * all tokens of the call. With a few tokens (the usual case for one expert) rows_few_tokens decodes
 * a few rows a chunk at a time and keeps their sums in registers. Blocks are decoded with vector
 * code (bytes widened by a 64-byte load and a permute, see top_bytes16), which never reads past the
 * matrix (decode_row). (qk_dequantize decodes every type this way, for tests and fallbacks.)
 *
 * Exactness: the bits of y[t, r] depend only on row r and x[t]. Float path: the dot product's
 * association is fixed (16 lanes over k = 16i + lane, then a fixed tree). Integer path: x[t]'s
 * quantization is elementwise IEEE arithmetic on x[t] alone; integer sums are exact in any order;
 * the float scalings and sums are the same operations in the same order in the scalar code and
 * every SIMD one (see "Integer path"). Every operation is a plain IEEE float32 operation (built
 * with -ffp-contract=off: no fused multiply-add), and threads split the rows, never a dot product.
 * So the result does not depend on the thread count, the other rows or tokens of a call, the
 * buffers' addresses, or which implementation the CPU runs (tests/test_quant_kernels.py forces
 * each one through qk_use_isa and compares the bits).
 *
 * A whole expert (qk_expert: gate and up products, the activation, the down product and its bias)
 * and a whole layer's routed experts (qk_experts: grouping by expert, routing weights, the adds into
 * the output) run in one call each, by the same functions and float operations as the per-matrix
 * calls (qk_matmul, qk_silu_glu / qk_oss_glu) and torch's adds and products in between: the same
 * bits, without the caller's per-matrix work (moeswarm/kernels/quant_experts.py).
 *
 * Plain C with no Python API: moeswarm/kernels/qk_library.py loads it with ctypes. The file includes
 * itself once per instruction set (QK_PASS) to build the SIMD integer dots from one source.
 */
#ifndef QK_PASS  /* the main part; the integer dots per instruction set are at the end */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "frames.h"
#include "qk_dispatch.h"
#include "qk_pool.h"
#include "qk_vec.h"

#define ROW_TILE 4
#define TOKEN_TILE 2
#define FEW_TOKENS 4
#define FEW_ROWS 8
#define CHUNK 256
#define TILES_PER_THREAD 8  /* a product's row tiles per thread: what a thread on a busy core may leave to the others */

typedef uint32_t u16 __attribute__((vector_size(LANES * sizeof(uint32_t)), aligned(4)));
typedef uint16_t h16 __attribute__((vector_size(LANES * sizeof(uint16_t)), aligned(2)));

/* Bytes to int32 lanes, int32 to float, floats stored: the vector forms of the scalar decoders'
 * steps (each lane's operations are those of the scalar code, so the same bits). */
typedef int32_t i16v __attribute__((vector_size(LANES * sizeof(int32_t)), aligned(4)));

/* The bytes p[0..16) one per lane, at the top of it: a 64-byte load, its first 4 words each spread
 * to 4 lanes (one permute) and shifted (one variable shift). The load reads up to 48 bytes past
 * p + 16: decode_row makes sure they are readable (OVERREAD). */
#define OVERREAD 64
/* Choices that change how fast a product runs, never its bits (every one computes the same integer
 * sums and float steps per (row, token)): measured on the host by moeswarm/kernels/kernel_tuning.py at
 * first use and set with qk_tune, rather than fixed for a CPU family. Until then, the defaults below.
 *   prefetch   how the dots fetch the next row group's weights ahead: QK_PREFETCH_NONE, _L2 (into L2)
 *              or _NTA (non-temporal: not kept in the shared L3 when they leave L2)
 *   wide_from  the K-quants' wide tiles (several tokens' sums in one register) from this many tokens on
 *   wide16     AVX-512's 16-token Q4_K tiles while more than 8 tokens are left (0: tiles of 8 only)
 *   rows16_from  AVX512-VNNI's Q4_K on 16 rows side by side (qk_q4k16.h) from this many tokens on
 *              (2..64; 0: never)
 *   q6k_rows16_from  the same for Q6_K (qk_q6k16.h) */
enum { QK_PREFETCH_NONE = 0, QK_PREFETCH_L2 = 1, QK_PREFETCH_NTA = 2 };
static struct { int prefetch, wide_from, wide16, rows16_from, q6k_rows16_from; } tuning = {QK_PREFETCH_L2, 4, 1, 2, 4};
static const u16 BYTE_SHIFT = {24, 16, 8, 0, 24, 16, 8, 0, 24, 16, 8, 0, 24, 16, 8, 0};
static inline __attribute__((always_inline)) u16 top_bytes16(const uint8_t *p) {
    u16 words;
    memcpy(&words, p, sizeof words);
    return __builtin_shufflevector(words, words, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3) << BYTE_SHIFT;
}
static inline __attribute__((always_inline)) i16v unsigned16(const uint8_t *p) { return (i16v)(top_bytes16(p) >> 24); }
static inline __attribute__((always_inline)) i16v signed16(const uint8_t *p) { return (i16v)top_bytes16(p) >> 24; }
static inline __attribute__((always_inline)) v16 to_float(i16v v) { return __builtin_convertvector(v, v16); }
static inline __attribute__((always_inline)) void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* GGUF type ids (ggml_type). */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30, T_MXFP4 = 39 };

/* IEEE half -> float, exactly, without branches (the loops over F16 rows vectorise) and without
 * subnormal float arithmetic (a microcode assist on x86, a hundred cycles): a normal half's exponent
 * is rebased (+112); a subnormal half or zero is its 10-bit mantissa times 2^-24 (an exact product,
 * a normal float); infinities and NaNs keep an all-ones exponent. */
static inline __attribute__((always_inline)) float bits_float(uint32_t bits) {
    union { uint32_t u; float f; } v = {bits};
    return v.f;
}

static inline __attribute__((always_inline)) uint32_t float_bits(float f) {
    union { float f; uint32_t u; } v = {f};
    return v.u;
}

static inline __attribute__((always_inline)) float half_to_float(uint16_t h) {
    uint32_t magnitude = (uint32_t)(h & 0x7fff) << 13, exponent = h & 0x7c00;
    uint32_t bits = exponent == 0 ? float_bits((float)(h & 0x03ff) * 0x1p-24f) : magnitude + (112u << 23);
    bits = exponent == 0x7c00 ? (magnitude | 0x7f800000u) : bits;
    return bits_float(bits | ((uint32_t)(h & 0x8000) << 16));
}

static inline __attribute__((always_inline)) float read_half(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return half_to_float(h); }

/* K-quant 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes. */
static inline __attribute__((always_inline)) void k_scale_min(int j, const uint8_t *s, int *scale, int *min) {
    if (j < 4) {
        *scale = s[j] & 63;
        *min = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* A Q4_K / Q5_K super-block's 12 packed bytes s -> scmn: the 8 6-bit scales, then the 8 mins
 * (k_scale_min for j = 0..7, 4 at a time in 32-bit words). */
static inline __attribute__((always_inline)) void k_scales_mins(const uint8_t *s, uint8_t scmn[16]) {
    uint32_t u[4], a[3];
    memcpy(a, s, 12);
    u[0] = a[0] & 0x3f3f3f3fu;
    u[1] = (a[2] & 0x0f0f0f0fu) | ((a[0] >> 6) & 0x03030303u) << 4;
    u[2] = a[1] & 0x3f3f3f3fu;
    u[3] = ((a[2] >> 4) & 0x0f0f0f0fu) | ((a[1] >> 6) & 0x03030303u) << 4;
    memcpy(scmn, u, 16);
}

static int block_size(int type) {
    switch (type) {
    case T_F32: case T_F16: case T_BF16: return 1;
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: case T_MXFP4: return 32;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return 256;
    default: return 0;
    }
}

static int block_bytes(int type) {
    switch (type) {
    case T_F32: return 4;
    case T_F16: case T_BF16: return 2;
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_MXFP4: return 17;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* Half of the E8M0 scale 2^(e-127): the table values above are doubled. */
static float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Decode one row of K values (inlined into each CPU clone of decode_tile). */
/* Decode K values of whole blocks; the vector loads may read OVERREAD bytes past the last block. */
static inline __attribute__((always_inline)) void decode_blocks(int type, const uint8_t *src, int64_t K, float *out) {
    int64_t nb = K / (block_size(type) ? block_size(type) : 1);
    switch (type) {
    case T_F32:
        memcpy(out, src, (size_t)K * 4);
        return;
    case T_F16: {
        const uint16_t *h = (const uint16_t *)src;  /* GGUF rows of 2-byte values start 2-byte aligned */
        int64_t i = 0;
        for (; i + LANES <= K; i += LANES) {  /* half_to_float, 16 at a time: the same bit operations */
            h16 halves;
            memcpy(&halves, h + i, sizeof halves);
            u16 wide = __builtin_convertvector(halves, u16);
            u16 magnitude = (wide & 0x7fff) << 13, exponent = wide & 0x7c00;
            u16 small = (u16)(__builtin_convertvector((i16v)(wide & 0x03ff), v16) * 0x1p-24f);
            u16 zero = (u16)(exponent == 0), special = (u16)(exponent == 0x7c00);  /* all ones where so */
            u16 bits = (special & (magnitude | 0x7f800000u)) | (zero & small) | (~(special | zero) & (magnitude + (112u << 23)));
            v16 values = (v16)(bits | ((wide & 0x8000) << 16));
            memcpy(out + i, &values, sizeof values);
        }
        for (; i < K; i++) out[i] = half_to_float(h[i]);
        return;
    }
    case T_BF16: {
        const uint16_t *h = (const uint16_t *)src;
        for (int64_t i = 0; i < K; i++) out[i] = bits_float((uint32_t)h[i] << 16);
        return;
    }
    case T_Q8_0:
        for (int64_t b = 0; b < nb; b++, src += 34, out += 32) {
            float d = read_half(src);
            for (int g = 0; g < 2; g++) store16(out + 16 * g, to_float(signed16(src + 2 + 16 * g)) * d);
        }
        return;
    case T_Q4_0:
    case T_Q4_1:
        for (int64_t b = 0; b < nb; b++, out += 32) {
            float d = read_half(src), m = type == T_Q4_1 ? read_half(src + 2) : 0.0f;
            i16v q = unsigned16(src + (type == T_Q4_1 ? 4 : 2));
            int offset = type == T_Q4_1 ? 0 : 8;
            store16(out, to_float((q & 0x0f) - offset) * d + m);
            store16(out + 16, to_float((q >> 4) - offset) * d + m);
            src += block_bytes(type);
        }
        return;
    case T_Q5_0:
    case T_Q5_1:
        for (int64_t b = 0; b < nb; b++, out += 32) {
            float d = read_half(src), m = type == T_Q5_1 ? read_half(src + 2) : 0.0f;
            const uint8_t *p = src + (type == T_Q5_1 ? 4 : 2);
            uint32_t high;
            memcpy(&high, p, 4);
            i16v q = unsigned16(p + 4);
            u16 bit = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};  /* value j's bit: j, and j + 16 */
            i16v high_lo = (i16v)(((high >> bit) & 1) << 4), high_hi = (i16v)(((high >> (bit + 16)) & 1) << 4);
            int offset = type == T_Q5_1 ? 0 : 16;
            store16(out, to_float(((q & 0x0f) | high_lo) - offset) * d + m);
            store16(out + 16, to_float(((q >> 4) | high_hi) - offset) * d + m);
            src += block_bytes(type);
        }
        return;
    case T_MXFP4:
        for (int64_t b = 0; b < nb; b++, src += 17, out += 32) {
            float d = e8m0_half(src[0]);
            const uint8_t *q = src + 1;
            for (int j = 0; j < 16; j++) {
                out[j] = (float)MXFP4_VALUES[q[j] & 0x0f] * d;
                out[j + 16] = (float)MXFP4_VALUES[q[j] >> 4] * d;
            }
        }
        return;
    case T_Q4_K:
    case T_Q5_K:
        for (int64_t b = 0; b < nb; b++) {
            float d = read_half(src), dmin = read_half(src + 2);
            const uint8_t *scales = src + 4;
            const uint8_t *high = type == T_Q5_K ? src + 16 : NULL;  /* [32]: bit 2c / 2c+1 of value l */
            const uint8_t *q = src + (type == T_Q5_K ? 48 : 16);
            for (int chunk = 0; chunk < 4; chunk++, q += 32, out += 64) {
                int s0, m0, s1, m1;
                k_scale_min(2 * chunk, scales, &s0, &m0);
                k_scale_min(2 * chunk + 1, scales, &s1, &m1);
                float d0 = d * (float)s0, dm0 = dmin * (float)m0, d1 = d * (float)s1, dm1 = dmin * (float)m1;
                for (int g = 0; g < 2; g++) {  /* values l in [16 g, 16 g + 16) */
                    i16v raw = unsigned16(q + 16 * g), lo = raw & 0x0f, hi = raw >> 4;
                    if (high) {
                        i16v bits = unsigned16(high + 16 * g);
                        lo |= ((bits >> (2 * chunk)) & 1) << 4;
                        hi |= ((bits >> (2 * chunk + 1)) & 1) << 4;
                    }
                    store16(out + 16 * g, d0 * to_float(lo) - dm0);
                    store16(out + 32 + 16 * g, d1 * to_float(hi) - dm1);
                }
            }
            src += block_bytes(type);
        }
        return;
    case T_Q6_K:
        for (int64_t b = 0; b < nb; b++, src += 210) {
            const uint8_t *low = src, *high = src + 128;
            const int8_t *scales = (const int8_t *)(src + 192);
            float d = read_half(src + 208);
            for (int half = 0; half < 2; half++, low += 64, high += 32, scales += 8, out += 128) {
                for (int part = 0; part < 2; part++) {  /* values l in [16 part, 16 part + 16): scales[part + 2 j] */
                    float f0 = d * (float)scales[part], f1 = d * (float)scales[part + 2];
                    float f2 = d * (float)scales[part + 4], f3 = d * (float)scales[part + 6];
                    i16v a = unsigned16(low + 16 * part), c = unsigned16(low + 32 + 16 * part);
                    i16v h = unsigned16(high + 16 * part);
                    float *o = out + 16 * part;
                    store16(o, f0 * to_float(((a & 0x0f) | ((h & 3) << 4)) - 32));
                    store16(o + 32, f1 * to_float(((c & 0x0f) | (((h >> 2) & 3) << 4)) - 32));
                    store16(o + 64, f2 * to_float(((a >> 4) | (((h >> 4) & 3) << 4)) - 32));
                    store16(o + 96, f3 * to_float(((c >> 4) | (((h >> 6) & 3) << 4)) - 32));
                }
            }
        }
        return;
    }
}

/* Decode K values (whole blocks) from src, reading nothing at or past `end`: the blocks too close
 * to `end` for the vector loads' overread are copied into a padded buffer first. */
static inline __attribute__((always_inline)) void decode_row(int type, const uint8_t *src, int64_t K, float *out,
                                                             const uint8_t *end) {
    int64_t values = block_size(type), bytes = block_bytes(type), nb = K / values;
    int64_t safe = (end - src - OVERREAD) / bytes;  /* blocks [0, safe) may be read as they are */
    if (values == 1 || safe >= nb) { decode_blocks(type, src, K, out); return; }
    if (safe < 0) safe = 0;
    decode_blocks(type, src, safe * values, out);
    for (int64_t b = safe; b < nb; b++) {
        uint8_t padded[256 + OVERREAD] = {0};
        memcpy(padded, src + b * bytes, (size_t)bytes);
        decode_blocks(type, padded, values, out + b * values);
    }
}

static inline __attribute__((always_inline)) float reduce16(v16 acc) {
    float a[LANES];
    memcpy(a, &acc, sizeof a);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++) a[i] = a[i] + a[i + w];
    return a[0];
}


/* Finish one accumulator: the tail k >= main in lane k mod 16, then the fixed tree. */
static inline __attribute__((always_inline)) float finish(v16 acc, const float *w, const float *x, int64_t main, int64_t K) {
    float lanes[LANES];
    memcpy(lanes, &acc, sizeof lanes);
    for (int64_t k = main; k < K; k++) lanes[k % LANES] = lanes[k % LANES] + w[k] * x[k];
    memcpy(&acc, lanes, sizeof lanes);
    return reduce16(acc);
}

/* y[t][r] = dot(w[r], x[t]) for ROW_TILE decoded rows w [ROW_TILE][K] and TOKEN_TILE tokens:
 * every (r, t) has its own accumulator, so the bits are those of a single dot product. */
CLONES static void dot_tile(const float *w, int64_t K, int nrows, const float *const *x, int ntokens, float *y, int64_t ldy) {
    v16 acc[TOKEN_TILE][ROW_TILE];
    for (int t = 0; t < TOKEN_TILE; t++)
        for (int r = 0; r < ROW_TILE; r++) acc[t][r] = (v16){0};
    int64_t main = K - K % LANES;
    for (int64_t k = 0; k < main; k += LANES) {
        v16 wv[ROW_TILE];
        for (int r = 0; r < ROW_TILE; r++) wv[r] = load16(w + r * K + k);
        for (int t = 0; t < TOKEN_TILE; t++) {
            v16 xv = load16(x[t] + k);
            for (int r = 0; r < ROW_TILE; r++) acc[t][r] = acc[t][r] + wv[r] * xv;
        }
    }
    for (int t = 0; t < ntokens; t++)
        for (int r = 0; r < nrows; r++) y[t * ldy + r] = finish(acc[t][r], w + r * K, x[t], main, K);
}

/* A few tokens (n <= FEW_TOKENS): rows go by in tiles of `R` and K in chunks of CHUNK values; a
 * chunk of the tile's rows is decoded (scratch [R][CHUNK]: 8 KiB at most, it stays in L1) and at
 * once dotted with each token, R x NT accumulators live in registers from the first chunk to the
 * last, so the row's blocks are read once and the independent sums keep the vector units busy.
 * Only for types of 32- or 256-value blocks: K is a multiple of LANES, no tail. Lane k mod 16 of
 * acc[t][r] gets w[r][k] * x[t][k] in the order of k, then the fixed tree: the bits of dot_tile. */
static inline __attribute__((always_inline)) void few_tokens_body(
        int type, const uint8_t *w, int64_t row_bytes, int64_t K, int64_t rows,
        const float *const *x, float *y, int64_t ldy, float *scratch, const int R, const int NT) {
    int64_t values = block_size(type), bytes = block_bytes(type);
    const uint8_t *end = w + rows * row_bytes;
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
        int nrows = (int)(rows - r0 < R ? rows - r0 : R);
        v16 acc[FEW_TOKENS][FEW_ROWS];
        for (int t = 0; t < NT; t++)
            for (int r = 0; r < R; r++) acc[t][r] = (v16){0};
        for (int64_t c = 0; c < K; c += CHUNK) {
            int64_t len = K - c < CHUNK ? K - c : CHUNK;
            for (int r = 0; r < nrows; r++)
                decode_row(type, w + (r0 + r) * row_bytes + c / values * bytes, len, scratch + r * CHUNK, end);
            for (int64_t k = 0; k < len; k += LANES) {
                v16 wv[FEW_ROWS];
                for (int r = 0; r < R; r++) wv[r] = load16(scratch + r * CHUNK + k);
                for (int t = 0; t < NT; t++) {
                    v16 xv = load16(x[t] + c + k);
                    for (int r = 0; r < R; r++) acc[t][r] = acc[t][r] + wv[r] * xv;
                }
            }
        }
        for (int t = 0; t < NT; t++)
            for (int r = 0; r < nrows; r++) y[t * ldy + r0 + r] = reduce16(acc[t][r]);
    }
}

CLONES static void rows_few_tokens(int type, const uint8_t *w, int64_t row_bytes, int64_t K, int64_t rows,
                                   const float *const *x, int n, float *y, int64_t ldy, float *scratch) {
    switch (n) {  /* constant tile sizes: the accumulators stay in registers */
    case 1: few_tokens_body(type, w, row_bytes, K, rows, x, y, ldy, scratch, 8, 1); return;
    case 2: few_tokens_body(type, w, row_bytes, K, rows, x, y, ldy, scratch, 8, 2); return;
    case 3: few_tokens_body(type, w, row_bytes, K, rows, x, y, ldy, scratch, 4, 3); return;
    default: few_tokens_body(type, w, row_bytes, K, rows, x, y, ldy, scratch, 4, 4); return;
    }
}

/* F32 rows with a few tokens, read in place (an F32 "decode" is a copy): each (row, token) sum as
 * dot_tile's, lane k mod 16 in the order of k then finish, so the same bits, without the copy or
 * dot_tile's second, duplicated token at n = 1 (a router's product; docs/measured.md, "kernels"). */
static inline __attribute__((always_inline)) void f32_tile(const float *w, int64_t K, const float *x, float *y, const int R) {
    int64_t main = K - K % LANES;
    v8 lo[ROW_TILE], hi[ROW_TILE];  /* lanes 0-7 and 8-15 of each row's 16 (qk_vec.h) */
    for (int r = 0; r < R; r++) lo[r] = hi[r] = (v8){0};
    for (int64_t k = 0; k < main; k += LANES) {
        v8 xl = load8(x + k), xh = load8(x + k + 8);
        for (int r = 0; r < R; r++) {
            lo[r] = lo[r] + load8(w + r * K + k) * xl;
            hi[r] = hi[r] + load8(w + r * K + k + 8) * xh;
        }
    }
    for (int r = 0; r < R; r++) {
        add_tail(&lo[r], &hi[r], w + r * K, x, main, K);
        y[r] = tree16(lo[r], hi[r]);
    }
}

CLONES static void f32_rows(const float *w, int64_t K, int64_t rows, const float *x, int64_t n, int64_t ldx,
                            float *y, int64_t ldy) {
    for (int64_t r = 0; r < rows; r += ROW_TILE)
        for (int64_t t = 0; t < n; t++) {
            if (rows - r >= ROW_TILE) f32_tile(w + r * K, K, x + t * ldx, y + t * ldy + r, ROW_TILE);
            else for (int64_t q = r; q < rows; q++) f32_tile(w + q * K, K, x + t * ldx, y + t * ldy + q, 1);
        }
}

CLONES static void decode_tile(int type, const uint8_t *src, int64_t row_bytes, int64_t K, int nrows, float *out) {
    for (int r = 0; r < nrows; r++) decode_row(type, src + r * row_bytes, K, out + r * K, src + nrows * row_bytes);
    if (nrows < ROW_TILE) memset(out + nrows * K, 0, (size_t)(ROW_TILE - nrows) * K * sizeof(float));
}

/* ---- Integer path: activations quantized to int8 blocks, integer dots on the weight quants ----
 *
 * Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K. Each token's x row is quantized once per call
 * (quantize_tokens) into blocks of QB values (32 for the 32-value types, 256 for the K-quants):
 * one float scale d = amax / 127 and QB int8 q = round(x * 127 / amax), in [-127, 127]; plus the
 * int16 sum of every 16 consecutive q (the K-quants' min and offset terms). A dot product is then
 * a sum of integer dots of weight quants with activation quants, scaled by float scales:
 *   32-value types: 8 int32 lanes per block, lane j = the sum of the 4 products of values 4j..4j+3;
 *     16 float lanes, block b's lane j into a = acc[8 * (b % 2) + j]: a = a + (dw * dx) * (float)lane
 *     block after block (Q4_1/Q5_1 then a = a + (mw * dx) * (float)(the 4 q of x summed)); then
 *     acc[j] + acc[j + 8] and the fixed tree of 8 lanes (a 512-bit register holds a block pair);
 *   K-quants: per 256-value super-block one exact int32 (sub-block scales multiplied in as
 *     integers), then one float accumulator: acc = acc + (d * dx) * (float)sumi, for Q4_K/Q5_K
 *     then acc = acc - (dmin * dx) * (float)summ (summ = the mins times the 16-sums).
 * Integer sums are exact whatever the order (no int16 saturation: |q| <= 127 for x, and the
 * widening steps' pairs stay below 2^15), so every implementation (scalar, AVX2, AVX-VNNI,
 * AVX512-VNNI) gives the same integers, and the float operations above are the same scalar or
 * per-lane IEEE operations in the same order in each: the same bits. */

#define QX_TILE 4  /* tokens dotted with one weight block while it is in registers */

#define WIDE_TILE 8  /* the K-quants' wide tile: 8 tokens' sums in one register's lanes */
#define WIDE16_TILE 16  /* AVX512's Q4_K tile: 16 tokens' sums in one 512-bit register's lanes (wide16_q4k) */

/* Quantized activations: q [n][K], d [n][K / block], sums [n][K / 16]. */
typedef struct {
    int64_t K, block;
    int8_t *q;
    float *d;
    int16_t *sums;
    float *dx8;  /* 32-value blocks: [n][K / 4], each d repeated 8 times (a vector's load) */
    /* K-quants, token-major (a wide tile's 8 tokens side by side): n = the tokens rounded up to
     * WIDE_TILE; dT [K / 256][n] = d; sT [K / 256][n / 8][8][8][2]: super-block b, tile u (tokens
     * 8u..8u + 7), g < 8, token, then the 16-sums pair (2g, 2g + 1), so that a tile's pairs for one
     * super-block are 256 contiguous bytes (four AVX-512 loads); the pad tokens' entries are 0 */
    int64_t n;
    float *dT;
    int16_t *sT;
} QX;

static int integer_type(int type) {
    switch (type) {
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: case T_Q4_K: case T_Q5_K: case T_Q6_K: return 1;
    default: return 0;
    }
}

/* One row of K floats -> blocks of `block` int8 and their scales. amax is an integer max of the
 * magnitudes' bits (order-free, and a NaN wins); rounding is to nearest even by the 1.5 * 2^23
 * trick (plain float adds: |v| <= 127); a NaN quantizes to -127 (the clamp), never undefined.
 * Cloned per CPU for speed: each clone does these same elementwise IEEE operations, so the same q. */
CLONES static void quantize_row(const float *x, int64_t K, int64_t block, int8_t *q, float *d, int16_t *sums) {
    for (int64_t b = 0; b < K / block; b++, x += block, q += block) {
        uint32_t top = 0;
        for (int64_t i = 0; i < block; i++) {
            uint32_t bits = float_bits(x[i]) & 0x7fffffffu;
            top = bits > top ? bits : top;
        }
        float amax = bits_float(top);
        float inv = amax >= 0x1p-100f ? 127.0f / amax : 0.0f;  /* tiny blocks (and NaN) quantize to 0 */
        d[b] = amax / 127.0f;
        for (int64_t i = 0; i < block; i++) {
            float v = x[i] * inv;
            float r = (v + 0x1.8p23f) - 0x1.8p23f;
            r = r >= -127.0f ? r : -127.0f;
            r = r <= 127.0f ? r : 127.0f;
            q[i] = (int8_t)(int)r;
        }
        for (int64_t g = 0; g < block / 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += q[16 * g + i];
            sums[b * (block / 16) + g] = (int16_t)s;
        }
    }
}

/* Where super-block b's 16-sum pairs of the wide tile starting at token t0 begin in sT (n: its n). */
static inline __attribute__((always_inline)) int64_t wide_pairs(int64_t b, int64_t n, int64_t t0) {
    return (b * (n / WIDE_TILE) + t0 / WIDE_TILE) * (8 * WIDE_TILE * 2);
}

static void quantize_tokens(const float *x, int64_t n, int64_t ldx, QX *qx) {
    for (int64_t t = 0; t < n; t++)
        quantize_row(x + t * ldx, qx->K, qx->block, qx->q + t * qx->K, qx->d + t * (qx->K / qx->block),
                     qx->sums + t * (qx->K / 16));
    if (qx->block == 32)
        for (int64_t i = 0; i < n * (qx->K / 4); i++) qx->dx8[i] = qx->d[i / 8];
    int64_t nb = qx->K / 256, n8 = qx->n;
    if (qx->block == 256)
        for (int64_t t = 0; t < n; t++)
            for (int64_t b = 0; b < nb; b++) {
                qx->dT[b * n8 + t] = qx->d[t * nb + b];
                for (int g = 0; g < 8; g++)
                    for (int k = 0; k < 2; k++)
                        qx->sT[wide_pairs(b, n8, t - t % WIDE_TILE) + (g * WIDE_TILE + t % WIDE_TILE) * 2 + k] =
                            qx->sums[t * (qx->K / 16) + 16 * b + 2 * g + k];
            }
}

/* The fixed tree of 8 float lanes: a[i] + a[i + 4], then + a[i + 2], then + a[i + 1]. */
static inline __attribute__((always_inline)) float tree8(const float *lanes) {
    float a[8];
    memcpy(a, lanes, sizeof a);
    for (int w = 4; w > 0; w /= 2)
        for (int i = 0; i < w; i++) a[i] = a[i] + a[i + w];
    return a[0];
}

/* The 32 integer weight values of a 32-value block (signed for Q4_0/Q5_0/Q8_0, 0..31 for Q4_1/Q5_1),
 * its scale and its min (0 without one). */
static inline __attribute__((always_inline)) void unpack32(int type, const uint8_t *blk, int v[32], float *dw, float *mw) {
    *dw = read_half(blk);
    *mw = type == T_Q4_1 || type == T_Q5_1 ? read_half(blk + 2) : 0.0f;
    uint32_t qh = 0;
    switch (type) {
    case T_Q8_0:
        for (int k = 0; k < 32; k++) v[k] = (int8_t)blk[2 + k];
        return;
    case T_Q4_0: case T_Q4_1: {
        const uint8_t *q = blk + (type == T_Q4_1 ? 4 : 2);
        int offset = type == T_Q4_1 ? 0 : 8;
        for (int j = 0; j < 16; j++) { v[j] = (q[j] & 15) - offset; v[j + 16] = (q[j] >> 4) - offset; }
        return;
    }
    case T_Q5_0: case T_Q5_1: {
        const uint8_t *p = blk + (type == T_Q5_1 ? 4 : 2);
        memcpy(&qh, p, 4);
        int offset = type == T_Q5_1 ? 0 : 16;
        for (int j = 0; j < 16; j++) {
            v[j] = ((p[4 + j] & 15) | (int)((qh >> j) & 1) << 4) - offset;
            v[j + 16] = ((p[4 + j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4) - offset;
        }
        return;
    }
    }
}

/* The portable reference of every integer dot (and the baseline CPUs' implementation). */
static float dot_int_scalar(int type, const uint8_t *w, const QX *qx, int64_t t) {
    int64_t K = qx->K, bytes = block_bytes(type);
    const int8_t *x = qx->q + t * K;
    const float *xd = qx->d + t * (K / qx->block);
    const int16_t *bs = qx->sums + t * (K / 16);
    if (block_size(type) == 32) {
        float acc16[16] = {0}, acc[8];  /* block b's lane j in acc16[8 * (b % 2) + j] */
        for (int64_t b = 0; b < K / 32; b++, w += bytes, x += 32) {
            int v[32];
            float dw, mw;
            unpack32(type, w, v, &dw, &mw);
            float dd = dw * xd[b], md = mw * xd[b];
            float *a = acc16 + 8 * (b % 2);
            for (int j = 0; j < 8; j++) {
                int lane = 0, s = 0;
                for (int i = 4 * j; i < 4 * j + 4; i++) { lane += v[i] * x[i]; s += x[i]; }
                a[j] = a[j] + dd * (float)lane;
                if (type == T_Q4_1 || type == T_Q5_1) a[j] = a[j] + md * (float)s;
            }
        }
        for (int j = 0; j < 8; j++) acc[j] = acc16[j] + acc16[j + 8];
        return tree8(acc);
    }
    float acc = 0.0f;
    for (int64_t b = 0; b < K / 256; b++, w += bytes, x += 256, bs += 16) {
        int u[256], sumi = 0;
        if (type == T_Q6_K) {
            const uint8_t *ql = w, *qh = w + 128;
            const int8_t *sc = (const int8_t *)(w + 192);
            for (int h = 0; h < 2; h++, ql += 64, qh += 32)
                for (int l = 0; l < 32; l++) {
                    u[128 * h + l] = (ql[l] & 15) | (qh[l] & 3) << 4;
                    u[128 * h + 32 + l] = (ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4;
                    u[128 * h + 64 + l] = (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4;
                    u[128 * h + 96 + l] = (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4;
                }
            for (int i = 0; i < 16; i++) {
                int s = 0;
                for (int l = 16 * i; l < 16 * i + 16; l++) s += (u[l] - 32) * x[l];
                sumi += sc[i] * s;
            }
            acc = acc + (read_half(w + 208) * xd[b]) * (float)sumi;
            continue;
        }
        const uint8_t *qh = w + 16, *qs = w + (type == T_Q5_K ? 48 : 16);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                u[64 * c + l] = qs[32 * c + l] & 15;
                u[64 * c + 32 + l] = qs[32 * c + l] >> 4;
                if (type == T_Q5_K) {
                    u[64 * c + l] |= ((qh[l] >> (2 * c)) & 1) << 4;
                    u[64 * c + 32 + l] |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                }
            }
        int summ = 0;
        for (int j = 0; j < 8; j++) {
            int sc, m, s = 0;
            k_scale_min(j, w + 4, &sc, &m);
            for (int l = 32 * j; l < 32 * j + 32; l++) s += u[l] * x[l];
            sumi += sc * s;
            summ += m * (bs[2 * j] + bs[2 * j + 1]);
        }
        acc = acc + (read_half(w) * xd[b]) * (float)sumi;
        acc = acc - (read_half(w + 2) * xd[b]) * (float)summ;
    }
    return acc;
}

static void int_rows_scalar(int type, const uint8_t *w, int64_t row_bytes, int64_t rows, const QX *qx,
                            int64_t n, float *y, int64_t ldy) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = 0; t < n; t++) y[t * ldy + r] = dot_int_scalar(type, w + r * row_bytes, qx, t);
}

typedef void (*IntRows)(int, const uint8_t *, int64_t, int64_t, const QX *, int64_t, float *, int64_t);

/* Implementations, best last: ISA_* index `int_rows` (built per instruction set below). */
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVXVNNI = 2, ISA_AVX512VNNI = 3 };

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QK_SIMD 1
#include <immintrin.h>
/* This file again, once per instruction set (its QK_PASS part at the end): the same source,
 * compiled with AVX2 (madd/maddubs), AVX-VNNI and AVX512-VNNI (vpdpbusd/vpdpwssd, 256-bit). */
#define QK_PASS 1
#include "qkernels.c"
#undef QK_PASS
#define QK_PASS 2
#include "qkernels.c"
#undef QK_PASS
#define QK_PASS 3
#include "qkernels.c"
#undef QK_PASS
static const IntRows INT_ROWS[] = {int_rows_scalar, int_rows_avx2, int_rows_avxvnni, int_rows_avx512vnni};

/* Whether this CPU runs implementation `level`. The levels do not nest: AMD's Zen 4 has
 * AVX512-VNNI but not AVX-VNNI (its VEX form), so each one is checked on its own. */
static int runs_isa(int level) {
    __builtin_cpu_init();
    switch (level) {
    case ISA_SCALAR: return 1;
    case ISA_AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case ISA_AVXVNNI: return runs_isa(ISA_AVX2) && __builtin_cpu_supports("avxvnni");
    case ISA_AVX512VNNI:
        return runs_isa(ISA_AVX2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    default: return 0;
    }
}
#else
static const IntRows INT_ROWS[] = {int_rows_scalar};
static int runs_isa(int level) { return level == ISA_SCALAR; }
#endif

static int best_isa(void) {
    for (int level = ISA_AVX512VNNI; level > ISA_SCALAR; level--)
        if (runs_isa(level)) return level;
    return ISA_SCALAR;
}

static int chosen_isa = -1;  /* -1: not chosen yet */

/* Use implementation `level` (ISA_*), or the best this CPU runs if level is -1 or one it does not
 * run; returns the level in use. All give the same bits: this exists so that tests can prove it. */
int qk_use_isa(int level) {
    if (level < 0 || !runs_isa(level)) level = best_isa();
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __builtin_cpu_init();
#endif
    __atomic_store_n(&chosen_isa, level, __ATOMIC_RELAXED);
    return level;
}

/* The implementation in use: chosen once, at the first call, from MOESWARM_QK_ISA (scalar, avx2,
 * avxvnni, avx512vnni; one the CPU does not run: the best it does) or else the best one. */
int qk_isa(void) {
    int level = __atomic_load_n(&chosen_isa, __ATOMIC_RELAXED);
    if (level >= 0) return level;
    const char *name = getenv("MOESWARM_QK_ISA");
    static const char *const NAMES[] = {"scalar", "avx2", "avxvnni", "avx512vnni"};
    level = -1;
    for (int i = 0; name && i < 4; i++) if (strcmp(name, NAMES[i]) == 0) level = i;
    return qk_use_isa(level);
}

/* Set the speed choices (see `tuning`): prefetch one of QK_PREFETCH_*, wide_from 1..9 (9: never wide,
 * a product's tokens being tiled by 4 instead), wide16 0 or 1, rows16_from and q6k_rows16_from 0 or
 * 2..64. Returns 0, or -1 (nothing changed) for a value out of range. The bits of every product are
 * the same under every choice. */
int qk_tune(int prefetch, int wide_from, int wide16, int rows16_from, int q6k_rows16_from) {
    if (prefetch < QK_PREFETCH_NONE || prefetch > QK_PREFETCH_NTA || wide_from < 1 || wide_from > 9 ||
        (wide16 != 0 && wide16 != 1) || rows16_from < 0 || rows16_from == 1 || rows16_from > 64 ||
        q6k_rows16_from < 0 || q6k_rows16_from == 1 || q6k_rows16_from > 64)
        return -1;
    __atomic_store_n(&tuning.prefetch, prefetch, __ATOMIC_RELAXED);
    __atomic_store_n(&tuning.wide_from, wide_from, __ATOMIC_RELAXED);
    __atomic_store_n(&tuning.wide16, wide16, __ATOMIC_RELAXED);
    __atomic_store_n(&tuning.rows16_from, rows16_from, __ATOMIC_RELAXED);
    __atomic_store_n(&tuning.q6k_rows16_from, q6k_rows16_from, __ATOMIC_RELAXED);
    return 0;
}

/* The choices in force: out[0..5) = prefetch, wide_from, wide16, rows16_from, q6k_rows16_from. */
void qk_tuning(int out[5]) {
    out[0] = __atomic_load_n(&tuning.prefetch, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&tuning.wide_from, __ATOMIC_RELAXED);
    out[2] = __atomic_load_n(&tuning.wide16, __ATOMIC_RELAXED);
    out[3] = __atomic_load_n(&tuning.rows16_from, __ATOMIC_RELAXED);
    out[4] = __atomic_load_n(&tuning.q6k_rows16_from, __ATOMIC_RELAXED);
}

/* Evict p[0..n) from every cache level (x86: clflush), so that the next read of it comes from DRAM,
 * as a decode step reads its weights: what kernel_tuning.py times the prefetch choices on. */
void qk_evict(const void *p, int64_t n) {
#ifdef QK_SIMD
    for (int64_t i = 0; i < n; i += 64) _mm_clflush((const char *)p + i);
    if (n > 0) _mm_clflush((const char *)p + n - 1);
    _mm_mfence();
#else
    (void)p;
    (void)n;
#endif
}

typedef struct {
    int type;
    const uint8_t *w;
    int64_t row_bytes, K, rows, tile_rows;
    const float *x;
    int64_t n, ldx;
    float *y;
    int64_t ldy;
    const QX *qx;  /* the quantized x, for the integer types */
    int64_t *next;  /* shared by a call's jobs: the next tile of rows to take */
    int status;
} Job;

/* Whether a float-path job's rows are F32 read in place (f32_rows: no decoded scratch). */
static int f32_in_place(const Job *job) { return job->type == T_F32 && job->n <= FEW_TOKENS; }

/* Rows [a, b) of a job's product. scratch: the float path's decoded rows (NULL: the integer path). */
static void run_range(const Job *job, int64_t a, int64_t b, float *scratch) {
    if (job->qx) {
        INT_ROWS[qk_isa()](job->type, job->w + a * job->row_bytes, job->row_bytes, b - a, job->qx, job->n,
                           job->y + a, job->ldy);
        return;
    }
    if (f32_in_place(job)) {
        f32_rows((const float *)(job->w + a * job->row_bytes), job->K, b - a, job->x, job->n, job->ldx, job->y + a, job->ldy);
        return;
    }
    if (job->n <= FEW_TOKENS && block_size(job->type) >= 32) {
        const float *x[FEW_TOKENS];
        for (int i = 0; i < job->n; i++) x[i] = job->x + i * job->ldx;
        rows_few_tokens(job->type, job->w + a * job->row_bytes, job->row_bytes, job->K, b - a, x, (int)job->n,
                        job->y + a, job->ldy, scratch);
        return;
    }
    for (int64_t r = a; r < b; r += ROW_TILE) {
        int nrows = (int)(b - r < ROW_TILE ? b - r : ROW_TILE);
        decode_tile(job->type, job->w + r * job->row_bytes, job->row_bytes, job->K, nrows, scratch);
        for (int64_t t = 0; t < job->n; t += TOKEN_TILE) {
            int ntokens = (int)(job->n - t < TOKEN_TILE ? job->n - t : TOKEN_TILE);
            const float *x[TOKEN_TILE];
            for (int i = 0; i < TOKEN_TILE; i++) x[i] = job->x + (t + (i < ntokens ? i : 0)) * job->ldx;
            dot_tile(scratch, job->K, nrows, x, ntokens, job->y + t * job->ldy + r, job->ldy);
        }
    }
}

/* A call's jobs take tiles of rows in turn until none is left (`next`): a thread on a busier core
 * takes fewer of them, where a fixed share each would make the call wait for the slowest. Which
 * thread computes a row changes none of its bits. */
static void *run_job(void *arg) {
    Job *job = arg;
    float *scratch = NULL;
    if (!job->qx && !f32_in_place(job)) {
        int64_t length = job->K > CHUNK ? job->K : CHUNK;
        scratch = calloc((size_t)(ROW_TILE > FEW_ROWS ? ROW_TILE : FEW_ROWS) * length, sizeof(float));
        if (!scratch) { job->status = -1; return NULL; }
    }
    for (;;) {
        int64_t a = __atomic_fetch_add(job->next, 1, __ATOMIC_RELAXED) * job->tile_rows;
        if (a >= job->rows) break;
        run_range(job, a, a + job->tile_rows < job->rows ? a + job->tile_rows : job->rows, scratch);
    }
    free(scratch);
    job->status = 0;
    return NULL;
}

/* Whether `type` is decoded here and K fits its blocks (1) or not (0). */
int qk_supported(int type, int64_t K) {
    int bs = block_size(type);
    return bs > 0 && K > 0 && K % bs == 0;
}

/* x's int8 blocks for `type` (its integer path) in one allocation: *scratch is to be freed. */
static int quantize_for(int type, int64_t K, const float *x, int64_t n, int64_t ldx, QX *qx, void **scratch) {
    int64_t n8 = (n + WIDE_TILE - 1) / WIDE_TILE * WIDE_TILE;
    *qx = (QX){K, block_size(type) == 256 ? 256 : 32, NULL, NULL, NULL, NULL, n8, NULL, NULL};
    size_t qbytes = (size_t)(n * K), dbytes = (size_t)(n * (K / qx->block)) * sizeof(float);
    size_t d8bytes = qx->block == 32 ? (size_t)(n * K) : 0;  /* n * (K / 4) floats */
    size_t sbytes = (size_t)(n * (K / 16)) * sizeof(int16_t);
    size_t dTbytes = qx->block == 256 ? (size_t)(n8 * (K / 256)) * sizeof(float) : 0;
    size_t sTbytes = qx->block == 256 ? (size_t)(n8 * (K / 16)) * sizeof(int16_t) : 0;
    *scratch = malloc(d8bytes + dTbytes + dbytes + sTbytes + sbytes + qbytes);
    if (!*scratch) return -1;
    qx->dx8 = *scratch;
    qx->dT = (float *)((char *)*scratch + d8bytes);
    qx->d = (float *)((char *)qx->dT + dTbytes);
    qx->sT = (int16_t *)((char *)qx->d + dbytes);
    qx->sums = (int16_t *)((char *)qx->sT + sTbytes);
    memset(qx->dT, 0, dTbytes);  /* the pad tokens' lanes: computed, never stored */
    memset(qx->sT, 0, sTbytes);
    qx->q = (int8_t *)(qx->sums + n * (K / 16));
    quantize_tokens(x, n, ldx, qx);
    return 0;
}

/* Whether (type, K, row_bytes) is a matrix these kernels compute. */
static int valid_matrix(int type, int64_t K, int64_t row_bytes) {
    return qk_supported(type, K) && row_bytes == K / block_size(type) * block_bytes(type);
}

/* The rows in tiles that `threads` threads (this one included) take in turn (run_job); qx: x's
 * int8 blocks (the integer path), or NULL (the float path). Returns 0 or -1. */
static int run_rows(int type, const void *w, int64_t rows, int64_t K, int64_t row_bytes, const float *x,
                    int64_t n, int64_t ldx, float *y, int64_t ldy, int threads, const QX *qx) {
    if (rows <= 0 || n <= 0) return 0;
    if (threads < 1) threads = 1;
    if (threads > 256) threads = 256;
    /* one tile on one thread; else about TILES_PER_THREAD a thread, whole groups of 8 rows (rows8_kquant's) */
    int64_t share = (int64_t)threads * TILES_PER_THREAD;
    int64_t tile_rows = threads == 1 ? rows : ((rows + share - 1) / share + 7) / 8 * 8;
    int64_t tiles = (rows + tile_rows - 1) / tile_rows, next = 0;
    if (threads > tiles) threads = (int)tiles;
    Job jobs[256];
    for (int i = 0; i < threads; i++)
        jobs[i] = (Job){type, w, row_bytes, K, rows, tile_rows, x, n, ldx, y, ldy, qx, &next, -1};
    qk_pool_run(run_job, jobs, sizeof(Job), threads);  /* qk_pool.c: helpers kept between calls */
    for (int i = 0; i < threads; i++) if (jobs[i].status != 0) return -1;
    return 0;
}

/* y[t, r] = dot(W[r], x[t]) for t < n, r < rows. W: rows x row_bytes of `type`'s blocks (K values
 * per row); x: [n, K] float32 with row stride ldx; y: [n, rows] with row stride ldy. int8: 1 for the
 * integer path (x quantized to int8 blocks) where the type has one, 0 for the float path (decoded
 * weights times float32 x: the decoded matrix's product up to float32 rounding).
 * Returns 0, or -1 (unsupported type or K, or out of memory). */
int qk_matmul(int type, const void *w, int64_t rows, int64_t K, int64_t row_bytes,
              const float *x, int64_t n, int64_t ldx, float *y, int64_t ldy, int threads, int int8) {
    if (!valid_matrix(type, K, row_bytes)) return -1;
    if (rows <= 0 || n <= 0) return 0;
    QX qx;
    void *scratch = NULL;
    if (int8 && integer_type(type) && quantize_for(type, K, x, n, ldx, &qx, &scratch) != 0) return -1;
    int status = run_rows(type, w, rows, K, row_bytes, x, n, ldx, y, ldy, threads, scratch ? &qx : NULL);
    free(scratch);
    return status;
}

/* Per head h < heads: y[:, h] = x[:, h] times W_h^T, where W_h = w + h * head_bytes is a [rows, row_bytes]
 * matrix: x [n, heads, K] (row stride ldx, heads back to back), y [n, heads, rows] (row stride ldy).
 * Multi-head latent attention's absorbed products (W_uk per head on the queries, W_uv per head on
 * what they attended to: moeswarm/forward/latent.py) in one call. The threads share the heads,
 * each head whole on one thread (one hand-out for the call: a head's matrix is small, ~70 KB at
 * GLM-4.7-Flash's shape, and a split of its rows handed out per head cost more than it saved);
 * each head is qk_matmul on its matrix and columns, so the same bits. Returns 0 or -1. */
typedef struct {
    int type, int8;
    const uint8_t *w;
    int64_t head_bytes, rows, K, row_bytes, n, ldx, ldy, first, last;
    const float *x;
    float *y;
    int status;
} HeadsJob;

static void *run_heads(void *arg) {
    HeadsJob *job = arg;
    for (int64_t h = job->first; h < job->last && job->status == 0; h++)
        job->status = qk_matmul(job->type, job->w + h * job->head_bytes, job->rows, job->K, job->row_bytes,
                                job->x + h * job->K, job->n, job->ldx, job->y + h * job->rows, job->ldy, 1, job->int8);
    return NULL;
}

int qk_matmul_heads(int type, const void *w, int64_t heads, int64_t head_bytes, int64_t rows, int64_t K,
                    int64_t row_bytes, const float *x, int64_t n, int64_t ldx, float *y, int64_t ldy, int threads,
                    int int8) {
    if (heads <= 0) return 0;
    if (threads < 1) threads = 1;
    if (threads > heads) threads = (int)heads;
    if (threads > 256) threads = 256;
    HeadsJob jobs[256];
    for (int i = 0; i < threads; i++)
        jobs[i] = (HeadsJob){type, int8, w, head_bytes, rows, K, row_bytes, n, ldx, ldy,
                             heads * i / threads, heads * (i + 1) / threads, x, y, 0};
    qk_pool_run(run_heads, jobs, sizeof(HeadsJob), threads);
    for (int i = 0; i < threads; i++) if (jobs[i].status != 0) return -1;
    return 0;
}

/* ---- A whole expert in one call: gate and up, the activation, down ----
 *
 * The same kernels and float operations as qk_matmul (gate), qk_matmul (up), the bias adds,
 * qk_silu_glu / qk_oss_glu, qk_matmul (down) and the down bias add in turn, so the same bits; only
 * the calls and allocations differ: one scratch buffer per call, and with int8 activations x's
 * blocks are made once for gate and up when their types share a block size (they depend only on x
 * and the block size). */

enum { ACT_SILU = 0, ACT_OSS = 1 };
void qk_silu_glu(const float *gate, const float *up, float *h, int64_t count);
void qk_oss_glu(const float *gate, const float *up, float *h, int64_t count, float alpha, float limit);

/* out [n, H] (row stride ldo) = expert(x [n, H], row stride ldx). gate, up: [I, H] matrices of
 * types gate_type, up_type; down: [H, I] of down_type (rows of whole blocks, back to back).
 * gate_bias, up_bias [I] (ACT_OSS only) and down_bias [H]: NULL for none. activation: ACT_SILU
 * (silu(gate) * up) or ACT_OSS (gpt-oss's clamped swiglu with alpha, limit). Returns 0 or -1. */
int qk_expert(int gate_type, const void *gate, int up_type, const void *up, int down_type, const void *down,
              int64_t H, int64_t I, const float *x, int64_t n, int64_t ldx,
              const float *gate_bias, const float *up_bias, const float *down_bias,
              int activation, float alpha, float limit, float *out, int64_t ldo, int threads, int int8) {
    int64_t gate_bytes = qk_supported(gate_type, H) ? H / block_size(gate_type) * block_bytes(gate_type) : 0;
    int64_t up_bytes = qk_supported(up_type, H) ? H / block_size(up_type) * block_bytes(up_type) : 0;
    int64_t down_bytes = qk_supported(down_type, I) ? I / block_size(down_type) * block_bytes(down_type) : 0;
    if (!gate_bytes || !up_bytes || !down_bytes || (activation != ACT_SILU && activation != ACT_OSS)) return -1;
    if (n <= 0 || H <= 0) return 0;
    float *g = malloc((size_t)(3 * n * I) * sizeof(float));  /* gate, up, h: [n, I] each */
    if (!g) return -1;
    float *u = g + n * I, *h = u + n * I;
    QX qx_gate, qx_up, qx_down;
    void *s_gate = NULL, *s_up = NULL, *s_down = NULL;
    int status = -1;
    int gate_int = int8 && integer_type(gate_type), up_int = int8 && integer_type(up_type);
    if (gate_int && quantize_for(gate_type, H, x, n, ldx, &qx_gate, &s_gate) != 0) goto done;
    if (up_int) {
        if (gate_int && (block_size(up_type) == 256) == (block_size(gate_type) == 256)) qx_up = qx_gate;  /* the same blocks */
        else if (quantize_for(up_type, H, x, n, ldx, &qx_up, &s_up) != 0) goto done;
    }
    if (run_rows(gate_type, gate, I, H, gate_bytes, x, n, ldx, g, I, threads, gate_int ? &qx_gate : NULL) != 0) goto done;
    if (run_rows(up_type, up, I, H, up_bytes, x, n, ldx, u, I, threads, up_int ? &qx_up : NULL) != 0) goto done;
    if (activation == ACT_SILU) {
        qk_silu_glu(g, u, h, n * I);
    } else {
        for (int64_t t = 0; t < n; t++)
            for (int64_t i = 0; i < I; i++) {
                if (gate_bias) g[t * I + i] = g[t * I + i] + gate_bias[i];
                if (up_bias) u[t * I + i] = u[t * I + i] + up_bias[i];
            }
        qk_oss_glu(g, u, h, n * I, alpha, limit);
    }
    int down_int = int8 && integer_type(down_type);
    if (down_int && quantize_for(down_type, I, h, n, I, &qx_down, &s_down) != 0) goto done;
    if (run_rows(down_type, down, H, I, down_bytes, h, n, I, out, ldo, threads, down_int ? &qx_down : NULL) != 0) goto done;
    if (down_bias)
        for (int64_t t = 0; t < n; t++)
            for (int64_t j = 0; j < H; j++) out[t * ldo + j] = out[t * ldo + j] + down_bias[j];
    status = 0;
done:
    free(s_gate);
    free(s_up);
    free(s_down);
    free(g);
    return status;
}

/* A layer's routed experts on S rows, in the order and float operations of the family's eager
 * experts (QuantExperts.forward): experts ascending, each on its rows slot-major then token, its
 * output rows scaled by their routing weights and added into final [S, H] (zeros on entry) one
 * after another. hidden [S, H] (row stride ldx); index [S, k] int64 (-1 and below: no expert) and
 * weights [S, k] float32, both contiguous. Expert e's matrices are at gate[e], up[e], down[e];
 * biases, when not NULL, are gate_bias, up_bias [n_experts, I] and down_bias [n_experts, H].
 * Returns 0, -1 (a kernel failed: unsupported type or out of memory) or -2 (an id >= n_experts). */
/* qk_experts with few rows per expert (decode) on several threads: whole experts per thread, each
 * computed on one thread (a one-token product split over threads paid a hand-off per matrix,
 * three per expert). The threads take experts in turn (`next`), each computing its expert into out
 * (rows in `order`'s order) with xs as its scratch for the expert's rows. */
#define SPLIT_EXPERTS_ROWS 32
typedef struct {
    int64_t *next, n_experts;  /* shared by a call's jobs: the next expert to take */
    const int64_t *gate, *up, *down;
    int gate_type, up_type, down_type;
    int64_t H, I;
    const float *hidden;
    int64_t ldx, k;
    const int64_t *start, *order;
    const float *gate_bias, *up_bias, *down_bias;
    int activation;
    float alpha, limit;
    int int8;
    float *xs, *out;
    int status;
} ExpertsJob;

static void *run_experts_job(void *arg) {
    ExpertsJob *j = arg;
    int64_t H = j->H, I = j->I;
    for (;;) {
        int64_t e = __atomic_fetch_add(j->next, 1, __ATOMIC_RELAXED);
        if (e >= j->n_experts) break;
        int64_t n = j->start[e + 1] - j->start[e];
        const int64_t *mine = j->order + j->start[e];
        if (n == 0) continue;
        for (int64_t i = 0; i < n; i++) memcpy(j->xs + i * H, j->hidden + mine[i] / j->k * j->ldx, (size_t)H * sizeof(float));
        if (qk_expert(j->gate_type, (const void *)(intptr_t)j->gate[e], j->up_type, (const void *)(intptr_t)j->up[e],
                      j->down_type, (const void *)(intptr_t)j->down[e], H, I, j->xs, n, H,
                      j->gate_bias ? j->gate_bias + e * I : NULL, j->up_bias ? j->up_bias + e * I : NULL,
                      j->down_bias ? j->down_bias + e * H : NULL, j->activation, j->alpha, j->limit,
                      j->out + j->start[e] * H, H, 1, j->int8) != 0) {
            j->status = -1;
            return NULL;
        }
    }
    j->status = 0;
    return NULL;
}

int qk_experts(int64_t n_experts, const int64_t *gate, const int64_t *up, const int64_t *down,
               int gate_type, int up_type, int down_type, int64_t H, int64_t I,
               const float *hidden, int64_t S, int64_t ldx, const int64_t *index, int64_t k, const float *weights,
               const float *gate_bias, const float *up_bias, const float *down_bias,
               int activation, float alpha, float limit, float *final, int threads, int int8) {
    int64_t pairs = S * k;
    int64_t *start = calloc((size_t)n_experts + 1, sizeof(int64_t));
    int64_t *order = malloc((size_t)(pairs > 0 ? pairs : 1) * sizeof(int64_t));  /* positions token * k + slot */
    float *buffer = NULL;
    int status = -1;
    if (!start || !order) goto done;
    for (int64_t p = 0; p < pairs; p++) {
        int64_t e = index[p];
        if (e >= n_experts) { status = -2; goto done; }
        if (e >= 0) start[e + 1]++;
    }
    int64_t most = 0;
    for (int64_t e = 0; e < n_experts; e++) {
        most = start[e + 1] > most ? start[e + 1] : most;
        start[e + 1] += start[e];
    }
    {  /* a counting sort, stable in slot-major order */
        int64_t *next = malloc((size_t)(n_experts > 0 ? n_experts : 1) * sizeof(int64_t));
        if (!next) goto done;
        memcpy(next, start, (size_t)n_experts * sizeof(int64_t));
        for (int64_t slot = 0; slot < k; slot++)
            for (int64_t t = 0; t < S; t++) {
                int64_t e = index[t * k + slot];
                if (e >= 0) order[next[e]++] = t * k + slot;
            }
        free(next);
    }
    int64_t active = 0;
    for (int64_t e = 0; e < n_experts; e++) active += start[e + 1] > start[e];
    if (threads > 1 && active >= threads && most <= SPLIT_EXPERTS_ROWS) {
        ExpertsJob jobs[256];
        int groups = threads > 256 ? 256 : threads;
        buffer = malloc((size_t)(start[n_experts] * H + groups * most * H) * sizeof(float) + 1);
        if (!buffer) goto done;
        /* The threads take experts in turn until none is left: one on a busier core takes fewer. */
        int64_t next = 0;
        for (int g = 0; g < groups; g++)
            jobs[g] = (ExpertsJob){&next, n_experts, gate, up, down, gate_type, up_type, down_type, H, I, hidden, ldx, k,
                                   start, order, gate_bias, up_bias, down_bias, activation, alpha, limit, int8,
                                   buffer + start[n_experts] * H + g * most * H, buffer, -1};
        qk_pool_run(run_experts_job, jobs, sizeof(ExpertsJob), groups);
        for (int g = 0; g < groups; g++) if (jobs[g].status != 0) goto done;
        for (int64_t e = 0; e < n_experts; e++) {  /* the adds in the one-thread order: the same bits */
            const int64_t *mine = order + start[e];
            const float *ys = buffer + start[e] * H;
            for (int64_t i = 0; i < start[e + 1] - start[e]; i++) {
                float w = weights[mine[i]], *row = final + mine[i] / k * H;
                for (int64_t j = 0; j < H; j++) row[j] = row[j] + ys[i * H + j] * w;
            }
        }
        status = 0;
        goto done;
    }
    buffer = malloc((size_t)(2 * most * H) * sizeof(float) + 1);  /* the expert's rows, its outputs: [n_e, H] */
    if (!buffer) goto done;
    float *xs = buffer, *ys = buffer + most * H;
    for (int64_t e = 0; e < n_experts; e++) {
        int64_t n = start[e + 1] - start[e];
        const int64_t *mine = order + start[e];
        if (n == 0) continue;
        for (int64_t i = 0; i < n; i++) memcpy(xs + i * H, hidden + mine[i] / k * ldx, (size_t)H * sizeof(float));
        if (qk_expert(gate_type, (const void *)(intptr_t)gate[e], up_type, (const void *)(intptr_t)up[e],
                      down_type, (const void *)(intptr_t)down[e], H, I, xs, n, H,
                      gate_bias ? gate_bias + e * I : NULL, up_bias ? up_bias + e * I : NULL,
                      down_bias ? down_bias + e * H : NULL, activation, alpha, limit, ys, H, threads, int8) != 0)
            goto done;
        for (int64_t i = 0; i < n; i++) {
            float w = weights[mine[i]], *row = final + mine[i] / k * H;
            for (int64_t j = 0; j < H; j++) row[j] = row[j] + ys[i * H + j] * w;
        }
    }
    status = 0;
done:
    free(buffer);
    free(order);
    free(start);
    return status;
}

/* A DISPATCH's ids as they travel (id_bytes: wire/frames.h's MSW_ID_BYTES_, 1: u8 with 255 for -1;
 * 2, 4, 8: little-endian signed), each mapped through table[id + 2] (clipped into [0, table_len))
 * into local[p]: its expert within the module, or -1 (another holder's slot); counts[e] += each expert's slots. The routed slots, or
 * -3 when an id maps outside [-1, n_experts) (not held here), -1 for an unknown id width. */
static int64_t read_ids(const void *ids, int id_bytes, int64_t pairs, const int64_t *table, int64_t table_len,
                        int64_t n_experts, int64_t *local, int64_t *counts) {
    int64_t routed = 0;
    if (id_bytes != MSW_ID_BYTES_U8 && id_bytes != MSW_ID_BYTES_I16 && id_bytes != MSW_ID_BYTES_I32 &&
        id_bytes != MSW_ID_BYTES_I64)
        return -1;
    for (int64_t p = 0; p < pairs; p++) {
        int64_t id;
        const uint8_t *at = (const uint8_t *)ids + p * id_bytes;
        if (id_bytes == MSW_ID_BYTES_U8) {
            id = at[0] == MSW_ID_NONE_U8 ? -1 : at[0];
        } else if (id_bytes == MSW_ID_BYTES_I16) {
            int16_t v; memcpy(&v, at, sizeof v); id = v;
        } else if (id_bytes == MSW_ID_BYTES_I32) {
            int32_t v; memcpy(&v, at, sizeof v); id = v;
        } else {
            memcpy(&id, at, sizeof id);
        }
        int64_t e = table[id < -1 ? 0 : id >= table_len - 2 ? table_len - 1 : id + 2];
        if (e < -1 || e >= n_experts) return -3;
        local[p] = e;
        if (e >= 0) {
            counts[e]++;
            routed++;
        }
    }
    return routed;
}

/* A partial DISPATCH's sums straight from its frame's bytes (moeswarm/worker/quant_lane.py): the ids as
 * they travel, mapped by read_ids; the routing weights as they travel (float32, copied to aligned
 * memory); then qk_experts into final [S, H] (zeros). counts [n_experts] gets each expert's
 * routed slots. Returns -3, computing nothing, when an id is not held or no slot is routed (the
 * caller's own checks then name the fault); otherwise what qk_experts returns. */
int qk_dispatch_sums(int64_t n_experts, const int64_t *gate, const int64_t *up, const int64_t *down,
                     int gate_type, int up_type, int down_type, int64_t H, int64_t I,
                     const float *hidden, int64_t S, const void *ids, int id_bytes, int64_t k, const void *weights,
                     const int64_t *table, int64_t table_len,
                     const float *gate_bias, const float *up_bias, const float *down_bias,
                     int activation, float alpha, float limit, float *final, int64_t *counts, int threads, int int8) {
    int64_t pairs = S * k, routed = 0;
    int64_t *index = malloc((size_t)(pairs > 0 ? pairs : 1) * sizeof(int64_t));
    float *w = malloc((size_t)(pairs > 0 ? pairs : 1) * sizeof(float));
    int status = -3;
    if (!index || !w) { status = -1; goto done; }
    memcpy(w, weights, (size_t)pairs * sizeof(float));
    memset(counts, 0, (size_t)n_experts * sizeof(int64_t));
    routed = read_ids(ids, id_bytes, pairs, table, table_len, n_experts, index, counts);
    if (routed <= 0) {
        status = routed == 0 ? -3 : (int)routed;
        goto done;
    }
    status = qk_experts(n_experts, gate, up, down, gate_type, up_type, down_type, H, I, hidden, S, H, index, k, w,
                        gate_bias, up_bias, down_bias, activation, alpha, limit, final, threads, int8);
done:
    free(w);
    free(index);
    return status;
}

/* An exact DISPATCH's rows straight from its frame's bytes (moeswarm/worker/quant_lane.py): the ids and
 * weights as in qk_dispatch_sums; each routed (token, slot) pair's row w * E(x) into rows [pairs, H]
 * (zeros), experts ascending and, within an expert, slot-major then token (eager's order): the
 * pairs' rows gathered and run as one-slot tokens through qk_experts, as the store's exact path
 * does. hit [n] gets the hit experts (within the module) ascending, counts [n] their rows, *n_hit
 * how many; rows_cap is rows' capacity (T x k). Returns -3, computing nothing, when an id is not
 * held or no slot is routed; otherwise what qk_experts returns. */
int qk_dispatch_rows(int64_t n_experts, const int64_t *gate, const int64_t *up, const int64_t *down,
                     int gate_type, int up_type, int down_type, int64_t H, int64_t I,
                     const float *hidden, int64_t S, const void *ids, int id_bytes, int64_t k, const void *weights,
                     const int64_t *table, int64_t table_len,
                     const float *gate_bias, const float *up_bias, const float *down_bias,
                     int activation, float alpha, float limit, float *rows, int64_t rows_cap,
                     int64_t *hit, int64_t *counts, int64_t *n_hit, int threads, int int8) {
    int64_t pairs = S * k, routed = 0;
    int64_t *local = malloc((size_t)(pairs > 0 ? pairs : 1) * sizeof(int64_t));
    int64_t *start = calloc((size_t)n_experts + 1, sizeof(int64_t));
    int64_t *pair_expert = malloc((size_t)(pairs > 0 ? pairs : 1) * sizeof(int64_t));
    float *pair_weight = malloc((size_t)(pairs > 0 ? pairs : 1) * sizeof(float));
    float *xs = NULL;
    int status = -3;
    if (!local || !start || !pair_expert || !pair_weight) { status = -1; goto done; }
    *n_hit = 0;
    routed = read_ids(ids, id_bytes, pairs, table, table_len, n_experts, local, start + 1);
    if (routed <= 0) {
        status = routed == 0 ? -3 : (int)routed;
        goto done;
    }
    if (routed > rows_cap) goto done;
    for (int64_t e = 0; e < n_experts; e++) {
        if (start[e + 1] > 0) {
            hit[*n_hit] = e;
            counts[*n_hit] = start[e + 1];
            ++*n_hit;
        }
        start[e + 1] += start[e];
    }
    xs = malloc((size_t)routed * (size_t)H * sizeof(float));
    if (!xs) { status = -1; goto done; }
    for (int64_t slot = 0; slot < k; slot++)  /* each expert's pairs slot-major, then token */
        for (int64_t t = 0; t < S; t++) {
            int64_t e = local[t * k + slot];
            if (e < 0) continue;
            int64_t r = start[e]++;
            memcpy(xs + r * H, hidden + t * H, (size_t)H * sizeof(float));
            memcpy(pair_weight + r, (const uint8_t *)weights + (t * k + slot) * sizeof(float), sizeof(float));
            pair_expert[r] = e;
        }
    status = qk_experts(n_experts, gate, up, down, gate_type, up_type, down_type, H, I, xs, routed, H, pair_expert, 1,
                        pair_weight, gate_bias, up_bias, down_bias, activation, alpha, limit, rows, threads, int8);
done:
    free(xs);
    free(pair_weight);
    free(pair_expert);
    free(start);
    free(local);
    return status;
}

/* total[j] += rows[r][j] for r = 0..n-1 in order, one IEEE single add each (numpy's and torch's
 * adds): a decode step's exact rows added into its token in one call (moeswarm/dispatch/combine.py). */
void qk_add_rows(float *total, const float *rows, int64_t n, int64_t d) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t j = 0; j < d; j++) total[j] = total[j] + rows[r * d + j];
}

/* The largest |x| of count float32 values, NaN when one is NaN (infinite when one is): a RESULT's
 * checks in one pass over its rows (moeswarm/dispatch/checks.py, plausible.py). */
double qk_peak(const float *x, int64_t count) {
    float top = 0.0f;
    int nan = 0;
    for (int64_t i = 0; i < count; i++) {
        float a = fabsf(x[i]);
        nan |= a != a;
        top = a > top ? a : top;
    }
    return nan ? (double)NAN : (double)top;
}

/* Decode rows [0, rows) into out [rows, K] float32 (tests compare it with gguf-py's decoder). */
int qk_dequantize(int type, const void *w, int64_t rows, int64_t K, int64_t row_bytes, float *out) {
    if (!qk_supported(type, K) || row_bytes != K / block_size(type) * block_bytes(type)) return -1;
    for (int64_t r = 0; r < rows; r++)
        decode_row(type, (const uint8_t *)w + r * row_bytes, K, out + r * K, (const uint8_t *)w + rows * row_bytes);
    return 0;
}

/* h = silu(gate) * up, elementwise over count values (gate, up, h may not overlap). */
void qk_silu_glu(const float *gate, const float *up, float *h, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        float g = gate[i];
        h[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

/* gpt-oss: gate = min(gate, limit), up = clamp(up, -limit, limit), h = (up + 1) * gate * sigmoid(alpha * gate). */
void qk_oss_glu(const float *gate, const float *up, float *h, int64_t count, float alpha, float limit) {
    for (int64_t i = 0; i < count; i++) {
        float g = gate[i] > limit ? limit : gate[i];
        float u = up[i] > limit ? limit : (up[i] < -limit ? -limit : up[i]);
        float glu = g * (1.0f / (1.0f + expf(-(g * alpha))));
        h[i] = (u + 1.0f) * glu;
    }
}

#else  /* QK_PASS: the integer dots for one instruction set (included from the main part above) */

#pragma GCC push_options
#if QK_PASS == 1
#pragma GCC target("avx2,fma,f16c")
#define S(name) name##_avx2
/* acc + the sums of 4 products u8 * s8 per int32 lane; acc + the sums of 2 products int16 * int16 */
#define DOTUS(acc, u, s) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#define DOTWW(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#elif QK_PASS == 2
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define S(name) name##_avxvnni
#define DOTUS(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#define DOTWW(acc, a, b) _mm256_dpwssd_avx_epi32((acc), (a), (b))
#else
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#define S(name) name##_avx512vnni
#define DOTUS(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#define DOTWW(acc, a, b) _mm256_dpwssd_epi32((acc), (a), (b))
#endif
#define AI __attribute__((always_inline))

static inline AI int S(hsum)(__m256i v) {  /* integer: any order is exact */
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

static inline AI float S(tree)(__m256 acc) {  /* tree8's association: +4, +2, +1 */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

static inline AI float S(half)(const uint8_t *p) {  /* F16C: exact, as read_half */
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

#if QK_PASS == 3
static inline AI __m512 S(pair_ps)(__m256 lo, __m256 hi) {  /* AVX512F only (no DQ) */
    return _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_castps_si256(lo)), _mm256_castps_si256(hi), 1));
}
static inline AI __m256 S(high_ps)(__m512 v) { return _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(v), 1)); }
#endif

static inline AI __m256i S(load)(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* v: 8 words in both halves. Word j broadcast over the register, or words j (low half) and j + 1
 * (high half) each broadcast over its half: one byte shuffle by a constant, where a broadcast of
 * a scalar byte takes a load, a move and a broadcast. */
static inline AI __m256i S(word)(__m256i v, const int j) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)((2 * j + 1) << 8 | 2 * j)));
}
static inline AI __m256i S(word_pair)(__m256i v, const int j) {
    return _mm256_shuffle_epi8(v, _mm256_set_m128i(_mm_set1_epi16((short)((2 * j + 3) << 8 | (2 * j + 2))),
                                                   _mm_set1_epi16((short)((2 * j + 1) << 8 | 2 * j))));
}
/* 8 bytes at p (unsigned or signed) as words, in both halves */
static inline AI __m256i S(words_u8)(const uint8_t *p) {
    return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)));
}
static inline AI __m256i S(words_s8)(const int8_t *p) {
    return _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)));
}

/* The cache lines of p[0..n) on their way (a hint: no fault, no result changed; tuning.prefetch says where). */
static inline AI void S(prefetch)(const uint8_t *p, int64_t n) {
    const int how = __atomic_load_n(&tuning.prefetch, __ATOMIC_RELAXED);
    if (how == QK_PREFETCH_NONE) return;
    if (how == QK_PREFETCH_NTA) {
        for (int64_t i = 0; i < n; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_NTA);
        _mm_prefetch((const char *)p + n - 1, _MM_HINT_NTA);
    } else {
        for (int64_t i = 0; i < n; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T1);
        _mm_prefetch((const char *)p + n - 1, _MM_HINT_T1);
    }
}

/* The 32 values of a 32-value block, in order: signed, or 0..31 for the types with a min. */
static inline AI __m256i S(values32)(const int type, const uint8_t *w) {
    if (type == T_Q8_0) return S(load)(w + 2);
    const uint8_t *p = w + (type == T_Q4_1 || type == T_Q5_1 ? 4 : 2);
    uint32_t qh = 0;
    if (type == T_Q5_0 || type == T_Q5_1) { memcpy(&qh, p, 4); p += 4; }
    __m128i q = _mm_loadu_si128((const __m128i *)p);
    __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0f));
    if (type == T_Q5_0 || type == T_Q5_1) {  /* byte k gets bit k of qh, as 16 */
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
        __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
        h = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);
        v = _mm256_or_si256(v, _mm256_and_si256(h, _mm256_set1_epi8(16)));
    }
    if (type == T_Q4_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(8));
    if (type == T_Q5_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(16));
    return v;
}

/* One 32-value block b into the 8-lane accumulators acc[0..NT) (the half of the 16 lanes for b's parity). */
static inline AI void S(block32)(const int type, const uint8_t *w, int64_t b, const QX *qx, int64_t t0, const int NT,
                                 __m256 *acc) {
    int64_t K = qx->K;
    int has_min = type == T_Q4_1 || type == T_Q5_1;
    const __m256i zero = _mm256_setzero_si256();
    __m256i v = S(values32)(type, w);
    __m256i u = has_min ? v : _mm256_abs_epi8(v);  /* |v| * (x with v's sign) = v * x */
    __m256 dw = _mm256_set1_ps(S(half)(w)), mw = _mm256_set1_ps(has_min ? S(half)(w + 2) : 0.0f);
    for (int i = 0; i < NT; i++) {
        __m256i x = S(load)(qx->q + (t0 + i) * K + 32 * b);
        __m256 dx = _mm256_loadu_ps(qx->dx8 + (t0 + i) * (K / 4) + 8 * b);
        __m256i lanes = DOTUS(zero, u, has_min ? x : _mm256_sign_epi8(x, v));
        acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(lanes)));
        if (has_min)
            acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_mul_ps(mw, dx),
                                                         _mm256_cvtepi32_ps(DOTUS(zero, _mm256_set1_epi8(1), x))));
    }
}

#if QK_PASS == 3
/* Blocks w and w + bytes (a pair) as one register: values32 of each, in turn. The 5th bit of Q5_0 /
 * Q5_1 comes from the two qh words as one 64-bit mask (bit k: byte k), a single masked add or
 * subtract of 16 in place of values32's broadcast, shuffle and compare: the same bytes. */
static inline AI __m512i S(values64)(const int type, const uint8_t *w, int64_t bytes) {
    if (type != T_Q5_0 && type != T_Q5_1)
        return _mm512_inserti64x4(_mm512_castsi256_si512(S(values32)(type, w)), S(values32)(type, w + bytes), 1);
    const int off = type == T_Q5_1 ? 4 : 2;
    uint32_t qh0, qh1;
    memcpy(&qh0, w + off, 4);
    memcpy(&qh1, w + bytes + off, 4);
    __m128i q0 = _mm_loadu_si128((const __m128i *)(w + off + 4)), q1 = _mm_loadu_si128((const __m128i *)(w + bytes + off + 4));
    __m512i nib = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(_mm_srli_epi16(q0, 4), q0)),
                                     _mm256_set_m128i(_mm_srli_epi16(q1, 4), q1), 1);
    nib = _mm512_and_si512(nib, _mm512_set1_epi8(0x0f));
    __mmask64 high = (__mmask64)qh0 | (__mmask64)qh1 << 32;
    if (type == T_Q5_0) return _mm512_mask_sub_epi8(nib, _knot_mask64(high), nib, _mm512_set1_epi8(16));  /* nib + 16 * bit - 16 */
    return _mm512_mask_add_epi8(nib, high, nib, _mm512_set1_epi8(16));
}
#endif

/* 32-value blocks, NT tokens t0.. at once: out[i] = dot(row, token t0 + i). Even blocks go to lanes
 * 0..7, odd ones to lanes 8..15 (one 512-bit register holds a pair), then lanes i + 8 onto i and
 * tree8. */
static inline AI void S(dot32)(const int type, const uint8_t *w, const QX *qx, int64_t t0, const int NT, float *out,
                               const uint8_t *pf) {
    int64_t nb = qx->K / 32, bytes = block_bytes(type), b = 0;
#if QK_PASS == 3
    int64_t K = qx->K;
    int has_min = type == T_Q4_1 || type == T_Q5_1;
    __m512 acc[QX_TILE];
    for (int i = 0; i < NT; i++) acc[i] = _mm512_setzero_ps();
    for (; b + 2 <= nb; b += 2, w += 2 * bytes) {
        if (pf) S(prefetch)(pf + b * bytes, 2 * bytes);
        __m512i v = S(values64)(type, w, bytes);
        __m512i u = has_min ? v : _mm512_abs_epi8(v);
        __mmask64 negative = _mm512_movepi8_mask(v);
        __m512 dw = S(pair_ps)(_mm256_set1_ps(S(half)(w)), _mm256_set1_ps(S(half)(w + bytes)));
        __m512 mw = has_min ? S(pair_ps)(_mm256_set1_ps(S(half)(w + 2)), _mm256_set1_ps(S(half)(w + bytes + 2))) : dw;
        for (int i = 0; i < NT; i++) {
            __m512i x = _mm512_loadu_si512(qx->q + (t0 + i) * K + 32 * b);
            __m512 dx = _mm512_loadu_ps(qx->dx8 + (t0 + i) * (K / 4) + 8 * b);
            __m512i sx = has_min ? x : _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
            __m512i lanes = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, sx);
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(lanes)));
            if (has_min)
                acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_mul_ps(mw, dx), _mm512_cvtepi32_ps(
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), x))));
        }
    }
    __m256 even[QX_TILE], odd[QX_TILE];
    for (int i = 0; i < NT; i++) {
        even[i] = _mm512_castps512_ps256(acc[i]);
        odd[i] = S(high_ps)(acc[i]);
    }
#else
    __m256 even[QX_TILE], odd[QX_TILE];
    for (int i = 0; i < NT; i++) even[i] = odd[i] = _mm256_setzero_ps();
    for (; b + 2 <= nb; b += 2, w += 2 * bytes) {
        if (pf) S(prefetch)(pf + b * bytes, 2 * bytes);
        S(block32)(type, w, b, qx, t0, NT, even);
        S(block32)(type, w + bytes, b + 1, qx, t0, NT, odd);
    }
#endif
    if (b < nb) S(block32)(type, w, b, qx, t0, NT, even);
    for (int i = 0; i < NT; i++) out[i] = S(tree)(_mm256_add_ps(even[i], odd[i]));
}

#if QK_PASS == 3
/* AVX512: a Q4_K super-block's integer sums for NT tokens (x: token 0's 256 values, the next
 * token's K further on) into the 16 lanes of wsum[0..NT), 64 values a register: chunk c's low and
 * high nibbles side by side with the values 64c.. of x. scmn: the 8 scales (as dot_q45k), each
 * chunk's two picked by one byte shuffle from the 8 words in every 128-bit lane. */
static inline AI void S(q4k_sums)(const uint8_t *qs, const uint8_t *scmn, const int8_t *x, int64_t K, const int NT,
                                  __m512i *wsum) {
    for (int i = 0; i < NT; i++) wsum[i] = _mm512_setzero_si512();
    const __m512i scales = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)scmn)));
    for (int c = 0; c < 4; c++, x += 64) {
        __m256i q = S(load)(qs + 32 * c);
        __m512i v = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1),
                                     _mm512_set1_epi8(0x0f));
        __m512i sc2 = _mm512_shuffle_epi8(scales, _mm512_inserti64x4(  /* words 2c (low half), 2c + 1 (high) */
            _mm512_castsi256_si512(_mm256_set1_epi16((short)((4 * c + 1) << 8 | 4 * c))),
            _mm256_set1_epi16((short)((4 * c + 3) << 8 | (4 * c + 2))), 1));
        for (int i = 0; i < NT; i++)
            wsum[i] = _mm512_dpwssd_epi32(wsum[i], _mm512_maddubs_epi16(v, _mm512_loadu_si512(x + i * K)), sc2);
    }
}

/* Lane t of the result = the sum of v[t]'s 16 lanes (integer: exact in any order): pairs of
 * registers interleaved and added, twice, then the four 128-bit lanes added. */
static inline AI __m256i S(sum8z)(const __m512i *v) {
    __m512i s[4], u[2];
    for (int i = 0; i < 4; i++)  /* per 128-bit lane: [v0 + v2, w0 + w2, v1 + v3, w1 + w3] of v[2i], w = v[2i + 1] */
        s[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++)  /* per 128-bit lane: that lane's sum of v[4i], .., v[4i + 3] */
        u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_epi64(s[2 * i], s[2 * i + 1]));
    __m512i z = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
    z = _mm512_shuffle_i32x4(z, z, _MM_SHUFFLE(3, 1, 2, 0));  /* [tokens 0-3, 4-7 | the same, the other halves] */
    return _mm256_add_epi32(_mm512_castsi512_si256(z), _mm512_extracti64x4_epi64(z, 1));
}

/* AVX512: a Q6_K super-block's integer sums (before the -32 offset) for NT tokens, as q4k_sums:
 * values 32j.. and 32(j + 1).. of a half side by side (j = 0, 2), 64 values a register, into
 * the 16 lanes of wsum[0..NT). */
static inline AI void S(q6k_zsums)(const uint8_t *w, const int8_t *x, int64_t K, const int NT, __m512i *wsum) {
    const int8_t *sc = (const int8_t *)(w + 192);
    for (int i = 0; i < NT; i++) wsum[i] = _mm512_setzero_si512();
    const __m512i m4 = _mm512_set1_epi8(0x0f), three = _mm512_set1_epi8(3);
    const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)sc));
    for (int h = 0; h < 2; h++, x += 128) {
        const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
        __m256i qh0 = S(load)(qh);
        __m512i l = _mm512_inserti64x4(_mm512_castsi256_si512(S(load)(ql)), S(load)(ql + 32), 1);
        __m512i hh = _mm512_inserti64x4(_mm512_castsi256_si512(qh0), _mm256_srli_epi16(qh0, 2), 1);
        for (int j = 0; j < 4; j += 2) {
            __m512i q = _mm512_or_si512(_mm512_and_si512(j ? _mm512_srli_epi16(l, 4) : l, m4),
                                        _mm512_slli_epi16(_mm512_and_si512(j ? _mm512_srli_epi16(hh, 4) : hh, three), 4));
            const char k = (char)(8 * h + 2 * j);  /* the scales of sub-blocks k..k+3, 8 words each */
            __m256i pick = _mm256_setr_epi8(k, k, k, k, k, k, k, k, k + 1, k + 1, k + 1, k + 1, k + 1, k + 1, k + 1, k + 1,
                                            k + 2, k + 2, k + 2, k + 2, k + 2, k + 2, k + 2, k + 2, k + 3, k + 3, k + 3, k + 3, k + 3, k + 3, k + 3, k + 3);
            __m512i sz = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(sc16, pick));
            for (int i = 0; i < NT; i++)
                wsum[i] = _mm512_dpwssd_epi32(wsum[i], _mm512_maddubs_epi16(q, _mm512_loadu_si512(x + i * K + 32 * j)), sz);
        }
    }
}

/* q6k_zsums folded to 8 lanes a token: isum[0..NT). */
static inline AI void S(q6k_sums)(const uint8_t *w, const int8_t *x, int64_t K, const int NT, __m256i *isum) {
    __m512i wsum[WIDE_TILE];
    S(q6k_zsums)(w, x, K, NT, wsum);
    for (int i = 0; i < NT; i++)
        isum[i] = _mm256_add_epi32(_mm512_castsi512_si256(wsum[i]), _mm512_extracti64x4_epi64(wsum[i], 1));
}
#endif

/* Super-block b of a Q4_K / Q5_K row (w: its start) for NT tokens t0..: the 8 lanes of isum[i] add
 * up to token t0 + i's integer sum of the scaled quants, those of msum[i] to its sum of the mins
 * times the 16-sums (integers: exact in any order). */
static inline AI void S(q45k_block)(const int type, const uint8_t *w, const QX *qx, int64_t t0, int64_t b, const int NT,
                                    __m256i *isum, __m256i *msum) {
    int64_t K = qx->K;
    const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    uint8_t scmn[16];
    k_scales_mins(w + 4, scmn);
    __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(scmn + 8)));
    __m256i mins2 = _mm256_set_m128i(_mm_unpackhi_epi16(mins, mins), _mm_unpacklo_epi16(mins, mins));
    __m256i scales = S(words_u8)(scmn);
    const uint8_t *qs = w + (type == T_Q5_K ? 48 : 16);
    __m256i hb = type == T_Q5_K ? S(load)(w + 16) : _mm256_setzero_si256();
    __m256i isum2[QX_TILE];  /* two chains of integer sums (exact: any split) */
    for (int i = 0; i < NT; i++) isum[i] = isum2[i] = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {  /* (q4k_sums measured no faster at these few tokens) */
        __m256i q = S(load)(qs + 32 * c);
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (type == T_Q5_K) {  /* bit 2c of qh[l] for value l, bit 2c + 1 for value 32 + l */
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 1), one), 4));
            hb = _mm256_srli_epi16(hb, 2);
        }
        __m256i s0 = S(word)(scales, 2 * c), s1 = S(word)(scales, 2 * c + 1);
        for (int i = 0; i < NT; i++) {
            const int8_t *x = qx->q + (t0 + i) * K + 256 * b + 64 * c;
            isum[i] = DOTWW(isum[i], _mm256_maddubs_epi16(lo, S(load)(x)), s0);
            isum2[i] = DOTWW(isum2[i], _mm256_maddubs_epi16(hi, S(load)(x + 32)), s1);
        }
    }
    for (int i = 0; i < NT; i++) {
        isum[i] = _mm256_add_epi32(isum[i], isum2[i]);
        msum[i] = _mm256_madd_epi16(S(load)(qx->sums + (t0 + i) * (K / 16) + 16 * b), mins2);
    }
}

/* Q4_K / Q5_K super-blocks, NT tokens at once. */
static inline AI void S(dot_q45k)(const int type, const uint8_t *w, const QX *qx, int64_t t0, const int NT, float *out,
                                  const uint8_t *pf) {
    int64_t nb = qx->K / 256, bytes = block_bytes(type);
    float acc[QX_TILE] = {0};
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        if (pf) S(prefetch)(pf + b * bytes, bytes);
        __m256i isum[QX_TILE], msum[QX_TILE];
        S(q45k_block)(type, w, qx, t0, b, NT, isum, msum);
        float d = S(half)(w), dmin = S(half)(w + 2);
        for (int i = 0; i < NT; i++) {
            __m256i both = _mm256_hadd_epi32(isum[i], msum[i]);  /* [i i m m | i i m m] */
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
            s = _mm_hadd_epi32(s, s);  /* [sumi, summ, ...] */
            float dx = qx->d[(t0 + i) * nb + b];
            acc[i] = acc[i] + (d * dx) * (float)_mm_cvtsi128_si32(s);
            acc[i] = acc[i] - (dmin * dx) * (float)_mm_extract_epi32(s, 1);
        }
    }
    for (int i = 0; i < NT; i++) out[i] = acc[i];
}

/* Super-block b of a Q6_K row (w: its start) for NT tokens t0..: the 8 lanes of v[i] add up to token
 * t0 + i's integer sum (quants 0..63, the -32 taken off through the 16-sums). */
static inline AI void S(q6k_block)(const uint8_t *w, const QX *qx, int64_t t0, int64_t b, const int NT, __m256i *v) {
    int64_t K = qx->K;
    const int8_t *sc = (const int8_t *)(w + 192);
    __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
    __m256i isum2[QX_TILE];  /* two chains of integer sums (exact: any split) */
    for (int i = 0; i < NT; i++) v[i] = isum2[i] = _mm256_setzero_si256();
#if QK_PASS == 3
    S(q6k_sums)(w, qx->q + t0 * K + 256 * b, K, NT, v);  /* AVX512's 64 values a register */
#else
    const __m256i m4 = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        __m256i ql0 = S(load)(w + 64 * h), ql1 = S(load)(w + 64 * h + 32), qh = S(load)(w + 128 + 32 * h);
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, three), 4));
        q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), three), 4));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), three), 4));
        __m256i s[4], half_scales = S(words_s8)(sc + 8 * h);  /* values 32j..32j+31 of this half: */
        for (int j = 0; j < 4; j++) s[j] = S(word_pair)(half_scales, 2 * j);  /* sub-blocks 8h + 2j, 8h + 2j + 1 */
        for (int i = 0; i < NT; i++) {
            const int8_t *x = qx->q + (t0 + i) * K + 256 * b + 128 * h;
            v[i] = DOTWW(v[i], _mm256_maddubs_epi16(q[0], S(load)(x)), s[0]);
            isum2[i] = DOTWW(isum2[i], _mm256_maddubs_epi16(q[1], S(load)(x + 32)), s[1]);
            v[i] = DOTWW(v[i], _mm256_maddubs_epi16(q[2], S(load)(x + 64)), s[2]);
            isum2[i] = DOTWW(isum2[i], _mm256_maddubs_epi16(q[3], S(load)(x + 96)), s[3]);
        }
    }
#endif
    for (int i = 0; i < NT; i++) {
        __m256i bs = S(load)(qx->sums + (t0 + i) * (K / 16) + 16 * b);
        __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(bs, scales16), 5);  /* 32 * sc * 16-sum */
        v[i] = _mm256_sub_epi32(_mm256_add_epi32(v[i], isum2[i]), offset);
    }
}

/* Q6_K super-blocks, NT tokens at once. */
static inline AI void S(dot_q6k)(const uint8_t *w, const QX *qx, int64_t t0, const int NT, float *out, const uint8_t *pf) {
    int64_t nb = qx->K / 256;
    float acc[QX_TILE] = {0};
    for (int64_t b = 0; b < nb; b++, w += 210) {
        if (pf) S(prefetch)(pf + 210 * b, 210);
        __m256i v[QX_TILE];
        S(q6k_block)(w, qx, t0, b, NT, v);
        float d = S(half)(w + 208);
        for (int i = 0; i < NT; i++) acc[i] = acc[i] + (d * qx->d[(t0 + i) * nb + b]) * (float)S(hsum)(v[i]);
    }
    for (int i = 0; i < NT; i++) out[i] = acc[i];
}

/* Lane t of the result = the sum of v[t]'s 8 lanes (integer: exact in any order). */
static inline AI __m256i S(sum8)(const __m256i *v) {
    __m256i a = _mm256_hadd_epi32(v[0], v[1]), b = _mm256_hadd_epi32(v[2], v[3]);
    __m256i c = _mm256_hadd_epi32(v[4], v[5]), d = _mm256_hadd_epi32(v[6], v[7]);
    __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d);  /* [v0..v3 low halves | high halves] */
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

/* Lane t = sum over g < 8 of the madd of 16-sum pair g of token t (a wide tile's pairs `st`,
 * wide_pairs) with the word pair in int32 lane g of `pairs` (integer: exact in any order). */
static inline AI __m256i S(wide_pairs_dot)(const int16_t *st, __m256i pairs) {
#if QK_PASS == 3  /* pairs g and g + 1 in one register: four loads, four lane permutes */
    __m512i p = _mm512_castsi256_si512(pairs), sum = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        __m512i pick = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(2 * j)), _mm256_set1_epi32(2 * j + 1), 1);
        sum = _mm512_add_epi32(sum, _mm512_madd_epi16(_mm512_loadu_si512(st + 32 * j), _mm512_permutexvar_epi32(pick, p)));
    }
    return _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
#else
    __m256i sum = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++)
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(S(load)(st + 16 * g), _mm256_permutevar8x32_epi32(pairs, _mm256_set1_epi32(g))));
    return sum;
#endif
}

/* A Q4_K / Q5_K super-block's mins times a wide tile's 16-sums: min g for both 16-sums of sub-block g. */
static inline AI __m256i S(wide_mins)(const int16_t *st, const uint8_t *scmn) {
    __m256i mins = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(scmn + 8)));  /* int32 lane g: min g */
    return S(wide_pairs_dot)(st, _mm256_or_si256(mins, _mm256_slli_epi32(mins, 16)));
}

/* A Q6_K super-block's 16 scales (signed) times a wide tile's 16-sums: the pair (2g, 2g + 1) for pair g. */
static inline AI __m256i S(wide_offset)(const int16_t *st, const int8_t *sc) {
    return S(wide_pairs_dot)(st, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc)));
}

/* The wide tile: one K-quant row with WIDE_TILE tokens t0.. at once, lane t for token t0 + t.
 * Each super-block's integer sums go to the lanes of one register (sum8, sum8z) and the float
 * steps run on all 8 lanes together: per lane the same IEEE operations as dot_q45k / dot_q6k's
 * scalar ones, so the same bits, with the weights decoded once for 8 tokens and no per-token
 * reduction. NT < 8: a last, partial tile (lanes NT.. are sums of zeros, and not stored). */
static inline AI __m256 S(wide_q45k)(const int type, const uint8_t *w, const QX *qx, int64_t t0, const int NT,
                                     const uint8_t *pf) {
    int64_t K = qx->K, n = qx->n, nb = K / 256, bytes = block_bytes(type);
    const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        if (pf) S(prefetch)(pf + b * bytes, bytes);
        uint8_t scmn[16];
        k_scales_mins(w + 4, scmn);
        const int8_t *x = qx->q + t0 * K + 256 * b;
        __m256i sums;
#if QK_PASS == 3
        if (type == T_Q4_K) {  /* AVX512's 64 values a register (q4k_sums) */
            __m512i wsum[WIDE_TILE];
            for (int i = NT; i < WIDE_TILE; i++) wsum[i] = _mm512_setzero_si512();  /* lanes NT.. stay 0 */
            S(q4k_sums)(w + 16, scmn, x, K, NT, wsum);
            sums = S(sum8z)(wsum);
        } else
#endif
        {
            __m256i scales = S(words_u8)(scmn);
            const uint8_t *qs = w + (type == T_Q5_K ? 48 : 16);
            __m256i hb = type == T_Q5_K ? S(load)(w + 16) : _mm256_setzero_si256();
            __m256i isum[WIDE_TILE];
            for (int i = 0; i < WIDE_TILE; i++) isum[i] = _mm256_setzero_si256();  /* lanes NT.. stay 0 */
            for (int c = 0; c < 4; c++, x += 64) {
                __m256i q = S(load)(qs + 32 * c);
                __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                if (type == T_Q5_K) {
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 1), one), 4));
                    hb = _mm256_srli_epi16(hb, 2);
                }
                __m256i s0 = S(word)(scales, 2 * c), s1 = S(word)(scales, 2 * c + 1);
                for (int i = 0; i < NT; i++) {
                    isum[i] = DOTWW(isum[i], _mm256_maddubs_epi16(lo, S(load)(x + i * K)), s0);
                    isum[i] = DOTWW(isum[i], _mm256_maddubs_epi16(hi, S(load)(x + i * K + 32)), s1);
                }
            }
            sums = S(sum8)(isum);
        }
        __m256i summ = S(wide_mins)(qx->sT + wide_pairs(b, n, t0), scmn);  /* the mins times the 16-sums */
        __m256 dx = _mm256_loadu_ps(qx->dT + b * n + t0);
        __m256 d = _mm256_set1_ps(S(half)(w)), dmin = _mm256_set1_ps(S(half)(w + 2));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(sums)));
        acc = _mm256_sub_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(summ)));
    }
    return acc;
}

static inline AI __m256 S(wide_q6k)(const uint8_t *w, const QX *qx, int64_t t0, const int NT, const uint8_t *pf) {
    int64_t K = qx->K, n = qx->n, nb = K / 256;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 210) {
        if (pf) S(prefetch)(pf + 210 * b, 210);
        const int8_t *sc = (const int8_t *)(w + 192);
#if QK_PASS == 3
        __m512i wsum[WIDE_TILE];
        for (int i = NT; i < WIDE_TILE; i++) wsum[i] = _mm512_setzero_si512();  /* lanes NT.. stay 0 */
        S(q6k_zsums)(w, qx->q + t0 * K + 256 * b, K, NT, wsum);
        __m256i sums = S(sum8z)(wsum);
#else
        const __m256i m4 = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3);
        __m256i isum[WIDE_TILE];
        for (int i = 0; i < WIDE_TILE; i++) isum[i] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
            const int8_t *x = qx->q + t0 * K + 256 * b + 128 * h;
            __m256i half_scales = S(words_s8)(sc + 8 * h);
            for (int j = 0; j < 4; j++) {  /* values 32j..32j+31 of this half: as dot_q6k's q[j], s[j] */
                __m256i l = S(load)(ql + 32 * (j & 1));
                l = j < 2 ? l : _mm256_srli_epi16(l, 4);
                __m256i q = _mm256_or_si256(_mm256_and_si256(l, m4),
                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(S(load)(qh), 2 * j), three), 4));
                __m256i s = S(word_pair)(half_scales, 2 * j);
                for (int i = 0; i < NT; i++)
                    isum[i] = DOTWW(isum[i], _mm256_maddubs_epi16(q, S(load)(x + i * K + 32 * j)), s);
            }
        }
        __m256i sums = S(sum8)(isum);
#endif
        __m256i offset = S(wide_offset)(qx->sT + wide_pairs(b, n, t0), sc);  /* the scales times the 16-sums */
        __m256i sumi = _mm256_sub_epi32(sums, _mm256_slli_epi32(offset, 5));
        __m256 dx = _mm256_loadu_ps(qx->dT + b * n + t0);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(S(half)(w + 208)), dx), _mm256_cvtepi32_ps(sumi)));
    }
    return acc;
}

/* The half at byte `at` of 8 blocks `stride` bytes apart, as 8 float lanes (exact). */
static inline AI __m256 S(halves8)(const uint8_t *w, int64_t stride, int64_t at) {
    uint16_t h[8];
    for (int r = 0; r < 8; r++) memcpy(&h[r], w + r * stride + at, 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* Eight K-quant rows (w: the first, the others row_bytes apart) with NT tokens t0.. (NT < 4),
 * lanes[i] lane r for token t0 + i and row r: each super-block's 8 rows' integer sums go to one
 * register's lanes (sum8) and the float steps run on 8 lanes, per lane the IEEE operations of
 * dot_q45k / dot_q6k (so the same bits), with one horizontal step per super-block for 8 rows
 * instead of one per row: the few-token (decode) case. pf: the next 8 rows, read into L2 meanwhile
 * (NULL: none). */
static inline AI void S(rows8_kquant)(const int type, const uint8_t *w, int64_t row_bytes, const QX *qx, int64_t t0,
                                      const int NT, __m256 *lanes, const uint8_t *pf) {
    int64_t nb = qx->K / 256, bytes = block_bytes(type);
    for (int i = 0; i < NT; i++) lanes[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * bytes;
        __m256i isum[QX_TILE][8], msum[QX_TILE][8], v[QX_TILE], m[QX_TILE];
        for (int r = 0; r < 8; r++) {
            if (pf) S(prefetch)(pf + r * row_bytes + b * bytes, bytes);
            if (type == T_Q6_K) S(q6k_block)(wb + r * row_bytes, qx, t0, b, NT, v);
            else S(q45k_block)(type, wb + r * row_bytes, qx, t0, b, NT, v, m);
            for (int i = 0; i < NT; i++) isum[i][r] = v[i];
            for (int i = 0; i < NT && type != T_Q6_K; i++) msum[i][r] = m[i];
        }
        __m256 d = S(halves8)(wb, row_bytes, type == T_Q6_K ? 208 : 0);
        __m256 dmin = type == T_Q6_K ? d : S(halves8)(wb, row_bytes, 2);
        for (int i = 0; i < NT; i++) {
            __m256 dx = _mm256_set1_ps(qx->d[(t0 + i) * nb + b]);
            lanes[i] = _mm256_add_ps(lanes[i], _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(S(sum8)(isum[i]))));
            if (type != T_Q6_K)
                lanes[i] = _mm256_sub_ps(lanes[i], _mm256_mul_ps(_mm256_mul_ps(dmin, dx),
                                                                 _mm256_cvtepi32_ps(S(sum8)(msum[i]))));
        }
    }
}

/* pf: a row to prefetch into L2 as this one is read (NULL: none); prefetches change no result. */
static inline AI void S(dot_tokens)(const int type, const uint8_t *row, const QX *qx, int64_t t0, const int NT, float *out,
                                    const uint8_t *pf) {
    if (type == T_Q6_K) S(dot_q6k)(row, qx, t0, NT, out, pf);
    else if (type == T_Q4_K || type == T_Q5_K) S(dot_q45k)(type, row, qx, t0, NT, out, pf);
    else S(dot32)(type, row, qx, t0, NT, out, pf);
}

#if QK_PASS == 3
/* AVX-512's double wide tile: one Q4_K row with 16 tokens t0.. at once (NT > 8: the last 16 - NT
 * lanes sums of zeros, not stored), lane t of a 512-bit register for token t0 + t: the super-block's
 * scales, unpacking and float steps taken once for 16 tokens, its integer sums reduced 8 tokens at a
 * time (sum8z) and its 16-sums read as two wide tiles (sT's layout). Per lane the same IEEE
 * operations as wide_q45k, so the same bits. (Q6_K's, written alike, measured slower than two wide
 * tiles: 0.92-0.95x at 16 and 64 tokens.) */
static inline AI __m512 S(wide16_q4k)(const uint8_t *w, const QX *qx, int64_t t0, const int NT, const uint8_t *pf) {
    int64_t K = qx->K, n = qx->n, nb = K / 256, bytes = block_bytes(T_Q4_K);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        if (pf) S(prefetch)(pf + b * bytes, bytes);
        const int16_t *st = qx->sT + wide_pairs(b, n, t0);
        uint8_t scmn[16];
        k_scales_mins(w + 4, scmn);
        __m512i wsum[WIDE16_TILE];
        for (int i = NT; i < WIDE16_TILE; i++) wsum[i] = _mm512_setzero_si512();  /* lanes NT.. stay 0 */
        S(q4k_sums)(w + 16, scmn, qx->q + t0 * K + 256 * b, K, NT, wsum);
        __m512 sums = _mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(S(sum8z)(wsum)), S(sum8z)(wsum + 8), 1));
        __m512 summ = _mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(S(wide_mins)(st, scmn)),
                                                            S(wide_mins)(st + 8 * WIDE_TILE * 2, scmn), 1));
        __m512 dx = _mm512_loadu_ps(qx->dT + b * n + t0);
        __m512 d = _mm512_set1_ps(S(half)(w)), dmin = _mm512_set1_ps(S(half)(w + 2));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(d, dx), sums));
        acc = _mm512_sub_ps(acc, _mm512_mul_ps(_mm512_mul_ps(dmin, dx), summ));
    }
    return acc;
}
#endif

/* Whether `type` takes 16-token wide tiles (wide16_q4k) in this implementation. */
static inline AI int S(wide16_for)(const int type) {
#if QK_PASS == 3
    return type == T_Q4_K;
#else
    (void)type;
    return 0;
#endif
}

#if QK_PASS == 3
/* wide16_q4k's tiles of nt (9..16) tokens into out[0..nt): out of line, so that the decode's
 * one-token code around it keeps its layout (inlined, the 16-token cases made one-token Q4_K
 * products 6 % slower, and Q6_K's 3-8 %). */
static __attribute__((noinline)) void S(wide16_tile)(const uint8_t *row, const QX *qx, int64_t t, int nt,
                                                     const uint8_t *pf, float *out) {
    __m512 lanes;
    switch (nt) {  /* constant tile sizes: the accumulators stay in registers */
#define WIDE(NT) case NT: lanes = S(wide16_q4k)(row, qx, t, NT, pf); break
    WIDE(9); WIDE(10); WIDE(11); WIDE(12); WIDE(13); WIDE(14); WIDE(15);
    default: WIDE(16);
#undef WIDE
    }
    _mm512_storeu_ps(out, lanes);
}
#endif

/* A wide tile's nt tokens t.. of one K-quant row into out[0..nt): nt <= 8, or up to 16 where
 * wide16_for(type); constant tile sizes, so that each case's accumulators stay in registers. */
static inline AI void S(wide_tile)(const int type, const uint8_t *row, const QX *qx, int64_t t, int nt,
                                   const uint8_t *pf, float *out) {
#if QK_PASS == 3
    if (S(wide16_for)(type) && nt > WIDE_TILE) {  /* a constant false for the other types */
        S(wide16_tile)(row, qx, t, nt, pf, out);
        return;
    }
#endif
    __m256 lanes;
    switch (nt) {
#define WIDE(NT) case NT: lanes = type == T_Q6_K ? S(wide_q6k)(row, qx, t, NT, pf) : S(wide_q45k)(type, row, qx, t, NT, pf); break
    WIDE(1); WIDE(2); WIDE(3); WIDE(4); WIDE(5); WIDE(6); WIDE(7);
    default: WIDE(8);
#undef WIDE
    }
    _mm256_storeu_ps(out, lanes);
}

/* Rows in groups of INT_ROW_TILE, tokens in tiles of QX_TILE (K-quants from 4 tokens on: wide tiles
 * instead, WIDE_TILE tokens at a time, WIDE16_TILE on AVX512's Q4_K while more than 8 are left): one
 * tile's quantized x (4 x K bytes)
 * stays in L1 while the group's rows (a few KiB) are dotted with it. The first tile's pass over a
 * group prefetches the next group's rows into L2, a row for each row read: a layer's experts are
 * far larger than the caches, so each group's weights come from DRAM, and without the prefetch the
 * first pass waits for them (docs/gguf.md has the measurement). */
#define INT_ROW_TILE 8  /* = the 8 lanes of rows8_kquant */
static inline AI void S(rows_of)(const int type, const uint8_t *w, int64_t row_bytes, int64_t rows, const QX *qx,
                                 int64_t n, float *y, int64_t ldy) {
    const int wide_from = __atomic_load_n(&tuning.wide_from, __ATOMIC_RELAXED);
    const int wide16 = __atomic_load_n(&tuning.wide16, __ATOMIC_RELAXED);
    for (int64_t r0 = 0; r0 < rows; r0 += INT_ROW_TILE) {
        int64_t r1 = rows - r0 < INT_ROW_TILE ? rows : r0 + INT_ROW_TILE, t = 0;
        const int wide = (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) && n >= wide_from;
        while (wide && t < n) {  /* AVX512's Q4_K: 16 tokens a tile while more than 8 are left */
            const int width = S(wide16_for)(type) && wide16 && n - t > WIDE_TILE ? WIDE16_TILE : WIDE_TILE;
            int nt = (int)(n - t < width ? n - t : width);
            for (int64_t r = r0; r < r1; r++) {
                const uint8_t *row = w + r * row_bytes;
                const uint8_t *pf = t == 0 && r + INT_ROW_TILE < rows ? row + INT_ROW_TILE * row_bytes : NULL;
                float out[WIDE16_TILE];
                S(wide_tile)(type, row, qx, t, nt, pf, out);
                for (int i = 0; i < nt; i++) y[(t + i) * ldy + r] = out[i];
            }
            t += width;
        }
        for (int64_t first = t; t < n; t += QX_TILE) {
            int nt = (int)(n - t < QX_TILE ? n - t : QX_TILE);
            /* rows8_kquant where it measured faster (docs/measured.md, "kernels": not Q4_K at 2 tokens) */
            const int rows8 = type == T_Q6_K ? nt < 4 : (type == T_Q4_K || type == T_Q5_K) && (nt == 1 || nt == 3);
            if (rows8 && r1 - r0 == 8) {
                const uint8_t *group = w + r0 * row_bytes;  /* a few tokens, a whole group: rows8_kquant */
                const uint8_t *pf = t == first && r1 + INT_ROW_TILE <= rows ? group + INT_ROW_TILE * row_bytes : NULL;
                __m256 lanes[QX_TILE];
                switch (nt) {  /* constant tile sizes */
                case 1: S(rows8_kquant)(type, group, row_bytes, qx, t, 1, lanes, pf); break;
                case 2: S(rows8_kquant)(type, group, row_bytes, qx, t, 2, lanes, pf); break;
                default: S(rows8_kquant)(type, group, row_bytes, qx, t, 3, lanes, pf); break;
                }
                for (int i = 0; i < nt; i++) _mm256_storeu_ps(y + (t + i) * ldy + r0, lanes[i]);
                continue;
            }
            for (int64_t r = r0; r < r1; r++) {
                const uint8_t *row = w + r * row_bytes;
                const uint8_t *pf = t == first && r + INT_ROW_TILE < rows ? row + INT_ROW_TILE * row_bytes : NULL;
                float out[QX_TILE];
                switch (nt) {  /* constant tile sizes: the accumulators stay in registers */
                case 1: S(dot_tokens)(type, row, qx, t, 1, out, pf); break;
                case 2: S(dot_tokens)(type, row, qx, t, 2, out, pf); break;
                case 3: S(dot_tokens)(type, row, qx, t, 3, out, pf); break;
                default: S(dot_tokens)(type, row, qx, t, 4, out, pf); break;
                }
                for (int i = 0; i < nt; i++) y[(t + i) * ldy + r] = out[i];
            }
        }
    }
}

#if QK_PASS == 3
#include "qk_q4k16.h"
#include "qk_q6k16.h"
#endif

static void S(int_rows)(int type, const uint8_t *w, int64_t row_bytes, int64_t rows, const QX *qx,
                        int64_t n, float *y, int64_t ldy) {
#if QK_PASS == 3
    const int rows16_from = __atomic_load_n(&tuning.rows16_from, __ATOMIC_RELAXED);
    if (type == T_Q4_K && rows16_from && n >= rows16_from && rows >= Q4K16_ROWS) {  /* qk_q4k16.h: 16 rows side by side */
        int64_t most = rows - rows % Q4K16_ROWS;
        S(rows16_q4k)(w, row_bytes, most, qx, n, y, ldy);
        w += most * row_bytes, y += most, rows -= most;
        if (rows == 0) return;
    }
    const int q6k_rows16_from = __atomic_load_n(&tuning.q6k_rows16_from, __ATOMIC_RELAXED);
    if (type == T_Q6_K && q6k_rows16_from && n >= q6k_rows16_from && rows >= Q4K16_ROWS) {  /* qk_q6k16.h */
        int64_t most = rows - rows % Q4K16_ROWS;
        S(rows16_q6k)(w, row_bytes, most, qx, n, y, ldy);
        w += most * row_bytes, y += most, rows -= most;
        if (rows == 0) return;
    }
#endif
    switch (type) {  /* one copy of the loops per type: its branches fold away */
    case T_Q4_0: S(rows_of)(T_Q4_0, w, row_bytes, rows, qx, n, y, ldy); return;
    case T_Q4_1: S(rows_of)(T_Q4_1, w, row_bytes, rows, qx, n, y, ldy); return;
    case T_Q5_0: S(rows_of)(T_Q5_0, w, row_bytes, rows, qx, n, y, ldy); return;
    case T_Q5_1: S(rows_of)(T_Q5_1, w, row_bytes, rows, qx, n, y, ldy); return;
    case T_Q8_0: S(rows_of)(T_Q8_0, w, row_bytes, rows, qx, n, y, ldy); return;
    case T_Q4_K: S(rows_of)(T_Q4_K, w, row_bytes, rows, qx, n, y, ldy); return;
    case T_Q5_K: S(rows_of)(T_Q5_K, w, row_bytes, rows, qx, n, y, ldy); return;
    case T_Q6_K: S(rows_of)(T_Q6_K, w, row_bytes, rows, qx, n, y, ldy); return;
    }
}

#undef AI
#undef S
#undef DOTUS
#undef DOTWW
#pragma GCC pop_options
#endif  /* QK_PASS */
