"""POST /tokenize in both servers' shapes, told apart by their keys:

- llama-server's `{"content", "add_special", "with_pieces"}` -> `{"tokens": [ids or {id, piece}]}`;
- vLLM's `{"prompt", "add_special_tokens"}` or `{"messages", "add_generation_prompt", "tools"}` (the
  chat rendered by the chat template, as /v1/chat/completions renders it) -> `{"count", "max_model_len",
  "tokens", "token_strs"}` (`return_token_strs`: each token's text).

A body with neither `content`, `prompt` nor `messages` is a 400 naming them.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError, model_validator

from moeswarm.serve.schemas import ChatMessage, TokenizeRequest, Tool, _check_text
from moeswarm.serve.state import codec_of


class VllmTokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a prompt, or chat messages."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: StrictBool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: StrictBool = True
    tools: list[Tool] | None = None
    return_token_strs: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data):
        return _check_text(data)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


def add_tokenize_route(app: FastAPI, state) -> None:
    """Register POST /tokenize on `app` (state: serve/state.py ServeState)."""
    from moeswarm.errors import MoeSwarmError, one_line
    from moeswarm.serve.chat import NoChatTemplate, chat_prompt
    from moeswarm.serve.responses import APIError
    from moeswarm.serve.tools import template_tools

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _json_object(request)
        codec = codec_of(state)
        if "content" in body:
            given = _validated(TokenizeRequest, body)
            tokens = codec.encode(given.content)
            if given.add_special:
                tokens = _with_bos(codec, tokens)
            if given.with_pieces:
                return {"tokens": [{"id": t, "piece": codec.decode([t])} for t in tokens]}
            return {"tokens": tokens}
        if "prompt" not in body and "messages" not in body:
            raise APIError(400, "the body must give content (llama-server's shape), prompt or messages (vLLM's)")
        given = _validated(VllmTokenizeRequest, body)
        if given.prompt is not None:
            tokens = codec.encode(given.prompt)
            if given.add_special_tokens is not False:
                tokens = _with_bos(codec, tokens)
        else:
            messages = [m.as_template_input() for m in given.messages]
            try:
                tokens = chat_prompt(codec, messages, template_tools(given.tools))
                if not given.add_generation_prompt:  # the chat as it stands, no assistant turn opened
                    tokens = codec.encode(codec.tokenizer.apply_chat_template(
                        messages, tools=template_tools(given.tools), tokenize=False, add_generation_prompt=False))
            except NoChatTemplate as error:
                raise APIError(400, str(error), code="no_chat_template") from None
            except MoeSwarmError as error:
                raise APIError(400, one_line(error), param="messages") from None
            except Exception as error:  # the template's own checks raise from jinja
                raise APIError(400, f"the model's chat template refused these messages: {one_line(error)}",
                               param="messages") from None
            if given.add_special_tokens:
                tokens = _with_bos(codec, tokens)
        strs = [codec.decode([t]) for t in tokens] if given.return_token_strs else None
        return {"count": len(tokens), "max_model_len": state.context, "tokens": tokens, "token_strs": strs}


async def _json_object(request: Request) -> dict:
    from moeswarm.serve.responses import APIError

    try:
        body = await request.json()
    except ValueError:
        raise APIError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


def _validated(model: type[BaseModel], body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as error:  # the same 400 as any route's body (api.py's handler)
        raise RequestValidationError(error.errors()) from None


def _with_bos(codec, tokens: list[int]) -> list[int]:
    bos = getattr(codec.tokenizer, "bos_token_id", None) if codec.tokenizer is not None else None
    return tokens if bos is None else [bos] + tokens
