/* The wire as C sees it: the frame header, the opcodes and the expert ids' codecs of wire/frames.py
 * and wire/codecs.py, for every C file that reads or writes frames (kernels/qk_express.c,
 * kernels/qk_hold.c, kernels/qkernels.c, transport/token_call.c).
 *
 * Header layout (little-endian, 24 bytes):
 *
 *     offset size field
 *     0      4    magic        "MSWM"
 *     4      1    version      MSW_VERSION
 *     5      1    opcode       MSW_OP_*
 *     6      2    flags        reserved, 0
 *     8      8    request_id   echoed by the reply
 *     16     4    meta_len     msgpack metadata bytes after the header
 *     20     4    payload_len  raw tensor bytes after the metadata
 *
 * Every #define here is checked against the Python side by tests/test_frames_header.py (the values
 * come from wire/frames.py's c_constants()), and each library reports the ones it was built with at
 * load (moeswarm/native.py), so neither side can drift. Opcodes are pinned: never renumber, only append.
 */
#ifndef MSW_FRAMES_H
#define MSW_FRAMES_H

#include <stdint.h>
#include <string.h>

#define MSW_MAGIC "MSWM"
#define MSW_MAGIC_LEN 4
#define MSW_MAGIC_U32 0x4D57534D /* the magic read as a little-endian u32 (for the load-time report) */
#define MSW_VERSION 2
#define MSW_HEADER_SIZE 24
#define MSW_MAX_META (1 << 20)

/* each field's offset in the header */
#define MSW_AT_VERSION 4
#define MSW_AT_OPCODE 5
#define MSW_AT_FLAGS 6
#define MSW_AT_REQUEST_ID 8
#define MSW_AT_META_LEN 16
#define MSW_AT_PAYLOAD_LEN 20

/* opcodes (wire/frames.py Opcode) */
#define MSW_OP_HELLO 1
#define MSW_OP_DISPATCH 2
#define MSW_OP_RESULT 3
#define MSW_OP_ERROR 4
#define MSW_OP_PING 5
#define MSW_OP_PONG 6
#define MSW_OP_STEP 7
#define MSW_OP_STEP_RESULT 8

/* expert ids as a DISPATCH carries them: bytes an id in each integer codec (wire/codecs.py
 * INTEGER_CODECS), little-endian signed, except u8, which carries -1 (another holder's) as 255 */
#define MSW_ID_BYTES_U8 1
#define MSW_ID_BYTES_I16 2
#define MSW_ID_BYTES_I32 4
#define MSW_ID_BYTES_I64 8
#define MSW_ID_NONE_U8 255

/* `bytes` little-endian bytes at `at` as an unsigned int */
static inline uint64_t msw_get_le(const uint8_t *at, int bytes) {
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; i--) v = v << 8 | at[i];
    return v;
}

/* v's low `bytes` bytes at `at`, little-endian */
static inline void msw_put_le(uint8_t *at, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) at[i] = (uint8_t)(v >> (8 * i));
}

/* Whether the header at `at` (MSW_HEADER_SIZE bytes) is this protocol's: magic and version. */
static inline int msw_is_header(const uint8_t *at) {
    return memcmp(at, MSW_MAGIC, MSW_MAGIC_LEN) == 0 && at[MSW_AT_VERSION] == MSW_VERSION;
}

/* A header at `at`: this version, `opcode`, flags 0, request `rid`, the body's two lengths. */
static inline void msw_put_header(uint8_t *at, int opcode, uint64_t rid, uint64_t meta_len, uint64_t payload_len) {
    memcpy(at, MSW_MAGIC, MSW_MAGIC_LEN);
    at[MSW_AT_VERSION] = MSW_VERSION;
    at[MSW_AT_OPCODE] = (uint8_t)opcode;
    msw_put_le(at + MSW_AT_FLAGS, 0, 2);
    msw_put_le(at + MSW_AT_REQUEST_ID, rid, 8);
    msw_put_le(at + MSW_AT_META_LEN, meta_len, 4);
    msw_put_le(at + MSW_AT_PAYLOAD_LEN, payload_len, 4);
}

#endif
