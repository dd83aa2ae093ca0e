"""`moeswarm bench swarm`: a swarm made from an invite, on loopback, under churn (issue 59).

For each N of `--joiners` (2, 4, 8), on a fresh swarm of the model:

1. `moeswarm invite --model M` starts the swarm (DHT node, seeders); N `moeswarm join INVITE`
   processes follow one after another, each with `--memory` for ceil(R x E / N) experts (R =
   `--replicas`, 2: every expert held twice once all have joined, so one member can leave without
   uncovering any), `--rebalance` and `--announce-ttl` short. Per joiner: seconds from start to
   its share chosen, its slice fetched, its announcement (serving), and every byte it fetched (the
   manifest and the slice) against its share's bytes (its experts' bytes in the file).
2. A stream: a backbone in this process finds the workers on the swarm (as `generate --swarm
   INVITE`) and decodes greedily without pause (swarm_stream.py), each segment's tokens compared with
   the local run's (and, with `--check-local`, every forward's logits with the local eager model's).
3. K times: a random joiner is killed (SIGKILL: no withdrawal; its record expires after the TTL),
   then started again in the same --dir: after its record expired (`--rejoin expiry`, default: the
   rejoiner sees the hole it left) or at once (`--rejoin now`: as a supervisor restarts a process;
   with a TTL longer than a start takes, `--ttl 30` as join's default, it sees its own stale record
   and chooses around it, and rebalancing repairs what that unbalances). Recorded: the coverage the DHT shows once the killed record is gone, the rejoin's
   figures, the seconds until the coverage is back to what it was before the kill, the seconds
   until the stream's first layer call answered by the rejoiner, the stream's tokens/s and longest
   pause over the event, and rebalancing moves.

Coverage is read from the DHT as `moeswarm status INVITE` reads it (the announcements), and also
worked out from what is alive: the shares of the members serving at each moment (from their own
lines), which is what decides whether a failed layer call had a holder it could have used.

Targets (issue 59): each joiner fetches at most 1.1x its share's bytes; no layer call fails for
lack of a holder while at least one holder of every expert is alive; the running stream's tokens
stay bit-identical through every join and leave.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import random
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from moeswarm.errors import MoeSwarmError
from moeswarm_bench.bench.swarm_procs import Joiner, Process, fetches_of, make_keys, start_inviter
from moeswarm_bench.bench.swarm_stream import Stream, segment_tokens, stream_prompt

JOINERS = (2, 4, 8)
KILLS = 3
REPLICAS = 2
TTL_S = 5.0  # a killed member's record lasts at most this long
REBALANCE_S = 2.0  # seconds between a member's rebalancing rounds
SEGMENT_TOKENS = 128
STEADY_TOKENS = 48  # the stream's tokens before the first kill and after the last rejoin
PAUSE_TOKENS = 16  # between one event's end and the next kill
SETTLE_S = 120.0  # the most a kill's coverage is waited for to come back
FETCH_TARGET = 1.1


@dataclass(frozen=True)
class Settings:
    joiners: tuple[int, ...] = JOINERS
    kills: int = KILLS
    replicas: int = REPLICAS
    seed: int = 0
    ttl_s: float = TTL_S
    rebalance_s: float = REBALANCE_S
    segment_tokens: int = SEGMENT_TOKENS
    rejoin: str = "expiry"  # or "now"
    keyed: bool = False
    check_local: bool = False


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


def command_line(model: str, settings: Settings) -> str:
    parts = [f"moeswarm bench swarm --model {model} --joiners {','.join(map(str, settings.joiners))}",
             f"--kills {settings.kills}", f"--replicas {settings.replicas}", f"--seed {settings.seed}"]
    if settings.rejoin != "expiry":
        parts.append(f"--rejoin {settings.rejoin}")
    if settings.ttl_s != TTL_S:
        parts.append(f"--ttl {settings.ttl_s:g}")
    if settings.rebalance_s != REBALANCE_S:
        parts.append(f"--rebalance {settings.rebalance_s:g}")
    if settings.segment_tokens != SEGMENT_TOKENS:
        parts.append(f"--segment-tokens {settings.segment_tokens}")
    parts += ["--keyed"] * settings.keyed + ["--check-local"] * settings.check_local
    return " ".join(parts)


def model_path(model: str, work: Path) -> tuple[Path, str]:
    """(the GGUF file the swarm serves, its name in the report). The bundled model is copied into
    `work` (the invite writes its manifest beside the file)."""
    if model == "bundled":
        from moeswarm.bundled import PYMOE

        source = PYMOE / "gguf" / "pymoe-Q4_K_M.gguf"
        if not source.is_file():
            raise MoeSwarmError(f"the bundled model's GGUF file is missing ({source})")
        copy = work / source.name
        shutil.copy(source, copy)
        return copy, "bundled pymoe-Q4_K_M.gguf"
    if model == "olmoe":
        from moeswarm_bench.bench.real_build import DEFAULT_CACHE, model_file
        from moeswarm_bench.bench.real_shapes import SHAPES

        return model_file(SHAPES["olmoe"], DEFAULT_CACHE), "OLMoE-1B-7B-shaped Q4_K_M (random weights, `bench real`'s file)"
    path = Path(model)
    if not path.is_file() or path.suffix.lower() != ".gguf":
        raise MoeSwarmError(f"--model {model}: give bundled, olmoe or a GGUF file (an invite seeds a GGUF file)")
    return path, path.name


def model_facts(path: Path) -> dict:
    manifest = manifest_of(path)
    return {"path": str(path), "file_bytes": path.stat().st_size, "experts": len(manifest.data["expert_ids"]),
            "moe_layers": len(manifest.moe_layers()), "expert_bytes": manifest.expert_bytes()}


def manifest_of(path: Path):
    from moeswarm.slices.manifest import load_manifest

    return load_manifest(Path(f"{path}.manifest.json"))


@dataclass(frozen=True)
class Reference:
    prompt: list[int]
    tokens: list[int]
    model: object | None  # the local eager model, with --check-local


def make_reference(path: Path, settings: Settings, say) -> Reference:
    """The stream's segment decoded with every expert in this process: what every segment must equal."""
    from moeswarm.engine.generate import generate
    from moeswarm.sources.source import open_source
    from moeswarm.swarm import open_swarm

    source = open_source(str(path))
    prompt = stream_prompt(source.config.vocab_size)
    tokens = segment_tokens(getattr(source.config, "max_position_embeddings", None), len(prompt), settings.segment_tokens)
    say(f"reference: {tokens} tokens decoded locally")
    with open_swarm(source, []) as local:
        reference = generate(local, prompt, tokens)
    eager = None
    if settings.check_local:
        from moeswarm.sources.loading import load_local

        eager = load_local(source)
    return Reference(prompt, list(reference.tokens), eager)


def experts_each(count: int, num_experts: int, replicas: int) -> int:
    return min(num_experts, math.ceil(replicas * num_experts / count))


def run_joiners(path: Path, count: int, settings: Settings, reference: Reference, directory: Path, say) -> dict:
    """One N: the swarm, its joins, the stream through K kills and rejoins; every process stopped after."""
    from moeswarm.discovery.invite import parse_invite

    directory.mkdir(parents=True)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    names = [f"j{i + 1}" for i in range(count)]
    keys = make_keys(directory, ["inviter", "stream", *names]) if settings.keyed else {}
    processes: list[Process] = []
    joiners: list[Joiner] = []
    dht = swarm = stream = None
    try:
        inviter, text = start_inviter(path, directory, keys.get("inviter"))
        processes.append(inviter)
        invite = parse_invite(text)
        manifest = manifest_of(path)
        num_experts, layers = len(manifest.data["expert_ids"]), manifest.moe_layers()
        each = experts_each(count, num_experts, settings.replicas)
        memory_gb = (each + 0.5) * manifest.expert_bytes() / 1e9
        flags = ["--rebalance", f"{settings.rebalance_s:g}", "--announce-ttl", f"{settings.ttl_s:g}"]
        joins = []
        for name in names:  # one after another: each chooses its share from those announced before it
            joiner = Joiner(name, text, directory / name, memory_gb, flags, keys.get(name))
            joiners.append(joiner)
            joiner.start()
            figures = joiner.serving()
            joins.append(join_row(joiner, figures, invite.manifest_bytes, manifest.expert_bytes()))
            say(f"  {name} serves experts {len(figures.share)} of {num_experts}, "
                f"{figures.announced_at - figures.started:.1f} s after it started")
        dht = open_dht(invite, keys.get("stream"))
        view = Coverage(dht, invite.model, layers, num_experts)
        initial = view.wait(lambda c: {j.address_now() for j in joiners} <= c.members, 60.0)
        swarm = open_stream_swarm(path, invite, keys.get("stream"))
        stream = Stream(swarm, reference.prompt, reference.tokens, reference.model)
        stream.start()
        stream.wait_tokens(STEADY_TOKENS)
        events, spans = churn(joiners, view, stream, initial, settings, random.Random(settings.seed * 1000 + count),
                              manifest.expert_bytes(), say)
        stream.wait_tokens(STEADY_TOKENS)
        figures = stream.stop()
        resilience = swarm.resilience()
        moves = [(joiner.name, move) for joiner in joiners for move in joiner.moves()]
    finally:
        if stream is not None:
            stream.abort()
        if swarm is not None:
            swarm.close()
        if dht is not None:
            dht.close()
        stopping = [joiner.life for joiner in joiners] + processes
        for process in stopping:  # all at once: each withdraws its record, which takes a DHT store
            process.terminate()
        for process in stopping:
            process.stop()
    move_bytes = sum(f.fetched_bytes for joiner in joiners for life in joiner.lives for f in fetches_of(life)[1:])
    run = {"joiners": count, "experts_each": each, "memory_gb": memory_gb, "joins": joins,
           "initial": initial.to_json(), "kills": events,
           "stream": stream_row(figures, spans, joiners, num_experts, reference, resilience),
           "moves": len(moves), "moves_by": [{"joiner": name, "share": list(m.share)} for name, m in moves],
           "move_fetched_bytes": move_bytes, "seconds": time.monotonic() - started,
           "load": {"before": load_before, "after": os.getloadavg()[0]}}
    run["targets"] = targets(run)
    shutil.rmtree(directory, ignore_errors=True)  # the slices: a real-size model's are gigabytes
    return run


def join_row(joiner: Joiner, figures, manifest_bytes: int | None, expert_bytes: int) -> dict:
    """A join's (or rejoin's) figures: its seconds, and its bytes against its share's."""
    share_bytes = len(figures.share) * expert_bytes
    fetched = figures.fetch.fetched_bytes + (manifest_bytes or 0)
    return {"joiner": joiner.name, "start": len(joiner.lives), **figures.seconds(), "experts": len(figures.share),
            "share": list(figures.share), "share_bytes": share_bytes, "manifest_bytes": manifest_bytes or 0,
            "slice_bytes": figures.fetch.fetched_bytes, "reused": figures.fetch.reused, "fetched_bytes": fetched,
            "fetched_over_share": fetched / share_bytes if share_bytes else None}


def open_dht(invite, key: Path | None):
    from moeswarm.discovery.dht import SwarmDht

    authority = None
    if key is not None:
        from moeswarm.transport.member_cert import Authority

        authority = Authority.load(key)
    return SwarmDht.open(list(invite.dht), client=True, authority=authority)


def open_stream_swarm(path: Path, invite, key: Path | None):
    from moeswarm.commands._tls import client_tls
    from moeswarm.discovery.follow import DiscoveryOptions
    from moeswarm.swarm import open_swarm
    from moeswarm.swarm_config import SwarmConfig

    key_file = str(key) if key is not None else None
    discovery = DiscoveryOptions(tuple(invite.dht), 120.0, report=lambda line: None, swarm_key=key_file)
    return open_swarm(str(path), [], SwarmConfig(tls=client_tls(key_file), discovery=discovery))


@dataclass(frozen=True)
class Snapshot:
    at: float
    members: frozenset[str]
    fewest: int  # holders of the least-held (layer, expert) pair
    uncovered: int  # (layer, expert) pairs nobody announced

    def to_json(self) -> dict:
        return {"members": len(self.members), "fewest": self.fewest, "uncovered_pairs": self.uncovered}


class Coverage:
    """The swarm's coverage as its DHT announces it (what `moeswarm status INVITE` prints)."""

    def __init__(self, dht, model: str, layers: list[int], num_experts: int):
        self.dht, self.model, self.layers, self.num_experts = dht, model, layers, num_experts

    def read(self) -> Snapshot:
        from moeswarm.placement.share import coverage_of

        records = self.dht.fetch(self.model)
        coverage = coverage_of([r.held for r in records.values()], self.layers, self.num_experts)
        holders = [h for row in coverage.values() for h in row]
        return Snapshot(time.monotonic(), frozenset(records), min(holders), sum(h == 0 for h in holders))

    def wait(self, done, wait_s: float) -> Snapshot:
        """The first reading that is `done`; MoeSwarmError naming the last after `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            snapshot = self.read()
            if done(snapshot):
                return snapshot
            if time.monotonic() > deadline:
                raise MoeSwarmError(f"the swarm's announcements did not settle within {wait_s:g} s: {snapshot}")
            time.sleep(0.25)


def churn(joiners: list[Joiner], view: Coverage, stream: Stream, initial: Snapshot, settings: Settings,
          rng: random.Random, expert_bytes: int, say) -> tuple[list[dict], list[tuple[float, float]]]:
    """K kills, each followed by a rejoin: a row per kill, and each one's (kill, coverage back) times."""
    rows, spans = [], []
    for k in range(settings.kills):
        victim = rng.choice(joiners)
        address = victim.address_now()
        moves_before = sum(len(j.moves()) for j in joiners)
        killed_at = victim.life.kill()
        say(f"  kill {k + 1}: {victim.name} ({address}) killed")
        if settings.rejoin == "now":
            victim.start()
        dropped = view.wait(lambda c: address not in c.members, 3 * settings.ttl_s + 60.0)
        if settings.rejoin != "now":
            victim.start()
        figures = victim.serving()
        rejoin = join_row(victim, figures, None, expert_bytes)
        settle_deadline = time.monotonic() + SETTLE_S
        try:
            restored = view.wait(lambda c: c.fewest >= initial.fewest and victim.address_now() in c.members
                                 and len(c.members) >= len(joiners), SETTLE_S)
        except MoeSwarmError:
            restored = None
        first_use = wait_first_use(stream, victim, max(5.0, settle_deadline - time.monotonic()))
        ended = restored.at if restored is not None else time.monotonic()
        row = {"kill": k + 1, "joiner": victim.name, "address": address,
               "dropped_s": dropped.at - killed_at, "after_kill": dropped.to_json(),
               "alive_fewest_after_kill": alive_fewest(joiners, killed_at + 1e-6, view.num_experts),
               "rejoin": rejoin, "rejoin_announced_after_kill_s": figures.announced_at - killed_at,
               "first_use_after_announce_s": None if first_use is None else first_use - figures.announced_at,
               "restored": restored is not None,
               "restored_s": None if restored is None else restored.at - killed_at,
               "after_rejoin": (restored or view.read()).to_json(),
               "moves": sum(len(j.moves()) for j in joiners) - moves_before,
               **stream_window(stream.figures.tokens, killed_at, ended)}
        rows.append(row)
        spans.append((killed_at, ended))
        say(f"  kill {k + 1}: record gone after {row['dropped_s']:.1f} s (fewest holders {dropped.fewest}), "
            f"{victim.name} serving again {row['rejoin_announced_after_kill_s']:.1f} s after the kill"
            + ("" if restored is None else f", coverage back after {row['restored_s']:.1f} s"))
        stream.wait_tokens(PAUSE_TOKENS)
    return rows, spans


def wait_first_use(stream: Stream, joiner: Joiner, wait_s: float) -> float | None:
    """When the stream's first layer call answered by `joiner`'s current address came (None: not within `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        address = joiner.address_now()
        if address in stream.figures.first_used:
            return stream.figures.first_used[address]
        time.sleep(0.05)
    return None


def alive_fewest(joiners: list[Joiner], when: float, num_experts: int) -> int:
    """Holders of the least-held expert among the members serving at `when` (the same experts at every layer)."""
    holders = [0] * num_experts
    for joiner in joiners:
        for expert in joiner.share_at(when) or ():
            holders[expert] += 1
    return min(holders)


def stream_window(arrivals: list[tuple[float, int]], start: float, end: float) -> dict:
    """The stream's tokens/s over [start, end] and its longest wait for a token there."""
    tokens = [(t, n) for t, n in list(arrivals) if start < t <= end]
    produced = sum(n for _, n in tokens)
    times = [start] + [t for t, _ in tokens] + [end]
    return {"tokens": produced, "window_s": end - start, "tokens_per_s": produced / (end - start) if end > start else None,
            "longest_pause_s": max(b - a for a, b in zip(times, times[1:]))}


def stream_row(figures, spans: list[tuple[float, float]], joiners: list[Joiner], num_experts: int,
               reference: Reference, resilience: dict) -> dict:
    """The stream's figures: before the first kill, from it to the last rejoin's coverage back, and after."""
    first_token = figures.tokens[0][0] if figures.tokens else figures.started_at
    churn_start = spans[0][0] if spans else figures.stopped_at
    windows = {"before": stream_window(figures.tokens, first_token, churn_start)}
    if spans:
        windows["churn"] = stream_window(figures.tokens, churn_start, spans[-1][1])
        windows["after"] = stream_window(figures.tokens, spans[-1][1], figures.stopped_at)
    failures = [{"at_s": f.at - first_token, "segment": f.segment, "message": f.message,
                 "alive_fewest": alive_fewest(joiners, f.at, num_experts)} for f in figures.failures]
    return {"segment_tokens": len(reference.tokens), "segments": figures.segments, "segments_equal": figures.segments_equal,
            "last_partial_tokens": figures.last_partial, "last_partial_equal": figures.last_partial_equal,
            "first_difference": figures.first_difference, "logits_checked": figures.logits_checked,
            "logits_bit_identical": figures.logits_bit_identical,
            "tokens": sum(n for _, n in figures.tokens), "windows": windows, "failures": failures,
            "failures_while_covered": sum(f["alive_fewest"] >= 1 for f in failures),
            "resilience": {k: v for k, v in resilience.items() if v}}


def targets(run: dict) -> list[dict]:
    """Issue 59's targets for one N."""
    count = run["joiners"]
    rows = run["joins"] + [e["rejoin"] for e in run["kills"]]
    worst = max((r["fetched_over_share"] for r in rows if not r["reused"]), default=0.0)
    stream = run["stream"]
    identical = (stream["segments"] > 0 and stream["segments_equal"] == stream["segments"]
                 and stream["last_partial_equal"] is not False and stream["logits_bit_identical"] is not False)
    return [
        {"joiners": count, "target": "each joiner fetches <= 1.1x its share's bytes", "measured": f"{worst:.3f}x (worst)",
         "met": worst <= FETCH_TARGET},
        {"joiners": count, "target": "no layer call fails while every expert has a live holder",
         "measured": f"{stream['failures_while_covered']} failed ({len(stream['failures'])} in all)",
         "met": stream["failures_while_covered"] == 0},
        {"joiners": count, "target": "the stream's tokens bit-identical through every join and leave",
         "measured": f"{stream['segments_equal']}/{stream['segments']} segments equal"
                     + ("" if stream["last_partial_equal"] is None else
                        f" (and the last, cut at {stream['last_partial_tokens']} tokens: "
                        f"{'equal' if stream['last_partial_equal'] else 'differs'})")
                     + ("" if stream["logits_bit_identical"] is None else
                        f", logits {'torch.equal' if stream['logits_bit_identical'] else 'differ'} at "
                        f"{stream['logits_checked']} positions"),
         "met": identical},
        {"joiners": count, "target": "coverage back to its level before each kill",
         "measured": f"{sum(e['restored'] for e in run['kills'])}/{len(run['kills'])} kills",
         "met": all(e["restored"] for e in run["kills"])},
    ]


class LoadSampler:
    """The 1-minute load average, sampled every few seconds while the bench runs (a shared machine's)."""

    def __init__(self, every_s: float = 5.0):
        self.every_s = every_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load sampler", daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        s = self.samples or [os.getloadavg()[0]]
        return {"min": min(s), "mean": sum(s) / len(s), "max": max(s), "samples": len(s)}


def host_facts(load: LoadSampler) -> dict:
    from moeswarm_bench.bench.worker_real import _cpu_count, _cpu_model, _kernels

    return {"cpu": _cpu_model(), "cpu_count": _cpu_count(), "machine": platform.machine(), "kernels": _kernels(),
            "python": platform.python_version(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "load_1min": load.summary()}


def table_lines(result: dict) -> list[str]:
    """What the command prints: per N, a line per join and per kill, the stream, the targets."""
    lines = [f"model {result['model']['name']}: {result['model']['experts']} experts x {result['model']['moe_layers']} "
             f"MoE layers, {result['model']['expert_bytes']} bytes per expert; host {result['host']['cpu']} "
             f"({result['host']['cpu_count']} CPUs, load {result['host']['load_1min']['mean']:.1f})"]
    for run in result["runs"]:
        lines.append(f"{run['joiners']} joiners, {run['experts_each']} experts each:")
        for j in run["joins"]:
            lines.append(f"  join {j['joiner']}: share {j['share_s']:.1f} s, fetched {j['fetched_s']:.1f} s, serving "
                         f"{j['announced_s']:.1f} s; {j['fetched_bytes']} bytes for a share of {j['share_bytes']} "
                         f"({j['fetched_over_share']:.3f}x)")
        for e in run["kills"]:
            r = e["rejoin"]
            lines.append(f"  kill {e['kill']} ({e['joiner']}): dropped after {e['dropped_s']:.1f} s, fewest holders "
                         f"{e['after_kill']['fewest']} (alive {e['alive_fewest_after_kill']}); rejoined serving "
                         f"{r['announced_s']:.1f} s after its start ({'reused its slice' if r['reused'] else str(r['slice_bytes']) + ' bytes fetched'}); "
                         f"coverage {'back after ' + format(e['restored_s'], '.1f') + ' s' if e['restored'] else 'NOT back'} "
                         f"(fewest {e['after_rejoin']['fewest']}); {e['moves']} moves; stream "
                         f"{_rate(e['tokens_per_s'])} tokens/s, longest pause {e['longest_pause_s']:.2f} s")
        s = run["stream"]
        rates = ", ".join(f"{name} {_rate(w['tokens_per_s'])}" for name, w in s["windows"].items())
        lines.append(f"  stream: {s['tokens']} tokens in {s['segments']} segments, {s['segments_equal']} equal to the "
                     f"local run; tokens/s {rates}; {len(s['failures'])} failed segments; rebalancing moves "
                     f"{run['moves']}; resilience {s['resilience']}")
    lines += [f"target ({t['joiners']} joiners): {t['target']}: {t['measured']} ({'met' if t['met'] else 'NOT met'})"
              for t in result["targets"]]
    return lines


def _rate(value) -> str:
    return "-" if value is None else f"{value:.1f}"

