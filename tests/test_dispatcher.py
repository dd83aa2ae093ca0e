"""The dispatcher over fake links (in process) and over fake workers on real TCP (FakeWorker,
shared with the failover, spot-check and malicious-worker tests).

Whatever fails in the middle of a layer, at send or at receive, the layer's output must still be
right (another holder, or the same one after a successful probe) or the error must name the
worker, the layer and the experts; and the next layer must work: every link drained, or closed
and reconnected. Also: deadlines from measured round trips, backoff, replicas sharing the load.

Legend: T = tokens, k = top-k, d = hidden size, E = experts.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from moeswarm.dispatch.accounting import Accounting, LayerCall
from moeswarm.dispatch.combine import combine_exact
from moeswarm.dispatch.dispatcher import Dispatcher
from moeswarm.errors import MoeSwarmError, WorkerError
from moeswarm.placement.table import build_table
from moeswarm.transport.link import Pending, Reply
from moeswarm.transport.tcp import TcpLink
from moeswarm.wire.codecs import CODECS
from moeswarm.wire.config import CombineMode, WireConfig
from moeswarm.wire.frames import HEADER, MAGIC, VERSION, Frame, Opcode
from moeswarm.wire.messages import Dispatch, ErrorReply, Hello, Result, WorkerInfo
from moeswarm.wire.stream import recv_frame, send_frame

E, D, K = 8, 4, 2


def expert_output(expert: int, x: torch.Tensor) -> torch.Tensor:
    """A stand-in for expert e's MLP: [n, d] -> [n, d]."""
    return torch.tanh(x * (expert + 1) + expert)


def answer(request: Dispatch) -> Result:
    """What an honest holder returns, in the worker's layout (experts ascending, eager row order)."""
    index, weights, hidden = request.top_k_index, request.top_k_weights, request.hidden  # [T, k], [T, k], [T, d]
    hit = torch.unique(index[index >= 0]).tolist()
    blocks, counts = [], []
    for expert in hit:
        slot, token = torch.where(index.T == expert)  # [n_e]
        blocks.append(weights[token, slot].unsqueeze(1) * expert_output(expert, hidden[token]))  # [n_e, d]
        counts.append(token.numel())
    outputs = torch.cat(blocks)
    if request.mode == CombineMode.PARTIAL:
        rows = torch.cat([torch.where(index.T == e)[1] for e in hit])
        outputs = torch.zeros_like(hidden).index_add_(0, rows, outputs)
    return Result(request.layer, request.mode, outputs, hit, counts, request.wire_combine)


def reference(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Eager's sum: experts ascending, each added with index_add_."""
    out = torch.zeros_like(hidden)
    for expert in torch.unique(index).tolist():
        slot, token = torch.where(index.T == expert)
        out.index_add_(0, token, weights[token, slot].unsqueeze(1) * expert_output(expert, hidden[token]))
    return out


class FakeLink:
    """An in-process holder that can be told to fail its next send or wait."""

    def __init__(self, name: str, held: list[int]):
        self.address, self.held = name, held
        self.info = WorkerInfo("fp", "fake", E, D, {0: tuple(held), 1: tuple(held)}, tuple(CODECS))
        self.fail_send = self.fail_wait = False
        self.queue: list[tuple[int, Dispatch]] = []
        self.is_broken = False
        self.reconnects = 0
        self._id = 0

    @property
    def broken(self) -> bool:
        return self.is_broken

    def connect(self, fingerprint):
        return self.info

    def reconnect(self, timeout_s=None):
        self.is_broken, self.queue = False, []
        self.reconnects += 1
        return self.info

    def prepare(self, request: Dispatch) -> Dispatch:
        request.to_frame(0)  # encode as a TCP link would: a codec that refuses the data raises here
        return request

    def send(self, request: Dispatch) -> Pending:
        if self.fail_send:
            self.fail_send, self.is_broken = False, True
            raise WorkerError(self.address, "connection lost while sending")
        self._id += 1
        self.queue.append((self._id, request))
        return Pending(self._id, 100, time.perf_counter())

    def fileno(self):
        return None  # replies are computed when awaited

    def has_reply(self, pending: Pending) -> bool:
        return True

    def forget(self, pending: Pending) -> None:
        self.queue = [(i, r) for i, r in self.queue if i != pending.request_id]

    def wait(self, pending: Pending, deadline: float) -> Reply:
        request_id, request = self.queue.pop(0)
        assert request_id == pending.request_id, "replies must be awaited in order"
        if self.fail_wait:
            self.fail_wait, self.is_broken = False, True
            raise WorkerError(self.address, "bad reply: bad magic")
        return Reply(answer(request), 10, 0.001)

    def ping(self, timeout_s=10.0):
        return 0.0

    def close(self):
        self.queue = []


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, D, generator=g)  # [T, d]
    index = torch.rand(tokens, E, generator=g).argsort(dim=1)[:, :K]  # [T, k] distinct experts per row
    weights = torch.rand(tokens, K, generator=g).softmax(-1)  # [T, k]
    return hidden, index, weights


def _dispatcher(wire: WireConfig = WireConfig(), fanout: str = "star") -> tuple[Dispatcher, list[FakeLink]]:
    links = [FakeLink("a", [0, 2, 4, 6]), FakeLink("b", [1, 3, 5, 7])]
    table = build_table({i: link.info.held for i, link in enumerate(links)}, E)
    return Dispatcher(links, table, wire, fanout), links


@pytest.mark.parametrize("fanout", ["star", "chain"])
def test_exact_combine_equals_eager_sum(fanout):
    dispatcher, _ = _dispatcher(fanout=fanout)
    hidden, index, weights = _routing(6, 0)
    out = dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))
    assert torch.equal(out, reference(hidden, index, weights))
    call = dispatcher.accounting.calls[0]
    assert (call.layer, call.tokens, call.bytes_out, call.bytes_in) == (0, 6, 200, 20)
    assert call.round_trips == (1 if fanout == "star" else 2)
    assert call.worker_seconds == {"a": 0.001, "b": 0.001}


@pytest.mark.parametrize("repeat", [False, True])
def test_combine_exact_adds_as_index_add_does_bit_for_bit(repeat):
    """Rows of many experts, in numpy (float32) or, where a row lists an expert twice (hash-routed
    layers), with index_add_: either way the bits of eager's index_add_ per expert, in ascending order."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, D, generator=g)
    index = torch.rand(5, E, generator=g).argsort(dim=1)[:, :K]  # [T, k]
    if repeat:
        index[2, 1] = index[2, 0]
    per_expert, want = {}, torch.zeros_like(hidden)
    for expert in sorted(set(index.flatten().tolist())):
        _, token = torch.where(index.T == expert)
        per_expert[expert] = torch.randn(len(token), D, generator=g) * 1e3  # large and small: rounding shows
        want.index_add_(0, token, per_expert[expert])
    assert torch.equal(combine_exact(hidden, index, per_expert), want)


@pytest.mark.parametrize("held, tokens", [(([0, 1, 2, 3], [4, 5, 6, 7]), 6), (([0, 1, 2, 3], [4, 5, 6, 7]), 1),
                                           (([0, 2, 4, 6], [1, 3, 5, 7]), 6), (([4, 5, 6, 7], [0, 1, 2, 3]), 5)])
def test_exact_mode_sums_a_share_whose_experts_come_first(held, tokens):
    """In exact mode a holder whose experts come first in each of its tokens is asked for their sums
    (partial mode), the others for rows per expert; the combined output keeps eager's bits."""
    links = [FakeLink("a", held[0]), FakeLink("b", held[1])]
    sent = {link.address: [] for link in links}
    for link in links:
        link.send = (lambda request, link=link, send=link.send: sent[link.address].append(request) or send(request))
    dispatcher = Dispatcher(links, build_table({i: link.info.held for i, link in enumerate(links)}, E), WireConfig(), "star")
    g = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, D, generator=g)  # [T, d]
    index = torch.rand(tokens, E, generator=g).argsort(dim=1)[:, :4]  # [T, 4]: experts on both holders
    weights = torch.rand(tokens, 4, generator=g).softmax(-1)  # [T, 4]
    out = dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))
    assert torch.equal(out.view(torch.int32), reference(hidden, index, weights).view(torch.int32))
    for address in sent:
        request, = sent[address]
        mine = request.top_k_index  # [T_w, 4]: -1 where the other holder computes
        tokens_here = [t for t in range(tokens) if any(int(e) in held[address == "b"] for e in index[t])]
        first = all(max(int(e) for e in index[t] if int(e) in held[address == "b"])
                    < min([int(e) for e in index[t] if int(e) not in held[address == "b"]] + [E]) for t in tokens_here)
        assert request.mode == (CombineMode.PARTIAL if first else CombineMode.EXACT), (address, mine)
    if held[0] == [0, 1, 2, 3]:  # the lower range comes first in every token
        assert sent["a"][0].mode == CombineMode.PARTIAL


def test_partial_combine_is_close_to_eager_sum():
    dispatcher, _ = _dispatcher(WireConfig(CombineMode.PARTIAL))
    hidden, index, weights = _routing(6, 1)
    out = dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))
    torch.testing.assert_close(out, reference(hidden, index, weights), rtol=1e-6, atol=1e-6)


def test_failure_while_sending_is_retried_on_the_same_holder_after_a_probe():
    dispatcher, (a, b) = _dispatcher()
    b.fail_send = True  # no replica: b is probed (reconnect, PING) and asked again in the same call
    hidden, index, weights = _routing(6, 2)
    out = dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))
    assert torch.equal(out, reference(hidden, index, weights)) and b.reconnects == 1
    assert (dispatcher.stats.takedowns, dispatcher.stats.readmissions, dispatcher.stats.failovers) == (1, 1, 1)
    assert a.queue == [] and b.queue == []


def test_failure_while_receiving_is_retried_on_the_same_holder_after_a_probe():
    dispatcher, (a, b) = _dispatcher()
    a.fail_wait = True
    hidden, index, weights = _routing(6, 3)
    out = dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))
    assert torch.equal(out, reference(hidden, index, weights)) and a.reconnects == 1
    assert a.queue == [] and b.queue == [] and not a.broken and not b.broken


@pytest.mark.parametrize("where", ["send", "wait"])
def test_without_another_holder_the_error_names_worker_layer_experts(where):
    dispatcher, (a, b) = _dispatcher()
    setattr(b, f"fail_{where}", True)
    b.reconnect = lambda timeout_s=None: (_ for _ in ()).throw(WorkerError("b", "cannot connect"))
    hidden, index, weights = _routing(6, 2)
    with pytest.raises(WorkerError) as caught:
        dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))
    cause = "connection lost while sending" if where == "send" else "bad reply: bad magic"
    assert str(caught.value) == f"worker b: {cause}; layer 0 experts 1,3,5,7 have no other usable holder"
    assert (caught.value.layer, caught.value.experts) == (0, [1, 3, 5, 7])
    assert a.queue == [] and dispatcher.holders[1].cause == "cannot connect"


def test_codec_refusing_its_input_sends_nothing():
    dispatcher, (a, b) = _dispatcher(WireConfig(CombineMode.PARTIAL, "int8-b128"))
    hidden, index, weights = _routing(6, 4)
    hidden[5, 0] = float("nan")
    with pytest.raises(MoeSwarmError, match="non-finite"):
        dispatcher.dispatch(0, hidden, index, weights)
    assert a.queue == [] and b.queue == [] and a._id == 0 and b._id == 0
    hidden[5, 0] = 0.0
    dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))


def test_a_result_for_the_wrong_experts_names_the_worker():
    dispatcher, (a, _) = _dispatcher()
    hidden, index, weights = _routing(6, 5)
    a.wait = lambda pending, deadline: Reply(  # claims a different expert set
        Result(0, CombineMode.EXACT, torch.zeros(1, D), [9], [1]), 10, 0.0)
    with pytest.raises(WorkerError, match=r"^worker a: RESULT covers experts \[9\] x \[1\] rows, expected \["):
        dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))


def test_missing_experts_are_named():
    links = [FakeLink("a", [0, 1, 2, 3])]
    dispatcher = Dispatcher(links, build_table({0: links[0].info.held}, E))
    with pytest.raises(MoeSwarmError) as caught:
        dispatcher.check_covers([0, 1])
    assert str(caught.value) == "no worker holds layer 0 experts 4-7; layer 1 experts 4-7"


def test_accounting_summary_is_exact():
    accounting = Accounting()
    accounting.record(LayerCall(0, 4, 400, 800, 1, 0.002, {"a": 0.001, "b": 0.003}))  # a prompt's
    accounting.decoding = True
    accounting.record(LayerCall(1, 1, 100, 300, 1, 0.004, {"a": 0.002}, worker_cpu={"a": 0.0005}))  # a decode step's
    summary = accounting.summary()
    assert summary["layer_calls"] == 2 and summary["round_trips"] == 2
    assert (summary["bytes_out"], summary["bytes_in"]) == (500, 1100)
    assert summary["bytes_out_per_token_layer"] == 100.0 and summary["bytes_in_per_token_layer"] == 220.0
    assert summary["decode_bytes_out_per_token_layer"] == 100.0 and summary["decode_bytes_in_per_token_layer"] == 300.0
    assert summary["seconds_per_layer_call_mean"] == pytest.approx(0.003)
    assert summary["worker_rtt_ms_mean"] == pytest.approx({"a": 1.5, "b": 3.0})
    assert summary["worker_cpu_ms_mean"] == pytest.approx({"a": 0.5})  # only the calls whose RESULT said it


def test_accounting_counts_decode_by_step_not_by_rows():
    """A decode step of two sequences makes 2-row calls, a 1-token prompt 1-row calls: the step decides."""
    accounting = Accounting()
    accounting.record(LayerCall(0, 1, 90, 90, 1, 0.001, {}))  # a 1-token prompt
    accounting.decoding = True
    accounting.record(LayerCall(0, 1, 100, 300, 1, 0.001, {}))  # one sequence decoding
    accounting.record(LayerCall(0, 2, 300, 500, 1, 0.001, {}))  # two, batched
    summary = accounting.summary()
    assert [call.decode for call in accounting.calls] == [False, True, True]
    assert (summary["decode_bytes_out_per_token_layer"], summary["decode_bytes_in_per_token_layer"]) == (400 / 3, 800 / 3)


# -- fake workers over real TCP: honest, or answering what a test tells them to ----------------


def honest_hello(worker: "FakeWorker", hello: Frame) -> Frame:
    return WorkerInfo(Hello.from_frame(hello).fingerprint, "fake", E, D,
                      {0: tuple(worker.held), 1: tuple(worker.held)}, tuple(CODECS)).to_frame(hello.request_id)


def honest_reply(worker: "FakeWorker", conn: socket.socket, frame: Frame) -> None:
    send_frame(conn, answer(Dispatch.from_frame(frame)).to_frame(frame.request_id))


class FakeWorker:
    """A protocol-speaking worker on 127.0.0.1 (threads, real TCP). `on_dispatch(worker, conn, frame)`
    answers each DISPATCH (`worker.dispatches` counts them); `on_hello(worker, frame)` builds the
    HELLO answer. PING gets PONG."""

    def __init__(self, held: list[int], on_dispatch=honest_reply, on_hello=honest_hello):
        self.held, self.on_dispatch, self.on_hello = held, on_dispatch, on_hello
        self.dispatches = self.connections = 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket):
        with conn:
            while True:
                try:
                    frame, _ = recv_frame(conn)
                    if frame.opcode == Opcode.HELLO:
                        conn.sendall(b"".join(bytes(b) for b in self.on_hello(self, frame).encode()))
                    elif frame.opcode == Opcode.DISPATCH:
                        self.dispatches += 1
                        self.on_dispatch(self, conn, frame)
                    elif frame.opcode == Opcode.PING:
                        send_frame(conn, Frame(Opcode.PONG, frame.request_id))
                    else:
                        send_frame(conn, ErrorReply("bad_request", "unexpected").to_frame(frame.request_id))
                except (OSError, MoeSwarmError):
                    return

    def close(self):
        self.server.close()


def garbage_on(n: int):
    """An answer policy: honest, except random bytes for the n-th DISPATCH."""

    def reply(worker: FakeWorker, conn: socket.socket, frame: Frame) -> None:
        if worker.dispatches == n:
            conn.sendall(b"\x17garbage, not a frame" * 3)
        else:
            honest_reply(worker, conn, frame)

    return reply


def tcp_dispatcher(workers: list[FakeWorker], **options) -> Dispatcher:
    """A dispatcher over TCP links to `workers`, connected."""
    links = [TcpLink(worker.address) for worker in workers]
    for link in links:
        link.connect("fp")
    return Dispatcher(links, build_table({i: link.info.held for i, link in enumerate(links)}, E), **options)


def test_tcp_worker_answering_garbage_mid_layer_is_reconnected():
    honest, liar = FakeWorker([0, 2, 4, 6]), FakeWorker([1, 3, 5, 7], garbage_on(2))
    dispatcher = tcp_dispatcher([honest, liar])
    try:
        hidden, index, weights = _routing(5, 6)
        expected = reference(hidden, index, weights)
        for layer in (0, 1, 0):  # layer 1: the liar's reply is garbage; it is reconnected and asked again
            assert torch.equal(dispatcher.combine(dispatcher.dispatch(layer, hidden, index, weights)), expected)
        assert (dispatcher.stats.takedowns, dispatcher.stats.readmissions) == (1, 1)
        assert (honest.connections, liar.connections) == (1, 2)  # only the liar's link was reopened
    finally:
        dispatcher.close()
        honest.close()
        liar.close()


def test_error_text_from_a_worker_is_escaped():
    error = WorkerError("w:1", "ok\x1b[2J\rforged line")
    assert str(error) == "worker w:1: ok\\x1b[2J\\rforged line"


def _one_dispatch_worker(then) -> tuple[str, socket.socket]:
    """A worker on 127.0.0.1 that answers HELLO, reads one DISPATCH and hands (connection, DISPATCH)
    to `then`. Returns (its address, its listening socket)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = server.accept()
        with conn:
            hello, _ = recv_frame(conn)
            send_frame(conn, WorkerInfo("fp", "fake", E, D, {0: tuple(range(E))}, ("f32",)).to_frame(hello.request_id))
            dispatch, _ = recv_frame(conn)
            then(conn, dispatch)

    threading.Thread(target=serve, daemon=True).start()
    return "127.0.0.1:%d" % server.getsockname()[1], server


def test_ping_overtaken_reply_is_matched_by_request_id():
    """A PONG may overtake a RESULT on one connection: the link matches replies by id."""

    def pong_first(conn, dispatch):
        ping, _ = recv_frame(conn)
        send_frame(conn, Frame(Opcode.PONG, ping.request_id))  # answered first
        send_frame(conn, answer(Dispatch.from_frame(dispatch)).to_frame(dispatch.request_id))

    address, server = _one_dispatch_worker(pong_first)
    link = TcpLink(address)
    link.connect("fp")
    hidden, index, weights = _routing(3, 7)
    pending = link.send(link.prepare(Dispatch(0, hidden, index, weights)))
    assert link.ping() >= 0.0
    reply = link.wait(pending, time.monotonic() + 10)
    assert torch.equal(reply.result.outputs, answer(Dispatch(0, hidden, index, weights)).outputs)
    link.close()
    server.close()


def test_a_reply_larger_than_its_result_is_refused_unread():
    """A worker declaring a 1 GiB RESULT: refused from the header, nothing allocated; the link reconnects."""

    def huge_header(conn, dispatch):
        conn.sendall(HEADER.pack(MAGIC, VERSION, Opcode.RESULT, 0, dispatch.request_id, 0, 1 << 30))
        conn.recv(1)  # until the backbone hangs up

    address, server = _one_dispatch_worker(huge_header)
    link = TcpLink(address)
    link.connect("fp")
    hidden, index, weights = _routing(3, 8)  # 3 tokens x top-2: 6 rows of 4 f32 come back in exact mode
    pending = link.send(link.prepare(Dispatch(0, hidden, index, weights)))
    with pytest.raises(WorkerError) as caught:
        link.wait(pending, time.monotonic() + 10)
    assert str(caught.value) == (f"worker {address}: bad reply: frame payload of {1 << 30} bytes is over the limit "
                                 f"of {6 * D * 4}")
    assert link.broken
    server.close()


# -- failover, deadlines and backoff (in process) -----------------------------------------------


def test_a_failed_share_goes_to_a_replica_within_the_same_call():
    links = [FakeLink("a", list(range(E))), FakeLink("b", list(range(E)))]  # every expert held twice
    dispatcher = Dispatcher(links, build_table({i: link.info.held for i, link in enumerate(links)}, E))
    hidden, index, weights = _routing(6, 9)
    links[1].fail_wait = True
    out = dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))
    assert torch.equal(out, reference(hidden, index, weights))
    assert dispatcher.stats.failovers == 1 and dispatcher.stats.takedowns == 1
    assert [h.up for h in dispatcher.holders] == [True, False]
    assert dispatcher.holders[1].cause == "bad reply: bad magic"
    call = dispatcher.accounting.calls[-1]
    assert list(call.worker_seconds) == ["a"]  # a answered b's share too


def test_replicas_share_the_load_by_expert_id():
    links = [FakeLink("a", list(range(E))), FakeLink("b", list(range(E)))]
    dispatcher = Dispatcher(links, build_table({i: link.info.held for i, link in enumerate(links)}, E))
    assert dispatcher.owners.of(0).tolist() == [0, 1, 0, 1, 0, 1, 0, 1]


def test_deadline_is_a_multiple_of_the_recent_p99_between_floor_and_cap():
    from moeswarm.dispatch.health import DeadlinePolicy, Holder

    holder = Holder(DeadlinePolicy(cap_s=10.0, floor_s=0.5, multiple=4.0, min_samples=8))
    assert holder.deadline_s(1) == 10.0  # not measured yet: the cap
    for seconds in [0.01] * 99 + [0.2]:
        holder.round_trips.record(seconds, 1)
    assert holder.deadline_s(1) == 0.8  # 4 x p99 (0.2 s)
    assert holder.deadline_s(100) == 10.0  # 100x the usual rows: 80 s, capped
    for seconds in [0.01] * 256:
        holder.round_trips.record(seconds, 1)
    assert holder.deadline_s(1) == 0.5  # 4 x 10 ms is under the floor
    assert holder.hedge_after_s(1) == 0.01


def test_a_failed_holder_is_probed_with_exponential_backoff():
    from moeswarm.dispatch.health import DeadlinePolicy, Holder

    holder = Holder(DeadlinePolicy(backoff_s=0.5, backoff_max_s=3.0))
    waits = []
    for _ in range(5):
        holder.fail(100.0, "down")
        waits.append(holder.retry_at - 100.0)
    assert waits == [0.5, 1.0, 2.0, 3.0, 3.0] and not holder.usable
    holder.readmit()
    assert holder.usable and holder.failures == 0


def test_holders_that_left_are_pruned_so_a_long_run_does_not_grow():
    """Workers come and go 300 times: tombstones stay while young (indices stable), then are
    dropped with their links; the lists stay bounded and every call stays exact."""
    from moeswarm.dispatch.dispatcher import PRUNE_AT
    from moeswarm.dispatch.membership import Change

    dispatcher, links = _dispatcher()
    dispatcher.prune_after_s = 3600.0  # only the count bound prunes at first
    for round_ in range(300):
        visitor = FakeLink(f"visitor-{round_}", list(range(E)))
        dispatcher.change_members(Change.join(visitor))
        hidden, index, weights = _routing(4, 900 + round_)
        assert torch.equal(dispatcher.combine(dispatcher.dispatch(round_ % 2, hidden, index, weights)),
                           reference(hidden, index, weights))
        dispatcher.change_members(Change.leave(visitor))
        dispatcher.apply_membership()
        assert len(dispatcher.links) <= 2 + PRUNE_AT and len(dispatcher.gone) < PRUNE_AT
    assert dispatcher.stats.pruned >= 300 - PRUNE_AT
    assert [link.address for link in dispatcher.links[:2]] == ["a", "b"]  # the members keep their place
    young = len(dispatcher.gone)
    assert young > 0 and dispatcher.links[2].address.startswith("visitor")  # young tombstones are kept ...
    dispatcher.prune_after_s = 0.0
    hidden, index, weights = _routing(4, 1)
    assert torch.equal(dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights)),
                       reference(hidden, index, weights))
    assert dispatcher.gone == set() and [link.address for link in dispatcher.links] == ["a", "b"]  # ... until due
    assert [s["worker"] for s in dispatcher.standing()] == ["a", "b"]
