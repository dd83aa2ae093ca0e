"""A request as the engine sees it, and what the engine tells its caller back.

The engine calls `job.emit(event)` from its own thread; the HTTP side hops each event onto its
event loop. A caller that goes away sets `job.cancelled`; the engine frees the slot at its next step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from moeswarm.generation.sampling import SamplingParams


@dataclass(frozen=True)
class Delta:
    """New output: the text now safe to show (no partial stop string, no half character)."""

    text: str
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (end of text or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens taken from the prefix cache


@dataclass(frozen=True)
class Failed:
    message: str  # one line, safe to print
    status: int = 503  # the HTTP status the caller should answer with


Event = Delta | Finished | Failed


@dataclass(eq=False)
class Job:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    emit: Callable[[Event], None]
    stops: tuple[str, ...] = ()
    speculate: int | None = None  # most drafts per step, capped by the engine's --speculate; None: that cap
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
