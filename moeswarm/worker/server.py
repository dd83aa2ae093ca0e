"""The worker's asyncio TCP server: one persistent connection per backbone, frames in order.

A bad frame gets an ERROR reply and the worker goes on serving. When the framing itself is
broken (bad magic, a length over the limit, a truncated body) the stream cannot be trusted past
that point: the worker replies ERROR and closes that one connection, never the server.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from moeswarm.errors import MoeSwarmError, ProtocolError
from moeswarm.wire.codecs import CODECS
from moeswarm.wire.frames import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    HEADER_SIZE,
    Frame,
    Opcode,
    decode_meta,
    opcode_of,
    parse_header,
)
from moeswarm.wire.messages import Dispatch, ErrorReply, Hello, WorkerInfo
from moeswarm.worker.store import ExpertStore

log = logging.getLogger("moeswarm.worker")
BODY_TIMEOUT_S = 30.0


class WorkerServer:
    def __init__(self, store: ExpertStore, fingerprint: str, model_type: str, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES):
        self.store = store
        self.fingerprint = fingerprint
        self.info = WorkerInfo(
            fingerprint, model_type, store.num_experts, store.hidden_size, store.layers, store.experts, sorted(CODECS)
        )
        self.max_payload = max_payload
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._serve, host, port)
        return self._server.sockets[0].getsockname()[:2]

    async def serve_forever(self) -> None:
        assert self._server is not None
        async with self._server:
            await self._server.serve_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        greeted = False
        try:
            while True:
                try:
                    head = await reader.readexactly(HEADER_SIZE)
                except asyncio.IncompleteReadError as eof:
                    if eof.partial:
                        await self._fail(writer, 0, "truncated", f"truncated frame header: {len(eof.partial)} of {HEADER_SIZE} bytes")
                    return
                try:
                    header = parse_header(head, self.max_payload)
                except ProtocolError as error:
                    await self._fail(writer, 0, "framing", str(error))
                    return
                try:
                    body = await asyncio.wait_for(reader.readexactly(header.body_len), BODY_TIMEOUT_S)
                except (asyncio.IncompleteReadError, asyncio.TimeoutError) as error:
                    got = len(error.partial) if isinstance(error, asyncio.IncompleteReadError) else "fewer"
                    await self._fail(writer, header.request_id, "truncated", f"truncated frame: body of {header.body_len} bytes, got {got}")
                    return
                reply, greeted = self._handle(header, body, greeted)
                writer.writelines(reply.encode())
                await writer.drain()
        except (ConnectionError, OSError) as error:
            log.info("connection from %s ended: %s", peer, error)
        finally:
            writer.close()

    def _handle(self, header, body: bytes, greeted: bool) -> tuple[Frame, bool]:
        """One frame in, one frame out; every error becomes an ERROR reply."""
        rid = header.request_id
        try:
            opcode = opcode_of(header)
            meta = decode_meta(body[: header.meta_len])
            frame = Frame(opcode, rid, meta, memoryview(body)[header.meta_len :])
            if opcode == Opcode.PING:
                return Frame(Opcode.PONG, rid), greeted
            if opcode == Opcode.HELLO:
                hello = Hello.from_frame(frame)
                if hello.fingerprint != self.fingerprint:
                    raise ProtocolError(
                        f"model fingerprint mismatch: this worker serves {self.info.model_type} model "
                        f"{self.fingerprint}, the backbone runs {hello.fingerprint}"
                    )
                return self.info.to_frame(rid), True
            if opcode == Opcode.DISPATCH:
                if not greeted:
                    raise ProtocolError("DISPATCH before HELLO: send HELLO with the model fingerprint first")
                return self.store.run(Dispatch.from_frame(frame)).to_frame(rid), greeted
            raise ProtocolError(f"unexpected opcode {opcode.name} from a client")
        except MoeSwarmError as error:
            log.warning("request %d refused: %s", rid, error)
            return ErrorReply("bad_request", str(error)).to_frame(rid), greeted
        except Exception as error:  # a bug on our side: report it and keep serving
            log.exception("request %d failed", rid)
            return ErrorReply("internal", f"{type(error).__name__}: {error}").to_frame(rid), greeted

    async def _fail(self, writer: asyncio.StreamWriter, rid: int, code: str, message: str) -> None:
        log.warning("closing connection: %s", message)
        try:
            writer.writelines(ErrorReply(code, message).to_frame(rid).encode())
            await writer.drain()
        except (ConnectionError, OSError):
            pass
