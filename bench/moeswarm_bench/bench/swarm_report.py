"""docs/bench-swarm.md and docs/bench/swarm.json from `moeswarm bench swarm` results.

docs/bench/swarm.json keeps one result per command (`{"results": [...]}`): a report replaces the
result of the same command and keeps the others (the bundled model's, the OLMoE-shaped file's, a
run with --check-local...), and the page shows every result kept, each under its own command,
host and date.

    python -m moeswarm_bench.bench.swarm_report      # re-render the page from docs/bench/swarm.json
"""

from __future__ import annotations

import json
from pathlib import Path

from moeswarm.bundled import REPO
from moeswarm_bench.bench.markdown import markdown_table as table, write_page

DOCS = REPO / "docs"


def write_report(result: dict, docs: Path = DOCS) -> Path:
    """Merge `result` into docs/bench/swarm.json (replacing the same command's) and write the page."""
    (docs / "bench").mkdir(parents=True, exist_ok=True)
    store = docs / "bench" / "swarm.json"
    results = json.loads(store.read_text()).get("results", []) if store.is_file() else []
    results = [r for r in results if r["command"] != result["command"]] + [result]
    store.write_text(json.dumps({"results": results}, indent=1) + "\n")
    return render(results, docs)


def render(results: list[dict], docs: Path = DOCS) -> Path:
    sections = "\n\n".join(section(result) for result in results)
    text = f"""# A swarm from an invite, under churn (`moeswarm bench swarm`)

Issue 59's benchmark of `moeswarm invite` / `moeswarm join` (docs/network.md, Invites and join,
Rebalancing), with real processes on loopback. For each N, a fresh swarm:

- `moeswarm invite --model M` (a DHT node and the model's seeders), then N `moeswarm join INVITE`
  one after another, each with `--memory` for ceil(R x experts / N) experts (R = 2 by default:
  every expert held twice once all have joined, so any one member may leave without uncovering an
  expert), and a short `--rebalance` period and `--announce-ttl` (each section says). Each joiner chooses its share from the announcements
  made before it, fetches exactly that slice from the inviter's seeder and serves it.
- **time to serving**: from starting the process to its announcement on the DHT (its worker
  listening, its share loaded); its share chosen and its slice fetched on the way.
- **bytes**: every byte a joiner fetched, the manifest (the invite pins its hash) and the slice
  (the file's header, the fingerprint's samples and the share's expert blocks), against its
  share's bytes (its experts' blocks over every MoE layer). The manifest, header and samples are
  the same whatever the share ("slice beyond the share" is the header and samples), so a small
  model's small shares feel them and a real-size model's do not.
- **the stream**: a backbone in the bench's process that finds the workers on the swarm (as
  `generate --swarm INVITE`) and follows joins and leaves, decoding greedily without pause: the
  same prompt again and again in segments (the model's positions bound a sequence), each
  segment's tokens compared with the same segment decoded beforehand with every expert in one
  process. Its tokens/s before the first kill, from the first kill to the last rejoin's coverage
  back, and after.
- **churn**: K times a random joiner is killed (SIGKILL: no withdrawal, its record expires after
  the TTL); once its record is gone from the DHT, it is started again with the same `--dir` (a
  rejoin; `--rejoin now` starts it at once instead, as a supervisor would: with a TTL longer than
  its start, it chooses its share around its own stale record, and rebalancing repairs that). Coverage is read from the DHT as `moeswarm
  status INVITE` reads it ("fewest": holders of the least-held layer-expert pair), and worked out
  from what is alive ("alive": the shares of the members serving at that moment, from their own
  lines). A failed layer call (a segment that raised: no usable holder) is counted against the
  target only when every expert had a live holder through the 4 s before it (two of the
  backbone's DHT polls: a holder that started serving within them may not be in its pool yet;
  sections measured before 2026-12-07 03:45 UTC counted a live holder at that moment alone).
- Rebalancing moves: `moved: experts ...` lines of every joiner, over the whole run.

{sections}
"""
    return write_page(docs / "bench-swarm.md", text)


def section(result: dict) -> str:
    host, model, load, settings = result["host"], result["model"], result["host"]["load_1min"], result["settings"]
    joins, kills, streams, targets = [], [], [], []
    for run in result["runs"]:
        n = run["joiners"]
        for j in run["joins"]:
            joins.append([n, j["joiner"], j["experts"], j["share_s"], j["fetched_s"], j["announced_s"], j["share_bytes"],
                          j["manifest_bytes"], j["slice_bytes"], j["slice_bytes"] - j["share_bytes"],
                          f"{j['fetched_over_share']:.3f}"])
        for e in run["kills"]:
            r = e["rejoin"]
            kills.append([n, e["kill"], e["joiner"], e["dropped_s"], e["after_kill"]["fewest"], e["alive_fewest_after_kill"],
                          r["announced_s"], "reused" if r["reused"] else r["slice_bytes"], e["restored_s"],
                          e["after_rejoin"]["fewest"], e["first_use_after_announce_s"], e["moves"], e["tokens_per_s"],
                          e["longest_pause_s"]])
        s, w = run["stream"], run["stream"]["windows"]
        res = s["resilience"]
        streams.append([n, f"{s['segments_equal']}/{s['segments']}", s["tokens"], _rate(w.get("before")),
                        _rate(w.get("churn")), _rate(w.get("after")), _pause(w.get("churn")),
                        f"{len(s['failures'])} ({s['failures_while_covered']})", res.get("takedowns", 0),
                        res.get("failovers", 0), res.get("hedges", 0), run["moves"], run["move_fetched_bytes"],
                        f"{run['load']['before']:.1f} / {run['load']['after']:.1f}"])
        targets += [[n, t["target"], t["measured"], t["met"]] for t in run["targets"]]
    check = ("their tokens compared with the local run's" if not settings.get("check_local")
             else "their tokens compared with the local run's, and every forward's logits with the local eager "
                  "model's (torch.equal)")
    segment = result["runs"][0]["stream"]["segment_tokens"] if result["runs"] else "-"
    variant = [f"N = {', '.join(str(r['joiners']) for r in result['runs'])}",
               "rejoin once the record expired" if settings["rejoin"] == "expiry" else "rejoin at once",
               f"TTL {settings['ttl_s']:g} s"]
    variant += ["keyed (TLS, signed records)"] * bool(settings.get("keyed"))
    variant += ["logits checked live"] * bool(settings.get("check_local"))
    kill_words = f"{settings['kills']} kill{'s' if settings['kills'] != 1 else ''}"
    return f"""## {model['name']}: {', '.join(variant)}

```
{result['command']} --report
```

- model: {model['experts']} experts x {model['moe_layers']} MoE layers, {model['expert_bytes']:,} bytes per expert over its
  MoE layers, file {model['file_bytes']:,} bytes;
- host: {host['cpu']}, {host['cpu_count']} CPUs ({host['machine']}), kernels {host['kernels']}, Python
  {host['python']}, {host['date']}; 1-minute load average during the run {load['min']:.1f} to {load['max']:.1f}
  (mean {load['mean']:.1f}, {load['samples']} samples): the machine is shared with other jobs, so every
  second here includes waiting for a core;
- R = {settings['replicas']}, `--rebalance {settings['rebalance_s']:g}`, `--announce-ttl {settings['ttl_s']:g}`, {kill_words} per N, the
  killed joiner started again {'once its record expired' if settings['rejoin'] == 'expiry' else 'at once'}; {'a keyed swarm (a member file each: TLS on every link, signed records); ' if settings.get('keyed') else 'an unkeyed swarm; '}the
  stream's segments {segment} tokens long, {check}.

Rows: [bench/swarm.json](bench/swarm.json).

Joins (seconds from the process's start):

{table(["N", "joiner", "experts", "share chosen s", "slice fetched s", "serving s", "share bytes", "manifest bytes", "slice bytes", "slice beyond the share", "fetched / share"], joins)}

Kills and rejoins ("fewest": holders of the least-held pair as the DHT announces it once the killed
record is gone; "alive": as the live members hold it; "serving s": the rejoin's, from its start;
"coverage back s": from the kill until the DHT shows every pair held as often as before it; "first
call s": from the rejoin's announcement to the stream's first layer call it answered; tokens/s and
the longest pause: the stream's, from the kill to the coverage back):

{table(["N", "kill", "joiner", "record gone s", "fewest", "alive", "serving s", "slice", "coverage back s", "fewest after", "first call s", "moves", "stream tokens/s", "longest pause s"], kills)}

The stream (tokens/s before the first kill, during the churn, after it; failed segments, in
parentheses those while every expert had a live holder; the dispatcher's takedowns, failovers
and hedges; rebalancing moves and the bytes they fetched; load average before / after the N):

{table(["N", "segments equal", "tokens", "tokens/s before", "during churn", "after", "longest pause s", "failed (covered)", "takedowns", "failovers", "hedges", "moves", "move bytes", "load"], streams)}

Issue 59's targets:

{table(["N", "target", "measured", "met"], targets)}"""


def _rate(window: dict | None):
    return None if window is None or window["tokens_per_s"] is None else round(window["tokens_per_s"], 1)


def _pause(window: dict | None):
    return None if window is None else round(window["longest_pause_s"], 2)


if __name__ == "__main__":
    render(json.loads((DOCS / "bench" / "swarm.json").read_text())["results"])
