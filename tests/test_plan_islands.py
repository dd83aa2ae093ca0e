"""`moeswarm plan --machines`: islands from RTTs and the per-token estimates (placement/islands.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from moeswarm.placement.islands import Machine, plan_islands


def _two_cities(wan_ms: float = 50.0):
    machines = [Machine("g", 0.1, 5.0)] + [Machine(n, 0.45, 5.0) for n in ("a1", "a2", "b1", "b2")]
    names = [m.name for m in machines]
    rtts = {frozenset((x, y)): (0.4 if x[0] == y[0] else wan_ms) for i, x in enumerate(names) for y in names[i + 1:]}
    return machines, rtts


def test_machines_near_each_other_form_islands_with_contiguous_spans():
    machines, rtts = _two_cities()
    estimate = plan_islands(machines, rtts, "g", 16)
    assert [i.members for i in estimate.islands] == [("g",), ("a1", "a2"), ("b1", "b2")]
    assert [i.layers for i in estimate.islands] == [range(0, 1), range(1, 9), range(9, 16)]  # rooms 0.1 : 0.9 : 0.9
    # star: 16 layers x (50 ms to the farthest + 5 ms); islands: hops of 25 ms + 16 x 5 ms + LAN trips
    assert estimate.star_ms == 16 * 55
    assert estimate.islands_ms == 3 * 25 + 16 * 5 + 15 * 0.4  # the first island is on the gateway: 3 WAN hops
    assert estimate.islands_ms < 0.25 * estimate.star_ms


def test_plan_command_prints_stage_commands_and_refuses_a_bad_file(tmp_path):
    machines, rtts = _two_cities()
    path = tmp_path / "machines.json"
    path.write_text(json.dumps({"gateway": "g", "machines": [m.__dict__ for m in machines],
                                "rtt_ms": {" ".join(sorted(pair)): ms for pair, ms in rtts.items()}}))
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--machines", str(path), "--layers", "16",
                           "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert [i["layers"] for i in result["islands"]] == [[0, 0], [1, 8], [9, 15]]
    assert result["ms_per_token"]["star"] == 880
    path.write_text(json.dumps({"gateway": "g", "machines": [m.__dict__ for m in machines], "rtt_ms": {}}))
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "plan", "--machines", str(path), "--layers", "16"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no RTT for g a1" in done.stderr and "Traceback" not in done.stderr
