"""`moeswarm stage`: serve a span of a model's decoder layers (attention, routers, shared experts,
the sequences' caches) to gateways; its MoE layers go to its own workers (docs/stages.md)."""

from __future__ import annotations

import argparse
import logging
import signal

from moeswarm.commands._setup import add_quiet
from moeswarm.commands._swarm import check_workers_or_swarm
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
    limits.add_argument("--sequence-ttl", type=seconds, default=600.0, metavar="SECONDS",
                        help="a sequence untouched this long is dropped (default 600)")
    add_swarm_flags(parser)
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="least severe log records printed on stderr")
    add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    from moeswarm.commands._setup import quiet_progress

    quiet_progress(args)
    check_workers_or_swarm(args)
    from moeswarm.commands._setup import set_backbone_threads
    from moeswarm.commands._tls import server_tls
    from moeswarm.model.source import open_source
    from moeswarm.stages.caches import CacheLimits
    from moeswarm.stages.node import open_stage
    from moeswarm.stages.server import StageLimits
    from moeswarm.worker.listen import check_can_listen

    check_can_listen(args.host, args.port)
    source = open_source(args.model, args.backbone_dtype)
    caches = CacheLimits(args.max_sequences, args.max_cache_mb << 20, args.sequence_ttl)
    limits = StageLimits(max_connections=args.max_connections, max_tokens=args.max_tokens, caches=caches)
    set_backbone_threads(args.threads)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    span = args.layers
    server, swarm = open_stage(source, span, args.workers or [], swarm_config(args, source), limits,
                               server_tls(args.swarm_key, args.host))
    with swarm:
        bound = server.listen(args.host, args.port)
        print(f"moeswarm stage: listening on {args.host}:{bound} model {source.config.model_type} "
              f"{source.fingerprint} layers {span.start}-{span.stop - 1}", flush=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: server.close())
        server.serve_forever()
    print(f"moeswarm stage: stopped after {server.steps} steps", flush=True)
    return 0


def _span(text: str) -> range:
    """argparse type of `--layers`."""
    from moeswarm.stages.span import parse_span

    try:
        return parse_span(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
