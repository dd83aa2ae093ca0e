"""`moeswarm bench swarm` at its smallest, end to end with real processes: an invite of the bundled
model, 2 joiners (each holding every expert: R = 2), one random joiner killed and started again while
the stream decodes. About a minute on a quiet 2-core machine (two joins at ~5 s each, one rejoin,
the stream's backbone); more where the cores are shared."""

from __future__ import annotations

import json
import subprocess
import sys

from moeswarm_bench.bench.swarm_procs import environment
from moeswarm_bench.bench.swarm_report import write_report


def test_two_joiners_one_kill_meet_the_targets(tmp_path):
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "bench", "swarm", "--joiners", "2", "--kills", "1",
                           "--json", "--quiet"], capture_output=True, text=True, timeout=600, env=environment())
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    (run,) = result["runs"]
    assert run["joiners"] == 2 and run["experts_each"] == 32
    for join in run["joins"]:
        assert not join["reused"] and join["experts"] == 32
        assert join["fetched_over_share"] <= 1.1  # manifest + header + samples: 1.094x of a whole share's bytes
        assert 0 < join["share_s"] <= join["fetched_s"] <= join["announced_s"]
    (kill,) = run["kills"]
    assert kill["alive_fewest_after_kill"] == 1  # the other joiner holds every expert
    assert kill["after_kill"]["fewest"] == 1 and kill["after_kill"]["members"] == 1  # the record expired
    assert kill["restored"] and kill["after_rejoin"]["fewest"] == 2
    assert kill["rejoin"]["reused"] and kill["rejoin"]["slice_bytes"] == 0  # the same share: its slice kept in --dir
    stream = run["stream"]
    assert stream["segments"] >= 1 and stream["segments_equal"] == stream["segments"]
    assert stream["failures_while_covered"] == 0 and stream["failures"] == []
    assert stream["windows"]["churn"]["tokens"] > 0  # it ran through the kill and the rejoin
    assert stream["resilience"].get("takedowns", 0) >= 1  # the killed holder was taken out of use mid-stream
    assert all(t["met"] for t in result["targets"]), result["targets"]

    page = write_report(result, tmp_path)  # the page and its rows from the result
    text = page.read_text()
    assert "moeswarm bench swarm --model bundled --joiners 2 --kills 1" in text
    assert result["host"]["cpu"] in text and "load average" in text
    kill_row = f"| 2 | 1 | {kill['joiner']} | "  # the kills table: one row per kill, its joiner named
    assert sum(line.startswith(kill_row) for line in text.splitlines()) == 1
    assert json.loads((tmp_path / "bench" / "swarm.json").read_text())["results"][0]["runs"][0]["joiners"] == 2


def test_the_subcommand_takes_its_flags():
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "bench", "swarm", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    for flag in ("--joiners", "--kills", "--model", "--replicas", "--rejoin", "--keyed", "--report", "--json"):
        assert flag in done.stdout
