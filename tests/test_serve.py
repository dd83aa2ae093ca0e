"""`moeswarm serve` as a user runs it: a real server process, real workers, the official openai client.

One server on the trained model (with a chat template added) runs with --check-local, so every
batched step is also run on a local eager model and compared bit for bit; a second one on a tiny
model with an API key takes the bad requests.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from moeswarm.bundled import TRAINED
from moeswarm.engine.generate import generate
from moeswarm.engine.whole_model import WholeModel
from moeswarm.local.workers import local_workers, spawn_worker, split_experts, stop, wait_listening
from moeswarm.sources.loading import load_local
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm_bench.serve_process import ServeProcess

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def __init__(self):\n", "for i in range(10):\n"]
KEY = "sk-test-key"


class Server(ServeProcess):
    def metric(self, name: str, headers: dict | None = None) -> float:
        return self.metrics(headers).get(name, 0.0)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    """The trained model with a chat template in its tokenizer config (the weights are linked, not copied)."""
    path = tmp_path_factory.mktemp("pymoe-chat")
    for item in TRAINED.iterdir():
        if item.suffix == ".safetensors":
            (path / item.name).symlink_to(item)
        else:
            shutil.copy(item, path / item.name)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CHAT_TEMPLATE}))
    return str(path)


@pytest.fixture(scope="module")
def trained_server(chat_model):
    with local_workers(chat_model, split_experts(32, 2)) as workers:
        server = Server(chat_model, workers, "--check-local", "--speculate", "3", "--model-name", "pymoe")
        try:
            server.wait_ready()
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def client(trained_server):
    return openai.OpenAI(base_url=trained_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def alone(chat_model):
    """Greedy tokens of a prompt run alone on the local eager model (what `generate --check-local` equals)."""
    model = load_local(chat_model)
    codec = load_text_codec(chat_model, model.config.vocab_size)

    def run(prompt: str, max_tokens: int) -> str:
        result = generate(WholeModel(model), codec.encode(prompt), max_tokens, codec=codec)
        return codec.decode([t for t in result.tokens if t != codec.eos_token_id])

    return run


def _stream_text(client, prompt: str, max_tokens: int, **options) -> tuple[str, str]:
    text, finish = [], None
    for chunk in client.completions.create(model="pymoe", prompt=prompt, max_tokens=max_tokens, stream=True, **options):
        text.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def test_concurrent_greedy_streams_equal_each_prompt_run_alone(trained_server, client, alone):
    before_steps = trained_server.metric("moeswarm_steps_total")
    before_trips = trained_server.metric("moeswarm_step_round_trips_sum")
    before_groups = trained_server.metric("moeswarm_step_groups_sum")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: _stream_text(client, p, 16, temperature=0), PROMPTS))
    for prompt, (text, finish) in zip(PROMPTS, results):
        assert text == alone(prompt, 16)
        assert finish in ("length", "stop")
    steps = trained_server.metric("moeswarm_steps_total") - before_steps
    trips = trained_server.metric("moeswarm_step_round_trips_sum") - before_trips
    assert 0 < steps < 4 * 16  # requests shared steps
    groups = trained_server.metric("moeswarm_step_groups_sum") - before_groups
    assert steps <= groups <= 2 * steps  # one or two batches in flight (engine/group_policy.py)
    assert trips == 6 * groups  # one round trip per MoE layer per group, whatever the number of requests
    assert trained_server.metric("moeswarm_check_local_logits_total") > 0
    assert trained_server.metric("moeswarm_check_local_mismatched_logits_total") == 0


def test_models_health_and_usage(trained_server, client):
    assert [m.id for m in client.models.list().data] == ["pymoe"]
    assert httpx.get(trained_server.url + "/health").json()["status"] == "ok"
    reply = client.completions.create(model="pymoe", prompt=PROMPTS[1], max_tokens=5, temperature=0)
    assert 1 <= reply.usage.completion_tokens <= 5
    assert reply.usage.prompt_tokens == len(load_text_codec(TRAINED, 4096).encode(PROMPTS[1]))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_sampling_with_a_seed_is_reproducible(client):
    options = dict(model="pymoe", prompt=PROMPTS[0], max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    first = client.completions.create(**options).choices[0].text
    second = client.completions.create(**options).choices[0].text
    assert first == second and first


def test_stop_strings_cut_the_text(client, alone):
    full = alone(PROMPTS[0], 16)
    stop = full[5:8]
    reply = client.completions.create(model="pymoe", prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop])
    assert reply.choices[0].text == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_chat_uses_the_model_template(client, alone):
    reply = client.chat.completions.create(model="pymoe", messages=[{"role": "user", "content": "def f(x):"}],
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == alone("<|user|>def f(x):\n<|assistant|>", 8)
    stream = client.chat.completions.create(model="pymoe", messages=[{"role": "user", "content": "def f(x):"}],
                                            max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content


def test_raw_sse_ends_with_done_and_carries_usage(trained_server):
    body = {"model": "pymoe", "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", trained_server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2][6:])["usage"]
    assert usage["completion_tokens"] == 4


def test_a_repeated_prompt_reuses_its_prefix_in_whole_prefill_chunks(client):
    prompt = "".join(f"def parse_{i}(line):\n    parts = line.split(',')\n" for i in range(6))  # over 64 tokens
    client.completions.create(model="pymoe", prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model="pymoe", prompt=prompt + "    return", max_tokens=4, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 64 == 0  # the rest is prefilled in the chunks it has alone (--prefill-chunk 64)


def test_a_client_that_goes_away_frees_its_slot(trained_server):
    body = {"model": "pymoe", "prompt": PROMPTS[2], "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", trained_server.url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 30
    while trained_server.metric("moeswarm_active_sequences") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert trained_server.metric("moeswarm_active_sequences") == 0


# -- bad requests, the API key, a lost worker -------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_server(qwen2_moe, qwen2_workers):
    server = Server(qwen2_moe, qwen2_workers, "--ctx-size", "64", "--model-name", "tiny", env={"MOESWARM_API_KEY": KEY})
    try:
        server.wait_ready()
        yield server, qwen2_workers
    finally:
        server.stop()


def _post(server, path: str, body, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers=headers | {"Content-Type": "application/json"}, timeout=60)


@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/completions", "{not json", 400, "not valid JSON"),
    ("/v1/completions", {"prompt": "x"}, 400, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 64}, 400, "context"),
    ("/v1/completions", {"model": "tiny", "prompt": "y" * 80}, 400, "context"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 17}, 400, "from 1 to 16"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "functions": [{"name": "f"}]}, 400, "functions"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"1": 500}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, 400, "chat template"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/nothing", {}, 404, "unknown route"),
])
def test_bad_requests_get_the_right_status_in_openai_shape(tiny_server, path, body, status, words):
    server, _ = tiny_server
    response = _post(server, path, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert words in error["message"] and "\n" not in error["message"] and error["type"]


def test_the_api_key_guards_every_route_but_health(tiny_server):
    server, _ = tiny_server
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    assert _post(server, "/v1/completions", body, key=None).status_code == 401
    assert _post(server, "/v1/completions", body, key="wrong").json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    tiny = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert tiny.completions.create(model="tiny", prompt="ab", max_tokens=3, temperature=0).usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_a_lost_worker_fails_requests_with_a_clear_error_and_health_says_so(qwen2_moe, qwen2_workers):
    # experts 0-3 on conftest's first worker (it outlives the test); 4-7 on this test's own, which it kills
    processes = [spawn_worker(qwen2_moe, split_experts(8, 2)[1])]
    try:
        workers = [qwen2_workers[0], wait_listening(processes[0])]
        server = Server(qwen2_moe, workers, "--model-name", "tiny")
        try:
            server.wait_ready()
            tiny = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
            assert tiny.completions.create(model="tiny", prompt="ab", max_tokens=3).usage.completion_tokens == 3
            processes[0].send_signal(signal.SIGKILL)
            processes[0].wait(10)
            with pytest.raises(openai.APIStatusError) as failed:
                tiny.completions.create(model="tiny", prompt="abc", max_tokens=3)
            assert failed.value.status_code == 503 and workers[1] in failed.value.message
            deadline = time.monotonic() + 30
            while httpx.get(server.url + "/health").status_code != 503 and time.monotonic() < deadline:
                time.sleep(0.2)
            health = httpx.get(server.url + "/health")
            assert health.status_code == 503 and workers[1] in " ".join(health.json()["problems"])
            assert tiny.models.list().data[0].id == "tiny"  # still serving
        finally:
            server.stop()
    finally:
        stop(processes)


def test_model_name_is_the_directory_name():
    from moeswarm.commands.serve import _model_name

    assert _model_name(Path("models/pymoe/hf")) == "pymoe"
    assert _model_name(Path("/x/tiny")) == "tiny"
    assert _model_name(Path("/x/Qwen3-30B-Q4_K_M.gguf")) == "Qwen3-30B-Q4_K_M"
