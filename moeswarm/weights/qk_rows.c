/* A decoder layer's row operations around its matrices, float32: RMSNorm and the rotary embedding.
 *
 * Each is one C call where transformers' PyTorch code runs 6-10 tensor operations (each a few
 * microseconds of dispatch at a decode step's one row: about a third of a real-dimension backbone's
 * Python time per token). Loaded with ctypes by moeswarm/weights/row_ops.py, which says where each
 * is used.
 *
 * Exactness: every output value depends on its own row only (never on the other rows, the batch or a
 * thread count), and both local references and remote paths call the same function.
 * - rope is bit for bit torch's `(x * cos) + (rotate_half(x) * sin)`: elementwise IEEE float32
 *   operations in the same order (built with -ffp-contract=off: no fused multiply-add).
 * - rms_norm is `w * (x * (1 / sqrt(mean(x^2) + eps)))` with its own fixed sum: the squares added in
 *   16 lanes (lane k mod 16, in the order of k), the lanes by a fixed tree, then / d. torch's sum has
 *   another association (and another per instruction set), so its bits differ from transformers'
 *   in the last place; it is only used where the reference uses it too.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "qk_vec.h"

/* y[r] = w * (x[r] * (1 / sqrtf(sum(x[r]^2) / d + eps))) for `rows` rows of d values (x's rows
 * ldx apart, y's d apart; w: d values). */
CLONES void qk_rms_norm(const float *x, int64_t rows, int64_t d, int64_t ldx, const float *w, float eps, float *y) {
    for (int64_t r = 0; r < rows; r++, x += ldx, y += d) {
        v16 acc = {0};
        int64_t main = d - d % LANES, k = 0;
        for (; k < main; k += LANES) {
            v16 v = load16(x + k);
            acc = acc + v * v;
        }
        float lanes[LANES];
        memcpy(lanes, &acc, sizeof lanes);
        for (; k < d; k++) lanes[k % LANES] = lanes[k % LANES] + x[k] * x[k];
        for (int width = LANES / 2; width > 0; width /= 2)
            for (int i = 0; i < width; i++) lanes[i] = lanes[i] + lanes[i + width];
        float scale = 1.0f / sqrtf(lanes[0] / (float)d + eps);
        for (k = 0; k < d; k++) y[k] = w[k] * (x[k] * scale);
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
