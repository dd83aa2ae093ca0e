"""`moeswarm bench swarm`: a swarm made from an invite, on loopback, under churn (issue 59).

For each N of `--joiners` (2, 4, 8), on a fresh swarm of the model (swarm_run.py):

1. `moeswarm invite --model M` starts the swarm (DHT node, seeders); N `moeswarm join INVITE`
   processes follow one after another, each with `--memory` for ceil(R x E / N) experts (R =
   `--replicas`, 2: every expert held twice once all have joined, so one member can leave without
   uncovering any), `--rebalance` and `--announce-ttl` short. Per joiner (swarm_joins.py): seconds
   from start to its share chosen, its slice fetched, its announcement (serving), and every byte it
   fetched (the manifest and the slice) against its share's bytes (its experts' bytes in the file).
2. A stream: a backbone in this process finds the workers on the swarm (as `generate --swarm
   INVITE`) and decodes greedily without pause (swarm_stream.py), each segment's tokens compared with
   the local run's (swarm_model.py's reference; and, with `--check-local`, every forward's logits
   with the local eager model's); its figures by window in swarm_windows.py.
3. K times: a random joiner is killed and started again in the same --dir (swarm_churn.py).

Coverage is read from the DHT as `moeswarm status INVITE` reads it (the announcements), and also
worked out from what is alive (swarm_coverage.py). Issue 59's targets are checked per N
(swarm_targets.py); the page and its rows are swarm_report.py's, the printed lines swarm_lines.py's.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from moeswarm_bench.bench.swarm_host import LoadSampler, host_facts
from moeswarm_bench.bench.swarm_model import make_reference, model_facts, model_path
from moeswarm_bench.bench.swarm_run import run_joiners
from moeswarm_bench.bench.swarm_settings import Settings, command_line


def run_swarm_bench(model: str = "bundled", settings: Settings = Settings(), report: bool = False,
                    say=lambda line: None) -> dict:
    """The whole benchmark (see the module's docstring); docs/bench-swarm.md written with `report`."""
    work = Path(tempfile.mkdtemp(prefix="moeswarm-bench-swarm-"))
    kept = False
    try:
        path, label = model_path(model, work)
        with LoadSampler() as load:
            reference = make_reference(path, settings, say)
            runs = []
            for count in settings.joiners:
                say(f"{count} joiners: starting")
                runs.append(run_joiners(path, count, settings, reference, work / f"n{count}", say))
        result = {"command": command_line(model, settings), "model": {**model_facts(path), "name": label},
                  "host": host_facts(load), "settings": asdict(settings), "runs": runs}
        result["targets"] = [t for run in runs for t in run["targets"]]
    except BaseException:
        kept = True
        say(f"the run's logs are kept in {work}")
        raise
    finally:
        if not kept:
            shutil.rmtree(work, ignore_errors=True)
    if report:
        from moeswarm_bench.bench.swarm_report import write_report

        write_report(result)
    return result
