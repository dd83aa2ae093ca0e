"""The shared expert computed while the layer's trip is in flight: bit-identical to eager for a
family that calls it before the experts (qwen2_moe) and one that calls it after (deepseek_v3),
and really between the send and the reply."""

from __future__ import annotations

import torch

from moeswarm.forward.stepper import Stepper
from moeswarm.model.experts import experts_modules
from moeswarm.sources.loading import load_local
from moeswarm.swarm import open_swarm

STEPS = 5


class RecordingLink:
    """A worker link that notes when a layer's request leaves and when its reply is taken."""

    def __init__(self, link, events: list):
        self._link, self._events, self._layers = link, events, {}

    def __getattr__(self, name):
        return getattr(self._link, name)

    def prepare(self, request):
        prepared = self._link.prepare(request)
        self._layers[id(prepared)] = request.layer
        return prepared

    def send(self, prepared):
        layer = self._layers.pop(id(prepared))
        self._events.append(("send", layer))
        pending = self._link.send(prepared)
        self._layers[pending.request_id] = layer
        return pending

    def wait(self, pending, deadline):
        reply = self._link.wait(pending, deadline)
        self._events.append(("reply", self._layers.pop(pending.request_id)))
        return reply


def _decode_equal(swarm, local, prompt: list[int]) -> None:
    remote, eager = Stepper(swarm.model), Stepper(local)
    feed = prompt
    for step in range(1 + STEPS):
        remote_logits, local_logits = remote.forward(feed), eager.forward(feed)
        assert torch.equal(remote_logits, local_logits), f"logits differ at step {step}"
        feed = [int(remote_logits[-1].argmax())]


def _overlapped(swarm) -> list[int]:
    return [m._moeswarm.shared.overlapped for _, m in experts_modules(swarm.model).values()]


def test_shared_expert_runs_between_send_and_reply(qwen2_moe, qwen2_workers):
    local = load_local(qwen2_moe)
    events: list = []
    with open_swarm(qwen2_moe, qwen2_workers, local_experts={0: (2, 6)},
                    wrap_link=lambda _, link: RecordingLink(link, events)) as swarm:
        assert swarm.set_overlap(True) == len(swarm.moe_layers)
        for layer, (name, _) in experts_modules(swarm.model).items():
            block = swarm.model.get_submodule(name.rsplit(".", 1)[0])
            block.shared_expert.down_proj.register_forward_hook(lambda *_, layer=layer: events.append(("shared", layer)))
        _decode_equal(swarm, local, list(range(3, 20)))
        calls = (1 + STEPS) * len(swarm.moe_layers)
        assert _overlapped(swarm) == [1 + STEPS] * len(swarm.moe_layers)
        assert sum(1 for e in events if e[0] == "shared") == calls
        for index, event in enumerate(events):  # each layer: its sends, then the shared expert, then replies
            if event[0] == "shared":
                before, after = events[:index], events[index + 1:]
                assert before and before[-1] == ("send", event[1])
                assert after == [] or after[0] == ("reply", event[1])

        swarm.set_overlap(False)  # off: the block computes it where it calls it, before the send
        events.clear()
        _decode_equal(swarm, local, list(range(5, 15)))
        assert events[0][0] == "shared" and _overlapped(swarm) == [1 + STEPS] * len(swarm.moe_layers)


def test_shared_expert_called_after_the_experts(tiny_models):
    """deepseek_v3 calls its shared experts after the routed ones, on the same hidden states."""
    path = tiny_models("deepseek_v3")
    local = load_local(path)
    with open_swarm(path, [], local_experts=list(range(8))) as swarm:
        assert swarm.set_overlap(True) == len(swarm.moe_layers) > 0
        _decode_equal(swarm, local, list(range(3, 20)))
        assert _overlapped(swarm) == [1 + STEPS] * len(swarm.moe_layers)
