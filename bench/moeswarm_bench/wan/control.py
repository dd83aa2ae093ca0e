"""The control channel: one command per line over TCP, one answer line back.

    rtt 100ms | jitter 5ms | bandwidth 10mbit | bandwidth off
    stall 2s | close-after 1000 | close-after off | reset | clear | status | help

Answers start with `ok` or `error:`; `status` answers one line of JSON. Try it with
`nc 127.0.0.1 9002` or `printf 'status\\n' | nc -q1 127.0.0.1 9002`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from moeswarm_bench.wan.link import parse_bandwidth, parse_duration
from moeswarm_bench.wan.proxy import WanProxy

HELP = (
    "commands: rtt DURATION | jitter DURATION | bandwidth RATE|off | stall DURATION | "
    "close-after BYTES|off | reset | clear | status | help"
)
_OFF = ("off", "none", "unlimited")
_COMMANDS = ("rtt", "jitter", "bandwidth", "stall", "close-after", "reset", "clear", "status", "help")


def execute(proxy: WanProxy, line: str) -> str:
    """Run one control command on `proxy`; return the answer line (without newline)."""
    words = line.split()
    if not words:
        return f"error: empty command; {HELP}"
    command, arguments = words[0].lower(), words[1:]
    if command not in _COMMANDS:
        return f"error: unknown command {command!r}; {HELP}"
    try:
        if command == "status":
            return json.dumps(proxy.status(), sort_keys=True)
        if command == "help":
            return f"ok {HELP}"
        if command in ("reset", "clear"):
            _expect(command, arguments, 0)
            if command == "reset":
                return f"ok reset {proxy.reset()} connections"
            proxy.clear()
            return f"ok cleared: {proxy.profile.describe()}"
        _expect(command, arguments, 1)
        value = arguments[0]
        if command == "rtt":
            proxy.set_profile(rtt_s=parse_duration(value))
        elif command == "jitter":
            proxy.set_profile(jitter_s=parse_duration(value))
        elif command == "bandwidth":
            proxy.set_profile(bandwidth_bps=None if value.lower() in _OFF else parse_bandwidth(value))
        elif command == "stall":
            proxy.stall(parse_duration(value))
            return f"ok stalled for {value}"
        else:  # close-after
            proxy.close_after(None if value.lower() in _OFF else _byte_count(value))
            return f"ok close-after {value}"
        return f"ok {proxy.profile.describe()}"
    except ValueError as error:
        return f"error: {error}"


def _expect(command: str, arguments: list[str], count: int) -> None:
    if len(arguments) != count:
        raise ValueError(f"{command} takes {count} argument(s), got {len(arguments)}")


def _byte_count(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"bad byte count {text!r}: expected a whole number such as 1000")
    return int(text)


class ControlServer:
    """Serves `execute` on a TCP port, many commands per connection."""

    def __init__(self, proxy: WanProxy, listen: tuple[str, int]):
        self._proxy = proxy
        self._listen = listen
        self._server: asyncio.Server | None = None

    async def start(self) -> ControlServer:
        self._server = await asyncio.start_server(self._serve, *self._listen)
        return self

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None, "ControlServer.start() has not run"
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                text = line.decode("utf-8", errors="replace").strip()
                if not text:
                    continue
                writer.write((execute(self._proxy, text) + "\n").encode())
                await writer.drain()
        except (ConnectionError, asyncio.LimitOverrunError, ValueError, asyncio.CancelledError):
            pass  # cancelled: shutting down (a server-callback task; see proxy._accept)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
