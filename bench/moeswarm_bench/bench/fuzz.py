"""`moeswarm bench fuzz`: a fuzzer against a live `moeswarm worker` process.

The worker serves half the experts of a tiny random qwen2_moe (made in a temporary directory)
or of `--model`. The fuzzer loads the same experts in its own process: every RESULT the worker
sends for a fuzzed frame is compared with what the same frame gives here (worker/compute.py's `Computation`
over a local store: same checks, same kernels, so the same bytes), and after each batch of cases
a valid DISPATCH must still get the right RESULT.

Counted: crashes (the worker process died: it is restarted), hangs (no answer and no close within
the case deadline), wrong replies (a RESULT that differs from the local one, a RESULT where the
local side refuses, or a wrong health-check RESULT), internal errors (ERROR "internal": a bug),
and the worker's RSS and open files before and after.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import psutil
import torch

from moeswarm_bench.bench.fuzz_cases import Case, CaseMaker, Shape
from moeswarm_bench.bench.worker_process import spawn_worker
from moeswarm.errors import MoeSwarmError
from moeswarm.wire.frames import HEADER_SIZE, Frame, Opcode, parse_header
from moeswarm.wire.messages import Dispatch, ErrorReply, Hello
from moeswarm.wire.stream import StreamClosed, decode_frame, recv_frame, send_frame
from moeswarm.worker.limits import WorkerLimits

CASE_DEADLINE_S = 10.0  # longer than the worker's frame timeout below: a hang is a real one
WORKER_FRAME_TIMEOUT_S = 2.0
BATCH = 250
MARKER_ID = 2**64 - 1  # the PING after each case


class Oracle:
    """The worker's answer to a frame, computed here with the same experts and the same code."""

    def __init__(self, model: str, experts: Sequence[int], limits: WorkerLimits):
        from moeswarm.sources.loading import load_experts
        from moeswarm.worker.limits import model_top_k
        from moeswarm.worker.compute import Computation
        from moeswarm.worker.store import ExpertStore

        hosted, source, num_experts = load_experts(model, list(experts))
        self.store = ExpertStore(hosted, num_experts, source.config.hidden_size)
        self.fingerprint = source.fingerprint
        top_k = model_top_k(source.config)  # a worker caps top-k at its model's, as `moeswarm worker` does
        self.computation = Computation(self.store, limits, top_k)
        layers = tuple(self.store.held)
        self.shape = Shape(self.store.hidden_size, num_experts, layers, tuple(self.store.held[layers[0]]),
                           limits.max_tokens, min(limits.max_top_k, top_k or limits.max_top_k))

    def answer(self, frame: Frame) -> Frame:
        return self.computation.one(frame)


def run_fuzz(cases: int = 2000, seed: int = 0, model: str | None = None, batch: int = BATCH,
             progress=None) -> dict:
    """Fuzz a live worker with `cases` cases; return the counts and the worker's memory figures."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            from moeswarm.model.tiny import make_tiny_model

            model = str(make_tiny_model("qwen2_moe", Path(tmp) / "qwen2_moe"))
        from moeswarm.model.experts import num_experts_in_config
        from moeswarm.sources.source import open_source

        num_experts = num_experts_in_config(open_source(model).config)
        experts = list(range(num_experts // 2))
        limits = WorkerLimits(frame_timeout_s=WORKER_FRAME_TIMEOUT_S)
        oracle = Oracle(model, experts, limits)
        return _Fuzzer(model, experts, oracle, seed).run(cases, batch, progress)


class _Fuzzer:
    def __init__(self, model: str, experts: list[int], oracle: Oracle, seed: int):
        self.model, self.experts, self.oracle = model, experts, oracle
        self.maker = CaseMaker(oracle.shape, seed)
        self.counts: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.replies: Counter[str] = Counter()
        self.findings: list[str] = []
        self.health_rtt: list[float] = []
        self.sock: socket.socket | None = None

    def run(self, cases: int, batch: int, progress) -> dict:
        args = ["--frame-timeout", str(WORKER_FRAME_TIMEOUT_S)]
        started = time.perf_counter()
        with contextlib.ExitStack() as stack:
            self.address, self.process = stack.enter_context(spawn_worker(self.model, self.experts, args))
            worker = psutil.Process(self.process.pid)
            self._health()
            rss_before, files_before = worker.memory_info().rss, worker.num_fds()
            rss_peak = rss_before
            done, interrupted = 0, False
            while done < cases and not interrupted:
                try:
                    for _ in range(min(batch, cases - done)):
                        self._one(self.maker.next())
                        done += 1
                except KeyboardInterrupt:  # Ctrl-C: report the cases run so far
                    interrupted = True
                if self.process.poll() is not None:
                    self._crashed(stack, args)
                    worker = psutil.Process(self.process.pid)
                self._health()
                rss_peak = max(rss_peak, worker.memory_info().rss)
                if progress:
                    progress(done, dict(self.counts))
            self._close()
            time.sleep(0.5)  # the worker notices the closed connections
            rss_after, files_after = worker.memory_info().rss, worker.num_fds()
        elapsed = time.perf_counter() - started
        return {
            "cases": done,
            "interrupted": interrupted,
            "seconds": round(elapsed, 1),
            "cases_per_s": round(done / elapsed, 1),
            "crashes": self.counts["crash"],
            "hangs": self.counts["hang"],
            "wrong_replies": self.counts["wrong"],
            "internal_errors": self.counts["internal"],
            "health_checks": len(self.health_rtt),
            "health_rtt_ms_p50": round(sorted(self.health_rtt)[len(self.health_rtt) // 2] * 1e3, 3),
            "worker_rss_mb_before": round(rss_before / 2**20, 1),
            "worker_rss_mb_peak": round(rss_peak / 2**20, 1),
            "worker_rss_mb_after": round(rss_after / 2**20, 1),
            "worker_open_files_before": files_before,
            "worker_open_files_after": files_after,
            "kinds": dict(self.kinds),
            "replies": dict(self.replies),
            "findings": self.findings[:20],
        }

    # -- one case ---------------------------------------------------------------------------------

    def _one(self, case: Case) -> None:
        self.kinds[case.kind] += 1
        try:
            if case.framed:
                self._framed(case)
            else:
                self._unframed(case)
        except (ConnectionError, OSError, MoeSwarmError) as error:
            if self.process.poll() is not None:
                return  # counted as a crash after the batch
            self._finding("hang" if isinstance(error, socket.timeout) else "wrong", case, repr(error))
            self._close()

    def _framed(self, case: Case) -> None:
        """One frame on the greeted connection, then a PING: every reply up to the PONG is checked."""
        sock = self._greeted()
        marker = Frame(Opcode.PING, MARKER_ID)
        sock.sendall(case.data + marker.to_bytes())
        deadline = time.monotonic() + CASE_DEADLINE_S
        header = parse_header(case.data[:HEADER_SIZE])
        replies = []
        for _ in range(2):  # every frame gets exactly one reply; the PONG may overtake the case's
            try:
                replies.append(recv_frame(sock, deadline)[0])
            except StreamClosed:  # closed: only after an ERROR that says the stream broke
                self._close()
                break
        markers = [i for i, r in enumerate(replies) if r.opcode == Opcode.PONG and r.request_id == MARKER_ID]
        if markers:
            replies.pop(markers[-1])
        for reply in replies:
            self._check(case, header, reply)

    def _check(self, case: Case, header, reply: Frame) -> None:
        if header.opcode == Opcode.HELLO:  # any HELLO, even a refused one, resets the greeting
            self.sock_greeted = reply.opcode == Opcode.HELLO
        code = ErrorReply.from_frame(reply).code if reply.opcode == Opcode.ERROR else None
        self.replies[f"error:{code}" if code else reply.opcode.name.lower()] += 1
        if code == "internal":
            self._finding("internal", case, ErrorReply.from_frame(reply).message)
            return
        if header.opcode != Opcode.DISPATCH or code not in (None, "bad_request"):
            return  # "busy" depends on load, not on the frame
        try:
            expected = self.oracle.answer(decode_frame(header, case.data[HEADER_SIZE:]))
        except MoeSwarmError as error:
            expected = ErrorReply("bad_request", str(error)).to_frame(header.request_id)
        if expected.opcode != reply.opcode or expected.meta != reply.meta or _payload(expected) != _payload(reply):
            self._finding("wrong", case, f"worker sent {reply.opcode.name} {_describe(reply)}, the local run "
                                         f"gives {expected.opcode.name} {_describe(expected)}")

    def _unframed(self, case: Case) -> None:
        """Bytes that may break the framing: a fresh connection, half-closed after them; it must close."""
        with socket.create_connection(self.address, timeout=CASE_DEADLINE_S) as sock:
            if case.greet:
                send_frame(sock, Hello(self.oracle.fingerprint).to_frame(1))
                recv_frame(sock, time.monotonic() + CASE_DEADLINE_S)
            sock.sendall(case.data)
            sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + CASE_DEADLINE_S
            while True:
                try:
                    reply, _ = recv_frame(sock, deadline)
                except StreamClosed:
                    return
                except MoeSwarmError as error:  # the worker's reply itself did not parse
                    self._finding("wrong", case, f"unparsable reply: {error}")
                    return
                if reply.opcode == Opcode.ERROR and ErrorReply.from_frame(reply).code == "internal":
                    self._finding("internal", case, ErrorReply.from_frame(reply).message)
                self.replies[f"unframed:{reply.opcode.name.lower()}"] += 1

    # -- the worker's health ---------------------------------------------------------------------------

    def _health(self) -> None:
        """A valid DISPATCH on a fresh connection gets exactly the local RESULT."""
        shape, held = self.oracle.shape, self.oracle.shape.held
        ids = torch.tensor([[held[t % len(held)], -1 if t % 2 else held[(t + 1) % len(held)]] for t in range(4)])  # [T, k]
        request = Dispatch(shape.layers[0], torch.randn(4, shape.hidden), ids, torch.rand(4, 2))
        expected = self.oracle.store.run(request).to_frame(7)
        with socket.create_connection(self.address, timeout=CASE_DEADLINE_S) as sock:
            send_frame(sock, Hello(self.oracle.fingerprint).to_frame(1))
            recv_frame(sock, time.monotonic() + CASE_DEADLINE_S)
            started = time.perf_counter()
            send_frame(sock, request.to_frame(7))
            try:
                reply, _ = recv_frame(sock, time.monotonic() + CASE_DEADLINE_S)
            except socket.timeout:
                self._finding("hang", None, "health check: no RESULT")
                return
            self.health_rtt.append(time.perf_counter() - started)
        if reply.meta != expected.meta or _payload(reply) != _payload(expected):
            self._finding("wrong", None, f"health check: {reply.opcode.name} differs from the local RESULT")

    def _crashed(self, stack: contextlib.ExitStack, args: list[str]) -> None:
        self._finding("crash", None, f"worker exited with {self.process.returncode}")
        self._close()
        self.address, self.process = stack.enter_context(spawn_worker(self.model, self.experts, args))

    # -- connections -----------------------------------------------------------------------------------

    def _greeted(self) -> socket.socket:
        if self.sock is None or not getattr(self, "sock_greeted", False):
            self._close()
            self.sock = socket.create_connection(self.address, timeout=CASE_DEADLINE_S)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_frame(self.sock, Hello(self.oracle.fingerprint).to_frame(1))
            reply, _ = recv_frame(self.sock, time.monotonic() + CASE_DEADLINE_S)
            if reply.opcode != Opcode.HELLO:
                raise ConnectionError(f"HELLO refused: {reply.meta}")
            self.sock_greeted = True
        return self.sock

    def _close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = None
        self.sock_greeted = False

    def _finding(self, what: str, case: Case | None, detail: str) -> None:
        self.counts[what] += 1
        where = f"{case.kind} case {case.data[:48].hex()}" if case else "worker"
        self.findings.append(f"{what}: {where}: {detail[:300]}")


def _payload(frame: Frame) -> bytes:
    return b"".join(bytes(part) for part in frame.parts)


def _describe(frame: Frame) -> str:
    if frame.opcode == Opcode.ERROR:
        return repr(ErrorReply.from_frame(frame).message[:150])
    return repr({key: value for key, value in frame.meta.items() if key != "tensors"})[:150]
