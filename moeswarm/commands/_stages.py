"""`--stages H:P,...`: generate and serve as the gateway over a chain of stages (docs/stages.md)."""

from __future__ import annotations

import argparse

from moeswarm.errors import MoeSwarmError


def stage_route(text: str) -> list[str]:
    """argparse type of `--stages`."""
    from moeswarm.stages.client import parse_route

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


def check_stages(args: argparse.Namespace, config) -> None:
    """With --stages, no holders of this process's own (MoeSwarmError: one line)."""
    if args.stages and (args.workers or args.swarm is not None or config.local_experts is not None):
        raise MoeSwarmError("with --stages the experts are the stages' own: give --workers, --swarm or "
                            "--local-experts to each `moeswarm stage` instead")


def open_backbone(source, args: argparse.Namespace, config):
    """The Swarm generate runs: a gateway over `--stages`, or the backbone of `open_swarm`."""
    check_stages(args, config)
    if not args.stages:
        from moeswarm.swarm import open_swarm

        return open_swarm(source, args.workers or [], config)
    from moeswarm.stages.gateway import open_gateway

    return open_gateway(source, args.stages, config)
