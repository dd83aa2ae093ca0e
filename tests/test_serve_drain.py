"""Graceful shutdown with a real process and a real signal (serve/drain.py): during the drain new
requests get 503 naming the shutdown, a request that ends within the drain gets its whole answer,
a stream still running at the deadline ends with an error event and `data: [DONE]`, and an idle
server stops at once. The second server runs a bundled GGUF file, whose chat template it reads
from the file itself."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from moeswarm.bundled import TRAINED
from moeswarm_bench.serve_process import ServeProcess

DRAIN_S = 1.0
BUNDLED_Q8 = TRAINED.parent / "gguf" / "pymoe-Q8_0.gguf"


def test_sigint_drains_then_ends_running_streams_with_a_final_event():
    with ServeProcess(str(TRAINED), [], "--model-name", "pymoe", "--drain-seconds", str(DRAIN_S)) as server:
        server.wait_ready()
        eos = json.loads(open(TRAINED / "config.json").read()).get("eos_token_id", 0)
        # 8 choices of 240 tokens with the end of text banned: about 4 s here, far longer than the drain
        long = {"model": "pymoe", "prompt": "def f(x):\n", "max_tokens": 240, "n": 8, "temperature": 0,
                "stream": True, "logit_bias": {str(eos): -100}}
        short: list[httpx.Response] = []
        with httpx.stream("POST", server.url + "/v1/completions", json=long, timeout=60) as reply:
            lines = reply.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            asking = threading.Thread(target=lambda: short.append(httpx.post(
                server.url + "/v1/completions", json={"model": "pymoe", "prompt": "x = ", "max_tokens": 3,
                                                      "temperature": 0}, timeout=30)))
            asking.start()
            time.sleep(0.2)  # the short request is in before the signal
            server.process.send_signal(signal.SIGINT)
            signalled = time.monotonic()
            time.sleep(0.3)
            refused = httpx.post(server.url + "/v1/chat/completions", timeout=10,
                                 json={"model": "pymoe", "messages": [{"role": "user", "content": "hi"}]})
            assert refused.status_code == 503
            assert refused.json()["error"]["message"] == "the server is shutting down: no new requests are taken"
            assert httpx.get(server.url + "/health", timeout=10).status_code == 503
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        ended = time.monotonic() - signalled
        asking.join(timeout=30)
        assert short and short[0].status_code == 200
        assert short[0].json()["choices"][0]["finish_reason"] == "length"  # ended within the drain: whole
        assert rest[-1] == "[DONE]"
        final = json.loads(rest[-2])
        assert final["error"]["message"].startswith("the server is shutting down: this request did not end "
                                                    "within the drain (1 s)")
        assert all("choices" in json.loads(chunk) for chunk in rest[:-2])  # text until then
        assert DRAIN_S <= ended < DRAIN_S + 3
        server.process.wait(timeout=30)  # it stops by itself after the drain
        errors = server.process.stderr.read()
        assert "Traceback" not in errors, errors[-2000:]


def test_a_bundled_gguf_chats_out_of_the_box_and_an_idle_server_stops_at_once(trained_local):
    _, codec = trained_local
    with ServeProcess(str(BUNDLED_Q8), [], "--model-name", "pymoe", "--drain-seconds", "60") as server:
        server.wait_ready()
        messages = [{"role": "user", "content": "def add(a, b):"}]
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                           json={"model": "pymoe", "messages": messages, "max_tokens": 8, "temperature": 0})
        assert reply.status_code == 200, reply.text  # the file carries its chat template: no --chat-template
        rendered = codec.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert reply.json()["usage"]["prompt_tokens"] == len(codec.encode(rendered))  # the HF model's template
        assert reply.json()["choices"][0]["message"]["content"]
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=30)
        assert time.monotonic() - signalled < 10  # nothing in flight: no 60 s wait
