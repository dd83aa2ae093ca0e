"""The fuzzer against a live worker process: a bounded run finds no crash, hang, wrong reply or leak.

`moeswarm bench fuzz --cases N` runs the same fuzzer longer. The fuzzer's own judgement is tested
too: a RESULT that differs from the local computation, or an "internal" ERROR, is counted.
"""

from __future__ import annotations

import torch

from moeswarm_bench.bench.fuzz import MARKER_ID, _Fuzzer, run_fuzz
from moeswarm_bench.bench.fuzz_cases import Case, CaseMaker, Shape, is_framed
from moeswarm.wire.config import CombineMode
from moeswarm.wire.frames import HEADER_SIZE, Frame, parse_header
from moeswarm.wire.messages import Dispatch, ErrorReply, Result

CI_CASES = 1200


def test_a_bounded_fuzz_run_finds_nothing():
    result = run_fuzz(CI_CASES, seed=11, batch=300)
    assert (result["crashes"], result["hangs"], result["wrong_replies"], result["internal_errors"]) == (0, 0, 0, 0), \
        result["findings"]
    assert result["health_checks"] == CI_CASES // 300 + 1
    assert set(result["kinds"]) == {"random-bytes", "mutated", "odd-metadata", "adversarial"}
    # The cases reach the experts, not only the parsers: some RESULTs came back and were checked.
    assert result["replies"].get("result", 0) >= CI_CASES // 20, result["replies"]
    assert result["replies"].get("error:bad_request", 0) >= CI_CASES // 4, result["replies"]
    assert result["worker_rss_mb_after"] - result["worker_rss_mb_before"] < 50, result
    assert result["worker_open_files_after"] <= result["worker_open_files_before"] + 1, result


SHAPE = Shape(hidden=8, num_experts=8, layers=(0,), held=(0, 1, 2, 3), max_tokens=64, max_top_k=8)


class _Oracle:
    """Answers every DISPATCH with a fixed RESULT: what a correct worker would send."""

    shape = SHAPE
    fingerprint = "hf-test"

    def __init__(self, answer: Frame):
        self._answer = answer

    def answer(self, frame: Frame) -> Frame:
        return Frame(self._answer.opcode, frame.request_id, self._answer.meta, self._answer.payload)


def _judge(oracle_reply: Frame, worker_reply: Frame) -> dict:
    request = Dispatch(0, torch.ones(2, 8), torch.tensor([[0, 1], [2, -1]]), torch.ones(2, 2)).to_frame(5)
    data = request.to_bytes()
    fuzzer = _Fuzzer("unused", [0, 1, 2, 3], _Oracle(oracle_reply), seed=0)
    fuzzer._check(Case("adversarial", data, True), parse_header(data[:HEADER_SIZE]), worker_reply)
    return dict(fuzzer.counts)


def _result(value: float) -> Frame:
    return Result(0, CombineMode.EXACT, torch.full((3, 8), value), [0, 1, 2], [1, 1, 1]).to_frame(5)


def test_the_fuzzer_counts_wrong_results_and_internal_errors():
    assert _judge(_result(1.0), _result(1.0)) == {}
    assert _judge(_result(1.0), _result(1.0 + 2**-20)) == {"wrong": 1}
    refusal = ErrorReply("bad_request", "expert 9 is not held").to_frame(5)
    assert _judge(refusal, _result(1.0)) == {"wrong": 1}  # a RESULT where the worker must refuse
    assert _judge(_result(1.0), refusal) == {"wrong": 1}  # a refusal of what the worker must serve
    assert _judge(_result(1.0), ErrorReply("busy", "worker busy").to_frame(5)) == {}  # load, not a fault
    assert _judge(_result(1.0), ErrorReply("internal", "IndexError: boom").to_frame(5)) == {"internal": 1}


def test_cases_are_reproducible_and_cover_every_kind():
    first, again = CaseMaker(SHAPE, seed=3), CaseMaker(SHAPE, seed=3)
    assert [first.next() for _ in range(50)] == [again.next() for _ in range(50)]
    maker = CaseMaker(SHAPE, seed=4)
    cases = [maker.next() for _ in range(400)]
    assert {case.kind for case in cases} == {"random-bytes", "mutated", "odd-metadata", "adversarial"}
    assert all(is_framed(case.data) for case in cases if case.framed)
    assert any(not case.framed for case in cases)
    assert MARKER_ID not in {parse_header(c.data[:HEADER_SIZE]).request_id for c in cases if c.framed}
