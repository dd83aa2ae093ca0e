"""Bringing the gateway up: the model and its workers, loaded while the HTTP side already answers.

/health says 503 with the reason until the engine runs. Workers that are not up yet are waited for
(the backbone loads once they accept connections); a model that cannot load ends the server.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from moeswarm.errors import MoeSwarmError, WorkerError, one_line
from moeswarm.ids import parse_address
from moeswarm.sources.loading import load_local
from moeswarm.sources.source import ModelSource
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm.serve.api import ServeState
from moeswarm.serve.chat import set_chat_template
from moeswarm.engine.config import EngineConfig
from moeswarm.engine.engine import Engine
from moeswarm.stages.link import StageError
from moeswarm.stages.find import StageWatch
from moeswarm.stages.gateway import open_gateway
from moeswarm.swarm import open_swarm
from moeswarm.swarm_config import SwarmConfig

RETRY_S = 2.0


@dataclass(frozen=True)
class Backend:
    source: ModelSource
    workers: Sequence[str]
    swarm: SwarmConfig
    engine: EngineConfig
    check_local: bool = False
    chat_template: str | None = None  # serve --chat-template's text: replaces the model's own
    stages: Sequence[Sequence[str]] = ()  # --stages: per span its replicas; a gateway over them (stages/)
    stage_watch: StageWatch | None = None  # --stages-swarm: the swarm they were found on, for stages announced later


def load(state: ServeState, backend: Backend, on_fatal: Callable[[str], None],
         on_ready: Callable[[str], None] = lambda line: None) -> None:
    """Run in a thread: fill `state` (codec, engine) and call `on_ready(line)`, or call `on_fatal(message)`."""
    try:
        state.codec = load_text_codec(backend.source, backend.source.config.vocab_size)
        if backend.chat_template is not None:
            set_chat_template(state.codec, backend.chat_template)
        state.vocab_size = backend.source.config.vocab_size
        state.context = backend.engine.context
        while True:
            _wait_for_workers(state, [replicas[0] for replicas in backend.stages] or backend.workers)
            state.loading = "loading the backbone and connecting to the workers"
            try:
                swarm = open_gateway(backend.source, list(backend.stages), backend.swarm, backend.stage_watch) \
                    if backend.stages \
                    else open_swarm(backend.source, backend.workers, backend.swarm)
                break
            except (WorkerError, StageError) as error:  # a holder still starting, or one that went away again
                state.loading = f"waiting for workers: {one_line(error)}"
                time.sleep(RETRY_S)
        reference = load_local(backend.source) if backend.check_local else None
        engine = Engine(swarm, state.codec, backend.engine, state.metrics, reference)
        engine.start()
        state.engine = engine
        holders = f"{len(swarm.workers)} workers" if backend.workers or backend.swarm.discovery is not None \
            else f"{len(backend.stages)} stages" if backend.stages else "local mode: every expert in this process"
        on_ready(f"ready ({swarm.model.config.model_type}, {holders}, {len(swarm.moe_layers)} MoE layers, "
                 f"context {backend.engine.context})")
    except MoeSwarmError as error:
        on_fatal(one_line(error))
    except Exception as error:  # a bug: said in one line here too, the server must not hang in "loading"
        on_fatal(f"internal error while loading: {one_line(error)}")


def _wait_for_workers(state: ServeState, workers: Sequence[str]) -> None:
    """Until every worker accepts a TCP connection (cheap: nothing is loaded meanwhile)."""
    while True:
        down = [w for w in workers if not _accepts(w)]
        if not down:
            return
        state.loading = f"waiting for workers: {', '.join(down)} not reachable"
        time.sleep(RETRY_S)


def _accepts(address: str) -> bool:
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=RETRY_S):
            return True
    except OSError:
        return False
