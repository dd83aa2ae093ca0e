"""What `moeswarm serve` is told: one frozen ServeOptions, each field a flag of the command.

Nothing here imports torch or the HTTP stack: the command builds its options before the server
module (serve/server.py) loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moeswarm.generation.draft_names import DEFAULT_DRAFT


@dataclass(frozen=True)
class ServeOptions:
    model: str  # model directory or GGUF file
    backbone_dtype: str = "file"  # a GGUF backbone's matrices: the file's encoding, or f32
    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free one
    api_key: str | None = None  # 'Authorization: Bearer KEY' on every route but /health
    model_name: str | None = None  # the model's id in the API (None: `model_name(path)`)
    log_level: str = "info"  # uvicorn's
    # the engine: how requests are stepped together
    ctx_size: int | None = None  # positions per request (None: the model's max_position_embeddings, else 4096)
    max_batch: int = 16
    speculate: int | None = None  # None: on where steps have remote trips (engine/speculation.py), else off
    speculate_policy: str = "goodput"  # or "fixed": up to `speculate` drafts every step
    draft: str = DEFAULT_DRAFT
    groups: int = 0
    prefill_chunk: int = 64
    step_tokens: int = 256
    cache_slots: int = 8
    check_local: bool = False  # every step also on a local eager model, mismatches counted
    workers: tuple[str, ...] = ()  # where the experts are (the stages, if any, come with the swarm's config)
    # the HTTP side
    chat_template: str | None = None  # a Jinja file or a name (None: the model's own)
    max_tokens: int | None = None  # a request's max_tokens when it gives none
    cors_origins: tuple[str, ...] = ()
    max_queue: int = 256
    max_connections: int = 512
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    drain_s: float = 30.0  # on SIGINT/SIGTERM: how long running requests may go on (serve/drain.py)


def model_name(path) -> str:
    """The model's id in the API by default: its GGUF file's stem, or its directory's name."""
    path = Path(path)
    if path.suffix == ".gguf":
        return path.stem
    return path.parent.name if path.name == "hf" else path.name  # models/pymoe/hf -> pymoe
