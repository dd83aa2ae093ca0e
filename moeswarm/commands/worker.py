"""`moeswarm worker`: serve some of a model's routed experts (any set of them)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from moeswarm.commands._types import positive
from moeswarm.ids import parse_experts, parse_range


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (config.json + safetensors) or GGUF file (.gguf)")
    parser.add_argument("--experts", type=expert_list, default=None,
                        help="experts to serve, ids and inclusive ranges, e.g. 0-3,9,17-20 "
                             "(default: what the model source holds: every expert, or a slice file's)")
    parser.add_argument("--layers", type=_range("layers"), default=None, help="inclusive MoE layer range A-B (default: all)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=_port, default=0, help="TCP port (0: pick a free one and print it)")
    parser.add_argument("--max-payload", type=positive, default=1 << 30, help="largest frame payload accepted, in bytes")
    parser.add_argument("--queue-limit", type=positive, default=64,
                        help="DISPATCHes that may wait for the compute thread, over all connections; beyond it a "
                             "request is answered 'busy' (default 64)")
    parser.add_argument("--threads", type=positive, default=None,
                        help="torch CPU threads (default: torch's choice; use 1 when several workers share a machine)")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="least severe log records printed on stderr")


def expert_list(text: str) -> list[int]:
    """argparse type for an expert list such as 0-3,9,17-20."""
    try:
        return parse_experts(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _range(what: str):
    def parse(text: str) -> tuple[int, int]:
        try:
            return parse_range(text, what)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def run(args: argparse.Namespace) -> int:
    from moeswarm.worker.listen import check_can_listen

    check_can_listen(args.host, args.port)  # a busy port is found now, before torch and the experts load

    from moeswarm.commands._setup import set_threads
    from moeswarm.model.loading import load_experts
    from moeswarm.worker.server import WorkerServer
    from moeswarm.worker.store import ExpertStore

    set_threads(args.threads)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    hosted, source, num_experts = load_experts(args.model, args.experts, args.layers)
    store = ExpertStore(hosted, num_experts, source.config.hidden_size)
    del hosted  # the store holds the experts now (re-placed per contiguous run)
    server = WorkerServer(store, source.fingerprint, source.config.model_type, args.max_payload,
                          queue_limit=args.queue_limit)

    async def main() -> None:
        host, port = await server.start(args.host, args.port)
        print(f"moeswarm worker: listening on {host}:{port} model {source.config.model_type} "
              f"{source.fingerprint} {store.describe()}", flush=True)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        serving = asyncio.create_task(server.serve_forever())
        await stop.wait()
        serving.cancel()

    asyncio.run(main())
    return 0


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {value}")
    return value
