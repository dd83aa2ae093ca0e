"""`moeswarm stage`: serve a span of a model's decoder layers (attention, routers, shared experts,
the sequences' caches) to gateways; its MoE layers go to its own workers (docs/stages.md)."""

from __future__ import annotations

import argparse
import functools
import logging
import signal

from moeswarm.commands._setup import add_quiet
from moeswarm.commands._swarm import DEFAULT_TTL_S, check_workers_or_swarm, swarm_peers
from moeswarm.commands._swarm_flags import add_swarm_flags, swarm_config
from moeswarm.commands._types import port, positive, seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (config.json + safetensors) or GGUF file (.gguf)")
    parser.add_argument("--layers", required=True, type=_span, metavar="A-B",
                        help="the decoder layers this stage holds, inclusive (0-based), e.g. 0-7")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=port, default=0, help="TCP port (0: pick a free one and print it)")
    limits = parser.add_argument_group("limits", "what the stage accepts from the network (docs/stages.md)")
    limits.add_argument("--max-connections", type=positive, default=64, help="open connections (default 64)")
    limits.add_argument("--max-tokens", type=positive, default=4096, help="rows of one step (default 4096)")
    limits.add_argument("--max-sequences", type=positive, default=4096,
                        help="sequences whose caches are held at once (default 4096)")
    limits.add_argument("--max-cache-mb", type=positive, default=4096,
                        help="keys and values held, in MiB; past it the least recently used sequences are dropped "
                             "(their gateway replays them) (default 4096)")
    limits.add_argument("--session-sequences", type=positive, default=None, metavar="N",
                        help="sequences one gateway session may hold (default: its fair share, the bound divided "
                             "by the sessions holding caches, when the stage is full)")
    limits.add_argument("--session-cache-mb", type=positive, default=None, metavar="MIB",
                        help="keys and values one gateway session may hold, in MiB (default: its fair share)")
    limits.add_argument("--sequence-ttl", type=seconds, default=600.0, metavar="SECONDS",
                        help="a sequence untouched this long is dropped (default 600)")
    add_swarm_flags(parser)
    add_announce(parser)
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="least severe log records printed on stderr")
    add_quiet(parser)


def add_announce(parser: argparse.ArgumentParser) -> None:
    """The flags of a stage's own announcement on the DHT (named as `moeswarm worker`'s, under --announce-)."""
    group = parser.add_argument_group("announce", "announce this stage on the swarm's DHT, for gateways with "
                                                  "--stages-swarm (docs/stages.md)")
    group.add_argument("--announce-swarm", type=swarm_peers, default=None, metavar="PEERS",
                       help="join the swarm at these DHT peers (comma-separated multiaddrs /ip4/HOST/tcp/PORT/p2p/ID) "
                            "and announce this stage's layers there; 'new': start a new swarm (its multiaddr is "
                            "printed). Signed with --swarm-key when given")
    group.add_argument("--announce-host", default=None, metavar="HOST",
                       help="the address gateways dial this stage at (default: --host, which must then not be 0.0.0.0)")
    group.add_argument("--announce-ttl", type=seconds, default=DEFAULT_TTL_S, metavar="SECONDS",
                       help=f"the announcement expires this long after each refresh (every third of it) "
                            f"(default {DEFAULT_TTL_S:g})")
    group.add_argument("--dht-port", type=port, default=0, metavar="PORT",
                       help="TCP port of this stage's DHT node, on --host (0: a free one)")


def run(args: argparse.Namespace) -> int:
    from moeswarm.commands._setup import quiet_progress, set_backbone_threads

    quiet_progress(args)
    check_workers_or_swarm(args)
    from moeswarm.stages.node import open_stage_node

    set_backbone_threads(args.threads)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with open_stage_node(_options(args), functools.partial(swarm_config, args), report=_say) as node:
        from moeswarm.gc_freeze import freeze_loaded

        freeze_loaded()  # the span's trunk, out of the collector's walks on every step
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: node.stop())
        node.serve()
    _say(f"stopped after {node.steps} steps")
    return 0


def _options(args: argparse.Namespace):
    """The StageOptions the flags ask for (the TLS context made here: it may warn about plain TCP)."""
    from moeswarm.commands._tls import server_tls
    from moeswarm.stages.caches import CacheLimits
    from moeswarm.stages.node import StageAnnouncement, StageOptions
    from moeswarm.stages.server import StageLimits

    caches = CacheLimits(args.max_sequences, args.max_cache_mb << 20, args.sequence_ttl,
                         args.session_sequences or 0, (args.session_cache_mb or 0) << 20)
    announce = None if args.announce_swarm is None else StageAnnouncement(
        tuple(args.announce_swarm), args.announce_host, args.announce_ttl, args.dht_port, args.swarm_key)
    return StageOptions(args.model, args.layers, args.host, args.port, tuple(args.workers or ()),
                        StageLimits(max_connections=args.max_connections, max_tokens=args.max_tokens, caches=caches),
                        server_tls(args.swarm_key, args.host), args.backbone_dtype, announce)


def _say(line: str) -> None:
    print(f"moeswarm stage: {line}", flush=True)


def _span(text: str) -> range:
    """argparse type of `--layers`."""
    from moeswarm.stages.span import parse_span

    try:
        return parse_span(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
