"""A worker's measured load (worker/served.py): every answering path counts each routed row once,
the window turns counts into rows per minute, and the announcement carries them (discovery/record.py)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from test_worker_express import received, routing, store_of
from test_worker_limits import FINGERPRINT, greeted, recv
from test_worker_runner import running

from moeswarm.kernels import qkernels
from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import Opcode
from moeswarm.wire.messages import Dispatch
from moeswarm.wire.stream import send_frame
from moeswarm.worker.compute import Computation
from moeswarm.worker.limits import WorkerLimits
from moeswarm.worker.server import WorkerServer
from moeswarm.worker.served import LoadWindow, Served

quantized = pytest.mark.skipif(qkernels._library() is None, reason="moeswarm's C kernels are not built")


def _rows(requests: list[Dispatch]) -> Counter:
    """{expert: routed rows} of the requests (-1: another holder's slot, not counted)."""
    return Counter(int(e) for request in requests for e in request.top_k_index.reshape(-1).tolist() if e >= 0)


def _counted(store, held) -> Counter:
    return Counter({e: int(store.served.rows[0][e]) for e in held if store.served.rows[0][e]})


@quantized
@pytest.mark.parametrize("mode", [CombineMode.PARTIAL, CombineMode.EXACT])
def test_every_answering_path_counts_each_routed_row_once(mode):
    """The full path, express as a frame, express whole (a C lane) and a held connection (in C):
    the store's counters grow by exactly the rows each DISPATCH routed to each expert."""
    held = (0, 1, 2, 3, 4) if mode == CombineMode.PARTIAL else (2, 3, 4)
    requests = [Dispatch(0, *routing(1, 3, held, seed), mode) for seed in range(8)]
    computation = Computation(store_of(held), WorkerLimits())
    assert computation.one(received(requests[0], 30)).opcode == Opcode.RESULT  # the full path
    assert _counted(computation.store, held) == _rows(requests[:1])
    for i, request in enumerate(requests):
        assert computation.express.answer(received(request, 30 + i)).opcode == Opcode.RESULT  # express, a frame
    assert _counted(computation.store, held) == _rows(requests[:1]) + _rows(requests)
    from test_call_paths import _frame

    for i, request in enumerate(requests):
        header, body = _frame(request, 30 + i)
        lane = computation.express.whole_lane(body, header.meta_len)
        assert computation.express.answer_now(lane, body, 30 + i) is not None  # whole, in C
    assert _counted(computation.store, held) == _rows(requests[:1]) + _rows(requests) + _rows(requests)

    server = WorkerServer(store_of(held), FINGERPRINT, "scale", WorkerLimits(), inline_tokens=8)
    with running(server) as (_, address):
        sock = greeted(address)
        for i, request in enumerate(requests):  # the full path, then whole on the loop, then held in C
            send_frame(sock, request.to_frame(30 + i))
            assert recv(sock).opcode == Opcode.RESULT
        sock.close()
    assert server.computation.express.hold.answered >= 1
    assert _counted(server.store, held) == _rows(requests)


def test_the_store_s_own_run_counts_each_routed_row_once():
    """The store's `run` (what the full path, merged calls and float experts' lanes call): rows counted once."""
    from moeswarm.worker.store import ExpertStore

    stub = store_of((0, 1, 2, 3, 4))
    assert isinstance(stub, ExpertStore)
    requests = [Dispatch(0, *routing(3, 2, (0, 1, 2, 3, 4), seed), CombineMode.EXACT) for seed in range(3)]
    for request in requests:
        stub.run(request)
    assert _counted(stub, range(5)) == _rows(requests)


def test_the_window_gives_rows_per_minute_since_its_oldest_snapshot_within_the_span():
    served = Served({3: (1, 4), 5: (0,)}, num_experts=6)
    now = [100.0]
    window = LoadWindow(served, span_s=30.0, clock=lambda: now[0])
    served.add(3, [1], [50])  # before the mark: start-up work, not load
    window.mark()
    now[0] = 100.5
    assert window.rates() is None  # under a second seen
    served.add(3, np.array([1, 4]), np.array([10, 20]))
    served.add(5, [0], [5])
    served.add(9, [0], [5])  # a layer not held: ignored
    now[0] = 110.0
    assert window.rates() == {3: (60, 120), 5: (30,)}  # 10 s: x6
    now[0] = 135.0  # the mark (100 s) is dropped: 100.5 s's is the newest at least 30 s old
    assert window.rates() == {3: (17, 35), 5: (9,)}  # 10, 20 and 5 rows over 34.5 s
    now[0] = 200.0
    assert window.rates() == {3: (0, 0), 5: (0,)}


def test_the_store_counters_are_what_a_c_lane_adds_to():
    served = Served({0: (2, 3, 4)}, num_experts=5)
    span = served.span(0, 2, 3)
    span += np.array([1, 2, 3])
    assert served.totals() == {0: (1, 2, 3)} and span.flags.c_contiguous and served.span(7, 0, 1) is None
    assert torch.equal(torch.from_numpy(served.rows[0]), torch.tensor([0, 0, 1, 2, 3]))
