"""The seeder's wire format: byte ranges of one file, asked for and sent back, over TLS or TCP.

    request   b"MSR1" | offset u64 | length u32                       (16 bytes, big-endian)
    response  b"DATA" | length u32 | the bytes
              b"ERR!" | length u32 | a UTF-8 message (at most 1 KiB); the seeder closes after it

A client may send several requests before reading their responses; they are answered in order.
A request asks for at most MAX_REQUEST bytes inside the file, else it gets ERR!.
"""

from __future__ import annotations

import struct

from moeswarm.errors import ProtocolError

REQUEST = struct.Struct(">4sQI")
RESPONSE = struct.Struct(">4sI")
REQUEST_MAGIC = b"MSR1"
DATA, ERROR = b"DATA", b"ERR!"
MAX_REQUEST = 16 << 20  # slices/manifest.py MAX_CHUNK: one piece per request
MAX_ERROR = 1024


def encode_request(offset: int, length: int) -> bytes:
    return REQUEST.pack(REQUEST_MAGIC, offset, length)


def decode_request(raw: bytes) -> tuple[int, int]:
    magic, offset, length = REQUEST.unpack(raw)
    if magic != REQUEST_MAGIC:
        raise ProtocolError(f"not a seeder request (starts with {magic!r}, expected {REQUEST_MAGIC!r})")
    return offset, length


def encode_error(message: str) -> bytes:
    body = message.encode()[:MAX_ERROR]
    return RESPONSE.pack(ERROR, len(body)) + body
