"""The relay handshake: the few bytes a peer and a relay exchange before the pipe is spliced.

A peer opens a TCP connection to the relay and sends one request:

    MAGIC "MSR1" (4 bytes) | role (1 byte) | name length N (1 byte, 1..64) | name (N bytes, [A-Za-z0-9._-])

role "W": a worker offers this connection, idle, to the backbones that ask for NAME;
role "B": a backbone asks for a worker registered as NAME.

The relay answers with one status byte: "K" (ok: registered, or spliced) or "E" followed by a
2-byte big-endian length (at most 512) and a UTF-8 message, after which it closes. On a
worker's registered connection it later sends "A" (keepalive, every few seconds while idle) and
at last "P": a backbone was spliced to this connection; every byte after "P" is the backbone's.
On a backbone's connection every byte after "K" is the worker's.

A keyed relay (`moeswarm relay --swarm-key`) asks a worker to prove its member key before it
registers the name: to role "W" it answers "C" and a 32-byte random challenge, and the worker
sends its member certificate and a signature of the challenge:

    certificate length C (2 bytes, big-endian, 1..2048) | certificate (C bytes, DER) | signature (64 bytes, Ed25519)

over CHALLENGE_DOMAIN | challenge | name. The relay registers the name only when the certificate
was issued by the swarm key, is not revoked, names NAME (a member registers its own name only),
and the signature holds; then "K", else "E" and the reason.

After the handshake the relay copies bytes both ways and never reads them: the backbone and the
worker run TLS (the swarm key) and the moeswarm protocol end to end through the pipe.
Everything here is read with exact sizes (never more than the handshake), so no byte of the
pipe is consumed by the handshake's reader.
"""

from __future__ import annotations

import re
import struct

from moeswarm.errors import MoeSwarmError, printable

MAGIC = b"MSR1"
ROLE_WORKER = b"W"
ROLE_BACKBONE = b"B"
OK = b"K"
ERROR = b"E"
PAIRED = b"P"
KEEPALIVE = b"A"
CHALLENGE = b"C"
CHALLENGE_BYTES = 32
CHALLENGE_DOMAIN = b"moeswarm-relay/1"
SIGNATURE_BYTES = 64
MAX_CERTIFICATE = 2048
REQUEST_HEAD = len(MAGIC) + 2  # magic, role, name length
MAX_NAME = 64
MAX_ERROR = 512
NAME = re.compile(rb"[A-Za-z0-9._-]{1,64}")


class RelayError(MoeSwarmError):
    """A relay refused a peer, or a relay handshake broke its format."""


def check_name(name: str) -> str:
    """`name` if it is a valid relay name; RelayError naming what is wrong otherwise."""
    if not NAME.fullmatch(name.encode("utf-8", "replace")):
        raise RelayError(f"bad relay name {printable(name)!r}: expected 1 to {MAX_NAME} characters of A-Z a-z 0-9 . _ -")
    return name


def encode_request(role: bytes, name: str) -> bytes:
    raw = check_name(name).encode("ascii")
    return MAGIC + role + bytes([len(raw)]) + raw


def parse_request_head(head: bytes) -> tuple[bytes, int]:
    """(role, name length) from the first REQUEST_HEAD bytes; RelayError when they are not a request."""
    if len(head) != REQUEST_HEAD or head[:len(MAGIC)] != MAGIC:
        raise RelayError("not a moeswarm relay request (bad magic)")
    role, length = head[len(MAGIC):len(MAGIC) + 1], head[len(MAGIC) + 1]
    if role not in (ROLE_WORKER, ROLE_BACKBONE):
        raise RelayError(f"unknown relay role {role!r}: expected {ROLE_WORKER!r} or {ROLE_BACKBONE!r}")
    if not 1 <= length <= MAX_NAME:
        raise RelayError(f"relay name length {length} out of range 1..{MAX_NAME}")
    return role, length


def parse_name(raw: bytes) -> str:
    if not NAME.fullmatch(raw):
        raise RelayError(f"bad relay name {printable(raw.decode('utf-8', 'replace'))!r}: expected A-Z a-z 0-9 . _ -")
    return raw.decode("ascii")


def challenge_bytes(challenge: bytes, name: str) -> bytes:
    """What a worker signs to register `name` (bound to this challenge: a proof is good once)."""
    return CHALLENGE_DOMAIN + challenge + name.encode("ascii")


def encode_proof(certificate_der: bytes, signature: bytes) -> bytes:
    if not 0 < len(certificate_der) <= MAX_CERTIFICATE or len(signature) != SIGNATURE_BYTES:
        raise RelayError("a member certificate of 1 to 2048 bytes and a 64-byte signature")
    return struct.pack(">H", len(certificate_der)) + certificate_der + signature


def parse_proof_length(raw: bytes) -> int:
    (length,) = struct.unpack(">H", raw)
    if not 0 < length <= MAX_CERTIFICATE:
        raise RelayError(f"member certificate of {length} bytes (expected 1 to {MAX_CERTIFICATE})")
    return length


def encode_error(message: str) -> bytes:
    raw = message.encode("utf-8")[:MAX_ERROR]
    return ERROR + struct.pack(">H", len(raw)) + raw


def parse_error_length(raw: bytes) -> int:
    (length,) = struct.unpack(">H", raw)
    if length > MAX_ERROR:
        raise RelayError(f"relay error message of {length} bytes (limit {MAX_ERROR})")
    return length


def error_text(raw: bytes) -> str:
    return printable(raw.decode("utf-8", "replace"))


def parse_relay_address(text: str) -> tuple[str, int, str]:
    """"relay://HOST:PORT/NAME" (the scheme optional) -> (host, port, name); ValueError naming the bad text."""
    from moeswarm.ids import parse_address

    rest = text[len("relay://"):] if text.startswith("relay://") else text
    where, sep, name = rest.partition("/")
    if not sep:
        raise ValueError(f"bad relay address {text!r}: expected relay://HOST:PORT/NAME")
    try:
        host, port = parse_address(where)
        check_name(name)
    except (ValueError, RelayError) as error:
        raise ValueError(f"bad relay address {text!r}: {error}") from None
    return host, port, name
