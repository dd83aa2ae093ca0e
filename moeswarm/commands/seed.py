"""`moeswarm seed`: serve byte ranges of a model file to workers fetching their slice (slices/seed.py)."""

from __future__ import annotations

import argparse
import logging

from moeswarm.commands._tls import add_swarm_key, server_tls
from moeswarm.slices.seed import Seeder
from moeswarm.slices.seeding import run_seeder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="the GGUF file to serve (the one its manifest was made from)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free port)")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="least severe log records printed on stderr")
    add_swarm_key(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    seeder = Seeder(args.model, server_tls(args.swarm_key, args.host))

    def say_listening(host: str, port: int) -> None:
        print(f"moeswarm seed: listening on {host}:{port} serving {seeder.path} ({seeder.size} bytes)"
              f"{' with the swarm key' if seeder.tls else ''}", flush=True)

    run_seeder(seeder, args.host, args.port, on_listening=say_listening)
    return 0
