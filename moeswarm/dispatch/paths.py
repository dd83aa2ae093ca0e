"""The ways a layer call goes, behind one interface, and the one place one of them is chosen.

A layer call goes one of three paths (`CallPath`), each giving the same bits:

- `lane` (dispatch/lane.py `LanePath`): a decode step's one token sent and taken in C
  (transport/token_call.c), two C calls per holder;
- `express` (dispatch/express_call.py `ExpressPath`): the same one-token call in Python, every
  share's DISPATCH out at once, each reply awaited in turn, without a flight's bookkeeping;
- `flight` (dispatch/flight.py `FlightPath`): everything a call may meet (pieces cut to a reply
  bound, hedges, spot checks, failover within the call). Every call may go this way.

`Dispatcher.dispatch` asks them in that order (`Dispatcher.call_paths`): the first that is `eligible`
for the call and `send`s it takes it. A path that sends nothing says why (`Outcome`): `UNFIT`,
and the next path is asked; `FAILED` (a send failed and its holder was taken down), and the call
is planned again and sent as a flight. `Dispatcher.combine` asks the path that took the call to
`gather` its replies: the answer (`Gathered`), or the call handed on (`HandedOn`) to the path that
goes on with it (a lane call to express, keeping its requests in flight; either to a flight made
again). Whatever path answered, the call's bookkeeping is made in one place (dispatch/books.py),
which asks the path to `record` its own part.

Legend: T = tokens in the step, k = router top-k, d = hidden size.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Union

import torch

from moeswarm.ids import LayerId
from moeswarm.wire.config import CombineMode, WireConfig

if TYPE_CHECKING:
    from moeswarm.dispatch.express_call import ExpressCall
    from moeswarm.dispatch.flight import Flight
    from moeswarm.dispatch.lane import LaneCall
    from moeswarm.dispatch.plan import WorkerShare

InFlight = Union["Flight", "ExpressCall", "LaneCall"]  # a call sent, on the path that sent it


class Outcome(enum.Enum):
    """Why a path sent nothing of a call."""

    UNFIT = "unfit"  # this path cannot take the call (nothing sent): the next path is asked
    FAILED = "failed"  # a send failed, its holder taken down (nothing left in flight): planned again, as a flight


@dataclass(eq=False)
class Call:
    """A layer call to send: its rows and routing, the wire and fan-out it goes in, and its shares once
    planned (`plan`: the dispatcher's planner, called once, by the first path that needs them)."""

    layer: LayerId
    hidden: torch.Tensor  # [T, d]
    top_k_index: torch.Tensor  # [T, k] long
    top_k_weights: torch.Tensor  # [T, k]
    wire: WireConfig
    fanout: str
    spot_fraction: float  # the share of answers spot-checked
    started: float  # time.perf_counter() at `dispatch`
    plan: Callable[[], list[WorkerShare]] = field(repr=False, default=list)
    _shares: list[WorkerShare] | None = field(default=None, repr=False)

    @property
    def shares(self) -> list[WorkerShare]:
        """The call's shares, one per holder (planned now if not yet: ExpertsUnavailable where some
        routed experts have no usable holder)."""
        if self._shares is None:
            self._shares = self.plan()
        return self._shares

    @property
    def planned(self) -> bool:
        return self._shares is not None

    def replan(self) -> None:
        """Plan the shares again when next asked (a holder was taken down meanwhile)."""
        self._shares = None

    def one_token(self) -> bool:
        """Whether the call may go without a flight, its holders aside: one float32 token in exact mode
        over a lossless wire, star fan-out, no spot checks drawn (the lane's and express's condition)."""
        wire = self.wire
        return (self.hidden.shape[0] == 1 and self.hidden.dtype == torch.float32 and self.fanout == "star"
                and self.spot_fraction == 0 and wire.mode == CombineMode.EXACT and wire.dispatch_codec is None
                and wire.combine_codec is None)


@dataclass(frozen=True)
class Handle:
    """A layer call in flight: what `combine` needs."""

    layer: LayerId
    hidden: torch.Tensor  # [T, d]
    top_k_index: torch.Tensor  # [T, k] long
    flight: InFlight  # what the path that sent it keeps of it
    round_trips: int
    started: float  # time.perf_counter()
    call: int = 0  # the layer call's number (Dispatcher.call_number)
    path: CallPath | None = None  # the path that sent it
    top_k_weights: torch.Tensor | None = None  # [T, k]
    wire: WireConfig | None = None  # the wire it went in


@dataclass
class Gathered:
    """A layer call answered: its output (`out`, where its path added the rows up itself) or the
    answers to add up, and what its bookkeeping needs."""

    answers: list  # [(share, reply, holder)] in plan order ([] where `out` is made)
    answered: list[tuple[int, float, float | None]]  # (holder, round-trip seconds, its CPU seconds or None)
    unchecked: set[int] | list[int]  # holders (not trusted) whose answers count without a spot check confirming them
    bytes_out: int
    bytes_in: int
    remote_rows: int | None = None  # distinct rows of the call that went to a remote holder (None: from `answers`)
    out: torch.Tensor | None = None  # [T, d]: the combined output, where the path made it
    in_c: bool = False  # sent and taken in C
    plausible: list[tuple[int, float]] = field(default_factory=list)  # (layer, largest |value|) to learn from


@dataclass(frozen=True)
class HandedOn:
    """A call its path gave up on, and the path that goes on with it: `flight` is that path's
    in-flight object (the requests still out), or None where the call is sent again from its plan."""

    path: CallPath
    flight: InFlight | None


class CallPath(Protocol):
    """One way a layer call goes (the module's docstring lists them)."""

    name: str  # "lane", "express", "flight"
    plans: bool  # whether it needs the call's shares (the holders' standing is settled before they are planned)
    defers: bool  # whether its `record` waits for the next call's send (books.py)

    def eligible(self, call: Call) -> bool:
        """Whether this path may take `call` at all (its settings, shape, and layer; not yet its holders)."""

    def send(self, call: Call) -> InFlight | Outcome:
        """Send `call`: what is kept of it in flight (with `pieces`: (holder, DISPATCHes) per share), or
        why nothing was sent."""

    def gather(self, handle: Handle, flight: InFlight | None) -> Gathered | HandedOn:
        """The replies of `flight` (`handle`'s call), checked: the answer, or the path that goes on."""

    def record(self, answered: Gathered) -> None:
        """The path's own bookkeeping of a call it answered, beyond what every call's is (books.py): its
        holders' standing and the plausibility gate's learning, where `gather` left them."""
