"""`moeswarm worker`: serve some of a model's routed experts (any set of them)."""

from __future__ import annotations

import argparse
import functools
import logging
import sys

from moeswarm.commands._hosting import add_plan_arguments, experts_arg, hosting_from
from moeswarm.commands._setup import add_quiet, quiet_progress, set_threads
from moeswarm.commands._swarm import add_worker_swarm
from moeswarm.commands._tls import add_swarm_key, server_tls
from moeswarm.commands._types import layer_range, non_negative, port, positive, seconds
from moeswarm.ids import parse_address
from moeswarm.wire.relay import RelayError, check_name
from moeswarm.worker.config import INLINE_TOKENS, Hosting, WorkerConfig
from moeswarm.worker.limits import WorkerLimits
from moeswarm.worker.memory import serve_large_from_mmap


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (config.json + safetensors) or GGUF file (.gguf)")
    parser.add_argument("--experts", type=experts_arg, default=None,
                        help="experts to serve, ids and inclusive ranges, e.g. 0-3,9,17-20, or per layer, e.g. "
                             "0:1-4,9;1:2-5 (default: what the model source holds: every expert, or a slice file's)")
    parser.add_argument("--layers", type=layer_range("layers"), default=None, help="inclusive MoE layer range A-B (default: all)")
    add_plan_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=port, default=0, help="TCP port (0: pick a free one and print it)")
    add_swarm_key(parser)
    _add_relay(parser)
    add_worker_swarm(parser)
    _add_limits(parser)
    parser.add_argument("--threads", type=positive, default=None,
                        help="torch CPU threads (default: this machine's cores shared among the moeswarm processes on it)")
    parser.add_argument("--inline-tokens", type=non_negative, default=INLINE_TOKENS, metavar="N",
                        help="a DISPATCH of at most N tokens runs on the event loop when the compute thread is idle: "
                             "no hand-off between threads on a decode step (0: every DISPATCH on the compute thread; "
                             f"default {INLINE_TOKENS})")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="least severe log records printed on stderr")
    add_quiet(parser)


def _add_limits(parser: argparse.ArgumentParser) -> None:
    d = WorkerLimits()
    limits = parser.add_argument_group("limits", "what the worker accepts from the network (docs/protocol.md, Limits)")
    add = limits.add_argument
    add("--max-connections", type=positive, default=d.max_connections,
        help=f"open connections; one more is answered ERROR busy and closed at once (default {d.max_connections})")
    add("--queue-limit", type=positive, default=d.queue_limit,
        help=f"DISPATCHes waiting for the compute thread, over all connections; beyond it a request is answered "
             f"'busy' (default {d.queue_limit})")
    add("--queue-per-connection", type=positive, default=d.queue_per_connection,
        help=f"of those, waiting from one connection (default {d.queue_per_connection})")
    add("--max-buffered-bytes", type=positive, default=d.max_buffered_bytes,
        help=f"request bodies held at once, being read, queued or computing; a larger one is read, dropped and "
             f"answered 'busy' (default {d.max_buffered_bytes})")
    add("--max-payload", type=positive, default=d.max_payload,
        help=f"largest frame payload accepted, in bytes (default {d.max_payload})")
    add("--max-tokens", type=positive, default=d.max_tokens, help=f"tokens per DISPATCH (default {d.max_tokens})")
    add("--max-top-k", type=positive, default=d.max_top_k, help=f"top-k per DISPATCH (default {d.max_top_k})")
    add("--hello-max-bytes", type=positive, default=d.hello_max_bytes,
        help=f"largest frame body before a successful HELLO; a larger one closes the connection "
             f"(default {d.hello_max_bytes})")
    add("--hello-timeout", type=seconds, default=d.hello_timeout_s,
        help=f"seconds from connecting to a successful HELLO (default {d.hello_timeout_s:g})")
    add("--frame-timeout", type=seconds, default=d.frame_timeout_s,
        help=f"seconds for a frame's header and body once its first byte arrived (default {d.frame_timeout_s:g})")
    add("--idle-timeout", type=seconds, default=d.idle_timeout_s,
        help=f"seconds a connection may send no request, or take none of its replies, before it is closed "
             f"(default {d.idle_timeout_s:g})")
    add("--max-unsent-bytes", type=positive, default=d.max_unsent_bytes,
        help=f"replies of one connection its client has not read; its requests are not read beyond it, and a "
             f"DISPATCH whose RESULT alone is larger is refused (default {d.max_unsent_bytes})")
    add("--max-reply-bytes", type=positive, default=d.max_reply_bytes,
        help=f"replies being computed or not yet read, over all connections; beyond it a DISPATCH is answered "
             f"'busy' (default {d.max_reply_bytes})")
    add("--max-connections-per-peer", type=positive, default=d.max_connections_per_peer,
        help=f"open connections from one IP address (default {d.max_connections_per_peer})")
    add("--evict-after", type=seconds, default=d.evict_after_s,
        help=f"at a connection limit, a connection with no HELLO or DISPATCH for this many seconds is closed to "
             f"make room for a new one (default {d.evict_after_s:g})")


def _add_relay(parser: argparse.ArgumentParser) -> None:
    relay = parser.add_argument_group("relay", "for a worker that cannot be dialled (behind NAT): docs/network.md")
    relay.add_argument("--relay", type=_relay_address, default=None, metavar="HOST:PORT",
                       help="also keep idle connections open to this `moeswarm relay`; backbones reach the worker "
                            "through it as relay://HOST:PORT/NAME (TLS with --swarm-key runs end to end)")
    relay.add_argument("--relay-name", type=_relay_name, default=None, metavar="NAME",
                       help="the name to register at the relay, A-Z a-z 0-9 . _ - (default: a random one, printed)")
    relay.add_argument("--relay-pool", type=positive, default=2, metavar="N",
                       help="idle connections kept registered at the relay (each backbone takes one)")


def _relay_address(text: str) -> tuple[str, int]:
    try:
        return parse_address(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _relay_name(text: str) -> str:
    try:
        return check_name(text)
    except RelayError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def limits_from(args: argparse.Namespace) -> WorkerLimits:
    """The WorkerLimits the flags ask for."""
    return WorkerLimits(
        max_connections=args.max_connections, queue_limit=args.queue_limit,
        queue_per_connection=args.queue_per_connection, max_buffered_bytes=args.max_buffered_bytes,
        max_payload=args.max_payload, max_tokens=args.max_tokens, max_top_k=args.max_top_k,
        hello_max_bytes=args.hello_max_bytes, hello_timeout_s=args.hello_timeout, frame_timeout_s=args.frame_timeout,
        idle_timeout_s=args.idle_timeout, max_unsent_bytes=args.max_unsent_bytes,
        max_reply_bytes=args.max_reply_bytes, max_connections_per_peer=args.max_connections_per_peer,
        evict_after_s=args.evict_after,
    )


def config_from(args: argparse.Namespace) -> WorkerConfig:
    """The WorkerConfig the flags ask for (the TLS context made here: it may warn about plain TCP)."""
    return WorkerConfig(host=args.host, port=args.port, limits=limits_from(args),
                        tls=server_tls(args.swarm_key, args.host), swarm_key=args.swarm_key, relay=args.relay,
                        relay_name=args.relay_name, relay_pool=args.relay_pool,
                        swarm=None if args.swarm is None else tuple(args.swarm), announce_host=args.announce_host,
                        announce_ttl_s=args.announce_ttl, dht_port=args.dht_port, inline_tokens=args.inline_tokens)


def run(args: argparse.Namespace) -> int:
    quiet_progress(args)
    if args.relay and not args.swarm_key:
        print("moeswarm worker: warning: --relay without --swarm-key: the relay, and anyone on its paths, can read and "
              "alter the hidden states, and any backbone that knows the name can use this worker", file=sys.stderr,
              flush=True)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from moeswarm.node.worker import run_worker

    node = run_worker(config_from(args), functools.partial(_load, hosting_from(args), args.threads), report=_say)
    _say(f"stopped; {node.server.merged_requests} DISPATCHes of several backbones ran in "
         f"{node.server.merged_calls} merged expert calls")
    return 0


def _load(hosting: Hosting, threads: int | None):
    """The experts to serve and their source. Called by the node once the port is checked and the DHT
    joined (its process forks before torch loads): this process's threads are set first, and once the
    experts are in, the collector and the allocator are set for serving."""
    set_threads(threads)
    from moeswarm.gc_freeze import freeze_loaded
    from moeswarm.worker.hosting import load_hosted

    store, source = load_hosted(hosting)
    freeze_loaded()  # the model's objects live as long as the worker: the collector no longer walks them per DISPATCH
    serve_large_from_mmap()  # after loading: a flood's large buffers go back to the system when freed
    return store, source


def _say(line: str) -> None:
    print(f"moeswarm worker: {line}", flush=True)
