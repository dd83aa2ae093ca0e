"""serve's connection slots (issue 62): a reconnecting slowloris holds at most its address's share,
and one waiting for its headers gives its slot to a client that sends its request at once."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from moeswarm.serve.http_limits import limited_protocol


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def server():
    """A uvicorn server with 8 slots, a share of 2 per address, quiet after 0.2 s: its port."""
    config = uvicorn.Config(_app, host="127.0.0.1", port=0, log_level="error", lifespan="off",
                            http=limited_protocol(30.0, 30.0, 8, max_per_address=2, quiet_s=0.2))
    running = uvicorn.Server(config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(running.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not running.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield running.servers[0].sockets[0].getsockname()[1]
    running.should_exit = True
    thread.join(10)


def _slow(port: int, source: str) -> socket.socket:
    """A slowloris connection from `source`: half a request line, then nothing."""
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET / HT")
    return sock


def _get(port: int, source: str = "127.0.0.1") -> int:
    """One whole request; its HTTP status (0: the connection was closed without an answer)."""
    with socket.socket() as sock:
        sock.settimeout(5)
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
        try:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            reply = sock.recv(1024)
        except ConnectionResetError:
            return 0
    return int(reply.split()[1]) if reply.startswith(b"HTTP/1.1") else 0


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(0.5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_a_slowloris_holding_every_slot_cannot_keep_another_address_out(server):
    slow = [_slow(server, "127.0.0.2") for _ in range(8)]  # the whole cap, trickling headers
    time.sleep(0.1)
    started = time.monotonic()
    assert [_get(server) for _ in range(5)] == [200] * 5  # each takes a slot of the address over its share
    assert time.monotonic() - started < 2.0
    assert sum(_closed(s) for s in slow) == 1  # one slot taken; each request then frees it for the next
    for sock in slow:
        sock.close()


def test_a_client_sending_its_request_at_once_gets_a_slot_waited_on_by_a_slowloris_of_its_own_address(server):
    slow = [_slow(server, "127.0.0.1") for _ in range(8)]
    time.sleep(0.3)  # quiet past 0.2 s
    assert _get(server) == 200
    assert sum(_closed(s) for s in slow) == 1  # the one that waited longest gave its slot up
    for sock in slow:
        sock.close()


def test_with_no_slot_to_take_the_newcomer_is_closed(server):
    slow = [_slow(server, "127.0.0.3") for _ in range(8)]  # not quiet yet, and its own address holds them
    assert _get(server, "127.0.0.3") == 0
    assert not any(_closed(s) for s in slow)
    for sock in slow:
        sock.close()
