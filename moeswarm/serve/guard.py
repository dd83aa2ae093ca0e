"""What every request passes before a route: the drain (503 while shutting down), the API key, the
body's size; and the count of requests in flight and answered around it."""

from __future__ import annotations

import secrets
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from moeswarm.serve.drain import SHUTTING_DOWN, Drain
from moeswarm.serve.responses import APIError

MAX_BODY_BYTES = 4 * 1024 * 1024
OPEN_ROUTES = ("/health", "/", "/swarm")  # answered without the API key (the pages hold no data: they fetch it)


class Guard:
    """The key and body-size checks before any route, and the request count after it. A plain ASGI
    middleware (not @app.middleware, whose wrapped `receive` never reports that the client went away):
    a route waiting for a whole answer sees its client leave."""

    def __init__(self, app, state):  # state: serve/state.py ServeState (api_key, metrics)
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrived"] = time.monotonic()  # a request's arrival (its latency metrics)
        status = 500  # what a route that raised before answering ends in

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        request = Request(scope)
        drain = self.state.drain
        try:
            _check_draining(drain, request)
            _check_key(self.state, request)
            _check_body_size(request)
        except APIError as error:
            response = JSONResponse(error.body(), status_code=error.status, headers=error.headers)
            await response(scope, receive, send_and_note)
        else:
            drain.in_flight += 1
            try:
                await self.app(scope, receive, send_and_note)
            finally:
                drain.in_flight -= 1
                route = getattr(scope.get("route"), "path", "other")
                self.state.metrics.requests.labels(route, str(status)).inc()
            return
        self.state.metrics.requests.labels("other", str(status)).inc()


def _check_draining(drain: Drain, request: Request) -> None:
    """While the server drains (serve/drain.py), no new work: every POST, and /health, answer 503."""
    if drain.draining and (request.method == "POST" or request.url.path == "/health"):
        raise APIError(503, f"{SHUTTING_DOWN}: no new requests are taken", code="shutting_down",
                       headers={"Connection": "close"})


def _check_key(state, request: Request) -> None:
    if state.api_key is None or request.url.path in OPEN_ROUTES:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key")


def _check_body_size(request: Request) -> None:
    if request.method != "POST":
        return
    length = request.headers.get("content-length")
    if length is None:
        raise APIError(411, "a POST body needs a Content-Length header")
    if not length.isdigit() or int(length) > MAX_BODY_BYTES:
        raise APIError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
