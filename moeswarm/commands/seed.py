"""`moeswarm seed`: serve byte ranges of a model file to workers fetching their slice (slices/seed.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from moeswarm.commands._tls import add_swarm_key, server_tls
from moeswarm.slices.seed import Seeder


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

    async def main() -> None:
        host, port = await seeder.start(args.host, args.port)
        print(f"moeswarm seed: listening on {host}:{port} serving {seeder.path} ({seeder.size} bytes)"
              f"{' with the swarm key' if seeder.tls else ''}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await seeder.close()

    asyncio.run(main())
    return 0
