"""POST /v1/embeddings: the model's own hidden states, pooled.

An input's embedding is the mean, over its tokens, of the last layer's hidden states after the
model's final norm (what the output head reads: captured at the head's input), in float32, scaled
to unit length (L2). The forward is a plain one of the input alone (no KV cache kept), run on the
engine's thread between two steps (Engine.run_between_steps), its MoE layers served by the swarm
as any step's are. An input is a text or token ids; a list of either gives one embedding each.

H = hidden size, n = tokens.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Literal

import torch
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from moeswarm.errors import MoeSwarmError, one_line
from moeswarm.forward.stepper import Stepper
from moeswarm.serve.responses import APIError
from moeswarm.serve.state import check_ids, engine_for

MAX_INPUTS = 64  # inputs per request


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings body. `dimensions` is taken only equal to the hidden size (no truncation)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    input: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1)
    user: StrictStr | None = None

    @property
    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        return list(self.input)


def pooled(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """The embedding of `tokens` ([H] float32, unit length): their final hidden states [n, H], averaged."""
    captured: list[torch.Tensor] = []
    head = model.get_output_embeddings()
    hook = head.register_forward_pre_hook(lambda module, args: captured.append(args[0].detach()))
    try:
        Stepper(model).forward(tokens)  # a cache of its own, dropped after
    finally:
        hook.remove()
    states = captured[-1].reshape(-1, captured[-1].shape[-1])[-len(tokens):].float()  # [n, H]
    mean = states.mean(dim=0)  # [H]
    return mean / mean.norm().clamp_min(1e-12)


def add_embedding_routes(app: FastAPI, state) -> None:
    """Register POST /v1/embeddings on `app` (state: serve/state.py ServeState)."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        engine = engine_for(state, body)
        inputs = body.inputs
        if not inputs or len(inputs) > MAX_INPUTS:
            raise APIError(400, f"input: from 1 to {MAX_INPUTS} inputs", param="input")
        hidden = engine.swarm.model.config.hidden_size
        if body.dimensions is not None and body.dimensions != hidden:
            raise APIError(400, f"dimensions: this model's embeddings have {hidden} dimensions (no other size is "
                                "made)", param="dimensions")
        token_lists = [state.codec.encode(given) if isinstance(given, str) else list(given) for given in inputs]
        for tokens in token_lists:
            if not tokens:
                raise APIError(400, "input: an input gives no tokens", param="input")
            if len(tokens) > state.context:
                raise APIError(400, f"input: an input of {len(tokens)} tokens is longer than the context "
                                    f"({state.context})", param="input")
            check_ids(state, tokens, "input")
        model = engine.swarm.model
        vectors = []
        for tokens in token_lists:
            future = engine.run_between_steps(lambda tokens=tokens: pooled(model, tokens))
            try:
                vectors.append(await asyncio.wrap_future(future))
            except MoeSwarmError as error:  # a worker gone, the server stopping: retry later
                raise APIError(503, one_line(error)) from None
        data = [{"object": "embedding", "index": index, "embedding": _encoded(vector, body.encoding_format)}
                for index, vector in enumerate(vectors)]
        count = sum(len(tokens) for tokens in token_lists)
        return {"object": "list", "data": data, "model": state.model_id,
                "usage": {"prompt_tokens": count, "total_tokens": count}}


def _encoded(vector: torch.Tensor, encoding: str) -> list[float] | str:
    """The vector as a JSON list, or (base64) its little-endian float32 bytes, as OpenAI sends them."""
    if encoding == "base64":
        return base64.b64encode(vector.contiguous().numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()
