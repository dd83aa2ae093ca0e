"""A connection held between decode DISPATCHes (worker/hold.py): the next frames of a learned lane read,
answered and sent in C, everything else left to the event loop's reader.

Over real TCP to an in-process WorkerServer whose store holds quantized experts (random Q4_K blocks,
test_quant_experts), each RESULT compared bit for bit with the store's own answer.
"""

from __future__ import annotations

import time

import pytest
import torch

from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import HEADER_SIZE, Frame, Opcode
from moeswarm.wire.messages import Dispatch, ErrorReply, Result
from moeswarm.wire.stream import send_frame
from moeswarm.worker.limits import WorkerLimits
from moeswarm.worker.server import WorkerServer
from test_worker_express import routing, store_of
from test_worker_limits import FINGERPRINT, greeted, recv
from test_worker_runner import running

EXACT_HELD = (2, 3, 4)  # an exact worker's experts (ids 0 and 1 are held elsewhere)


def _server(held: tuple[int, ...]) -> WorkerServer:
    return WorkerServer(store_of(held), FINGERPRINT, "scale", WorkerLimits(), inline_tokens=8)


def _expect(sock, request: Dispatch, request_id: int, store) -> None:
    """The RESULT of `request` (sent as `request_id`) is the store's own answer, bit for bit."""
    reply = recv(sock)
    assert (reply.opcode, reply.request_id) == (Opcode.RESULT, request_id), ErrorReply.from_frame(reply).message
    result, expected = Result.from_frame(reply), store.run(request)
    assert torch.equal(result.outputs, expected.outputs)
    if request.mode == CombineMode.EXACT:
        assert (result.experts, result.counts) == (expected.experts, expected.counts)


def _frame_bytes(request: Dispatch, request_id: int) -> bytes:
    return b"".join(bytes(part) for part in request.to_frame(request_id).encode())


@pytest.mark.parametrize("mode", [CombineMode.PARTIAL, CombineMode.EXACT])
def test_a_held_connection_answers_its_next_decode_dispatches_in_c_with_the_stores_bits(mode):
    """After a DISPATCH answered whole on the loop, the connection is held: the next ones of the same
    lane (timed or not) are answered by the hold, each RESULT the store's own bits."""
    held = (0, 1, 2, 3, 4) if mode == CombineMode.PARTIAL else EXACT_HELD
    server = _server(held)
    with running(server) as (_, address):
        sock = greeted(address)
        for timed in (False, True):
            for seed in range(6):
                hidden, index, weights = routing(1, 3, held, seed)
                request = Dispatch(0, hidden, index, weights, mode, timed=timed)
                send_frame(sock, request.to_frame(100 + seed))
                _expect(sock, request, 100 + seed, server.store)
        sock.close()
    express = server.computation.express
    assert express.whole == 10  # all but the first of each metadata
    assert express.hold.answered >= 1  # frames 3-6 of each come while the connection is held


def test_a_held_connection_leaves_every_other_frame_to_the_loop_and_keeps_serving():
    """While held: a PING, a DISPATCH of another lane, one of the lane whose id is not held here (the
    full path names it), frames that come in parts (a short pause: the hold waits for the rest; a long
    one: the loop reads it) each get the loop's answer, and the lane's next frames the hold's."""
    held = EXACT_HELD
    server = _server(held)
    with running(server) as (_, address):
        sock = greeted(address)
        rid = 200

        def decode_step(seed: int) -> None:
            nonlocal rid
            rid += 1
            hidden, index, weights = routing(1, 3, held, seed)
            request = Dispatch(0, hidden, index, weights, CombineMode.EXACT)
            send_frame(sock, request.to_frame(rid))
            _expect(sock, request, rid, server.store)

        for seed in range(3):
            decode_step(seed)
        send_frame(sock, Frame(Opcode.PING, 300))  # it ends the hold: its count is in before the PONG
        reply = recv(sock)
        assert (reply.opcode, reply.request_id) == (Opcode.PONG, 300)
        answered = server.computation.express.hold.answered
        assert answered >= 1
        decode_step(3)

        hidden, index, weights = routing(2, 3, held, 4)  # two tokens: another lane
        request = Dispatch(0, hidden, index, weights, CombineMode.EXACT)
        send_frame(sock, request.to_frame(301))
        _expect(sock, request, 301, server.store)
        decode_step(5)

        hidden, index, weights = routing(1, 3, held, 6)
        index[0, 1] = 0  # expert 0 is held elsewhere: the same metadata, an id the lane's table refuses
        send_frame(sock, Dispatch(0, hidden, index, weights, CombineMode.EXACT).to_frame(302))
        reply = recv(sock)
        assert (reply.opcode, reply.request_id) == (Opcode.ERROR, 302)
        assert "expert" in ErrorReply.from_frame(reply).message
        decode_step(7)

        for pause_s, cut in ((0.001, HEADER_SIZE + 300), (0.05, HEADER_SIZE + 300), (0.05, 10)):
            hidden, index, weights = routing(1, 3, held, 8)
            request = Dispatch(0, hidden, index, weights, CombineMode.EXACT)
            rid += 1
            data = _frame_bytes(request, rid)
            sock.sendall(data[:cut])
            time.sleep(pause_s)
            sock.sendall(data[cut:])
            _expect(sock, request, rid, server.store)
            decode_step(9)
        sock.close()
    assert server.computation.express.hold.answered > answered  # held again after each of them


def test_another_connection_is_served_while_one_is_held():
    """A connection decoding (held between its DISPATCHes) does not keep another one waiting: the
    other's PINGs and DISPATCHes are answered in turn, every RESULT the store's own bits."""
    held = (0, 1, 2, 3, 4)
    server = _server(held)
    with running(server) as (_, address):
        first, second = greeted(address), greeted(address)
        for seed in range(12):
            for step in range(2):  # the second while the first connection is held
                request = Dispatch(0, *routing(1, 3, held, 2 * seed + step), CombineMode.PARTIAL)
                send_frame(first, request.to_frame(400 + 2 * seed + step))
                _expect(first, request, 400 + 2 * seed + step, server.store)
            send_frame(second, Frame(Opcode.PING, 500 + seed))
            reply = recv(second, 5.0)
            assert (reply.opcode, reply.request_id) == (Opcode.PONG, 500 + seed)
            if seed % 3 == 0:
                request = Dispatch(0, *routing(1, 3, held, 50 + seed), CombineMode.PARTIAL)
                send_frame(second, request.to_frame(600 + seed))
                _expect(second, request, 600 + seed, server.store)
        first.close()
        second.close()
    assert server.computation.express.hold.answered >= 1
