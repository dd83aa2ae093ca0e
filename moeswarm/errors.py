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
        super().__init__(f"worker {worker}: {cause}")
        self.worker = worker
        self.cause = cause
