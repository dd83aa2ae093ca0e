/* What the kernels' library reports about itself at load (moeswarm/native.h): the size and every
 * field's offset of each struct that Python fills or reads, and the frame's constants. Python
 * (moeswarm/kernels/qk_library.py) refuses a library whose report differs from its mirrors
 * (qk_mirrors.py) and from wire/frames.py. A struct added to the ctypes surface is added here. */
#include <stddef.h>

#include "frames.h"
#include "native.h"
#include "qk_calls.h"
#include "qk_express.h"
#include "qk_hold.h"

static const MswLayoutEntry layout[] = {
    MSW_SIZE(QkLane), MSW_FIELD(QkLane, set),
    MSW_FIELD(QkLane, tokens), MSW_FIELD(QkLane, k), MSW_FIELD(QkLane, id_bytes), MSW_FIELD(QkLane, hidden_at),
    MSW_FIELD(QkLane, ids_at), MSW_FIELD(QkLane, weights_at), MSW_FIELD(QkLane, table), MSW_FIELD(QkLane, table_len),
    MSW_FIELD(QkLane, counts), MSW_FIELD(QkLane, sums), MSW_FIELD(QkLane, meta), MSW_FIELD(QkLane, meta_len),
    MSW_FIELD(QkLane, timed), MSW_FIELD(QkLane, hit), MSW_FIELD(QkLane, first), MSW_FIELD(QkLane, served),
    MSW_SIZE(QkHoldLane), MSW_FIELD(QkHoldLane, meta), MSW_FIELD(QkHoldLane, meta_len),
    MSW_FIELD(QkHoldLane, payload_len), MSW_FIELD(QkHoldLane, lane), MSW_FIELD(QkHoldLane, exact),
    MSW_FIELD(QkHoldLane, tokens),
    MSW_SIZE(QkHoldOut), MSW_FIELD(QkHoldOut, answered), MSW_FIELD(QkHoldOut, tokens), MSW_FIELD(QkHoldOut, pending),
    MSW_FIELD(QkHoldOut, unsent_at), MSW_FIELD(QkHoldOut, unsent_len),
    MSW_SIZE(QkHold), MSW_FIELD(QkHold, lanes), MSW_FIELD(QkHold, n_lanes), MSW_FIELD(QkHold, max_tokens),
    MSW_FIELD(QkHold, fd), MSW_FIELD(QkHold, loop_fd), MSW_FIELD(QkHold, wait_s), MSW_FIELD(QkHold, limit_s),
    MSW_FIELD(QkHold, in), MSW_FIELD(QkHold, in_cap), MSW_FIELD(QkHold, reply), MSW_FIELD(QkHold, reply_cap),
    MSW_FIELD(QkHold, answer), MSW_FIELD(QkHold, threads), MSW_FIELD(QkHold, out),
    MSW_SIZE(QkMatmul), MSW_FIELD(QkMatmul, type), MSW_FIELD(QkMatmul, w), MSW_FIELD(QkMatmul, rows),
    MSW_FIELD(QkMatmul, K), MSW_FIELD(QkMatmul, row_bytes), MSW_FIELD(QkMatmul, x), MSW_FIELD(QkMatmul, n),
    MSW_FIELD(QkMatmul, ldx), MSW_FIELD(QkMatmul, y), MSW_FIELD(QkMatmul, ldy), MSW_FIELD(QkMatmul, threads),
    MSW_FIELD(QkMatmul, int8),
    MSW_SIZE(QkMatmulHeads), MSW_FIELD(QkMatmulHeads, type), MSW_FIELD(QkMatmulHeads, w),
    MSW_FIELD(QkMatmulHeads, heads), MSW_FIELD(QkMatmulHeads, head_bytes), MSW_FIELD(QkMatmulHeads, rows),
    MSW_FIELD(QkMatmulHeads, K), MSW_FIELD(QkMatmulHeads, row_bytes), MSW_FIELD(QkMatmulHeads, x),
    MSW_FIELD(QkMatmulHeads, n), MSW_FIELD(QkMatmulHeads, ldx), MSW_FIELD(QkMatmulHeads, y),
    MSW_FIELD(QkMatmulHeads, ldy), MSW_FIELD(QkMatmulHeads, threads), MSW_FIELD(QkMatmulHeads, int8),
    MSW_SIZE(QkExpert), MSW_FIELD(QkExpert, gate_type), MSW_FIELD(QkExpert, gate), MSW_FIELD(QkExpert, up_type),
    MSW_FIELD(QkExpert, up), MSW_FIELD(QkExpert, down_type), MSW_FIELD(QkExpert, down), MSW_FIELD(QkExpert, H),
    MSW_FIELD(QkExpert, I), MSW_FIELD(QkExpert, x), MSW_FIELD(QkExpert, n), MSW_FIELD(QkExpert, ldx),
    MSW_FIELD(QkExpert, gate_bias), MSW_FIELD(QkExpert, up_bias), MSW_FIELD(QkExpert, down_bias),
    MSW_FIELD(QkExpert, activation), MSW_FIELD(QkExpert, alpha), MSW_FIELD(QkExpert, limit), MSW_FIELD(QkExpert, out),
    MSW_FIELD(QkExpert, ldo), MSW_FIELD(QkExpert, threads), MSW_FIELD(QkExpert, int8),
    MSW_SIZE(QkExpertSet), MSW_FIELD(QkExpertSet, n_experts), MSW_FIELD(QkExpertSet, gate),
    MSW_FIELD(QkExpertSet, up), MSW_FIELD(QkExpertSet, down), MSW_FIELD(QkExpertSet, gate_type),
    MSW_FIELD(QkExpertSet, up_type), MSW_FIELD(QkExpertSet, down_type), MSW_FIELD(QkExpertSet, H),
    MSW_FIELD(QkExpertSet, I), MSW_FIELD(QkExpertSet, gate_bias), MSW_FIELD(QkExpertSet, up_bias),
    MSW_FIELD(QkExpertSet, down_bias), MSW_FIELD(QkExpertSet, activation), MSW_FIELD(QkExpertSet, alpha),
    MSW_FIELD(QkExpertSet, limit),
    MSW_SIZE(QkExperts), MSW_FIELD(QkExperts, set), MSW_FIELD(QkExperts, hidden), MSW_FIELD(QkExperts, S),
    MSW_FIELD(QkExperts, ldx), MSW_FIELD(QkExperts, index), MSW_FIELD(QkExperts, k), MSW_FIELD(QkExperts, weights),
    MSW_FIELD(QkExperts, final), MSW_FIELD(QkExperts, threads), MSW_FIELD(QkExperts, int8),
    MSW_SIZE(QkDispatch), MSW_FIELD(QkDispatch, set), MSW_FIELD(QkDispatch, hidden), MSW_FIELD(QkDispatch, S),
    MSW_FIELD(QkDispatch, ids), MSW_FIELD(QkDispatch, id_bytes), MSW_FIELD(QkDispatch, k),
    MSW_FIELD(QkDispatch, weights), MSW_FIELD(QkDispatch, table), MSW_FIELD(QkDispatch, table_len),
    MSW_FIELD(QkDispatch, out), MSW_FIELD(QkDispatch, out_rows), MSW_FIELD(QkDispatch, counts),
    MSW_FIELD(QkDispatch, hit), MSW_FIELD(QkDispatch, n_hit), MSW_FIELD(QkDispatch, threads),
    MSW_FIELD(QkDispatch, int8),
    MSW_SIZE(QkRope), MSW_FIELD(QkRope, x), MSW_FIELD(QkRope, xs0), MSW_FIELD(QkRope, xs1), MSW_FIELD(QkRope, xs2),
    MSW_FIELD(QkRope, out), MSW_FIELD(QkRope, os0), MSW_FIELD(QkRope, os1), MSW_FIELD(QkRope, os2),
    MSW_FIELD(QkRope, B), MSW_FIELD(QkRope, H), MSW_FIELD(QkRope, T), MSW_FIELD(QkRope, D), MSW_FIELD(QkRope, cos),
    MSW_FIELD(QkRope, sin),
    MSW_SIZE(QkAttend), MSW_FIELD(QkAttend, q), MSW_FIELD(QkAttend, qs0), MSW_FIELD(QkAttend, qs1),
    MSW_FIELD(QkAttend, qs2), MSW_FIELD(QkAttend, k), MSW_FIELD(QkAttend, ks0), MSW_FIELD(QkAttend, ks1),
    MSW_FIELD(QkAttend, ks2), MSW_FIELD(QkAttend, v), MSW_FIELD(QkAttend, vs0), MSW_FIELD(QkAttend, vs1),
    MSW_FIELD(QkAttend, vs2), MSW_FIELD(QkAttend, B), MSW_FIELD(QkAttend, Hq), MSW_FIELD(QkAttend, Hkv),
    MSW_FIELD(QkAttend, p), MSW_FIELD(QkAttend, D), MSW_FIELD(QkAttend, Dv), MSW_FIELD(QkAttend, scale),
    MSW_FIELD(QkAttend, out), MSW_FIELD(QkAttend, scratch), MSW_FIELD(QkAttend, threads), MSW_FIELD(QkAttend, half),
    MSW_FRAME_CONSTANTS,
    {NULL, 0},
};

const MswLayoutEntry *qk_layout(void) { return layout; }
