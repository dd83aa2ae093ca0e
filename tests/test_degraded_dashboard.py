"""A degraded holder (missed a deadline, or keeps losing hedges) is shown so on the dashboard; a
stalled one that is down is not shown "up"."""

from __future__ import annotations

import time
from types import SimpleNamespace

from test_dispatcher import _dispatcher

from moeswarm.placement.profile import RoutingStats
from moeswarm.serve.dashboard import dashboard_data
from moeswarm.engine.speculation import Speculation
from moeswarm.swarm import Swarm


def _state(swarm: Swarm) -> SimpleNamespace:
    stats = SimpleNamespace(workers=lambda: {}, num_experts=8, heat=lambda layers, counts: [], recent=lambda: [], totals={})
    engine = SimpleNamespace(swarm=swarm, stats=stats, problems=[], active=0, queue_depth=0,
                             speculation=Speculation(0, False))
    return SimpleNamespace(engine=engine, model_id="m", history=SimpleNamespace(series=lambda: []))


def test_the_dashboard_shows_degraded_and_down_holders():
    dispatcher, _ = _dispatcher()
    dispatcher.routing = RoutingStats(8)
    swarm = Swarm(None, None, dispatcher, [0, 1])
    assert [w["state"] for w in dashboard_data(_state(swarm))["workers"]] == ["up", "up"]
    dispatcher.holders[0].stalled(time.monotonic())  # a deadline missed: degraded ...
    assert [w["state"] for w in dashboard_data(_state(swarm))["workers"]] == ["degraded", "up"]
    dispatcher.holders[1].fail(time.monotonic(), "no reply within its deadline")  # ... a stalled holder: down
    assert [w["state"] for w in dashboard_data(_state(swarm))["workers"]] == ["degraded", "down"]
