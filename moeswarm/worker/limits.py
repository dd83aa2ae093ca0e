"""What a worker accepts from the network, and how long it waits: every bound in one place.

Legend: T = tokens of a DISPATCH, k = its top-k, d = hidden size, S = routed (token, expert)
pairs the worker computes (ids >= 0 in the DISPATCH; each must be a held expert, once per row).

Each limit is checked before the memory or time it guards is spent: header lengths before the
body is read, declared tensor shapes before they are decoded, the byte budget before a body is
buffered. A RESULT holds at most S x d values in exact mode (T x d in partial), and S <= T x k,
with k at most the model's own top-k: the reply is never larger than the routing implies.

Replies are bounded before compute: a DISPATCH's RESULT size follows from its declared shapes
and combine codec (`reply_bound`, integer arithmetic on the event loop), is counted against the
connection's unsent bound and the worker's reply budget before the request is queued, and its
exact size (from the routed pairs S) is checked again on the compute thread before any expert
runs. So a client that never reads holds at most its connection's bound of reply bytes, and all
clients together at most the worker's reply budget (plus SMALL_FRAME_BYTES per connection).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moeswarm.errors import MoeSwarmError, ProtocolError
from moeswarm.wire.frames import DEFAULT_MAX_PAYLOAD_BYTES
from moeswarm.wire.result_size import DEFAULT_MAX_RESULT_BYTES, reply_bytes

if TYPE_CHECKING:  # no torch import: the worker's flags take their defaults from here
    import torch

SMALL_FRAME_BYTES = 64 << 10  # bodies up to this size never wait for the byte budget (PING, HELLO, decode steps)


@dataclass(frozen=True)
class WorkerLimits:
    """A worker's limits; each field is a `moeswarm worker` flag (`max_top_k`: `--max-top-k`,
    `frame_timeout_s`: `--frame-timeout`)."""

    max_connections: int = 256  # open connections; one more is answered ERROR "busy" and closed at once
    queue_limit: int = 64  # DISPATCHes waiting for the compute thread, over all connections
    queue_per_connection: int = 16  # of those, from one connection
    max_buffered_bytes: int = 128 << 20  # request bodies held at once (being read, queued or computing)
    max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES  # one frame's payload
    max_tokens: int = 16384  # T of one DISPATCH
    max_top_k: int = 64  # k of one DISPATCH
    hello_max_bytes: int = 64 << 10  # one frame's body before a successful HELLO
    hello_timeout_s: float = 10.0  # from accept to a successful HELLO
    frame_timeout_s: float = 30.0  # a frame's header and body, once its first byte arrived
    idle_timeout_s: float = 600.0  # a greeted connection with no new frame (or no reply taken) for this long
    max_unsent_bytes: int = DEFAULT_MAX_RESULT_BYTES  # replies of one connection not yet taken by its client: reading pauses beyond
    max_reply_bytes: int = 128 << 20  # replies computing or not yet taken, over all connections: "busy" beyond
    max_connections_per_peer: int = 64  # open connections from one IP address
    evict_after_s: float = 5.0  # at a connection limit, one quiet this long (no HELLO or DISPATCH) makes room

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise MoeSwarmError(f"worker limit {name.replace('_', '-')} must be positive, got {value}")
        if self.max_reply_bytes < self.max_unsent_bytes:
            raise MoeSwarmError(f"worker limit max-reply-bytes ({self.max_reply_bytes}) must be at least "
                                f"max-unsent-bytes ({self.max_unsent_bytes}): one connection's replies must fit")


class ByteBudget:
    """Bytes of request bodies the worker holds at once: taken on the event loop, given back there
    or on the compute thread (when a DISPATCH is done)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> bool:
        """Reserve `size` bytes; False (nothing reserved) when that would go over the limit.

        A small body is always admitted: PINGs and decode steps get through while large
        prefills fill the budget, and small bodies are bounded by connections x SMALL_FRAME_BYTES.
        """
        with self._lock:
            if size > SMALL_FRAME_BYTES and self.held + size > self.limit:
                return False
            self.held += size
            return True

    def give(self, size: int) -> None:
        with self._lock:
            self.held -= size


def declared_shapes(meta: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """{tensor name: the shape a frame's metadata declares for it}, for the well-formed descriptors
    (the first of a name wins; the full descriptor check in `wire.tensors` names any fault)."""
    descriptors = meta.get("tensors")
    found: dict[str, tuple[int, ...]] = {}
    if not isinstance(descriptors, list):
        return found
    for desc in descriptors:
        if (isinstance(desc, list) and len(desc) == 4 and isinstance(desc[0], str) and isinstance(desc[3], list)
                and desc[0] not in found):
            shape = desc[3]
            if all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
                found[desc[0]] = tuple(shape)
    return found


def declared_shape(meta: dict[str, Any], name: str) -> tuple[int, ...] | None:
    """The shape a frame's metadata declares for tensor `name`, if it is well formed (else None)."""
    return declared_shapes(meta).get(name)


def model_top_k(config: Any) -> int | None:
    """The model's router top-k from its config (None when the config does not say)."""
    from moeswarm.sources.summary import TOP_K_KEYS

    for key in TOP_K_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_dispatch_size(meta: dict[str, Any], limits: WorkerLimits,
                        shapes: dict[str, tuple[int, ...]] | None = None, model_top_k: int | None = None) -> None:
    """Refuse a DISPATCH whose declared T or k is over the limits, before any tensor is decoded.
    shapes: `declared_shapes(meta)` when the caller has them already. model_top_k: the model's own
    top-k: no router picks more, so no DISPATCH needs more (it would only amplify the reply)."""
    shapes = declared_shapes(meta) if shapes is None else shapes
    for name in ("x", "ids", "w"):
        shape = shapes.get(name)
        if not shape:
            continue
        tokens = shape[0]
        if tokens > limits.max_tokens:
            raise ProtocolError(f"DISPATCH tensor {name!r} has {tokens} tokens, over the limit of {limits.max_tokens} "
                                "(worker flag --max-tokens)")
        if name != "x" and len(shape) > 1 and model_top_k is not None and shape[1] > model_top_k:
            raise ProtocolError(f"DISPATCH tensor {name!r} has top-k {shape[1]}, over the model's top-k of {model_top_k}")
        if name != "x" and len(shape) > 1 and shape[1] > limits.max_top_k:
            raise ProtocolError(f"DISPATCH tensor {name!r} has top-k {shape[1]}, over the limit of {limits.max_top_k} "
                                "(worker flag --max-top-k)")


def reply_bound(meta: dict[str, Any], hidden: int, num_experts: int,
                shapes: dict[str, tuple[int, ...]] | None = None) -> int:
    """An upper bound on a DISPATCH's RESULT bytes from its declared shapes, before decoding: T x k
    rows in exact mode (every id routed here), T in partial. Integer arithmetic only."""
    shape = (declared_shapes(meta) if shapes is None else shapes).get("ids")
    if shape is None or len(shape) != 2 or shape[0] <= 0 or shape[1] <= 0:
        return 0  # refused when decoded: no reply but an ERROR
    tokens, k = shape
    if meta.get("mode") == "exact":
        return reply_bytes(tokens * k, hidden, meta.get("combine"), min(num_experts, tokens * k))
    return reply_bytes(tokens, hidden, meta.get("combine"), 0)


def check_routing(index: torch.Tensor) -> int:
    """S, the routed (token, expert) pairs of a DISPATCH (at most T x k: no amplification).

    index: [T, k] int64, -1 where the expert lives elsewhere. A row may name an expert twice:
    some families' routers do (DeepSeek-V4's hash-routed layers), and each occurrence is computed
    and weighted on its own, as their eager code does.
    """
    import numpy as np  # here: the flags' defaults come from this module, and parsing them loads no numpy

    return int(np.count_nonzero(index.numpy() >= 0))  # numpy: a few ids, no torch dispatch


def check_reply_size(routed: int, tokens: int, hidden: int, exact: bool, outputs: torch.Tensor) -> None:
    """A RESULT larger than its routing implies is a bug on this side: never send it."""
    bound = (routed if exact else tokens) * hidden
    if outputs.numel() > bound:
        raise RuntimeError(f"RESULT of {outputs.numel()} values is over the {bound} its routing implies")
