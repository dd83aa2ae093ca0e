"""The flags of how a backbone reaches and trusts its expert holders, shared by `generate` and `serve`.

`add_swarm_flags` adds them (one group, one set of defaults: swarm_config.py's); `swarm_config`
turns the parsed flags into the frozen `SwarmConfig` that `open_swarm` takes. Parsing imports no
torch.
"""

from __future__ import annotations

import argparse

from moeswarm.commands._local import add_local_experts
from moeswarm.commands._local import resolve as resolve_local_experts
from moeswarm.commands._setup import add_backbone_dtype
from moeswarm.commands._swarm import add_backbone_swarm, discovery_options
from moeswarm.commands._tls import add_swarm_key, client_tls
from moeswarm.commands._types import fraction, positive, seconds
from moeswarm.dispatch.health import REPLY_TIMEOUT_S
from moeswarm.swarm_config import SwarmConfig
from moeswarm.transport import FANOUTS
from moeswarm.wire.config import COMBINE_MODES, PRESETS, WireConfig


def workers_list(text: str) -> list[str]:
    """argparse type of `--workers`: HOST:PORT, relay://RELAY:PORT/NAME, or both joined by + (docs/network.md)."""
    from moeswarm.transport.path import parse_worker

    workers = [w.strip() for w in text.split(",") if w.strip()]
    try:
        for worker in workers:
            parse_worker(worker)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not workers:
        raise argparse.ArgumentTypeError("empty worker list")
    return workers


def add_swarm_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--workers", default=None, type=workers_list,
        help="comma-separated workers: HOST:PORT, relay://RELAY:PORT/NAME (a worker behind NAT), or "
             "HOST:PORT+relay://RELAY:PORT/NAME (direct if it answers, else the relay); none (and no --swarm): "
             "the local mode, every expert in this process")
    add("--wire", choices=tuple(PRESETS), default="exact",
        help="preset: exact (bit-identical, lossless) or wan (the gated cheap wire: partial sums, int8 blockwise both "
             "ways; docs/wire.md); the flags below override it")
    add("--combine", choices=COMBINE_MODES, default=None,
        help="exact: per-expert outputs, bit-identical; partial: one weighted sum per token per worker (default: the preset's)")
    add("--wire-dispatch", default=None, help="codec for hidden states (default: the preset's)")
    add("--wire-combine", default=None, help="codec for the experts' outputs (default: the preset's)")
    add("--fanout", choices=FANOUTS, default="star",
        help="star: send every worker its share before awaiting any reply; chain: one worker after another")
    add("--reply-timeout", type=seconds, default=REPLY_TIMEOUT_S, metavar="SECONDS",
        help="the most any worker's reply is awaited; measured deadlines are shorter (docs/failover.md)")
    add("--no-hedge", action="store_true", help="never send a late share's duplicate to a replica of its experts")
    add("--spot-check", type=fraction, default=0.0, metavar="FRACTION",
        help="recompute this fraction of remote answers on another holder; ban a liar (0: off)")
    add("--threads", type=positive, default=None,
        help="CPU threads of the backbone, torch's and the kernels' (default: every core: the backbone and its "
             "workers take turns)")
    add("--kv-cache", choices=("model", "f16"), default="model",
        help="how the backbone keeps each sequence's keys and values: model (its own dtype, float32 for a GGUF "
             "file) or f16 (float16, as llama.cpp does: half the memory a position and half the bytes a decode "
             "step's attention reads; a stage and its gateway must agree for --check-local)")
    add_local_experts(parser)
    add_backbone_swarm(parser)
    add_swarm_key(parser)
    add_backbone_dtype(parser)


def swarm_config(args: argparse.Namespace, source, report=None) -> SwarmConfig:
    """The SwarmConfig the flags say, checked against the model `source` (local experts); `report`
    receives discovery's progress lines (default: standard error)."""
    return SwarmConfig(
        wire=WireConfig.from_flags(args.wire, args.combine, args.wire_dispatch, args.wire_combine),
        fanout=args.fanout, reply_timeout_s=args.reply_timeout, hedge=not args.no_hedge, spot_check=args.spot_check,
        local_experts=resolve_local_experts(args, source), tls=client_tls(args.swarm_key),
        discovery=discovery_options(args, report=report), kv_cache=args.kv_cache)
