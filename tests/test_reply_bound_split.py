"""A share whose RESULT would be over its worker's reply bound (--max-unsent-bytes, announced in
HELLO) goes as several DISPATCHes, each RESULT within the bound, combined back bit for bit."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from test_dispatcher import D, E, FakeLink, _routing, answer, reference

from moeswarm.dispatch.chunks import ReplyTooLarge, cut_share
from moeswarm.dispatch.dispatcher import Dispatcher
from moeswarm.dispatch.plan import plan_layer
from moeswarm.errors import WorkerError
from moeswarm.engine.generate import generate
from moeswarm.sources.loading import load_local
from moeswarm.placement.table import build_table
from moeswarm.swarm import open_swarm
from moeswarm.local.workers import spawn_worker, stop, wait_listening
from moeswarm.transport.tcp import TcpLink
from moeswarm.wire.config import EXACT, CombineMode, WireConfig
from moeswarm.wire.messages import Dispatch
from moeswarm.wire.result_size import reply_bytes


class BoundedLink(FakeLink):
    """A FakeLink announcing a reply bound, and refusing (as a worker does) a DISPATCH over it."""

    def __init__(self, name: str, held: list[int], bound: int):
        super().__init__(name, held)
        self.info = dataclasses.replace(self.info, max_result_bytes=bound)
        self.sizes: list[int] = []

    def send(self, request: Dispatch):
        exact = request.mode == CombineMode.EXACT
        routed = int((request.top_k_index >= 0).sum())
        rows = routed if exact else request.hidden.shape[0]
        size = reply_bytes(rows, D, request.wire_combine, min(routed, E) if exact else 0)
        if size > self.info.max_result_bytes:
            raise WorkerError(self.address, f"RESULT of {size} bytes would be over the limit")
        self.sizes.append(size)
        return super().send(request)


def _one_holder(bound: int, wire: WireConfig = EXACT) -> tuple[Dispatcher, BoundedLink]:
    link = BoundedLink("w", list(range(E)), bound)
    return Dispatcher([link], build_table({0: link.info.held}, E), wire), link


def test_a_share_over_the_bound_goes_in_pieces_of_whole_experts_and_combines_bit_for_bit():
    hidden, index, weights = _routing(64, 5)  # S = 64 x k rows, all to one holder
    whole = reply_bytes(int(index.numel()), D, "f32", E)
    dispatcher, link = _one_holder(whole // 3)
    out = dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))
    assert torch.equal(out, reference(hidden, index, weights))
    assert len(link.sizes) >= 3 and max(link.sizes) <= whole // 3
    call = dispatcher.accounting.calls[-1]
    assert call.round_trips == len(link.sizes)  # the pieces go one after another
    assert dispatcher.stats.takedowns == 0


def test_pieces_keep_each_experts_rows_together_and_in_order():
    hidden, index, weights = _routing(40, 8)
    (share,) = plan_layer(torch.zeros(E, dtype=torch.long), index, weights)
    bound = reply_bytes(int(index.numel()), D, "f32", E) // 2
    pieces = cut_share(share, CombineMode.EXACT, D, "f32", E, bound)
    assert len(pieces) >= 2
    seen = []
    for piece in pieces:
        result = answer(Dispatch(0, hidden[piece.tokens], piece.top_k_index, piece.top_k_weights))
        whole = answer(Dispatch(0, hidden[share.tokens], share.top_k_index, share.top_k_weights))
        for expert, block in zip(result.experts, torch.split(result.outputs, result.counts)):
            at = whole.experts.index(expert)
            start = sum(whole.counts[:at])
            assert torch.equal(block, whole.outputs[start:start + whole.counts[at]])  # the same rows, same order
            seen.append(expert)
        assert reply_bytes(int(result.outputs.shape[0]), D, "f32", len(result.experts)) <= bound
    assert seen == sorted(set(index.flatten().tolist()))  # every expert once, ascending across pieces


def test_partial_mode_cuts_runs_of_tokens():
    hidden, index, weights = _routing(50, 2)
    partial = WireConfig(CombineMode.PARTIAL)
    dispatcher, link = _one_holder(reply_bytes(20, D, "f32", 0), partial)
    out = dispatcher.combine(dispatcher.dispatch(1, hidden, index, weights))
    assert torch.allclose(out, reference(hidden, index, weights), atol=1e-5)
    assert len(link.sizes) == 3  # 20 + 20 + 10 tokens


def test_an_expert_whose_rows_alone_are_over_the_bound_is_a_one_line_error():
    hidden, index, weights = _routing(64, 5)
    dispatcher, link = _one_holder(reply_bytes(4, D, "f32", 4))
    with pytest.raises(WorkerError) as caught:
        dispatcher.dispatch(0, hidden, index, weights)
    message = str(caught.value)
    assert "\n" not in message and "over the" in message and "--max-unsent-bytes" in message
    assert link.sizes == [] and dispatcher.holders[0].usable  # nothing sent, nobody blamed
    (share,) = plan_layer(torch.zeros(E, dtype=torch.long), index, weights)
    with pytest.raises(ReplyTooLarge):
        cut_share(share, CombineMode.EXACT, D, "f32", E, reply_bytes(4, D, "f32", 4))


def test_a_real_worker_with_a_small_reply_bound_serves_a_long_prompt_bit_identically(qwen2_moe):
    """`moeswarm worker --max-unsent-bytes` small: the whole prefill's RESULT is refused by the
    worker, and the swarm's generate still equals the local model bit for bit."""
    bound = 16_000  # the tiny model's rows are 128 bytes: the prompt's 2 x 120 rows are ~31 KB (one expert takes ~100)
    process = spawn_worker(qwen2_moe, range(8), extra_args=["--max-unsent-bytes", str(bound)])
    try:
        address = wait_listening(process)
        prompt = [(7 * i + 3) % 250 for i in range(120)]
        reference = load_local(qwen2_moe)
        with open_swarm(qwen2_moe, [address]) as swarm:
            assert swarm.holdings() and swarm._dispatcher.links[0].info.max_result_bytes == bound
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                assert torch.equal(swarm.model(input_ids=ids).logits, reference(input_ids=ids).logits)
            prefill = swarm.layer_calls()
            assert prefill and all(call.round_trips >= 2 for call in prefill)  # every MoE layer's share went in pieces
            swarm.reset_accounting()
            result = generate(swarm, prompt, 6, 0, reference)
            assert result.bit_identical is True and len(result.tokens) == 6
        link = TcpLink(address)  # the same prefill's whole share, unsplit, is what the worker refuses
        try:
            link.connect(swarm.source.fingerprint)
            hidden = torch.randn(120, 32)
            index = torch.tensor([[i % 8, (i + 3) % 8] for i in range(120)])
            request = Dispatch(0, hidden, index, torch.full((120, 2), 0.5))
            with pytest.raises(WorkerError, match=f"would be over the limit of {bound} bytes"):
                link.wait(link.send(link.prepare(request)), time.monotonic() + 30)
        finally:
            link.close()
    finally:
        stop([process])
