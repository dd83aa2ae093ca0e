"""`--stages H:P,...` or `--stages-swarm PEERS`: generate and serve as the gateway over a chain of
stages, listed or found on the swarm's DHT (docs/stages.md)."""

from __future__ import annotations

import argparse
import sys

from moeswarm.commands._swarm import swarm_peers
from moeswarm.commands._types import seconds
from moeswarm.errors import MoeSwarmError

STAGES_WAIT_S = 60.0  # stages/find.py's default, restated so `--help` imports no torch


def stage_route(text: str) -> list[str]:
    """argparse type of `--stages`."""
    from moeswarm.stages.link import parse_route

    try:
        return parse_route(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_stages(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stages", type=stage_route, default=None, metavar="H:P,...",
                        help="run every decoder layer in these stages (`moeswarm stage`, listed in layer order; "
                             "H:P|H2:P2: replicas of one span, the next taking over when one fails): this process keeps "
                             "the embeddings, head, sampling and drafts, and a step crosses the network once per stage "
                             "(docs/stages.md)")
    parser.add_argument("--stages-swarm", type=swarm_peers, default=None, metavar="PEERS",
                        help="as --stages, with the stages found on the swarm at these DHT peers (comma-separated "
                             "multiaddrs; stages announce with `moeswarm stage --announce-swarm`): the "
                             "cheapest route covering every layer (round trips plus a weight per stage); stages of the same span are replicas")
    parser.add_argument("--stages-wait", type=seconds, default=STAGES_WAIT_S, metavar="SECONDS",
                        help=f"with --stages-swarm: the most to wait at start for announced stages covering every "
                             f"layer (default {STAGES_WAIT_S:g})")


def check_stages(args: argparse.Namespace, config, source=None) -> None:
    """With --stages or --stages-swarm, no holders of this process's own (MoeSwarmError: one line).
    With --stages-swarm, the route is found on the swarm here and set as `args.stages`, where
    generate and serve read it, and the swarm kept joined as `args.stage_watch` (stages announced
    later join the chain; `source`: the model's, when already open)."""
    stages_swarm = getattr(args, "stages_swarm", None)
    if args.stages and stages_swarm is not None:
        raise MoeSwarmError("give --stages or --stages-swarm, not both: the stages listed, or the swarm to find them on")
    if (args.stages or stages_swarm is not None) and \
            (args.workers or args.swarm is not None or config.local_experts is not None):
        raise MoeSwarmError(f"with {'--stages' if args.stages else '--stages-swarm'} the experts are the stages' own: "
                            "give --workers, --swarm or --local-experts to each `moeswarm stage` instead")
    args.stage_watch = None
    if stages_swarm is not None and not args.stages:
        args.stage_watch = find_stages(args, config, source)
        args.stages = args.stage_watch.route


def find_stages(args: argparse.Namespace, config, source=None):
    """`--stages-swarm`: the chain read from the DHT for the model's fingerprint, the swarm kept
    joined (a stages/watch.py StageWatch)."""
    from moeswarm.sources.source import open_source
    from moeswarm.stages.find import StageSearch, watch_stages

    source = source or open_source(args.model, getattr(args, "backbone_dtype", "file"))
    search = StageSearch(tuple(args.stages_swarm), args.swarm_key, args.stages_wait, report=_stderr(args))
    return watch_stages(search, source, config.tls)


def open_backbone(source, args: argparse.Namespace, config):
    """The Swarm generate runs: a gateway over `--stages` (or `--stages-swarm`), or the backbone of
    `open_swarm`; once it is loaded, out of the collector's walks on every decode step (gc_freeze.py)."""
    from moeswarm.gc_freeze import freeze_loaded

    swarm = _open(source, args, config)
    freeze_loaded()
    return swarm


def _open(source, args: argparse.Namespace, config):
    check_stages(args, config, source)
    if not args.stages:
        from moeswarm.swarm import open_swarm

        return open_swarm(source, args.workers or [], config)
    from moeswarm.stages.gateway import open_gateway

    try:
        return open_gateway(source, args.stages, config, args.stage_watch)
    except BaseException:
        if args.stage_watch is not None:
            args.stage_watch.close()
        raise


def _stderr(args: argparse.Namespace):
    def report(line: str) -> None:
        if not getattr(args, "quiet", False):
            print(f"moeswarm: {line}", file=sys.stderr, flush=True)

    return report
