"""`moeswarm bench flood --stage`: issue 62's attacks on a `moeswarm stage`, and an honest gateway's step time through them.

One `moeswarm stage` process holds every layer of a tiny random qwen2_moe (its experts local),
with `--max-cache-mb cache_mb`. An honest gateway session (one connection, a prompt of 32 rows,
then one-row decode steps) times its steps in each phase, and a fresh connect + HELLO:

  idle          nothing else
  copies        a session's STEP carrying `copies` copy records of a 200-position sequence
  new_seqs      a session's STEP opening `new_sequences` one-row sequences
  respellings   `respellings` connections, each a session naming a respelling of one next stage
  non_reader    a gateway that pipelines 64-row steps and never reads its answers
  silent        `silent` connections that connect and say nothing (counted 12 s later: closed
                by the HELLO deadline, refused at accept, or still open)

Reported per phase: p50 and max (ms) of the honest step and of connect + HELLO, the stage's RSS
(MB) and open descriptors at the end of the phase, whether the honest session's sequence survived
(`honest_kept`), and ERROR replies the attackers got, by their first words.
"""

from __future__ import annotations

import socket
import statistics
import tempfile
import threading
import time
from collections import Counter

import psutil
import torch

from moeswarm.stages.protocol import Segment, Step
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.stream import recv_frame, send_frame

WAIT_S = 60.0
HIDDEN = 256
HONEST, ATTACKER = "127.0.0.1", "127.0.0.2"  # the attacks from an address of their own, as from another machine
PROMPT = 1000  # the copied sequence's positions: 1000 x 2 layers x 8 heads x 32 x 2 x 4 bytes = 4 MB


def run_stage_flood(cache_mb: int = 64, copies: int = 120, new_sequences: int = 4096, respellings: int = 300,
                    silent: int = 80, samples: int = 20) -> dict:
    from moeswarm.sources.source import open_source
    from moeswarm.local.stages import spawn_stage
    from moeswarm.local.workers import stop, wait_listening
    from moeswarm.model.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model("qwen2_moe", f"{tmp}/model", num_hidden_layers=2, max_position_embeddings=4096,
                                    hidden_size=HIDDEN, num_attention_heads=8, num_key_value_heads=8, head_dim=32))
        fingerprint = open_source(model).fingerprint
        process = spawn_stage(model, "0-1", extra_args=["--max-cache-mb", str(cache_mb)])
        try:
            address = wait_listening(process)
            stage = psutil.Process(process.pid)
            honest = _Gateway(address, fingerprint, "honest")
            result = {"cache_mb": cache_mb, "phases": {}}
            attacks = {
                "idle": lambda: Counter(),
                "copies": lambda: _copies(address, fingerprint, copies),
                "new_seqs": lambda: _new_sequences(address, fingerprint, new_sequences),
                "respellings": lambda: _respellings(address, fingerprint, respellings),
                "non_reader": lambda: _non_reader(address, fingerprint),
                "silent": lambda: _silent(address, silent),
            }
            for phase, attack in attacks.items():
                errors: Counter = Counter()
                thread = threading.Thread(target=lambda: errors.update(attack()), daemon=True)
                thread.start()
                steps, hellos = honest.measure(samples)
                thread.join(WAIT_S)
                result["phases"][phase] = {
                    "step_ms_p50": round(statistics.median(steps), 2), "step_ms_max": round(max(steps), 2),
                    "hello_ms_p50": round(statistics.median(hellos), 2), "hello_ms_max": round(max(hellos), 2),
                    "rss_mb": round(stage.memory_info().rss / 2**20), "fds": stage.num_fds(),
                    "honest_kept": honest.kept, "attack_errors": dict(errors)}
            honest.close()
            return result
        finally:
            stop([process])


class _Gateway:
    """The honest session: a prompt, then decode steps on one sequence; `kept` is False once the stage lost it."""

    def __init__(self, address: str, fingerprint: str, session: str):
        self.address, self.fingerprint, self.session = address, fingerprint, session
        self.sock = _hello(address, fingerprint, session, HONEST)
        self.number, self.past, self.kept = 0, 0, True

    def step(self) -> float:
        rows = 32 if self.past == 0 else 1
        started = time.perf_counter()
        reply = _ask(self.sock, _step(self.session, self._next(), [Segment(1, None, 0, rows, self.past)], rows))
        elapsed = (time.perf_counter() - started) * 1e3
        if reply.opcode == Opcode.STEP_RESULT:
            self.past += rows
        else:
            self.kept, self.past = False, 0  # lost: open it again with the next step
        return elapsed

    def measure(self, samples: int) -> tuple[list[float], list[float]]:
        steps, hellos = [], []
        for _ in range(samples):
            steps.append(self.step())
            started = time.perf_counter()
            _hello(self.address, self.fingerprint, f"probe-{self.number}", HONEST).close()
            hellos.append((time.perf_counter() - started) * 1e3)
            time.sleep(0.05)
        return steps, hellos

    def _next(self) -> int:
        self.number += 1
        return self.number

    def close(self) -> None:
        self.sock.close()


def _connect(address: str, source: str = ATTACKER) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=WAIT_S, source_address=(source, 0))


def _hello(address: str, fingerprint: str, session: str, source: str = ATTACKER, **fields) -> socket.socket:
    sock = _connect(address, source)
    send_frame(sock, Frame(Opcode.HELLO, 0, {"role": "gateway", "fingerprint": fingerprint, "session": session,
                                            **fields}))
    reply, _ = recv_frame(sock, time.monotonic() + WAIT_S)
    if reply.opcode != Opcode.HELLO:
        sock.close()
        raise ConnectionError(str(reply.meta.get("message")))
    return sock


def _ask(sock: socket.socket, frame: Frame) -> Frame:
    send_frame(sock, frame)
    return recv_frame(sock, time.monotonic() + WAIT_S, max_payload=1 << 30)[0]


def _step(session: str, number: int, segments, rows: int, records=(), route=()) -> Frame:
    return Step(session, number, tuple(route), tuple(records), tuple(segments), torch.randn(rows, HIDDEN)).to_frame()


def _first_words(frame: Frame) -> str:
    if frame.opcode != Opcode.ERROR:
        return frame.opcode.name
    return " ".join(str(frame.meta.get("message", "")).split()[:6])


def _copies(address: str, fingerprint: str, count: int) -> Counter:
    with _hello(address, fingerprint, "copier") as sock:
        _ask(sock, _step("copier", 1, [Segment(1, None, 0, PROMPT, 0)], PROMPT))
        records = [["copy", 100 + i, 1, PROMPT] for i in range(count)]
        segments = [Segment(100 + i, None, i, i + 1, PROMPT) for i in range(count)]  # every copy used: none may go
        return Counter([_first_words(_ask(sock, _step("copier", 2, segments, count, records)))])


def _new_sequences(address: str, fingerprint: str, count: int) -> Counter:
    with _hello(address, fingerprint, "opener") as sock:
        segments = [Segment(1 + i, None, i, i + 1, 0) for i in range(count)]
        return Counter([_first_words(_ask(sock, _step("opener", 1, segments, count)))])


def _respellings(address: str, fingerprint: str, count: int) -> Counter:
    port = int(address.rsplit(":", 1)[1])
    forms = [lambda i: f"127.0.{i >> 8}.{i & 255}", lambda i: f"127.{i}", lambda i: f"0x7f{i:06x}", lambda i: str(0x7F000000 + i)]
    found: Counter = Counter()
    sockets = []
    for i in range(count):
        spelling = f"{forms[i % 4](1)}:{port}"  # one address (127.0.0.1), spelled four ways
        try:
            sock = _hello(address, fingerprint, f"spell-{i}", onward=spelling, onward_token="t")
        except (OSError, ConnectionError) as error:
            found[f"refused: {str(error)[:40]}"] += 1
            continue
        sockets.append(sock)
        send_frame(sock, _step(f"spell-{i}", 1, [Segment(1, None, 0, 1, 0)], 1, route=[spelling]))
    for sock in sockets:
        try:
            found[_first_words(recv_frame(sock, time.monotonic() + WAIT_S)[0])] += 1
        except OSError:
            found["closed"] += 1
        sock.close()
    return found


def _non_reader(address: str, fingerprint: str, steps: int = 400) -> Counter:
    sock = _connect(address)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    send_frame(sock, Frame(Opcode.HELLO, 0, {"role": "gateway", "fingerprint": fingerprint, "session": "sleeper"}))
    found: Counter = Counter()
    try:
        for i in range(steps):
            sock.sendall(_step("sleeper", i + 1, [Segment(1 + i, None, 0, 64, 0)], 64).to_bytes())
        found["sent all"] += 1
    except OSError:
        found["closed by the stage"] += 1
    sock.close()
    return found


def _silent(address: str, count: int) -> Counter:
    sockets, found = [], Counter()
    for _ in range(count):
        try:
            sockets.append(_connect(address))
        except OSError:
            found["connect failed"] += 1
    time.sleep(12.0)  # past the stage's HELLO deadline
    for sock in sockets:
        sock.settimeout(0.1)
        try:
            found["closed" if sock.recv(1) == b"" else "refused with an ERROR"] += 1
        except socket.timeout:
            found["open"] += 1
        except OSError:
            found["closed"] += 1
        sock.close()
    return found
