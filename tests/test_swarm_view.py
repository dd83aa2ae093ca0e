"""`moeswarm status`'s view (discovery/swarm_view.py): members, shares and coverage from announcements."""

from __future__ import annotations

from types import SimpleNamespace

from moeswarm.discovery.swarm_view import format_view, path_of, share_text, swarm_view


def _record(held, throughput=10.0, tls=False, load=None, version=None, started=None):
    return SimpleNamespace(held=held, throughput=throughput, tls=tls, load=load, version=version, started=started)


def test_the_view_marks_the_weakest_layers_and_the_uncovered_experts():
    records = {"127.0.0.1:2": _record({0: (0, 1), 1: (0, 1)}),
               "127.0.0.1:1+relay://r:7/n": _record({0: (2, 3), 1: (2,)}, tls=True, load={0: (40, 2), 1: (7,)},
                                                    version="0.1.0", started=1000.0)}
    members, layers = swarm_view(records, [0, 1], 4, now=1000.0 + 3 * 3600 + 25 * 60,
                                 rtts={"127.0.0.1:1+relay://r:7/n": 0.4567, "127.0.0.1:2": "cannot connect: refused"})
    assert [m.address for m in members] == ["127.0.0.1:1+relay://r:7/n", "127.0.0.1:2"]
    assert members[0].path == "direct+relay" and members[0].share == "layer 0: 2-3; layer 1: 2"
    assert members[1].share == "experts 0-1 of layers 0-1"
    assert members[0].load == 49 and members[1].load is None  # rows per minute, all its experts; none announced
    assert [(r.layer, r.fewest, r.weakest, r.weakest_layer) for r in layers] == [
        (0, 1, (0, 1, 2, 3), False), (1, 0, (3,), True)]
    assert (members[0].version, members[0].uptime_s, members[1].version, members[1].uptime_s) == (
        "0.1.0", 3 * 3600 + 25 * 60, None, None)
    text = format_view("fp", members, layers, [("127.0.0.1:9", range(0, 2))], [("127.0.0.1:5", (0, 1, 3))],
                       joining=[("127.0.0.1:8", "experts 3")])
    assert "  joining 127.0.0.1:8: experts 3 (fetching, not serving yet)\n" in text
    assert "  seed 127.0.0.1:5: the pieces of experts 0-1,3\n" in text
    assert "layer   1: UNCOVERED   experts 3  <- weakest" in text
    assert ("  127.0.0.1:1+relay://r:7/n  direct+relay  yes  0.1.0         3h25m     0.46         10         49  "
            "layer 0: 2-3; layer 1: 2\n") in text
    assert ("  127.0.0.1:2                direct        no   -                 -     down         10          -  "
            "experts 0-1 of layers 0-1\n") in text
    assert "  127.0.0.1:2: cannot connect: refused\n" in text
    assert "stage 127.0.0.1:9: decoder layers 0-1" in text and "layer   0: 1 holder    experts 0-3\n" in text + "\n"


def test_paths_and_shares_read_from_the_announced_forms():
    assert [path_of(a) for a in ("h:1", "relay://r:7/n", "h:1+relay://r:7/n")] == ["direct", "relay", "direct+relay"]
    assert share_text({3: (5,), 4: (5,)}) == "experts 5 of layers 3-4"
