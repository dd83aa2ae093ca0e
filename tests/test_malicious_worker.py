"""A malicious or broken worker cannot crash, hang or exhaust the backbone (fake workers over TCP).

Each bad answer is tried twice: with an honest replica of the same experts (the layer call fails
over and its output stays equal to eager's sum) and alone (a one-line WorkerError naming the
worker, the layer and the experts, within the deadline). A bad HELLO is refused at connect.
"""

from __future__ import annotations

import time
import tracemalloc

import msgpack
import pytest
import torch
from test_dispatcher import D, E, FakeWorker, _routing, honest_reply, reference, tcp_dispatcher

from moeswarm.dispatch.errors import ExpertsUnavailable
from moeswarm.dispatch.health import DeadlinePolicy
from moeswarm.errors import WorkerError
from moeswarm.swarm import connect
from moeswarm.transport.tcp import TcpLink
from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import HEADER, MAGIC, VERSION, Frame, Opcode
from moeswarm.wire.messages import Dispatch, ErrorReply, Result, WorkerInfo
from moeswarm.wire.stream import send_frame

ALL = list(range(E))
DEADLINE = DeadlinePolicy(cap_s=1.0)  # every wait is capped at 1 s: a test that hangs fails fast


def _result(frame: Frame, outputs: torch.Tensor | None = None, **changes) -> Result:
    honest = _honest(frame)
    fields = dict(layer=honest.layer, mode=honest.mode, outputs=honest.outputs if outputs is None else outputs,
                  experts=honest.experts, counts=honest.counts)
    fields.update(changes)
    return Result(**fields)


def _honest(frame: Frame) -> Result:
    from test_dispatcher import answer

    return answer(Dispatch.from_frame(frame))


def wrong_shape(worker, conn, frame):
    honest = _honest(frame)
    send_frame(conn, _result(frame, honest.outputs[:, :-1]).to_frame(frame.request_id))  # [n, d - 1]


def wrong_rows(worker, conn, frame):
    honest = _honest(frame)
    send_frame(conn, _result(frame, torch.cat([honest.outputs, honest.outputs])).to_frame(frame.request_id))


def nan_rows(worker, conn, frame):
    outputs = _honest(frame).outputs.clone()
    outputs[0, 0] = float("nan")
    send_frame(conn, _result(frame, outputs).to_frame(frame.request_id))


def inf_rows(worker, conn, frame):
    outputs = _honest(frame).outputs.clone()
    outputs[-1, -1] = float("inf")
    send_frame(conn, _result(frame, outputs).to_frame(frame.request_id))


def garbage_meta(worker, conn, frame):
    meta = msgpack.packb({"layer": "zero", "mode": 7, "tensors": [["y", "f32", [1, -5]]], "experts": None})
    conn.sendall(HEADER.pack(MAGIC, VERSION, Opcode.RESULT, 0, frame.request_id, len(meta), 0) + meta)


def huge_header(worker, conn, frame):
    conn.sendall(HEADER.pack(MAGIC, VERSION, Opcode.RESULT, 0, frame.request_id, 0, 1 << 30))


def one_byte_per_second(worker, conn, frame):
    data = b"".join(bytes(b) for b in _honest(frame).to_frame(frame.request_id).encode())
    for byte in data:
        conn.sendall(bytes([byte]))
        time.sleep(1.0)


def never(worker, conn, frame):
    time.sleep(30)


def ansi_error(worker, conn, frame):
    send_frame(conn, ErrorReply("internal", "ok\x1b[2J\x1b[H\rall good\n").to_frame(frame.request_id))


BAD_ANSWERS = {
    "wrong shape": (wrong_shape, f", {D - 1}], expected ["),
    "wrong row count": (wrong_rows, "bad reply: frame payload of"),
    "NaN": (nan_rows, "NaN or inf"),
    "inf": (inf_rows, "NaN or inf"),
    "garbage metadata": (garbage_meta, "bad RESULT"),
    "huge frame header": (huge_header, "is over the limit of"),
    "one byte per second": (one_byte_per_second, "no reply within its deadline of 1 s"),
    "never answers": (never, "no reply within its deadline of 1 s"),
    "terminal escapes": (ansi_error, "ok\\x1b[2J\\x1b[H\\rall good\\n"),
}


@pytest.mark.parametrize("case", list(BAD_ANSWERS))
def test_bad_answer_fails_over_to_an_honest_replica(case):
    behaviour, cause = BAD_ANSWERS[case]
    bad, honest = FakeWorker(ALL, behaviour), FakeWorker(ALL)
    dispatcher = tcp_dispatcher([bad, honest], policy=DEADLINE)
    try:
        hidden, index, weights = _routing(5, 20)
        started = time.monotonic()
        out = dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))
        assert time.monotonic() - started < 5.0  # bounded by 1 s deadlines (a lone holder is probed and asked once more)
        assert torch.equal(out, reference(hidden, index, weights))
        assert dispatcher.holders[0].up is False and cause in dispatcher.holders[0].cause
        assert dispatcher.stats.failovers == 1
        out = dispatcher.combine(dispatcher.dispatch(1, hidden, index, weights))  # the next layer: honest alone
        assert torch.equal(out, reference(hidden, index, weights))
    finally:
        dispatcher.close()
        bad.close()
        honest.close()


@pytest.mark.parametrize("case", list(BAD_ANSWERS))
def test_bad_answer_without_a_replica_is_one_line_naming_worker_layer_experts(case):
    behaviour, cause = BAD_ANSWERS[case]
    bad, honest = FakeWorker([0, 2, 4, 6], behaviour), FakeWorker([1, 3, 5, 7])
    dispatcher = tcp_dispatcher([bad, honest], policy=DEADLINE)
    try:
        hidden, index, weights = _routing(5, 21)
        started = time.monotonic()
        with pytest.raises(ExpertsUnavailable) as caught:
            dispatcher.combine(dispatcher.dispatch(1, hidden, index, weights))
        assert time.monotonic() - started < 5.0  # bounded by 1 s deadlines (a lone holder is probed and asked once more)
        message = str(caught.value)
        hit = sorted({e for e in index.flatten().tolist() if e % 2 == 0})
        assert message.startswith(f"worker {bad.address}: ") and cause in message
        assert message.endswith(f"layer 1 experts {','.join(map(str, hit))} have no other usable holder")
        assert message.isprintable()  # one line, no terminal escapes
        assert (caught.value.layer, caught.value.experts) == (1, hit)
    finally:
        dispatcher.close()
        bad.close()
        honest.close()


def test_huge_reply_header_allocates_nothing():
    bad = FakeWorker(ALL, huge_header)
    link = TcpLink(bad.address)
    link.connect("fp")
    hidden, index, weights = _routing(3, 22)
    pending = link.send(link.prepare(Dispatch(0, hidden, index, weights)))
    tracemalloc.start()
    with pytest.raises(WorkerError, match="over the limit"):
        link.wait(pending, time.monotonic() + 5)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20  # a 1 GiB declaration: under 1 MiB allocated
    bad.close()


def _hello(**changes):
    def build(worker, frame):
        meta = WorkerInfo("fp", "fake", E, D, {0: tuple(ALL)}, ("f32",)).to_frame(frame.request_id).meta
        meta.update(changes)
        return Frame(Opcode.HELLO, frame.request_id, meta)

    return build


BAD_HELLOS = {
    "expert None": (_hello(held=[[0, [0, None]]]), "bad HELLO answer"),
    "expert 1000": (_hello(held=[[0, [0, 1000]]]), "bad HELLO answer"),
    "expert -1": (_hello(held=[[0, [-1, 0]]]), "bad HELLO answer"),
    "expert as text": (_hello(held=[[0, ["7"]]]), "bad HELLO answer"),
    "layer as text": (_hello(held=[["zero", [0]]]), "bad HELLO answer"),
    "held not a list": (_hello(held={"0": [0]}), "bad HELLO answer"),
    "num_experts as text": (_hello(num_experts="8"), "bad HELLO answer"),
    "fewer experts than the model": (_hello(num_experts=4, held=[[0, [0, 1]]]), "announces 4 experts of width 4"),
    "wider than the model": (_hello(hidden_size=4096), "announces 8 experts of width 4096"),
    "a layer the model lacks": (_hello(held=[[0, ALL], [9, ALL]]), "announces experts of layers [9]"),
    "escapes in the fingerprint": (_hello(fingerprint="fp\x1b[31m"), "serves model fp\\x1b[31m"),
}


@pytest.mark.parametrize("case", list(BAD_HELLOS))
def test_bad_hello_is_refused_in_one_line(case):
    build, cause = BAD_HELLOS[case]
    bad = FakeWorker(ALL, honest_reply, build)
    link = TcpLink(bad.address)
    try:
        with pytest.raises(WorkerError) as caught:
            connect([link], "fp", E, D, [0, 1])
        message = str(caught.value)
        assert message.startswith(f"worker {bad.address}: ") and cause in message and message.isprintable()
        assert link.broken
    finally:
        bad.close()


def test_a_half_sent_reply_with_replica_does_not_hold_the_other_holder():
    """A trickling worker is cut at its deadline; the honest holder's stream stays in step."""
    bad, honest = FakeWorker(ALL, one_byte_per_second), FakeWorker(ALL)
    dispatcher = tcp_dispatcher([bad, honest], policy=DEADLINE)
    try:
        for layer in range(4):
            hidden, index, weights = _routing(4, 30 + layer)
            assert torch.equal(dispatcher.combine(dispatcher.dispatch(layer % 2, hidden, index, weights)),
                               reference(hidden, index, weights))
        assert honest.connections == 1 and dispatcher.stats.deadline_misses == 1
    finally:
        dispatcher.close()
        bad.close()
        honest.close()


def test_exact_combine_still_refuses_a_reply_mode_it_did_not_ask_for():
    def partial_instead(worker, conn, frame):
        request = Dispatch.from_frame(frame)
        send_frame(conn, Result(request.layer, CombineMode.PARTIAL, torch.zeros(request.hidden.shape), [], []).to_frame(
            frame.request_id))

    bad, honest = FakeWorker(ALL, partial_instead), FakeWorker(ALL)
    dispatcher = tcp_dispatcher([bad, honest], policy=DEADLINE)
    try:
        hidden, index, weights = _routing(4, 40)
        assert torch.equal(dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights)),
                           reference(hidden, index, weights))
        assert "RESULT for layer 0 (partial), asked layer 0 (exact)" in dispatcher.holders[0].cause
    finally:
        dispatcher.close()
        bad.close()
        honest.close()



def test_a_worker_that_comes_back_holding_other_experts_is_not_readmitted():
    from test_dispatcher import garbage_on

    changing, honest = FakeWorker(ALL, garbage_on(1)), FakeWorker(ALL)
    dispatcher = tcp_dispatcher([changing, honest], policy=DeadlinePolicy(cap_s=1.0, backoff_s=0.0))
    try:
        hidden, index, weights = _routing(4, 41)
        changing.held = [0, 1]  # its next HELLO announces fewer experts than it did
        assert torch.equal(dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights)),
                           reference(hidden, index, weights))
        dispatcher.readmit(due_only=False)
        assert dispatcher.holders[0].up is False and changing.connections == 2
        assert "came back holding other experts" in dispatcher.holders[0].cause
        changing.held = ALL  # the same experts again: a good HELLO and PING readmit it
        dispatcher.readmit(due_only=False)
        assert dispatcher.holders[0].up is True and dispatcher.stats.readmissions == 1
    finally:
        dispatcher.close()
        changing.close()
        honest.close()
