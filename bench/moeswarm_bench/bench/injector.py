"""Faults at a chosen layer call: a watcher on every link of a swarm runs an action before the
call's first request leaves (the benchmarks' and tests' kill, stall or reset "in the middle of a
generation"). Layer calls are counted by the swarm's own numbering, so the injector sees every
forward the engine makes, whatever stands between the model and the dispatcher.
"""

from __future__ import annotations


class Injector:
    """Runs the armed fault before the armed layer call's first request leaves. It watches every
    link of the swarm (`open_swarm(..., wrap_link=injector.watch)`, then `injector.swarm = swarm`)
    and counts layer calls by the swarm's own numbering."""

    def __init__(self):
        self.swarm = None
        self.armed: tuple[int, object] | None = None  # (the swarm's layer call number, the action)

    def watch(self, index: int, link) -> _Watched:
        return _Watched(link, self)

    def arm(self, at_call: int, action) -> None:
        """Run `action` before the `at_call`-th layer call from now (1: the next)."""
        self.armed = (self.swarm.layer_call_number() + at_call, action)

    def before_request(self) -> None:
        if self.armed and self.swarm.layer_call_number() >= self.armed[0]:
            action, self.armed = self.armed[1], None
            action()


class _Watched:
    """A link whose requests tell the injector before they leave."""

    def __init__(self, inner, injector: Injector):
        self.inner, self.injector = inner, injector

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def broken(self) -> bool:
        return self.inner.broken

    def send(self, prepared):
        self.injector.before_request()
        return self.inner.send(prepared)
