"""Frames: the fixed header, msgpack metadata and raw payload of every message.

Layout (little-endian), pinned by golden-byte tests:

    offset size field
    0      4    magic        b"MSWM"
    4      1    version      2 (1: HELLO listed one expert range for all layers)
    5      1    opcode       Opcode
    6      2    flags        reserved, 0
    8      8    request_id   echoed by the reply
    16     4    meta_len     bytes of msgpack metadata that follow the header
    20     4    payload_len  bytes of raw tensor data that follow the metadata

Nothing read from the network is trusted: lengths are checked against limits before any read,
metadata must decode as a msgpack map, and msgpack never builds anything but plain data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgpack

from moeswarm.errors import ProtocolError

MAGIC = b"MSWM"
VERSION = 2
HEADER_FIELDS = ("magic", "version", "opcode", "flags", "request_id", "meta_len", "payload_len")
_HEADER_CODES = ("4s", "B", "B", "H", "Q", "I", "I")  # struct's, one a field
HEADER = struct.Struct("<" + "".join(_HEADER_CODES))  # "<4sBBHQII"
HEADER_SIZE = HEADER.size  # 24
MAX_META_BYTES = 1 << 20
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30


class Opcode(IntEnum):
    """Pinned opcodes: never renumber, only append."""

    HELLO = 1
    DISPATCH = 2
    RESULT = 3
    ERROR = 4
    PING = 5
    PONG = 6
    STEP = 7  # a stage's rows: gateway -> first stage, stage -> next stage (docs/stages.md)
    STEP_RESULT = 8  # the hidden states after a chain's last stage, to the gateway


@dataclass(frozen=True)
class Header:
    opcode: int  # may be unknown: the handler answers ERROR after reading the body
    flags: int
    request_id: int
    meta_len: int
    payload_len: int

    @property
    def body_len(self) -> int:
        return self.meta_len + self.payload_len


Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Frame:
    """One message. `payload` is one buffer (as received) or a tuple of buffers (as built for
    sending: each tensor's bytes stay where the codec put them and go to the socket uncopied).
    meta_bytes: `meta` as msgpack bytes, where known: as it came off the wire (the key under which
    its checked layout may be known already: wire/layouts.py), or packed once for frames built
    from one template (encode then sends them as they are)."""

    opcode: Opcode
    request_id: int
    meta: dict[str, Any] = field(default_factory=dict)
    payload: Buffer | tuple[Buffer, ...] = b""
    meta_bytes: bytes | None = field(default=None, compare=False, repr=False)

    @property
    def parts(self) -> tuple[Buffer, ...]:
        return self.payload if isinstance(self.payload, tuple) else (self.payload,)

    def encode(self) -> list[Buffer]:
        """The frame as buffers ready for `sendmsg`/`writelines` (the payload is not copied)."""
        meta = self.meta_bytes if self.meta_bytes is not None else pack_meta(self.meta)
        parts = [part for part in self.parts if _nbytes(part)]
        header = HEADER.pack(MAGIC, VERSION, int(self.opcode), 0, self.request_id, len(meta), sum(map(_nbytes, parts)))
        return [header + meta, *parts]

    def to_bytes(self) -> bytes:
        return b"".join(bytes(b) for b in self.encode())


def pack_meta(meta: dict[str, Any]) -> bytes:
    return msgpack.packb(meta, use_bin_type=True)


def _nbytes(buffer: Buffer) -> int:
    return buffer.nbytes if isinstance(buffer, memoryview) else len(buffer)


def parse_header(data: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES) -> Header:
    """Check a 24-byte header; raise ProtocolError naming the field that is wrong."""
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"truncated header: {len(data)} of {HEADER_SIZE} bytes")
    magic, version, opcode, flags, request_id, meta_len, payload_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a moeswarm frame (expected {MAGIC!r})")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {VERSION})")
    if meta_len > MAX_META_BYTES:
        raise ProtocolError(f"frame metadata of {meta_len} bytes is over the limit of {MAX_META_BYTES}")
    if payload_len > max_payload:
        raise ProtocolError(f"frame payload of {payload_len} bytes is over the limit of {max_payload}")
    return Header(opcode, flags, request_id, meta_len, payload_len)


def decode_meta(data: bytes) -> dict[str, Any]:
    """Decode msgpack metadata; only a map with string keys is accepted."""
    try:
        meta = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_META_BYTES)
    except Exception as error:
        raise ProtocolError(f"metadata is not valid msgpack: {error}") from None
    if not isinstance(meta, dict):
        raise ProtocolError(f"metadata must be a map, got {type(meta).__name__}")
    return meta


def opcode_of(header: Header) -> Opcode:
    try:
        return Opcode(header.opcode)
    except ValueError:
        raise ProtocolError(f"unknown opcode {header.opcode}") from None


def c_constants() -> dict[str, int]:
    """The frame's #defines in wire/frames.h (MSW_ID_* aside: wire/codecs.py's), as this module
    has them: what each C library must report at load (moeswarm/native.py) and what
    tests/test_frames_header.py checks the header against."""
    at = {name: struct.calcsize("<" + "".join(_HEADER_CODES[:i])) for i, name in enumerate(HEADER_FIELDS)}
    return {"MSW_MAGIC_LEN": len(MAGIC), "MSW_MAGIC_U32": int.from_bytes(MAGIC, "little"), "MSW_VERSION": VERSION,
            "MSW_HEADER_SIZE": HEADER_SIZE, "MSW_MAX_META": MAX_META_BYTES,
            **{f"MSW_AT_{name.upper()}": at[name] for name in HEADER_FIELDS[1:]},
            **{f"MSW_OP_{opcode.name}": int(opcode) for opcode in Opcode}}
