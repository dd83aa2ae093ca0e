"""Progress bars: drawn on a terminal's stderr, never into a pipe or a log, never with --quiet."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import termios
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from moeswarm import progress as progress_module
from moeswarm.progress import chunks, progress, set_quiet, status

BUNDLED_Q8 = Path(__file__).resolve().parent.parent / "models" / "pymoe" / "gguf" / "pymoe-Q8_0.gguf"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def not_quiet():
    set_quiet(False)
    yield
    set_quiet(False)


def drive(stream: io.StringIO, monkeypatch) -> str:
    monkeypatch.setattr(sys, "stderr", stream)
    assert list(progress(range(3), desc="counting")) == [0, 1, 2]
    with status("a phase"):
        pass
    return stream.getvalue()


def test_bars_are_drawn_on_a_terminal(monkeypatch):
    assert "counting" in drive(Terminal(), monkeypatch)


def test_no_bars_when_stderr_is_not_a_terminal(monkeypatch):
    assert drive(io.StringIO(), monkeypatch) == ""
    assert not progress_module.enabled()


def test_no_bars_with_quiet_even_on_a_terminal(monkeypatch):
    set_quiet(True)
    assert drive(Terminal(), monkeypatch) == ""


def test_chunks_cover_every_item_in_order_in_at_most_that_many_pieces():
    pieces = list(chunks(list(range(10)), 3))
    assert pieces == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]
    assert list(chunks([5, 6], 16)) == [[5], [6]]


def _start_slice(out: Path, *flags: str, terminal: bool) -> Callable[[], str]:
    """Start `moeswarm slice` of the bundled Q8_0 file, its stderr on a pseudo-terminal or a pipe;
    the returned call waits for it and gives what it wrote there."""
    command = [sys.executable, "-m", "moeswarm.cli", "slice", str(BUNDLED_Q8), "--experts", "0-7", "-o", str(out), *flags]
    if not terminal:
        piped = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def piped_stderr() -> str:
            _, err = piped.communicate(timeout=300)
            assert piped.returncode == 0, err
            return err

        return piped_stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # a terminal 80 columns wide
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)

    def terminal_stderr() -> str:
        seen = b""
        while True:  # read as it comes: a full pseudo-terminal buffer would block the writer
            ready, _, _ = select.select([leader], [], [], 300)
            if not ready:
                break
            try:
                data = os.read(leader, 4096)
            except OSError:  # the writer closed its end
                break
            if not data:
                break
            seen += data
        os.close(leader)
        assert process.wait(timeout=300) == 0
        return seen.decode(errors="replace")

    return terminal_stderr


@pytest.mark.skipif(not BUNDLED_Q8.is_file(), reason="the bundled GGUF files are not in this checkout")
def test_slice_shows_progress_only_on_a_terminal_and_not_with_quiet(tmp_path):
    # the three run side by side (their starts overlap); each is waited for in turn
    shown = _start_slice(tmp_path / "a.gguf", terminal=True)
    quiet = _start_slice(tmp_path / "b.gguf", "--quiet", terminal=True)
    piped = _start_slice(tmp_path / "c.gguf", terminal=False)
    assert "slicing pymoe-Q8_0.gguf" in shown()
    assert quiet() == ""
    assert piped() == ""
