"""The HTTP API under hypothesis: whatever the body, the answer is a status below 500 in OpenAI's
error shape (or a whole answer), never a traceback, and the app keeps answering.

The app runs in-process (FastAPI's TestClient) over the bundled model's tokenizer, with a fake
engine that answers every job at once: the fuzzing is of the HTTP side, not of the model.
"""

from __future__ import annotations

import json

from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeswarm.bundled import TRAINED
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm.serve.api import ServeState, create_app
from moeswarm.engine.job import Delta, Finished, TokenLogprob


class AnsweringEngine:
    """Answers each job with one token at once (what the HTTP side relays is what is fuzzed)."""

    class config:
        max_batch = 4

    queue_depth = active = 0
    problems: list[str] = []

    def submit(self, job) -> None:
        token = 5
        scores = (TokenLogprob(token, -1.0, ((token, -1.0),)),) if job.logprobs is not None else ()
        job.emit(Delta("x", (token,), scores))
        job.emit(Finished("length", len(job.prompt), 1, 0))


def _app() -> TestClient:
    codec = load_text_codec(TRAINED, 4096)
    state = ServeState("m", codec=codec, context=64, vocab_size=4096)
    state.engine = AnsweringEngine()
    return TestClient(create_app(state), raise_server_exceptions=False)


CLIENT = _app()
text = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF, blacklist_categories=()), max_size=12)
scalar = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | text
value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                     max_leaves=8)
FIELDS = ["model", "prompt", "messages", "max_tokens", "n", "logprobs", "top_logprobs", "echo", "temperature", "top_p",
          "top_k", "min_p", "seed", "stop", "stream", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "response_format", "tools", "tool_choice", "logit_bias", "stream_options", "speculate", "best_of"]
GOOD = {"/v1/completions": {"model": "m", "prompt": "def f"},
        "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
# values a client might plausibly send for a field (small numbers, token ids, texts, shapes of
# OpenAI's objects), and anything at all
plausible = (st.integers(-2, 40) | st.floats(-3, 3) | st.booleans() | text | st.lists(st.integers(-1, 5000), max_size=5)
             | st.lists(st.lists(st.integers(0, 4095), max_size=4), max_size=3) | st.lists(text, max_size=3)
             | st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "function", "x"])},
                                     optional={"json_schema": value, "function": value}) | value)
body = st.fixed_dictionaries({}, optional={name: plausible for name in FIELDS if name != "model"})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(route=st.sampled_from(sorted(GOOD)), base=st.booleans() | st.just(True), extra=body)
def test_any_body_gets_an_answer_in_openai_shape(route, base, extra):
    sent = (GOOD[route] if base else {}) | extra
    try:
        content = json.dumps(sent).encode("utf-8", "surrogatepass")  # lone surrogates too, as raw UTF-8 bytes
    except (ValueError, OverflowError):
        return
    response = CLIENT.post(route, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, response.text
    reply = response.json() if not sent.get("stream") or response.status_code != 200 else None
    if response.status_code != 200:
        error = reply["error"]
        assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    elif reply is not None:
        assert reply["choices"] and reply["usage"]["completion_tokens"] >= 1


def test_a_bug_in_a_route_is_a_500_in_openai_shape_not_a_plain_text_page():
    app = create_app(ServeState("m"))

    @app.get("/boom")
    async def boom():
        raise RuntimeError("kaputt\nsecond line")

    response = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert response.status_code == 500
    assert response.json()["error"] == {"message": "internal error: kaputt second line", "type": "server_error",
                                        "param": None, "code": None}
