"""The processes of `moeswarm bench real`: measured children driven over a pipe, and what /proc says of them.

A child (`python -m moeswarm_bench.bench.real_llama` or `real_moeswarm`) loads its model, says "ready"
as one JSON line, then answers one JSON line per request line on stdin. Its start-up time is the
parent's clock from spawning it to that line. Anything else the child prints goes to its stderr
(a file, shown when it fails), so the pipe carries nothing but replies.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from moeswarm.errors import MoeSwarmError

# a start-up (a large backbone on a busy 2-core machine) or a run at 80 ms RTT takes minutes at most
REPLY_TIMEOUT_S = 900.0


class Child:
    """A measured child process: spawned, waited for until ready, then driven by `request`."""

    def __init__(self, role: str, module: str, args: list[str], env: dict[str, str] | None = None):
        self.role = role
        self._log = tempfile.TemporaryFile(mode="w+")
        start = time.perf_counter()
        self.process = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._log, text=True,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.ready = self._reply()["ready"]
        self.startup_s = time.perf_counter() - start

    @property
    def pid(self) -> int:
        return self.process.pid

    def request(self, **fields) -> dict:
        """Send one request; its reply (raises with the child's own error or last lines when it fails)."""
        self.process.stdin.write(json.dumps(fields) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def _reply(self) -> dict:
        # one reply line per request, so nothing waits in the reader's buffer: select sees it all
        ready, _, _ = select.select([self.process.stdout], [], [], REPLY_TIMEOUT_S)
        if not ready:
            self.process.kill()
            raise MoeSwarmError(f"{self.role} gave no reply within {REPLY_TIMEOUT_S:.0f} s: {self._tail()}")
        line = self.process.stdout.readline()
        if not line:
            raise MoeSwarmError(f"{self.role} {exit_words(self.process.wait())}: {self._tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise MoeSwarmError(f"{self.role}: {reply['error']}")
        return reply

    def _tail(self) -> str:
        self._log.seek(0)
        lines = self._log.read().strip().splitlines()
        return " | ".join(lines[-5:])[-1500:] or "no output"

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.flush()
                self.process.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self._log):
            stream.close()


def exit_words(code: int) -> str:
    """A child's exit status in words: 'exited (code 1)', 'was killed by SIGSEGV'."""
    import signal

    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited (code {code})"


def serve(load: Callable[[], tuple[dict, Callable[[dict], dict]]]) -> None:
    """A child's main loop: `load()` returns (what to say when ready, the request handler)."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (llama.cpp, transformers) go to stderr, not into the replies
    try:
        info, handle = load()
    except Exception as error:  # one line for the parent: what failed to load
        replies.write(json.dumps({"error": f"{type(error).__name__}: {error}"}) + "\n")
        return
    replies.write(json.dumps({"ready": info}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "quit":
            break
        try:
            reply = handle(request)
        except Exception as error:
            reply = {"error": f"{type(error).__name__}: {error}"}
        replies.write(json.dumps(reply) + "\n")


def memory(pid: int) -> dict[str, int]:
    """VmRSS, its anonymous and file-backed parts (mapped GGUF pages), and VmHWM (peak), in bytes."""
    fields = {"VmRSS": "rss_bytes", "RssAnon": "rss_anon_bytes", "RssFile": "rss_file_bytes", "VmHWM": "rss_peak_bytes"}
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in fields:
            found[fields[key]] = int(line.split()[1]) * 1024  # kB there
    return found


def thread_cpu(pid: int) -> dict[int, float]:
    """{thread id: CPU seconds so far} of every thread of `pid` (each thread's schedstat, ns)."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            times[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended between listing and reading
    return times


def cpu_split(pid: int, before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """CPU seconds of `pid` between two `thread_cpu` readings: its main thread (a worker's event
    loop) and every other thread (a worker's compute thread and its kernels' threads)."""
    main = after.get(pid, 0.0) - before.get(pid, 0.0)
    total = sum(after.values()) - sum(before.get(tid, 0.0) for tid in after)
    return {"main_s": main, "other_s": total - main, "total_s": total}


def prewarm(path: Path, chunk: int = 64 << 20) -> float:
    """Read `path` once (into the page cache: every start-up then maps a warm file); seconds taken."""
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(chunk):
            pass
    return time.perf_counter() - start
