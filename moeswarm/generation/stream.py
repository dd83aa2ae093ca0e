"""The output as text: decoded, cut at the first stop string, streamed only once it is final.

Text is shown when nothing that follows can change it: a tail that could start a stop string
waits (`held_back`), and so does a trailing replacement character (a multi-byte character whose
other bytes are still to come).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from moeswarm.generation.stops import find_stop, held_back

_UNFINISHED = "\ufffd"


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = (),
                 write: Callable[[str], None] | None = None):
        self.decode = decode
        self.stops = tuple(stops)
        self.write = write
        self.tokens: list[int] = []
        self.shown = 0  # characters written so far

    def stopped(self, tokens: list[int]) -> bool:
        """Whether `tokens` decode to a text holding a stop string (generate's `stop` callback)."""
        return find_stop(self.decode(tokens), self.stops) is not None

    @property
    def text(self) -> str:
        """The output so far, cut where the first stop string starts (the stop itself left out)."""
        text = self.decode(self.tokens)
        cut = find_stop(text, self.stops)
        return text if cut is None else text[:cut]

    def add(self, tokens: list[int]) -> None:
        """More output tokens; writes whatever text became final."""
        self.tokens.extend(tokens)
        if self.write is None:
            return
        text = self.decode(self.tokens)
        if find_stop(text, self.stops) is None:
            text = text[: len(text) - held_back(text, self.stops)].rstrip(_UNFINISHED)
        else:
            text = self.text
        self._show(text)

    def finish(self) -> None:
        """The generation is over: write the rest."""
        self._show(self.text)

    def _show(self, text: str) -> None:
        if self.write is not None and len(text) > self.shown:
            self.write(text[self.shown:])
            self.shown = len(text)
