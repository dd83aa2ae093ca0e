"""The dashboard opened late: its data are right after thousands of layer calls nobody looked at.

The routing counts gather calls on the engine's thread (under torch.inference_mode) and count
them once PENDING_CALLS have gathered; a page opened afterwards, and polled while requests run,
must answer 200 with every routed row counted: none dropped, none counted twice. On the bundled
model (6 MoE layers) and on a toy as deep as a 48-layer model (where ~85 steps are enough).
"""

from __future__ import annotations

import threading
import time

import pytest
from starlette.testclient import TestClient  # noqa: F401 (the type of `http`)
from inprocess_serve import in_process_serve

from moeswarm.bundled import TRAINED
from moeswarm.placement.profile import PENDING_CALLS
from moeswarm.model.tiny import make_tiny_model


@pytest.fixture(scope="module")
def deep_toy(tmp_path_factory):
    return str(make_tiny_model("qwen2_moe", tmp_path_factory.mktemp("deep"), num_hidden_layers=48))


def _complete(http: TestClient, prompt: str, max_tokens: int) -> int:
    """One greedy completion; the rows it routed at each MoE layer (its last token is never fed)."""
    reply = http.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                                               "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["completion_tokens"] == max_tokens
    return usage["prompt_tokens"] + usage["completion_tokens"] - 1


@pytest.mark.parametrize("which", ["bundled", "deep_toy"])
def test_the_dashboard_is_right_when_opened_after_thousands_of_unobserved_calls(which, request):
    model = str(TRAINED) if which == "bundled" else request.getfixturevalue("deep_toy")
    with in_process_serve(model, cache_slots=0) as (http, _, engine):  # no prefix cache: every prompt routed
        swarm = engine.swarm
        layers = len(swarm.moe_layers)
        routed, at, each = 0, 0, min(240, PENDING_CALLS // layers + 20)
        while layers * engine.steps <= PENDING_CALLS:  # until the engine's thread has counted them itself
            routed += _complete(http, f"def f{at}(x):\n", each)
            at += 1
        traffic = threading.Thread(target=lambda: _complete(http, "import os\n", 40))
        traffic.start()
        polls = []
        while traffic.is_alive() or not polls:  # the page polls while a request runs
            polls.append(http.get("/v1/dashboard"))
            time.sleep(0.05)
        traffic.join()
        routed += len(http.app.state.serve.codec.encode("import os\n")) + 40 - 1
        assert [p.status_code for p in polls] == [200] * len(polls), polls[-1].text
        data = http.get("/v1/dashboard").json()
        k = swarm.model.config.num_experts_per_tok
        assert [data["routing"]["layers"][str(layer)]["tokens"] for layer in data["layers"]] == [routed] * layers
        assert [sum(row) for row in data["heat"]] == [routed * k] * layers
