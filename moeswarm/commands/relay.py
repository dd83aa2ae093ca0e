"""`moeswarm relay`: splice backbones to workers that cannot be dialled (behind NAT); docs/network.md."""

from __future__ import annotations

import argparse
import logging
import sys

from moeswarm.commands._types import port, positive, seconds
from moeswarm.relay.running import STATUS_EVERY_S, run_relay
from moeswarm.relay.server import RelayLimits
from moeswarm.transport.member_cert import Authority
from moeswarm.worker.listen import check_can_listen, raise_open_files_limit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RelayLimits()
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=port, default=0, help="TCP port (0: pick a free one and print it)")
    parser.add_argument("--swarm-key", default=None, metavar="FILE",
                        help="the swarm key or any member file of the swarm: a worker then registers only its own "
                             "member name, proven with its member key (the relay reads the swarm's certificate, and "
                             "FILE.revoked when present; it never decrypts a pipe)")
    limits = parser.add_argument_group("limits", "what the relay holds for its peers")
    add = limits.add_argument
    add("--max-connections", type=positive, default=d.max_connections,
        help=f"open connections, idle, spliced or in their handshake (default {d.max_connections})")
    add("--max-names", type=positive, default=d.max_names, help=f"worker names registered at once (default {d.max_names})")
    add("--max-idle-per-name", type=positive, default=d.max_idle_per_name,
        help=f"idle connections one worker name may keep registered (default {d.max_idle_per_name})")
    add("--max-pipes-per-name", type=positive, default=d.max_pipes_per_name,
        help=f"spliced pipes to one worker name at once (default {d.max_pipes_per_name})")
    add("--max-names-per-host", type=positive, default=d.max_names_per_host,
        help=f"worker names registered from one IP address at once (default {d.max_names_per_host})")
    add("--handshake-timeout", type=seconds, default=d.handshake_timeout_s,
        help=f"seconds from connecting to a whole relay request (default {d.handshake_timeout_s:g})")
    add("--wait-for-worker", type=seconds, default=d.wait_for_worker_s,
        help=f"seconds a backbone waits for the named worker's idle connection (default {d.wait_for_worker_s:g})")
    add("--idle-timeout", type=seconds, default=d.idle_timeout_s,
        help=f"seconds a spliced pipe may carry nothing before it is closed (default {d.idle_timeout_s:g})")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="least severe log records printed on stderr (INFO: one line per pipe, and a status line "
                             f"every {STATUS_EVERY_S:g} s when something changed)")


def run(args: argparse.Namespace) -> int:
    authority = Authority.load(args.swarm_key) if args.swarm_key else None
    check_can_listen(args.host, args.port)
    raise_open_files_limit(args.max_connections)  # a flood must meet --max-connections, not the descriptor limit
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    limits = RelayLimits(max_connections=args.max_connections, max_names=args.max_names,
                         max_idle_per_name=args.max_idle_per_name, max_pipes_per_name=args.max_pipes_per_name,
                         max_names_per_host=args.max_names_per_host, handshake_timeout_s=args.handshake_timeout,
                         wait_for_worker_s=args.wait_for_worker, idle_timeout_s=args.idle_timeout)
    if authority is None:
        print("moeswarm relay: warning: without --swarm-key names are first come, first served: the first host to "
              "register a name holds it while it is in use, so a peer that knows a worker's name can take it first",
              file=sys.stderr, flush=True)
    run_relay(limits, authority, args.host, args.port, on_listening=_say_listening)
    return 0


def _say_listening(host: str, port: int) -> None:
    print(f"moeswarm relay: listening on {host}:{port}", flush=True)
