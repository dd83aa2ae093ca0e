"""What remote experts cost: bytes at the socket, round trips, per-worker round-trip times; and
what went wrong on the way (failovers, hedges, spot checks)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class LayerCall:
    layer: int
    tokens: int
    bytes_out: int
    bytes_in: int
    round_trips: int
    seconds: float
    worker_seconds: dict[str, float]  # each answering holder's round trip
    remote_tokens: int | None = None  # rows that went to a remote holder (None: not counted)
    decode: bool = False  # made by a decode step (every sequence of the step past its prompt), whatever its rows
    worker_cpu: dict[str, float] = field(default_factory=dict)  # the CPU seconds its experts took, as each worker said
    in_c: bool = False  # sent and taken in C (dispatch/lane.py)


@dataclass
class Accounting:
    calls: list[LayerCall] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)  # worker address -> "direct" or "relay" (transport/path.py)
    decoding: bool = False  # the calls recorded now are a decode step's (the engine says so before each step)
    _pending: Callable[[], tuple[LayerCall, bool]] | None = field(default=None, repr=False)  # `defer`'s

    def defer(self, make: Callable[[], tuple[LayerCall, bool]]) -> None:
        """A call's record, made later: by `flush`, or before the next call's record (calls stay in order).
        make: () -> (the LayerCall, whether it was a decode step's)."""
        self.flush()
        self._pending = make

    def flush(self) -> None:
        """Make the deferred record, if any."""
        make, self._pending = self._pending, None
        if make is not None:
            self.record(*make())

    def record(self, call: LayerCall, decoding: bool | None = None) -> None:
        """decoding: whether the call was a decode step's, where it is recorded after its step (None: now)."""
        if self._pending is not None:
            self.flush()
        if self.decoding if decoding is None else decoding:
            call.decode = True  # stamped here, where the step is known (a copy per call would cost more than the rest)
        self.calls.append(call)

    def reset(self) -> None:
        self.calls.clear()

    def summary(self) -> dict:
        token_layers = sum(c.tokens for c in self.calls)
        decode = [c for c in self.calls if c.decode]  # by step: a batched or verify step's calls carry many rows
        rtts: dict[str, list[float]] = defaultdict(list)
        cpu: dict[str, list[float]] = defaultdict(list)
        for call in self.calls:
            for worker, seconds in call.worker_seconds.items():
                rtts[worker].append(seconds)
            for worker, seconds in call.worker_cpu.items():
                cpu[worker].append(seconds)
        return {
            "layer_calls": len(self.calls),
            "layer_calls_in_c": sum(c.in_c for c in self.calls),
            "round_trips": sum(c.round_trips for c in self.calls),
            "trip_share": _ratio(sum(c.remote_tokens or 0 for c in self.calls), token_layers),  # (token, layer) pairs sent remote
            "bytes_out": sum(c.bytes_out for c in self.calls),
            "bytes_in": sum(c.bytes_in for c in self.calls),
            "bytes_out_per_token_layer": _ratio(sum(c.bytes_out for c in self.calls), token_layers),
            "bytes_in_per_token_layer": _ratio(sum(c.bytes_in for c in self.calls), token_layers),
            "decode_bytes_out_per_token_layer": _ratio(sum(c.bytes_out for c in decode), sum(c.tokens for c in decode)),
            "decode_bytes_in_per_token_layer": _ratio(sum(c.bytes_in for c in decode), sum(c.tokens for c in decode)),
            "seconds_per_layer_call_mean": _ratio(sum(c.seconds for c in self.calls), len(self.calls)),
            "worker_rtt_ms_mean": {w: 1000 * sum(v) / len(v) for w, v in sorted(rtts.items())},
            "worker_cpu_ms_mean": {w: 1000 * sum(v) / len(v) for w, v in sorted(cpu.items())},  # experts, as said
            "worker_paths": dict(sorted(self.paths.items())),
        }


@dataclass
class Resilience:
    """Counts since the swarm opened: each says how often the dispatcher had to do something."""

    takedowns: int = 0  # holders taken out of use (error, deadline, lost connection, bad RESULT)
    deadline_misses: int = 0
    failovers: int = 0  # parts re-planned over other holders within their layer call
    readmissions: int = 0  # holders back in use after a good HELLO and PING
    hedges: int = 0  # duplicates sent to a replica for a late reply
    hedge_wins: int = 0  # ... that answered first
    checks: int = 0  # spot checks sent
    checks_skipped: int = 0  # drawn, but no other usable holder had the experts
    checks_dropped: int = 0  # the checking holder failed first
    check_failures: int = 0  # answers that differed from their recomputation
    bans: int = 0
    implausible: int = 0  # answers whose row norms were far above the layer's running statistics
    disputes_settled: int = 0  # two holders disagreed and a third computation said who lied
    disputes_unsettled: int = 0  # ... and nothing could (the call failed, nobody was banned)
    referee_computations: int = 0  # third computations by the backbone itself
    pruned: int = 0  # holders that left the swarm, dropped from the lists

    def to_dict(self) -> dict[str, int]:
        return dict(vars(self))


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None
