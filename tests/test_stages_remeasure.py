"""A gateway's round trips measured again (stages/remeasure.py `due`, stages/find.py's reads).

`due` by hand: which answered stages are measured again at a given time, oldest first, bounded.
The finder's reads with a scripted probe: a stage answered is measured again once its figure is
`remeasure_s` old (here 0: at every later read), its new figure replacing the old; one that fails
its re-measure is left out of the offers and dialled as new at the next read; with `remeasure_s`
math.inf a figure is kept as first measured; a read measures again at most its bound, the oldest
first. (tests/test_stages_reroute.py: a real gateway moving off a stage whose link slowed down.)
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from moeswarm.discovery.stage_record import StageRecord
from moeswarm.stages.remeasure import Measured, due
from moeswarm.stages.route import Offer

FINGERPRINT = "f" * 16
A, B, C = ("a:1", 0, 3), ("b:1", 3, 6), ("c:1", 0, 6)


def test_due_is_the_figures_at_least_the_period_old_oldest_first_and_bounded():
    measured = {A: Measured(5.0, at=100.0), B: Measured(7.0, at=90.0), C: Measured(1.0, at=130.0)}
    assert due(measured, [A, B, C], now=130.0, period_s=30.0) == [B, A]  # C is 0 s old
    assert due(measured, [A, B, C], now=129.9, period_s=30.0) == [B]  # A is 29.9 s old
    assert due(measured, [A, B, C], now=160.0, period_s=30.0, most=2) == [B, A]
    assert due(measured, [A, B, C], now=160.0, period_s=30.0, most=0) == []
    assert due(measured, [C, A], now=1e9, period_s=30.0) == [A, C]  # B not offered: not due
    assert due(measured, [("d:1", 0, 6), A, A], now=1e9, period_s=30.0) == [A]  # not measured: dialled as new
    assert due(measured, [A, B, C], now=1e9, period_s=math.inf) == []
    tied = {A: Measured(5.0, at=1.0), B: Measured(7.0, at=1.0)}
    assert due(tied, [B, A], now=2.0, period_s=0.0) == [B, A]  # ties in the offered order


def _finder(monkeypatch, outcomes: dict[str, list], remeasure_s: float):
    """A finder over a 6-layer model whose probe answers each address's `outcomes` in turn (the list is consumed)."""
    from moeswarm.stages.find import StageSearch, _StageFinder

    monkeypatch.setattr(_StageFinder, "_probe", lambda self, record: outcomes[record.address].pop(0))
    config = SimpleNamespace(num_hidden_layers=6, hidden_size=16)
    source = SimpleNamespace(fingerprint=FINGERPRINT, config=SimpleNamespace(model_type="qwen2_moe",
                                                                             get_text_config=lambda: config))
    return _StageFinder(None, StageSearch(("peer",), remeasure_s=remeasure_s), source, None)


def _records() -> list[StageRecord]:
    return [StageRecord(address, FINGERPRINT, "qwen2_moe", range(start, stop), 16, tls=False)
            for address, start, stop in (A, B)]


def test_each_read_measures_the_answered_stages_again_and_drops_one_that_no_longer_answers(monkeypatch):
    outcomes = {"a:1": [5.0, 50.0, 4.0], "b:1": [7.0, "cannot be reached: refused", 8.0]}
    finder = _finder(monkeypatch, outcomes, remeasure_s=0.0)
    records = _records()
    assert finder._offers(records) == [Offer("a:1", range(0, 3), 5.0), Offer("b:1", range(3, 6), 7.0)]
    # a's link slowed down; b no longer answers: left out, and no longer answered
    assert finder._offers(records) == [Offer("a:1", range(0, 3), 50.0)]
    assert set(finder.answered) == {A}
    assert finder._offers(records) == [Offer("a:1", range(0, 3), 4.0), Offer("b:1", range(3, 6), 8.0)]
    assert outcomes == {"a:1": [], "b:1": []}  # each stage dialled once per read, no more


def test_with_remeasure_s_infinite_a_figure_is_kept_as_first_measured(monkeypatch):
    outcomes = {"a:1": [5.0], "b:1": [7.0]}
    finder = _finder(monkeypatch, outcomes, remeasure_s=math.inf)
    records = _records()
    for _ in range(3):
        assert finder._offers(records) == [Offer("a:1", range(0, 3), 5.0), Offer("b:1", range(3, 6), 7.0)]
    assert outcomes == {"a:1": [], "b:1": []}


def test_a_read_measures_again_at_most_its_bound_the_oldest_first(monkeypatch):
    import moeswarm.stages.find as find

    monkeypatch.setattr(find, "REMEASURED_PER_READ", 1)
    outcomes = {"a:1": [5.0, 6.0], "b:1": [7.0, 9.0]}
    finder = _finder(monkeypatch, outcomes, remeasure_s=0.0)
    records = _records()
    finder._offers(records)  # a's figure recorded first: the older one
    assert finder._offers(records) == [Offer("a:1", range(0, 3), 6.0), Offer("b:1", range(3, 6), 7.0)]
    assert finder._offers(records) == [Offer("a:1", range(0, 3), 6.0), Offer("b:1", range(3, 6), 9.0)]
    assert outcomes == {"a:1": [], "b:1": []}
