"""Which layer calls used each holder's unchecked answers: what a ban puts in doubt.

Layer calls are numbered by the dispatcher (monotonic, from 1). Each combined answer that was
not confirmed by a spot check marks its call against its holder, kept as runs of consecutive
call numbers (a holder used every call is one run). When a holder is banned, its runs become a
`Taint`: every sequence whose steps made one of those calls is in doubt from its first such step,
and the serving engine rolls it back to before that step and recomputes it.

Runs per holder are bounded: past `max_runs`, the two oldest merge (the merged run may cover
calls the holder did not serve: rolling those back too is safe, only slower).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Taint:
    holder: str  # the banned holder's address
    cause: str
    runs: tuple[tuple[int, int], ...]  # inclusive ranges of layer-call numbers, ascending

    @property
    def first(self) -> int | None:
        return self.runs[0][0] if self.runs else None

    def hits(self, first_call: int, last_call: int) -> bool:
        """Whether any call numbered in [first_call, last_call] is tainted."""
        return any(low <= last_call and first_call <= high for low, high in self.runs)


class Ledger:
    def __init__(self, max_runs: int = 4096):
        self.max_runs = max_runs
        self._runs: dict[object, list[list[int]]] = {}  # holder key -> [[low, high], ...]

    def used(self, holder: object, call: int) -> None:
        runs = self._runs.setdefault(holder, [])
        if runs and runs[-1][1] >= call - 1:
            runs[-1][1] = max(runs[-1][1], call)
            return
        runs.append([call, call])
        if len(runs) > self.max_runs:
            runs[0:2] = [[runs[0][0], runs[1][1]]]

    def runs(self, holder: object) -> tuple[tuple[int, int], ...]:
        return tuple((low, high) for low, high in self._runs.get(holder, ()))

    def forget(self, holder: object) -> None:
        self._runs.pop(holder, None)

    def rekey(self, mapping: dict) -> None:
        """Holders renumbered (tombstones pruned): old key -> new key; keys not mapped are dropped."""
        self._runs = {mapping[key]: runs for key, runs in self._runs.items() if key in mapping}
