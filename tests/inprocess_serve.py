"""The HTTP side and a real engine in this process: the whole model computing its own experts
(local mode), requests through FastAPI's TestClient (or the openai client over it)."""

from __future__ import annotations

import contextlib

import openai
from fastapi.testclient import TestClient

from moeswarm.sources.loading import load_local
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm.serve.api import ServeState, create_app
from moeswarm.engine.engine import Engine, EngineConfig
from moeswarm.swarm import open_swarm


@contextlib.contextmanager
def in_process_serve(model: str, name: str = "m", check_local: bool = False, **config):
    """Yields (TestClient, openai client, engine); config: EngineConfig's fields (context: the model's)."""
    swarm = open_swarm(model, [])
    vocab = swarm.model.config.vocab_size
    codec = load_text_codec(model, vocab)
    config.setdefault("context", swarm.model.config.max_position_embeddings)
    engine = Engine(swarm, codec, EngineConfig(**config), reference=load_local(model) if check_local else None)
    state = ServeState(name, codec=codec, context=config["context"], vocab_size=vocab)
    state.engine = engine
    engine.start()
    http = TestClient(create_app(state))
    try:
        yield http, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0), engine
    finally:
        engine.stop()
        swarm.close()
