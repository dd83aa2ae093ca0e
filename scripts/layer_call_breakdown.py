#!/usr/bin/env python
"""Where a one-token layer call's time goes on loopback, on both sides, with one clock.

A worker process (the bundled model, every expert, one torch thread) runs with stamps at: frame
read on the loop, DISPATCH queued, picked up on the compute thread, decoded, experts run
(store.run), RESULT encoded, sent. Each stamp is time.perf_counter_ns (CLOCK_MONOTONIC: one clock
for both processes on Linux) and time.thread_time_ns (CPU time of the thread doing the stage).
The backbone side is a bare TcpLink (prepare, send, wait, Result decode) sending one-token
DISPATCHes (8 of 32 experts, d = 128, f32, exact), a 1 ms pause every 50 calls. Prints the
median and mean of each stage, the PING round trip and CPU time per call of both processes.
Wall figures mean something only on a quiet machine: the load average is printed with them.

    python scripts/layer_call_breakdown.py                                 # N=3000 calls
    N=1000 STRACE=/tmp/w.strace python scripts/layer_call_breakdown.py     # the worker under strace -f -c
"""

from __future__ import annotations

import atexit
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL = str(Path(__file__).resolve().parents[1] / "models" / "pymoe" / "hf")
STAGES = ["b_encode (prepare)", "b_send", "net + loop wake + read_frame", "w_handle + submit (loop)",
          "hand-off to compute thread", "w_decode (Dispatch.from_frame, checks)", "w_kernel (store.run)",
          "w_encode (Result.to_frame)", "w_write_now (encode + sendmsg)", "net + backbone wake + recv",
          "b_Result.from_frame", "total round trip", "total - kernel"]
CPU_STAGES = ["b_encode (prepare)", "b_send", "w_handle + submit (loop)", "w_decode (Dispatch.from_frame, checks)",
              "w_kernel (store.run)", "w_encode (Result.to_frame)", "w_write_now (encode + sendmsg)",
              "b_wait (select + recv + decode_frame)", "b_Result.from_frame"]


def stamped_worker(argv: list[str]) -> int:
    """`moeswarm worker` with stamps around its stages, written to $STAMPS_OUT at exit."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from moeswarm.cli import main
    from moeswarm.worker import compute, requests, server, session

    stamps: dict[int, dict[str, int]] = {}

    def stamp(rid: int, name: str) -> None:
        at = stamps.setdefault(rid, {})
        at[name], at[name + "_cpu"] = time.perf_counter_ns(), time.thread_time_ns()

    read_frame = server.read_frame

    async def read_stamped(*args, **kwargs):
        incoming = await read_frame(*args, **kwargs)
        if incoming is not None:
            stamp(incoming.header.request_id, "read")
        return incoming

    handle, decode, answer = requests.Requests.handle, compute.Computation._decode, compute.Computation._answer
    write_now = session.Session.write_now

    def handle_stamped(self, session_, incoming):
        reply = handle(self, session_, incoming)
        stamp(incoming.header.request_id, "queued")
        return reply

    def decode_stamped(self, frame, quiet=False, sized=False):
        stamp(frame.request_id, "thread")
        decoded = decode(self, frame, quiet, sized)
        stamp(frame.request_id, "decoded")
        return decoded

    def answer_stamped(self, rid, request, routed, run):
        def timed(req):
            result = run(req)
            stamp(rid, "kernel")
            return result

        reply = answer(self, rid, request, routed, timed)
        stamp(rid, "encoded")
        return reply

    def write_stamped(self, frame, owed):
        done = write_now(self, frame, owed)
        stamp(frame.request_id, "sent")
        return done

    server.read_frame = read_stamped
    requests.Requests.handle = handle_stamped
    compute.Computation._decode, compute.Computation._answer = decode_stamped, answer_stamped
    session.Session.write_now = write_stamped
    atexit.register(lambda: Path(os.environ["STAMPS_OUT"]).write_text(json.dumps(stamps)))
    return main(argv)


def listening(process: subprocess.Popen) -> str:
    while line := process.stdout.readline():
        if "listening on " in line:
            return line.split("listening on ", 1)[1].split()[0]
    raise SystemExit(process.stderr.read())


def measure(calls: int) -> None:
    import psutil
    import torch

    from moeswarm.sources.source import open_source
    from moeswarm.transport.tcp import TcpLink
    from moeswarm.wire.config import CombineMode
    from moeswarm.wire.messages import Dispatch, Result

    out = os.environ.get("STAMPS_OUT", "/tmp/layer_call_stamps.json")
    strace = ["strace", "-f", "-c", "-o", os.environ["STRACE"]] if os.environ.get("STRACE") else []
    process = subprocess.Popen(strace + [sys.executable, __file__, "--stamped-worker", "worker", "--model", MODEL,
                                         "--port", "0", "--threads", "1"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", "STAMPS_OUT": out})
    warmup, rows = 200, {}
    try:
        link = TcpLink(listening(process))
        worker = psutil.Process(process.pid)
        worker = (worker.children() or [worker])[0] if strace else worker
        link.connect(open_source(MODEL).fingerprint)
        generator = torch.Generator().manual_seed(0)
        requests = [Dispatch(i % 6, torch.randn(1, 128, generator=generator),
                             torch.randperm(32, generator=generator)[:8].view(1, 8),
                             torch.rand(1, 8, generator=generator), CombineMode.EXACT) for i in range(64)]
        pings = [link.ping() for _ in range(500)]
        for i in range(warmup + calls):
            if i == warmup:
                worker_cpu, backbone_cpu = sum(worker.cpu_times()[:2]), time.thread_time_ns()
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            prepared = link.prepare(requests[i % len(requests)])
            t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            pending = link.send(prepared)
            t2, c2 = time.perf_counter_ns(), time.thread_time_ns()
            frame, _ = link._receive(pending.request_id, time.monotonic() + 10)
            t3, c3 = time.perf_counter_ns(), time.thread_time_ns()
            Result.from_frame(frame)
            t4, c4 = time.perf_counter_ns(), time.thread_time_ns()
            if i >= warmup:
                rows[pending.request_id] = (t0, t1, t2, t3, t4, c0, c1, c2, c3, c4)
            if i % 50 == 0:
                time.sleep(0.001)  # as a decode step's attention between layer calls
        worker_cpu = sum(worker.cpu_times()[:2]) - worker_cpu
        backbone_cpu = time.thread_time_ns() - backbone_cpu
    finally:
        (psutil.Process(process.pid).children() or [process])[0].terminate() if strace else process.terminate()
        process.wait()
    report(rows, json.loads(Path(out).read_text()), pings, worker_cpu, backbone_cpu, calls)


def report(rows: dict, stamps: dict, pings: list[float], worker_cpu: float, backbone_cpu: int, calls: int) -> None:
    wall: dict[str, list[int]] = {k: [] for k in STAGES}
    cpu: dict[str, list[int]] = {k: [] for k in CPU_STAGES}
    for rid, (t0, t1, t2, t3, t4, c0, c1, c2, c3, c4) in rows.items():
        s = stamps.get(str(rid))
        if not s or len(s) < 14:
            continue
        kernel = s["kernel"] - s["decoded"]
        for key, value in zip(STAGES, [t1 - t0, t2 - t1, s["read"] - t2, s["queued"] - s["read"], s["thread"] - s["queued"],
                                       s["decoded"] - s["thread"], kernel, s["encoded"] - s["kernel"],
                                       s["sent"] - s["encoded"], t3 - s["sent"], t4 - t3, t4 - t0, t4 - t0 - kernel]):
            wall[key].append(value)
        for key, value in zip(CPU_STAGES, [c1 - c0, c2 - c1, s["queued_cpu"] - s["read_cpu"],
                                           s["decoded_cpu"] - s["thread_cpu"], s["kernel_cpu"] - s["decoded_cpu"],
                                           s["encoded_cpu"] - s["kernel_cpu"], s["sent_cpu"] - s["encoded_cpu"],
                                           c3 - c2, c4 - c3]):
            cpu[key].append(value)
    print(f"{len(wall['total round trip'])} one-token DISPATCHes (8 of 32 experts, d=128, f32, exact), us; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"  {'wall clock':42s} {'median':>8s} {'mean':>8s}")
    for key, values in wall.items():
        print(f"  {key:42s} {statistics.median(values) / 1e3:8.1f} {statistics.mean(values) / 1e3:8.1f}")
    print(f"  {'PING round trip':42s} {1e6 * statistics.median(pings):8.1f}")
    print(f"  {'CPU time of the thread doing it':42s} {'median':>8s} {'mean':>8s}")
    for key, values in cpu.items():
        print(f"  {key:42s} {statistics.median(values) / 1e3:8.1f} {statistics.mean(values) / 1e3:8.1f}")
    kernel = statistics.mean(cpu["w_kernel (store.run)"]) / 1e3
    print(f"  {'worker process CPU per call':42s} {1e6 * worker_cpu / calls:8.1f}   "
          f"(less its kernel: {1e6 * worker_cpu / calls - kernel:.1f})")
    print(f"  {'backbone thread CPU per call':42s} {backbone_cpu / 1e3 / calls:8.1f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--stamped-worker"]:
        sys.exit(stamped_worker(sys.argv[2:]))
    measure(int(os.environ.get("N", 3000)))
