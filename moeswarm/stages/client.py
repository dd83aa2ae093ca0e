"""The gateway's side of a chain of stages: one connection to every stage, a step in, its result out.

The gateway sends a step to the first stage with the rest of the route; each stage sends it on to
the next, and the last answers on the gateway's own connection to it. So a step costs (stages + 1)
one-way trips, whatever the number of MoE layers. Every stage knows the gateway's session (its
HELLO), so any stage can answer an ERROR directly.
"""

from __future__ import annotations

import itertools
import os
import socket
import ssl
import threading
import time
from concurrent.futures import Future, InvalidStateError

import torch

from moeswarm.errors import MoeSwarmError, ProtocolError, one_line, printable
from moeswarm.stages.protocol import Segment, Step, parse_result
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.stream import recv_frame, send_frame

CONNECT_TIMEOUT_S = 10.0
MAX_TOKENS = 1 << 16  # the most rows a result may carry back (a step never sends more)


class StageError(MoeSwarmError):
    """A stage failed a step (its one-line reason), or a stage could not be reached."""


def parse_route(text: str) -> list[str]:
    """`--stages H:P,H:P,...` -> the addresses, in layer order."""
    route = [part.strip() for part in text.split(",") if part.strip()]
    if not route:
        raise ValueError("give at least one stage, HOST:PORT")
    for address in route:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"stage {address!r} is not HOST:PORT")
    return route


class StageLink:
    """One connection to one stage: HELLO, then a reader thread resolving the chain's futures."""

    def __init__(self, address: str, chain: "Chain"):
        self.address, self.chain = address, chain
        self.layers: range | None = None
        self._sock: socket.socket | None = None
        self._send = threading.Lock()

    def connect(self, session: str, fingerprint: str, tls: ssl.SSLContext | None) -> None:
        host, _, port = self.address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=host)
            send_frame(sock, Frame(Opcode.HELLO, 0, {"role": "gateway", "session": session, "fingerprint": fingerprint}))
            reply, _ = recv_frame(sock, time.monotonic() + CONNECT_TIMEOUT_S, max_payload=1 << 16)
        except (OSError, ProtocolError, ssl.SSLError) as error:
            raise StageError(f"stage {self.address}: cannot connect: {one_line(error)}") from None
        if reply.opcode != Opcode.HELLO:
            sock.close()
            raise StageError(f"stage {self.address} refused the gateway: {printable(str(reply.meta.get('message')), 300)}")
        layers = reply.meta.get("layers")
        if not (isinstance(layers, list) and len(layers) == 2 and all(isinstance(v, int) for v in layers)
                and 0 <= layers[0] <= layers[1]):
            sock.close()
            raise StageError(f"stage {self.address} answered HELLO without its layers")
        self.layers = range(layers[0], layers[1] + 1)
        sock.settimeout(None)
        self._sock = sock
        threading.Thread(target=self._read, name=f"moeswarm-stage-{self.address}", daemon=True).start()

    def send(self, frame: Frame) -> None:
        with self._send:
            send_frame(self._sock, frame)

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()

    def _read(self) -> None:
        try:
            while True:
                frame, _ = recv_frame(self._sock, None, max_payload=MAX_TOKENS * self.chain.hidden_size * 4 + 4096)
                self.chain.receive(self.address, frame)
        except (OSError, ProtocolError, ConnectionError, ValueError) as error:
            self.chain.lost(self.address, one_line(error))


class Chain:
    """A route of stages covering decoder layers [0, num_layers) in order, for one gateway session."""

    def __init__(self, route: list[str], fingerprint: str, hidden_size: int, num_layers: int,
                 timeout_s: float = 120.0, tls: ssl.SSLContext | None = None):
        self.route, self.fingerprint = list(route), fingerprint
        self.hidden_size, self.num_layers, self.timeout_s = hidden_size, num_layers, timeout_s
        self.session = os.urandom(8).hex()
        self._tls = tls
        self._links = [StageLink(address, self) for address in self.route]
        self._pending: dict[int, Future] = {}
        self._steps = itertools.count(1)
        self._lock = threading.Lock()
        self.trips = 0  # steps sent

    def connect(self) -> "Chain":
        try:
            for link in self._links:
                link.connect(self.session, self.fingerprint, self._tls)
            self._check_cover()
        except BaseException:
            self.close()
            raise
        return self

    def _check_cover(self) -> None:
        at = 0
        for link in self._links:
            if link.layers.start != at:
                raise StageError(f"stage {link.address} holds layers {link.layers.start}-{link.layers.stop - 1}, "
                                 f"but the chain needs layer {at} next: list the stages in layer order, without gaps")
            at = link.layers.stop
        if at != self.num_layers:
            raise StageError(f"the stages hold layers 0-{at - 1} of the model's {self.num_layers}")

    @property
    def spans(self) -> list[range]:
        return [link.layers for link in self._links]

    def step(self, segments: list[Segment], records: list[tuple], hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, d] through every stage: [T, d] after the model's last layer."""
        number = next(self._steps)
        future: Future = Future()
        with self._lock:
            self._pending[number] = future
        frame = Step(self.session, number, tuple(self.route[1:]), tuple(records), tuple(segments), hidden).to_frame()
        try:
            self._links[0].send(frame)
            self.trips += 1
            out = future.result(self.timeout_s)
        except TimeoutError:
            raise StageError(f"no answer from the chain within {self.timeout_s:g} s") from None
        except OSError as error:
            raise StageError(f"stage {self.route[0]}: {one_line(error)}") from None
        finally:
            with self._lock:
                self._pending.pop(number, None)
        if out.shape != hidden.shape or out.dtype != hidden.dtype:
            raise StageError(f"the chain answered {list(out.shape)} {out.dtype} for {list(hidden.shape)} {hidden.dtype}")
        return out

    def receive(self, address: str, frame: Frame) -> None:
        with self._lock:
            future = self._pending.get(frame.request_id)
        if future is None:
            return  # an answer to a step given up on
        if frame.opcode == Opcode.STEP_RESULT:
            try:
                _, hidden = parse_result(frame, self.hidden_size, MAX_TOKENS)
            except ProtocolError as error:
                _settle(future, error=StageError(f"stage {address}: bad result: {one_line(error)}"))
                return
            _settle(future, result=hidden)
        elif frame.opcode == Opcode.ERROR:
            _settle(future, error=StageError(printable(str(frame.meta.get("message", "(no message)")), 500)))

    def lost(self, address: str, why: str) -> None:
        with self._lock:
            pending = list(self._pending.values())
        for future in pending:
            _settle(future, error=StageError(f"stage {address}: connection lost: {printable(why, 200)}"))

    def close(self) -> None:
        for link in self._links:
            link.close()


def _settle(future: Future, result=None, error: BaseException | None = None) -> None:
    """Resolve `future` unless something else (a lost connection, say) already has."""
    try:
        future.set_exception(error) if error is not None else future.set_result(result)
    except InvalidStateError:
        pass
