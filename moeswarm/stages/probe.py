"""Probing a stage from here: dial it, check that its HELLO names the span expected, time PINGs."""

from __future__ import annotations

import ssl
import time

from moeswarm.errors import one_line
from moeswarm.stages.dial import DialError, dial, hello_layers
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.stream import recv_frame, send_frame

PINGS = 3  # a stage's round trip is the least of this many PINGs (one can catch the stage busy)


def probe_stage(address: str, layers: range, fingerprint: str, tls: ssl.SSLContext | None,
                timeout_s: float) -> float | str:
    """The least round trip of `PINGS` PINGs to the stage at `address` in ms, or why it cannot be
    used (unreachable, refused, or a HELLO naming other layers than `layers`, its record's)."""
    try:
        sock, reply = dial(address, {"role": "stage", "fingerprint": fingerprint}, tls, timeout_s)
        with sock:
            said = hello_layers(reply)
            if said != layers:
                named = "no layers" if said is None else f"layers {said.start}-{said.stop - 1}"
                return f"its HELLO says {named}, its record {layers.start}-{layers.stop - 1}"
            least = None
            for number in range(1, PINGS + 1):
                started = time.monotonic()
                send_frame(sock, Frame(Opcode.PING, number))
                answer, _ = recv_frame(sock, started + timeout_s, max_payload=1 << 16)
                if answer.opcode != Opcode.PONG:
                    return f"answered PING with {answer.opcode.name}"
                took = (time.monotonic() - started) * 1000.0
                least = took if least is None else min(least, took)
            return least
    except DialError as error:
        return f"cannot be reached: {one_line(error)}"
