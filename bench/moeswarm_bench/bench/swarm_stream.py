"""The running stream of `moeswarm bench swarm`: greedy decoding on the swarm, without pause, while
members are killed and join again.

The stream is a backbone in this process that finds its workers on the swarm's DHT and follows
joins and leaves (`open_swarm` with DiscoveryOptions, as `generate --swarm INVITE`). It decodes the
same prompt again and again, `tokens` tokens each time (a segment: the model's positions bound one
sequence), and every segment's tokens must equal the reference's: the same segment decoded before
the churn with every expert in one process (the local mode). With `check_local`, every forward's
logits are also compared with the local eager model's as `generate --check-local` compares them
(torch.equal on the exact wire), which costs a local forward per step.

Kept for the figures: each token's arrival time, each failed segment (a layer call that raised:
no usable holder, `generate` raises it) with its time and message, the first layer call each
holder answered, and the dispatcher's resilience counters (takedowns, failovers, ...).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from moeswarm.errors import MoeSwarmError, one_line


def stream_prompt(vocab_size: int, length: int = 16) -> list[int]:
    """A fixed prompt of token ids (any model's vocabulary has them): the same every run."""
    return [(7 * i + 3) % min(vocab_size - 10, 1000) + 10 for i in range(length)]


def segment_tokens(positions: int | None, prompt: int, wanted: int) -> int:
    """Tokens a segment decodes: `wanted`, within the model's positions."""
    return max(1, min(wanted, (positions or prompt + wanted + 1) - prompt - 1))


class _Stopped(BaseException):
    """Raised from the stream's event callback to end its segment now (the engine lets a BaseException through)."""


@dataclass
class Failure:
    at: float
    segment: int
    message: str


@dataclass
class StreamFigures:
    tokens: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, tokens in that delta)
    segments: int = 0  # completed
    segments_equal: int = 0  # whose tokens equal the reference's
    last_partial: int = 0  # tokens of the segment the stop cut short
    last_partial_equal: bool | None = None  # whether they equal the reference's first ones (None: no such segment)
    first_difference: str | None = None
    logits_checked: int = 0  # forwards compared with the local eager model (check_local)
    logits_bit_identical: bool | None = None  # None: not checked
    failures: list[Failure] = field(default_factory=list)
    first_used: dict[str, float] = field(default_factory=dict)  # holder address: its first layer call answered
    started_at: float = 0.0
    stopped_at: float = 0.0


class Stream:
    """Decoding on `swarm` in a thread of its own until `stop()`; figures in `.figures`."""

    def __init__(self, swarm, prompt: list[int], reference_tokens: list[int], reference_model=None):
        self.swarm = swarm
        self.prompt = prompt
        self.reference = list(reference_tokens)
        self.reference_model = reference_model
        self.figures = StreamFigures(logits_bit_identical=None if reference_model is None else True)
        self._stop = threading.Event()
        self._seen = 0  # layer calls of the segment already looked at
        self._segment_tokens: list[int] = []  # the segment's tokens so far
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="bench swarm stream", daemon=True)

    def start(self) -> None:
        self.figures.started_at = time.monotonic()
        self.thread.start()

    def stop(self, wait_s: float = 600.0) -> StreamFigures:
        """Ends the stream at its next token (what the cut segment produced is compared too)."""
        self._stop.set()
        self.thread.join(wait_s)
        if self.thread.is_alive():
            raise MoeSwarmError(f"the stream did not end its segment within {wait_s:g} s")
        if self.error is not None:
            raise self.error
        return self.figures

    def abort(self, wait_s: float = 60.0) -> None:
        """Ends the stream, if it runs, whatever state it is in (on the way out of a failed run)."""
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(wait_s)

    def wait_tokens(self, count: int, wait_s: float = 300.0) -> None:
        """Until the stream has produced `count` more tokens."""
        target, deadline = self.produced() + count, time.monotonic() + wait_s
        while self.produced() < target:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise MoeSwarmError(f"the stream produced fewer than {count} tokens within {wait_s:g} s "
                                    f"({len(self.figures.failures)} failed segments)")
            time.sleep(0.05)

    def produced(self) -> int:
        return sum(n for _, n in list(self.figures.tokens))

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._segment()
        except BaseException as error:  # noqa: BLE001  kept for stop() to raise
            self.error = error
        finally:
            self.figures.stopped_at = time.monotonic()

    def _segment(self) -> None:
        from moeswarm.engine.generate import generate

        figures = self.figures
        self.swarm.reset_accounting()
        self._seen = 0
        self._segment_tokens = []
        try:
            result = generate(self.swarm, self.prompt, len(self.reference), 0, self.reference_model,
                              on_event=self._event)
        except _Stopped:
            produced = self._segment_tokens
            figures.last_partial = len(produced)
            figures.last_partial_equal = produced == self.reference[:len(produced)]
            if not figures.last_partial_equal and figures.first_difference is None:
                figures.first_difference = f"the last segment (cut short), token {_first_difference(produced, self.reference)}"
            return
        except MoeSwarmError as error:  # a layer call failed for good (no usable holder): the segment is lost
            figures.failures.append(Failure(time.monotonic(), figures.segments, one_line(error)))
            time.sleep(0.2)
            return
        self._note_holders()
        figures.segments += 1
        if list(result.tokens) == self.reference:
            figures.segments_equal += 1
        elif figures.first_difference is None:
            figures.first_difference = f"segment {figures.segments}, token {_first_difference(result.tokens, self.reference)}"
        if result.check is not None:
            figures.logits_checked += result.check.positions
            figures.logits_bit_identical = figures.logits_bit_identical and result.check.bit_identical

    def _event(self, event) -> None:
        from moeswarm.engine.job import Delta

        if isinstance(event, Delta) and event.tokens:
            self.figures.tokens.append((time.monotonic(), len(event.tokens)))
            self._segment_tokens.extend(event.tokens)
            self._note_holders()
        if self._stop.is_set():
            raise _Stopped

    def _note_holders(self) -> None:
        """The holders of the layer calls made since the last look: the first time each answered."""
        calls = self.swarm.layer_calls(self._seen)
        self._seen += len(calls)
        now = time.monotonic()
        for call in calls:
            for address in call.worker_seconds:
                self.figures.first_used.setdefault(address, now)


def _first_difference(tokens, reference) -> int:
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
