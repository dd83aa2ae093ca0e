"""`serve`: the OpenAI-compatible gateway put together and run until it is stopped.

The order lives here once: the model is opened and the flags checked against it, and the port is
checked, before anything listens; the socket is bound (its port said through `on_listening`) and
the HTTP side answers (/health: 503 with the reason) while the backbone loads in a thread
(loader.py). A load that fails ends the server with that failure as a MoeSwarmError.

Process-wide settings (threads, the switch interval, logging) are the command's, made before this runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import uvicorn

from moeswarm.errors import MoeSwarmError
from moeswarm.sources.source import ModelSource, open_source
from moeswarm.serve.api import ServeState, create_app
from moeswarm.serve.chat import read_chat_template
from moeswarm.serve.drain import DrainingServer
from moeswarm.engine.config import EngineConfig
from moeswarm.serve.http_limits import limited_protocol, redact_access_log
from moeswarm.serve.loader import Backend, load
from moeswarm.serve.options import ServeOptions, model_name
from moeswarm.stages.find import StageWatch
from moeswarm.swarm_config import SwarmConfig
from moeswarm.worker.listen import check_can_listen

DEFAULT_CONTEXT = 4096  # positions per request for a model that does not say its own
GRACEFUL_SHUTDOWN_S = 5  # after the drain: for the last answers (the drain's final error events) to go out

Report = Callable[[str], None]
Stages = Sequence[Sequence[str]]  # per span of layers its replicas, in layer order
# (the model, discovery's progress lines) -> (the backbone's SwarmConfig, the stages to chain: () for none,
# the swarm they were found on when they were: stages/watch.py StageWatch, or None)
HoldersFor = Callable[[ModelSource, Report], tuple[SwarmConfig, Stages, StageWatch | None]]


def serve(options: ServeOptions, holders: HoldersFor,
          on_listening: Callable[[str, int], None] = lambda host, port: None,
          on_ready: Report = lambda line: None, before_load: Callable[[], None] = lambda: None) -> None:
    """Serve until the server is told to exit (SIGINT, SIGTERM): it then drains for up to
    options.drain_s (serve/drain.py) and stops.

    holders: the backbone's SwarmConfig, stages and stage watch for the opened model; its report sets what
    /health says while loading. on_listening(host, port): once bound, before the backbone loads;
    on_ready(line): once the engine runs (the model, its holders, the context). before_load(): once the
    model, the flags and the port are checked, before anything loads (the caller's process settings).
    MoeSwarmError (one line) for a bad model, context or template, a busy port, or a failed load.
    """
    source = open_source(options.model, options.backbone_dtype)  # a missing or broken model ends here, before anything listens
    context = _context(source, options.ctx_size)
    chat_template = read_chat_template(options.chat_template) if options.chat_template else None
    check_can_listen(options.host, options.port)
    before_load()
    engine = EngineConfig(context, options.max_batch, options.speculate, options.prefill_chunk, options.step_tokens,
                          options.cache_slots, draft=options.draft, groups=options.groups,
                          adaptive=options.speculate_policy == "goodput")
    state = ServeState(options.model_name or model_name(source.path), options.api_key,
                       default_max_tokens=options.max_tokens, max_queue=options.max_queue)
    config = uvicorn.Config(create_app(state, list(options.cors_origins)), host=options.host, port=options.port,
                            log_level=options.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            http=limited_protocol(options.header_timeout_s, options.body_timeout_s,
                                                  options.max_connections))
    redact_access_log()  # no API key in uvicorn's logs
    server = DrainingServer(config, state.drain, options.drain_s, lambda message: _end_all(state, message))
    fatal: list[str] = []

    def on_fatal(message: str) -> None:
        fatal.append(message)
        state.loading = f"failed: {message}"
        server.should_exit = True

    swarm, stages, watch = holders(source, lambda line: setattr(state, "loading", line))
    listener = config.bind_socket()  # --port 0: the port the system gave, said before anything else is
    on_listening(options.host, listener.getsockname()[1])
    backend = Backend(source, list(options.workers), swarm, engine, options.check_local, chat_template,
                      stages=tuple(stages), stage_watch=watch)
    threading.Thread(target=load, args=(state, backend, on_fatal, on_ready), name="moeswarm-load", daemon=True).start()
    try:
        server.run(sockets=[listener])
    finally:
        if state.engine is not None:
            state.engine.stop()
            state.engine.swarm.close()
        if watch is not None:
            watch.close()  # once the gateway has it, closed with it already: this is for a server that never opened it
    if fatal:
        raise MoeSwarmError(fatal[0])


def _end_all(state: ServeState, message: str) -> None:
    if state.engine is not None:
        state.engine.end_all(message)


def _context(source: ModelSource, ctx_size: int | None) -> int:
    """Positions per request: `ctx_size`, else the model's, else DEFAULT_CONTEXT; never more than the model's."""
    positions = getattr(source.config, "max_position_embeddings", None)
    context = ctx_size or positions or DEFAULT_CONTEXT
    if positions is not None and context > positions:
        raise MoeSwarmError(f"--ctx-size {context} is more than the model's {positions} positions (max_position_embeddings)")
    return context
