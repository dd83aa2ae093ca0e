"""OpenAI's response shapes: whole completions, stream chunks, usage, log-probabilities, errors (plain dicts)."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Sequence

from fastapi.exceptions import RequestValidationError

from moeswarm.errors import printable
from moeswarm.engine.job import Finished, TokenLogprob


class APIError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code, self.param)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(status)
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def total_usage(done: Sequence[Finished], n: int) -> dict:
    """Usage of a request's choices: each prompt counted once (its n choices share it), every completion."""
    prompts = done[::n]
    return usage(sum(d.prompt_tokens for d in prompts), sum(d.completion_tokens for d in done),
                 sum(d.cached_tokens for d in prompts))


class Logprobs:
    """One choice's log-probabilities in the route's shape: completions' four parallel lists, or
    chat's `content` list. `piece(token)` is the token's text."""

    def __init__(self, chat: bool, piece: Callable[[int], str], offset: int = 0):
        self.chat, self.piece, self.offset = chat, piece, offset

    def shape(self, scores: Sequence[TokenLogprob]) -> dict:
        if self.chat:
            return {"content": [self._chat_entry(s) for s in scores], "refusal": None}
        tokens, values, tops, offsets = [], [], [], []
        for score in scores:
            text = self.piece(score.token)
            tokens.append(text)
            values.append(score.logprob)
            tops.append(self._top_dict(score))
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _top_dict(self, score: TokenLogprob) -> dict | None:
        if score.logprob is None:
            return None
        pairs = score.top or ((score.token, score.logprob),)  # logprobs 0: the token itself (as vLLM)
        top: dict[str, float] = {}
        for token, value in pairs:
            top.setdefault(self.piece(token), value)  # two ids with one text: the likelier one's
        return top

    def _chat_entry(self, score: TokenLogprob) -> dict:
        text = self.piece(score.token)
        return {"token": text, "logprob": score.logprob, "bytes": list(text.encode("utf-8", "surrogatepass")),
                "top_logprobs": [{"token": (t := self.piece(token)), "logprob": value,
                                  "bytes": list(t.encode("utf-8", "surrogatepass"))} for token, value in score.top]}


class Shapes:
    """The bodies of one response: the same id, model and creation time in every chunk."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.id, self.created = new_id(chat), int(time.time())

    def choice(self, index: int, text: str, reason: str | None, logprobs: dict | None = None) -> dict:
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def call_choice(self, index: int, calls: list[dict], reason: str = "tool_calls", logprobs: dict | None = None,
                    content: str | None = None) -> dict:
        """A chat choice that calls tools (calls: serve/tools.py's call_entry each; none when an answer cut
        by max_tokens had not named its first call yet)."""
        message = {"role": "assistant", "content": content, "tool_calls": calls or None}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def call_chunk(self, index: int, call: dict) -> dict:
        """A stream chunk carrying a whole tool call (call: call_entry with its index)."""
        choice = {"index": index, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice])

    def whole(self, choices: list[dict], done: Sequence[Finished], n: int, prompt_logprobs: list | None = None) -> dict:
        """The whole answer; prompt_logprobs (vLLM's, chat only: completions carry them per choice)."""
        kind = "chat.completion" if self.chat else "text_completion"
        extra = {"prompt_logprobs": prompt_logprobs} if prompt_logprobs is not None else {}
        return self._envelope(kind, choices) | extra | {"usage": total_usage(done, n)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False, index: int = 0,
              logprobs: dict | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, done: Sequence[Finished], n: int) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(kind, []) | {"usage": total_usage(done, n)}

    def _envelope(self, kind: str, choices: list) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}


def prompt_logprobs(scores: Sequence[TokenLogprob], top: int, piece: Callable[[int], str]) -> list:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} holding the token and its `top` likeliest alternatives (ranks 1 to top)."""
    out: list = []
    for score in scores:
        if score.logprob is None:
            out.append(None)
            continue
        entry = {str(score.token): {"logprob": score.logprob, "rank": score.rank, "decoded_token": piece(score.token)}}
        for rank, (token, value) in enumerate(score.top[:top], start=1):
            entry.setdefault(str(token), {"logprob": value, "rank": rank, "decoded_token": piece(token)})
        out.append(entry)
    return out


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def validation_message(error: RequestValidationError) -> str:
    problems = error.errors()
    if not problems:
        return "invalid request body"
    first = problems[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}"
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = first.get("msg", "invalid").removeprefix("Value error, ")
    return printable(f"{where}: {message}" if where else message, 500)


def validation_param(error: RequestValidationError) -> str | None:
    problems = error.errors()
    if not problems or problems[0].get("type") == "json_invalid":
        return None
    loc = [str(p) for p in problems[0].get("loc", ()) if p != "body"]
    if loc:
        return loc[0]
    named = re.match(r"([A-Za-z_]\w*)[.\[:]", problems[0].get("msg", "").removeprefix("Value error, "))
    return named.group(1) if named else None  # a check of the whole body names its field first
