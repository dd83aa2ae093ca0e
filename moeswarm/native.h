/* What a C library reports about itself at load, for moeswarm/native.py's check_layout: the size
 * and every field's offset of each struct that Python mirrors with ctypes.Structure, and the
 * constants Python restates. Python refuses a library whose report differs from its mirrors.
 *
 * A library exports one function returning a table of these, ended by a NULL name:
 *
 *     static const MswLayoutEntry layout[] = {
 *         MSW_SIZE(QkLane), MSW_FIELD(QkLane, n_experts), ..., MSW_FRAME_CONSTANTS, {0, 0}};
 *     const MswLayoutEntry *qk_layout(void) { return layout; }
 *
 * Names: "Struct" for a size, "Struct.field" for an offset, the macro's own name for a constant.
 */
#ifndef MSW_NATIVE_H
#define MSW_NATIVE_H

#include <stddef.h>
#include <stdint.h>

#include "frames.h"

typedef struct {
    const char *name;
    int64_t value;
} MswLayoutEntry;

#define MSW_SIZE(type) {#type, (int64_t)sizeof(type)}
#define MSW_FIELD(type, field) {#type "." #field, (int64_t)offsetof(type, field)}
#define MSW_CONSTANT(name) {#name, (int64_t)(name)}

/* The frame's constants (wire/frames.h), which every frame-speaking library reports: Python expects
 * exactly these (wire/frames.py c_constants). */
#define MSW_FRAME_CONSTANTS                                                                                         \
    MSW_CONSTANT(MSW_MAGIC_LEN), MSW_CONSTANT(MSW_MAGIC_U32), MSW_CONSTANT(MSW_VERSION),                            \
        MSW_CONSTANT(MSW_HEADER_SIZE), MSW_CONSTANT(MSW_MAX_META), MSW_CONSTANT(MSW_AT_VERSION),                    \
        MSW_CONSTANT(MSW_AT_OPCODE), MSW_CONSTANT(MSW_AT_FLAGS), MSW_CONSTANT(MSW_AT_REQUEST_ID),                   \
        MSW_CONSTANT(MSW_AT_META_LEN), MSW_CONSTANT(MSW_AT_PAYLOAD_LEN), MSW_CONSTANT(MSW_OP_HELLO),                \
        MSW_CONSTANT(MSW_OP_DISPATCH), MSW_CONSTANT(MSW_OP_RESULT), MSW_CONSTANT(MSW_OP_ERROR),                     \
        MSW_CONSTANT(MSW_OP_PING), MSW_CONSTANT(MSW_OP_PONG), MSW_CONSTANT(MSW_OP_STEP),                            \
        MSW_CONSTANT(MSW_OP_STEP_RESULT)

#endif
