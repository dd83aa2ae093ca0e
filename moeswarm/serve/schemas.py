"""Request bodies of the OpenAI-compatible routes, validated by pydantic before any work is done.

Every field either works or is refused by name (serve/fields.py: undeclared fields get a 400 naming
them; user, metadata and OpenAI's other no-effect hints are accepted). vLLM's extensions that are
built here: top_k, min_p, repetition_penalty, ignore_eos, min_tokens, prompt_logprobs, and for chat
echo, add_generation_prompt and continue_final_message. A string with a lone surrogate (JSON
allows "\\ud800", UTF-8 cannot carry it) is refused wherever it is.
"""

from __future__ import annotations

from typing import Literal

from moeswarm.errors import printable
from moeswarm.serve.fields import refused_fields
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
MAX_N = 16  # completions per prompt
MAX_PROMPTS = 64  # prompts per completions request
MAX_TOP_LOGPROBS = 20
class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: StrictStr = "response"
    json_schema: dict = Field(default_factory=dict, alias="schema")  # "schema" shadows a BaseModel attribute
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON matching a schema (decoding is constrained)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format: type json_schema needs json_schema: {name, schema, strict}")
        return self

    @property
    def output_schema(self) -> dict | None:
        """The JSON schema output must match, or None (plain text)."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            return self.json_schema.json_schema or {}
        return None


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class Sampling(BaseModel):
    """The options both routes share."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=0)  # not OpenAI's: llama-server's and vLLM's extension; 0 is off
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    speculate: StrictInt | None = Field(None, ge=0, le=16)  # moeswarm's: most n-gram drafts per step for this request
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)  # vLLM's and llama-server's extension; 1.0 is off
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM's and llama-server's extension; 0.0 is off
    logit_bias: dict[str, float] | None = None  # OpenAI's: {"token id": -100 to 100}
    ignore_eos: StrictBool = False  # vLLM's: the end-of-text token does not end the output (max_tokens does)
    min_tokens: StrictInt = Field(0, ge=0)  # vLLM's: no end-of-text and no stop string before this many tokens
    # vLLM's: the prompt's tokens scored, each with this many alternatives (not with stream, as in vLLM)
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token, bias) pairs (keys checked to be ids by `_supported`)."""
        return tuple(sorted((int(token), float(value)) for token, value in (self.logit_bias or {}).items()))
    response_format: ResponseFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data):
        return _check_text(data)

    @model_validator(mode="after")
    def _supported(self):
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n: from 1 to {MAX_N} completions")
        refused = refused_fields(self.model_extra or {})
        if refused:
            raise ValueError(refused)
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available with stream true (as in vLLM)")
        for token, value in (self.logit_bias or {}).items():
            if not token.isdigit() or not -100 <= value <= 100:
                raise ValueError("logit_bias: maps token ids (as strings) to numbers from -100 to 100")
        stops = self.stops
        if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop: at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(Sampling):
    # a text, token ids, or a list of either (one completion per prompt, times n)
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(None, ge=0)  # None: serve's --max-tokens (16, OpenAI's default); 0: echo only
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token; 0: the token's only
    best_of: StrictInt | None = None

    @model_validator(mode="after")
    def _prompts(self):
        if (self.best_of or self.n) != self.n:
            raise ValueError("best_of: not supported by this server (only best_of equal to n)")
        if not self.prompt:
            raise ValueError("prompt: give a prompt (a text or token ids)")
        if len(self.prompts) > MAX_PROMPTS:
            raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts in one request")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only for scoring a prompt, with echo")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text or a list of token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TokenizeRequest(BaseModel):
    """llama-server's POST /tokenize."""

    content: StrictStr
    add_special: StrictBool = False
    with_pieces: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data):
        return _check_text(data)


class DetokenizeRequest(BaseModel):
    """llama-server's POST /detokenize."""

    tokens: list[StrictInt]


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        extra = self.model_extra or {}
        for key in ("tool_calls", "tool_call_id", "name"):  # what chat templates read of tool turns
            if extra.get(key) is not None:
                message[key] = extra[key]
        return message


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)  # None: serve's --max-tokens, else until the context is full
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # false: at most one call per answer (serve/tools.py)
    echo: StrictBool = False  # vLLM's: an answer continuing an assistant message starts with that message's text
    add_generation_prompt: StrictBool = True  # vLLM's: the template opens the assistant's turn
    continue_final_message: StrictBool = False  # vLLM's: the last message is continued, its turn left open

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be true with add_generation_prompt true (as in vLLM: "
                             "set add_generation_prompt false)")
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools with one name")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice: needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool is named {printable(choice.function.name, 64)!r}")
        return self

    @property
    def tool_mode(self) -> str | None:
        """None (no tools, or tool_choice none), "auto", "required", or the name of the function to call."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def _check_text(data):
    where = _lone_surrogate(data)
    if where is not None:
        raise ValueError(f"{where}: the text holds a lone surrogate (\\ud800-\\udfff), which no UTF-8 text can carry")
    return data


def _lone_surrogate(value, where: str = "") -> str | None:
    """The path of the first string (key or value) in `value` holding a lone surrogate, else None."""
    if isinstance(value, str):
        return where or "body" if any("\ud800" <= c <= "\udfff" for c in value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            name = f"{where}.{key}" if where and isinstance(key, str) else str(key)
            found = _lone_surrogate(key, name) if isinstance(key, str) else None
            found = found or _lone_surrogate(item, name)
            if found:
                return printable(found, 100)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _lone_surrogate(item, f"{where}[{index}]")
            if found:
                return found
    return None
