"""Hostile gateways against a stage (issue 62, items 2-6): sessions belong to the connection that
opened them, next hops are the ones named at HELLO and share one link per endpoint however they are
spelled, a gateway that never reads loses its slot without stalling another, silent connections
give their slots up, and accepting survives running out of descriptors.

Two stages of the tiny model run in this process (layers 0-2 and 3-5); each test puts servers with
its own limits over their models."""

from __future__ import annotations

import errno
import socket
import time
from dataclasses import replace

import pytest
import torch

from moeswarm.stages.caches import CacheLimits
from moeswarm.stages.node import open_stage
from moeswarm.stages.onward import canonical
from moeswarm.stages.protocol import Segment, Step
from moeswarm.stages.server import StageLimits, StageServer
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.stream import recv_frame, send_frame

MODEL = "models/pymoe/hf"  # 6 decoder layers, hidden size 128


@pytest.fixture(scope="module")
def spans():
    """The two halves' models (loaded once): (server, swarm) of layers 0-2 and of 3-5, not listening."""
    halves = [open_stage(MODEL, range(0, 3), []), open_stage(MODEL, range(3, 6), [])]
    yield [server for server, _ in halves]
    for _, swarm in halves:
        swarm.close()


@pytest.fixture
def serve(spans):
    """serve(half, **limits) -> (server, "127.0.0.1:PORT"): a listening server over that half's model."""
    started = []

    def start(half: int, caches: CacheLimits | None = None, **limits) -> tuple[StageServer, str]:
        base = spans[half]
        server = StageServer(base.model, base.span, base.fingerprint,
                             replace(StageLimits(), caches=caches or CacheLimits(), **limits))
        started.append(server)
        return server, f"127.0.0.1:{server.listen('127.0.0.1', 0)}"

    yield start
    for server in started:
        server.close()


def _connect(address: str, rcvbuf: int | None = None) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect((host, int(port)))
    return sock


def _hello(server: StageServer, address: str, role: str = "gateway", rcvbuf: int | None = None, **fields) -> socket.socket:
    sock = _connect(address, rcvbuf)
    send_frame(sock, Frame(Opcode.HELLO, 0, {"role": role, "fingerprint": server.fingerprint, **fields}))
    reply, _ = recv_frame(sock, time.monotonic() + 30)
    assert reply.opcode == Opcode.HELLO, reply.meta
    return sock


def _ask(sock: socket.socket, frame: Frame) -> Frame:
    send_frame(sock, frame)
    return recv_frame(sock, time.monotonic() + 60)[0]


def _step(session: str, number: int, segments, hidden, records=(), route=(), token="") -> Frame:
    return Step(session, number, tuple(route), tuple(records), tuple(segments), hidden, token).to_frame()


PROMPT = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))  # [T, d]
NEXT = torch.randn(1, 128, generator=torch.Generator().manual_seed(1))


def test_steps_are_taken_only_after_a_hello(serve):
    _, address = serve(0)
    with _connect(address) as sock:
        reply = _ask(sock, _step("s", 1, [Segment(1, None, 0, 3, 0)], PROMPT))
    assert reply.opcode == Opcode.ERROR and "HELLO first" in reply.meta["message"]


def test_another_connection_naming_a_session_gets_an_error_and_nothing_of_its_state(serve):
    server, address = serve(0)
    victim = _hello(server, address, session="victim-session")
    assert _ask(victim, _step("victim-session", 1, [Segment(1, None, 0, 3, 0)], PROMPT)).opcode == Opcode.STEP_RESULT
    with _connect(address) as thief:  # the same session on a second connection: refused
        send_frame(thief, Frame(Opcode.HELLO, 0, {"role": "gateway", "fingerprint": server.fingerprint,
                                                  "session": "victim-session"}))
        reply = recv_frame(thief, time.monotonic() + 30)[0]
        assert reply.opcode == Opcode.ERROR and "open on another connection" in reply.meta["message"]
    gateway = _hello(server, address, session="other")  # a gateway of its own, naming the victim's session
    crop = _step("victim-session", 5, [Segment(1, None, 0, 1, 0)], NEXT, records=[["crop", 1, 0]])
    reply = _ask(gateway, crop)
    assert reply.opcode == Opcode.ERROR and "may not send steps of that session" in reply.meta["message"]
    stage = _hello(server, address, role="stage")  # posing as the stage before it
    reply = _ask(stage, _step("victim-session", 6, [Segment(1, None, 0, 1, 3)], NEXT, token="guess"))
    assert reply.opcode == Opcode.ERROR and "may not send steps of that session" in reply.meta["message"]
    assert _ask(gateway, Frame(Opcode.HELLO, 7, {"role": "gateway", "fingerprint": server.fingerprint,
                                                 "session": "victim-session"})).opcode == Opcode.ERROR  # one HELLO
    # the victim's sequence is whole: its next step sees its 3 positions, and matches an untouched session's
    answer = _ask(victim, _step("victim-session", 2, [Segment(1, None, 0, 1, 3)], NEXT))
    reference = _hello(server, address, session="reference")
    _ask(reference, _step("reference", 1, [Segment(1, None, 0, 3, 0)], PROMPT))
    expected = _ask(reference, _step("reference", 2, [Segment(1, None, 0, 1, 3)], NEXT))
    assert answer.opcode == expected.opcode == Opcode.STEP_RESULT and answer.request_id == 2
    assert bytes(answer.payload) == bytes(expected.payload)
    for sock in (victim, gateway, stage, reference):
        sock.close()


def test_respelled_next_hops_share_one_link_and_only_the_named_one_is_dialed(serve):
    first, first_address = serve(0)
    last, last_address = serve(1)
    port = last_address.rsplit(":", 1)[1]
    spellings = [f"{host}:{port}" for host in ("127.0.0.1", "127.1", "0x7f000001", "2130706433", "0177.0.0.1")]
    assert {canonical(s) for s in spellings} == {f"127.0.0.1:{port}"}
    socks = []
    for i, spelling in enumerate(spellings):
        session, token = f"chain-{i}", f"token-{i}"
        tail = _hello(last, last_address, session=session, upstream=token)
        head = _hello(first, first_address, session=session, onward=spelling, onward_token=token)
        send_frame(head, _step(session, 1, [Segment(1, None, 0, 3, 0)], PROMPT, route=[spelling]))
        reply = recv_frame(tail, time.monotonic() + 60)[0]
        assert reply.opcode == Opcode.STEP_RESULT, reply.meta
        socks += [head, tail]
    assert first._onward.dials == 1 and len(first._onward) == 1
    # a step whose route names another stage than the one its HELLO named: refused, nothing dialed
    reply = _ask(socks[0], _step("chain-0", 2, [Segment(1, None, 0, 1, 3)], NEXT, route=["10.255.255.1:9"]))
    assert reply.opcode == Opcode.ERROR and "not the one its gateway named" in reply.meta["message"]
    assert first._onward.dials == 1
    for sock in socks:
        sock.close()


def test_a_gateway_that_never_reads_loses_its_slot_and_stalls_no_other(serve):
    server, address = serve(1, max_unsent_bytes=64 << 10, send_timeout_s=2.0, queue_per_connection=4)
    sleeper = _hello(server, address, session="sleeper", rcvbuf=4096)
    honest = _hello(server, address, session="honest")
    rows = torch.randn(64, 128)  # each answer 32 KiB
    waits, sent, seq = [], 0, 1
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(server._connections) > 1:
        try:
            for _ in range(4):
                seq += 1
                sleeper.send(_step("sleeper", seq, [Segment(seq, None, 0, 64, 0)], rows).to_bytes())
                sent += 1
        except OSError:
            break  # closed by the stage
        started = time.monotonic()
        seq += 1
        reply = _ask(honest, _step("honest", seq, [Segment(seq, None, 0, 1, 0)], NEXT))
        waits.append(time.monotonic() - started)
        assert reply.opcode == Opcode.STEP_RESULT, reply.meta
    assert len(server._connections) == 1, "the non-reading gateway still holds its slot"
    assert sent > 16 and max(waits) < 2.0, (sent, waits)  # behind at most the sleeper's 4 queued steps' compute
    assert _ask(honest, Frame(Opcode.PING, 1)).opcode == Opcode.PONG
    sleeper.close()
    honest.close()


def test_silent_connections_give_their_slots_up(serve):
    server, address = serve(0, max_connections=4, max_connections_per_peer=4, evict_after_s=0.2, hello_timeout_s=1.0)
    silent = [_connect(address) for _ in range(4)]
    time.sleep(0.3)  # quiet past evict_after_s
    started = time.monotonic()
    _hello(server, address, session="newcomer").close()
    assert time.monotonic() - started < 1.0
    time.sleep(1.6)  # past the HELLO deadline: every silent one is closed
    for sock in silent:
        sock.settimeout(5)
        try:
            assert sock.recv(1 << 16) == b""
        except ConnectionResetError:
            pass
        sock.close()
    assert server.connections == 0


class _OutOfDescriptors:
    """A listener whose next `failures` accepts fail as a process out of descriptors does (EMFILE)."""

    def __init__(self, listener: socket.socket, failures: int):
        self.listener, self.failures = listener, failures

    def accept(self):
        if self.failures > 0:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self.listener.accept()

    def __getattr__(self, name):
        return getattr(self.listener, name)


def test_accepting_survives_running_out_of_descriptors(serve):
    server, address = serve(0)
    server._listener = _OutOfDescriptors(server._listener, failures=8)
    _hello(server, address, session="first").close()  # accepted by the call already waiting; the next ones fail
    time.sleep(0.5)
    started = time.monotonic()
    while server._listener.failures > 0 and time.monotonic() - started < 30:
        time.sleep(0.05)
    started = time.monotonic()
    _hello(server, address, session="after").close()
    assert time.monotonic() - started < 1.0
    assert server.failures.counts["accept: OSError EMFILE"] == 8


class _BansOnce:
    """A swarm whose first step's layer calls are all tainted by a ban (a liar found out mid-step)."""

    def __init__(self):
        self.calls, self.banned = 0, False

    def layer_call_number(self) -> int:
        self.calls += 1
        return self.calls

    def take_taints(self):
        from moeswarm.dispatch.taint import Taint

        if self.banned:
            return []
        self.banned = True
        return [Taint("127.0.0.1:9", "answered zeros", ((1, 1 << 40),))]


def test_a_step_a_ban_hits_is_computed_again_from_the_caches_as_they_were(serve):
    """Marks restored, the span run again: the answer and the caches are bit for bit a clean run's,
    for a prompt, a decode step and branch rows."""
    banned, banned_address = serve(0)
    banned.swarm = _BansOnce()
    clean, clean_address = serve(0)
    answers = []
    for server, address in ((banned, banned_address), (clean, clean_address)):
        sock = _hello(server, address, session="s")
        got = [_ask(sock, _step("s", 1, [Segment(1, None, 0, 3, 0)], PROMPT))]
        server.swarm = _BansOnce() if server is banned else None  # a ban during the decode step too
        got.append(_ask(sock, _step("s", 2, [Segment(1, None, 0, 1, 3)], NEXT)))
        server.swarm = _BansOnce() if server is banned else None  # and during two branch rows
        got.append(_ask(sock, _step("s", 3, [Segment(1, 0, 0, 1, 4), Segment(1, 1, 1, 2, 4)], torch.cat([NEXT, NEXT]))))
        got.append(_ask(sock, _step("s", 4, [Segment(1, None, 0, 1, 5)], NEXT, records=[["keep", 1, 1]])))
        assert all(frame.opcode == Opcode.STEP_RESULT for frame in got), [frame.meta for frame in got]
        answers.append([bytes(frame.payload) for frame in got])
        sock.close()
    assert banned.recomputed == 3
    assert answers[0] == answers[1]


def test_a_member_revoked_while_connected_is_closed(spans, tmp_path):
    import shutil
    import ssl

    from moeswarm.transport.member_cert import revoke, write_member
    from moeswarm.transport.tls import client_context, server_context, write_swarm_key

    swarm = write_swarm_key(tmp_path / "swarm.key")
    for name in ("stage", "gateway"):
        write_member(swarm, name, tmp_path / f"{name}.pem")
    base = spans[0]
    server = StageServer(base.model, base.span, base.fingerprint, StageLimits(),
                         tls_server=server_context(tmp_path / "stage.pem"))
    port = server.listen("127.0.0.1", 0)
    try:
        raw = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock = client_context(tmp_path / "gateway.pem").wrap_socket(raw, server_hostname="127.0.0.1")
        send_frame(sock, Frame(Opcode.HELLO, 0, {"role": "gateway", "fingerprint": base.fingerprint, "session": "m"}))
        assert recv_frame(sock, time.monotonic() + 30)[0].opcode == Opcode.HELLO
        assert _ask(sock, Frame(Opcode.PING, 1)).opcode == Opcode.PONG
        revoke(swarm, tmp_path / "gateway.pem")
        shutil.copy(f"{swarm}.revoked", tmp_path / "stage.pem.revoked")  # the list beside the stage's key, as an operator does
        sock.settimeout(10)
        started = time.monotonic()
        with pytest.raises((ConnectionError, ssl.SSLError, OSError)):
            while time.monotonic() - started < 10:
                send_frame(sock, Frame(Opcode.PING, 2))
                if recv_frame(sock, time.monotonic() + 10)[0].opcode != Opcode.PONG:
                    break
                time.sleep(0.2)
        assert time.monotonic() - started < 5.0  # re-read within a second, checked at the next round
        assert server.connections == 0
    finally:
        server.close()
