"""The gateway's side of a chain of stages: one connection to every stage, a step in, its result out.

The gateway sends a step to the first stage with the rest of the route; each stage sends it on to
the next, and the last answers on the gateway's own connection to it. So a step costs (stages + 1)
one-way trips, whatever the number of MoE layers. Every stage knows the gateway's session (its
HELLO), so any stage can answer an ERROR directly.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

import torch

from moeswarm.errors import ProtocolError, one_line, printable
from moeswarm.stages.link import MAX_TOKENS, StageError, StageLink
from moeswarm.stages.protocol import Segment, Step, parse_result
from moeswarm.wire.frames import Frame, Opcode

log = logging.getLogger("moeswarm.gateway")


@dataclass(frozen=True)
class _Logged:
    """A step as sent: what a replay sends again."""

    number: int
    records: tuple
    segments: tuple
    hidden: torch.Tensor  # [T, d] entering the first stage


class Chain:
    """A route of stages covering decoder layers [0, num_layers) in order, for one gateway session.

    Every step is logged as sent (its records, segments and the hidden states entering the first
    stage). When a stage dies, stalls or loses this session's sequences, the chain takes the next
    replica of each dead stage (or, when a span has none left, the route `replan` gives), opens a
    new session, and replays the log in order: every stage
    recomputes every step exactly as the first time (the same rows packed the same way), so the
    caches, and the outputs after them, are bit for bit what they were; `reroute` moves to a better
    route the same way, between steps. Past `max_log_bytes` of
    logged hidden states the log is dropped and a failed stage fails its steps instead.
    `timeout_s`: the most a step waits for the chain's answer (the swarm's reply timeout, SwarmConfig).
    `kv_cache`: the gateway's --kv-cache; a stage keeping its cache otherwise is passed over at HELLO.
    """

    def __init__(self, positions: list[list[str]], fingerprint: str, hidden_size: int, num_layers: int,
                 timeout_s: float, tls: ssl.SSLContext | None = None, max_log_bytes: int = 1 << 30,
                 kv_cache: str = "model"):
        self.positions = [list(replicas) for replicas in positions]
        self.kv_cache = kv_cache  # --kv-cache: every stage must keep its cache as this gateway's reference does
        self.fingerprint, self.hidden_size, self.num_layers = fingerprint, hidden_size, num_layers
        self.timeout_s, self.tls, self.max_log_bytes = timeout_s, tls, max_log_bytes
        self.session = ""
        self._choice = [0] * len(self.positions)
        self._links: list[StageLink] = []
        self._log: list[_Logged] | None = []  # None: over max_log_bytes, no replay
        self._log_bytes = 0
        self._pending: dict[int, Future] = {}
        self._steps = itertools.count(1)
        self._lock = threading.Lock()  # the pending futures
        self._sending = threading.Lock()  # the order of sends and log entries; held through a replay
        self.spans: list[range] | None = None  # each position's decoder layers, once connected
        self.generation = 0  # sessions opened
        self.failovers = 0
        self.replayed_steps = 0
        self.last_replay_s: float | None = None  # from a failure's recovery to the failed step's answer
        self.reroutes = 0  # moves to a better route (`reroute`)
        # called with the dead stages' addresses when a span lost every replica: another route of the
        # stages alive (per position, its replicas), or None (stages/watch.py StageWatch sets it)
        self.replan: Callable[[set[str]], list[list[str]] | None] | None = None
        # the stages the swarm offers now, each with its round trip from here (stages/route.py Offers):
        # for a status page; set by StageWatch, None for a fixed --stages list
        self.offered: Callable[[], list] | None = None

    @property
    def route(self) -> list[str]:
        """The stages in use, in layer order."""
        return [replicas[i] for replicas, i in zip(self.positions, self._choice)]

    def connect(self) -> "Chain":
        """Open a session on the route. A stage that cannot be reached, at start as after a failure,
        is passed over for the next replica of its span; StageError when a span has none left."""
        for _ in range(sum(map(len, self.positions))):
            chosen = list(self._choice)
            self.session = os.urandom(8).hex()
            self._links = []
            tokens = [os.urandom(16).hex() for _ in self.positions]  # what stage i shows stage i + 1 with its steps
            try:
                for position in range(len(self.positions)):
                    links = {"upstream": tokens[position]} if position > 0 else {}
                    if position + 1 < len(self.positions):
                        links.update(onward=self.route[position + 1], onward_token=tokens[position + 1])
                    self._links.append(self._reach(position, links))
                if self._choice[1:] != chosen[1:]:  # a stage named as the next of the one before it was passed over
                    self.close()
                    continue  # again, on the replicas now chosen, under a new session
                self._check_cover()
                self.spans = [link.layers for link in self._links]
            except BaseException:
                self.close()
                raise
            return self
        raise StageError("the chain's stages kept changing while it connected")

    def _reach(self, position: int, links: dict) -> StageLink:
        """A connected link to the chosen replica of `position`, or to the next ones in turn."""
        replicas = self.positions[position]
        while True:
            link = StageLink(replicas[self._choice[position]], self)
            try:
                link.connect(self.session, self.fingerprint, self.tls, links)
                return link
            except StageError as error:
                if self._choice[position] + 1 >= len(replicas):
                    raise
                self._choice[position] += 1
                log.warning("stage chain: %s; using its replica %s", printable(str(error), 300),
                            replicas[self._choice[position]])

    def add_replica(self, layers: range, address: str, rtts_ms: Mapping[str, float] | None = None) -> bool:
        """A stage holding exactly `layers`, one of the chain's spans, joins that span's replicas, the
        next to take over when the ones before it fail: last, or with `rtts_ms` (round trips by
        address) among the replicas after the one in use by round trip, fastest first (unknown ones
        last, in their order). False when no span is `layers`, or the stage is listed there already.
        Thread-safe: between two steps' sends."""
        with self._sending:
            for position, (span, replicas) in enumerate(zip(self.spans or (), self.positions)):
                if span == layers:
                    if address in replicas:
                        return False
                    replicas.append(address)
                    if rtts_ms is not None:  # the ones not yet tried, by round trip (sorted() is stable)
                        after = self._choice[position] + 1
                        replicas[after:] = sorted(replicas[after:], key=lambda a: rtts_ms.get(a, math.inf))
                    return True
        return False

    def _check_cover(self) -> None:
        at = 0
        for link in self._links:
            if link.layers.start != at:
                raise StageError(f"stage {link.address} holds layers {link.layers.start}-{link.layers.stop - 1}, "
                                 f"but the chain needs layer {at} next: list the stages in layer order, without gaps")
            at = link.layers.stop
        if at != self.num_layers:
            raise StageError(f"the stages hold layers 0-{at - 1} of the model's {self.num_layers}")

    def step(self, segments: list[Segment], records: Callable[[], list[tuple]], hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, d] through every stage: [T, d] after the model's last layer.

        records: called as the step is sent (the gateway's journal drained), so that the records
        every stage replays before a step are exactly those made before it was sent, whichever of
        several groups in flight sends first."""
        recovered_at = None
        dead = next((link for link in self._links if link.dead), None)
        if dead is not None:  # found dead between steps: a step sent on would vanish at the stage before it
            recovered_at = time.monotonic()
            self._recover(self.generation, None, StageError(f"stage {dead.address}: connection lost"))
        with self._sending:
            logged = _Logged(next(self._steps), tuple(records()), tuple(segments), hidden)
            future = self._register(logged.number)
            self._remember(logged)
            generation = self.generation
            self._send_quietly(logged)
        try:
            for attempt in range(sum(map(len, self.positions)) + 1):
                try:
                    out = future.result(self.timeout_s)
                    break
                except (StageError, TimeoutError) as error:
                    cause = error if isinstance(error, StageError) else \
                        StageError(f"no answer from the chain within {self.timeout_s:g} s")
                    recovered_at = recovered_at or time.monotonic()
                    future, generation = self._recover(generation, logged.number, cause)
            else:
                raise StageError(f"step {logged.number} failed after every replica was tried")
        finally:
            with self._lock:
                self._pending.pop(logged.number, None)
        if recovered_at is not None:
            self.last_replay_s = time.monotonic() - recovered_at
        if out.shape != hidden.shape or out.dtype != hidden.dtype:
            raise StageError(f"the chain answered {list(out.shape)} {out.dtype} for {list(hidden.shape)} {hidden.dtype}")
        return out

    def _register(self, number: int) -> Future:
        future: Future = Future()
        with self._lock:
            self._pending[number] = future
        return future

    def _remember(self, logged: _Logged) -> None:
        if self._log is None:
            return
        self._log.append(logged)
        self._log_bytes += logged.hidden.nbytes
        if self._log_bytes > self.max_log_bytes:
            log.warning("the chain's step log passed %d bytes: it is dropped, and a failed stage now fails its "
                        "steps instead of being replayed", self.max_log_bytes)
            self._log = None

    def _send_quietly(self, logged: _Logged) -> None:
        """Send a logged step to the first stage; a broken connection is found by the wait (recovery)."""
        frame = Step(self.session, logged.number, tuple(self.route[1:]), logged.records, logged.segments,
                     logged.hidden).to_frame()
        try:
            self._links[0].send(frame)
        except OSError as error:
            self.lost(self._links[0], one_line(error))

    def _recover(self, generation: int, number: int | None, cause: StageError) -> tuple[Future | None, int]:
        """After `cause` failed step `number` (sent in session `generation`): the next replica of every
        dead stage, a new session, and the log replayed. Returns the step's new future and session."""
        with self._sending:
            if self.generation == generation:  # not yet recovered by another group's step
                if self._log is None:
                    raise cause
                dead = [i for i, link in enumerate(self._links) if link.dead or not link.answers_ping()]
                lost = [i for i in dead if self._choice[i] + 1 >= len(self.positions[i])]
                route = self.replan({self.route[i] for i in dead}) if lost and self.replan else None
                if lost and route is None:
                    span = self._links[lost[0]].layers
                    raise StageError(f"{cause}; no replica left for layers {span.start}-{span.stop - 1}") from None
                replaced = [self.route[i] for i in dead]
                if route is not None:  # a span lost every replica: another tiling of the stages alive
                    self.positions, self._choice = [list(r) for r in route], [0] * len(route)
                else:
                    for i in dead:
                        self._choice[i] += 1
                for link in self._links:
                    link.close()
                log.warning("stage chain: %s; %s, replaying %d steps", printable(str(cause), 300),
                            f"replaced {replaced}" if dead else "the same stages", len(self._log))
                self.generation += 1
                self.connect()
                if route is not None:
                    log.warning("stage chain: re-planned the route as %s", self.describe())
                with self._lock:
                    waiting = set(self._pending)
                self._replay(waiting)
                self.failovers += 1
            if number is None:
                return None, self.generation
            with self._lock:
                future = self._pending.get(number) or Future()
            return future, self.generation

    def _replay(self, waiting: set[int]) -> None:
        """Send every logged step again in order on the new session (a fresh future for each one `waiting`)."""
        for logged in self._log:
            if logged.number in waiting:
                self._register(logged.number)
            self._send_quietly(logged)
        self.replayed_steps += len(self._log)

    def reroute(self, positions: list[list[str]], drain_s: float = 10.0) -> bool:
        """Move to another route (per position in layer order, its replicas) between two steps:
        new sends wait while the step in flight ends (at most `drain_s`), then the new stages get a
        session and the log replayed, so their caches are what the old route's were. False (the old
        route kept) when the log was dropped, a step stayed in flight, or the new route cannot be
        connected."""
        with self._sending:
            deadline = time.monotonic() + drain_s
            while self._pending and time.monotonic() < deadline:
                time.sleep(0.002)
            if self._log is None or self._pending:
                return False
            old = (self.positions, self._choice)
            for link in self._links:
                link.close()
            self.positions, self._choice = [list(r) for r in positions], [0] * len(positions)
            self.generation += 1
            try:
                self.connect()
            except StageError as error:
                log.warning("stage chain: the new route %s failed (%s): keeping %s", positions,
                            printable(str(error), 300), old[0])
                self.positions, self._choice = old
                self.connect()
                self._replay(set())
                return False
            self._replay(set())
            self.reroutes += 1
            return True

    def describe(self) -> str:
        """The route in words: each position's layers and the stage in use."""
        return ", ".join(f"layers {span.start}-{span.stop - 1} at {address}"
                         for span, address in zip(self.spans or (), self.route))

    def receive(self, link: StageLink, frame: Frame) -> None:
        if link not in self._links:
            return  # a replaced session's connection
        with self._lock:
            future = self._pending.get(frame.request_id)
        if future is None:
            return  # an answer nobody waits for (a replayed step answered before)
        if frame.opcode == Opcode.STEP_RESULT:
            try:
                _, hidden = parse_result(frame, self.hidden_size, MAX_TOKENS)
            except ProtocolError as error:
                _settle(future, error=StageError(f"stage {link.address}: bad result: {one_line(error)}"))
                return
            _settle(future, result=hidden)
        elif frame.opcode == Opcode.ERROR:
            _settle(future, error=StageError(printable(str(frame.meta.get("message", "(no message)")), 500)))

    def lost(self, link: StageLink, why: str) -> None:
        if link not in self._links:
            return  # closed on purpose: a replaced session's connection
        with self._lock:
            pending = list(self._pending.values())
        for future in pending:
            _settle(future, error=StageError(f"stage {link.address}: connection lost: {printable(why, 200)}"))

    def close(self) -> None:
        for link in self._links:
            link.close()


def _settle(future: Future, result=None, error: BaseException | None = None) -> None:
    """Resolve `future` unless something else (a lost connection, say) already has."""
    try:
        future.set_exception(error) if error is not None else future.set_result(result)
    except InvalidStateError:
        pass
