"""One `moeswarm` command run in a forked child, under a deadline and an RSS cap: the file fuzzer's runner.

The parent imports moeswarm (torch, transformers) once; each run forks it, so a run starts in
milliseconds instead of an interpreter's seconds, and a crash, a hang or a blown memory budget
is the child's alone. The parent never runs torch compute before forking (a forked OpenMP pool
could hang the child).

A run ends as one of: "ok" (exit 0), "refused" (exit 2, its stderr one line `moeswarm CMD: error:
...`), "started" (a worker printed "listening on": it accepted the file and is stopped),
"traceback" (stderr holds "Traceback"), "bad-exit" (another exit status, or exit 2 with more
than one line), "crash" (ended by a signal), "hang" (past the deadline), "memory" (RSS past the cap).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

import psutil

POLL_S = 0.02


@dataclass(frozen=True)
class RunResult:
    outcome: str
    seconds: float
    peak_rss_mb: float
    stderr: str  # its last 2,000 characters


def run_forked(argv: list[str], timeout_s: float, rss_cap_mb: float, listening: bool = False) -> RunResult:
    """`moeswarm argv` in a forked child; `listening`: the command is a worker, stopped once it listens."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the child: the command, then _exit (never the parent's cleanup)
            status = 70
            try:
                os.setsid()
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.environ["PYTHONUNBUFFERED"] = "1"
                sys.stdout = os.fdopen(1, "w", buffering=1)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                from moeswarm.cli import main

                status = main(argv)
            except SystemExit as end:
                status = end.code if isinstance(end.code, int) else 1
            except BaseException:
                import traceback

                traceback.print_exc()
                status = 1
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(status)
        outcome, peak, status = _watch(pid, out, timeout_s, rss_cap_mb, listening)
        seconds = time.monotonic() - start
        err.seek(0)
        stderr = err.read()
    if outcome is None:
        outcome = _outcome(status, stderr)
    return RunResult(outcome, seconds, peak, stderr[-2000:])


def _watch(pid: int, out, timeout_s: float, rss_cap_mb: float, listening: bool) -> tuple[str | None, float, int]:
    """Wait for the child: (outcome when the parent ended it, else None; peak RSS MB; wait status)."""
    deadline, peak = time.monotonic() + timeout_s, 0.0
    try:
        process = psutil.Process(pid)
    except psutil.NoSuchProcess:
        process = None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return None, peak, status
        try:
            rss = sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]) / 1e6 if process else 0.0
        except psutil.Error:
            rss = 0.0
        peak = max(peak, rss)
        ended = None
        if rss > rss_cap_mb:
            ended = "memory"
        elif time.monotonic() > deadline:
            ended = "hang"
        elif listening:
            out.seek(0)
            if "listening on " in out.read():
                ended = "started"
        if ended:
            _kill(pid)
            return ended, peak, 0
        time.sleep(POLL_S)


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # its process group: the child called setsid
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)


def _outcome(status: int, stderr: str) -> str:
    if os.WIFSIGNALED(status):
        return "crash"
    code = os.WEXITSTATUS(status)
    if "Traceback" in stderr:
        return "traceback"
    if code == 0:
        return "ok"
    lines = [line for line in stderr.splitlines() if line.strip()]
    if code == 2 and len(lines) == 1 and ": error: " in lines[0]:
        return "refused"
    return "bad-exit"
