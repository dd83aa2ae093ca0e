"""Errors a user can act on. The CLI prints them as one line; anything else is a bug."""

from __future__ import annotations


class MoeSwarmError(Exception):
    """Base of every error moeswarm raises on purpose."""


class ModelError(MoeSwarmError):
    """A model directory or file is missing, malformed or unsupported."""


class ProtocolError(MoeSwarmError):
    """A frame or message broke the wire protocol (bad magic, size, field, shape...)."""


class WorkerError(MoeSwarmError):
    """A worker refused a request, answered with an ERROR frame, or could not be reached."""

    def __init__(self, worker: str, cause: str):
        cause = printable(cause)  # it may quote a peer's text: no terminal escapes reach a screen or log
        super().__init__(f"worker {printable(worker)}: {cause}")
        self.worker = worker
        self.cause = cause


def printable(text: str, limit: int = 2000) -> str:
    """Text from a peer made safe to print: control characters escaped, length bounded."""
    text = str(text)[:limit]
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def one_line(error: BaseException) -> str:
    """An error's message on one line (a message quoting a file or a peer may hold line breaks)."""
    return " ".join(str(error).split())
