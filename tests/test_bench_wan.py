"""`moeswarm bench wan --quick`: every scenario's rows, with every count checked.

Timings depend on the machine and are not asserted; everything derived from them is (steps/s,
ratios, the limit line), and so is everything that does not depend on time: the rows' shape,
steps, round trips per step, the tokens, drafts and bytes. Bytes and tokens are derived from
the local eager model (the exact wire reproduces it bit for bit), with the wire's own encoders
sizing each frame (test_cli.py's helpers).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import torch
from test_cli import exact_traffic, frame_size, routed_calls

from moeswarm_bench.bench.wan_scenarios import FANOUT_RTT_S, PETALS_BANDWIDTH_BPS, PETALS_RTT_S, SPECULATE, load_prompts
from moeswarm.engine.generate import generate
from moeswarm.engine.whole_model import WholeModel
from moeswarm.forward.stepper import Stepper
from moeswarm.sources.loading import load_local
from moeswarm.model.tiny import make_tiny_model
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm.wire.messages import Dispatch, Result

MOE_LAYERS = 2
WORKERS = 4
FOUR_WORKERS = torch.arange(8) // 2  # owner [E]: split_experts(8, 4), experts {0, 1}, {2, 3}, {4, 5}, {6, 7}
QUICK_STEPS, QUICK_NEW_TOKENS, QUICK_WIDTHS = 3, 8, (1, 8)  # run_wan(quick=True)
HIDDEN = 32
BUILT_IN_SCENARIOS = "petals,fanout,speculation"  # the registered ones (wan_local.py, ...) are not in this smoke run


@pytest.fixture(scope="module")
def wan_model(tmp_path_factory) -> str:
    return str(make_tiny_model("qwen2_moe", tmp_path_factory.mktemp("wan") / "qwen2_moe", num_hidden_layers=2))


@pytest.fixture(scope="module")
def wan_result(wan_model) -> dict:
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "bench", "wan", "--quick", "--json", "--model", wan_model,
                           "--scenarios", BUILT_IN_SCENARIOS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def local(wan_model) -> dict:
    """What the bench must reproduce, computed on the local eager model."""
    model = load_local(wan_model)
    codec = load_text_codec(wan_model, model.config.vocab_size)
    room = model.config.max_position_embeddings - QUICK_NEW_TOKENS - SPECULATE - 2
    prompts = load_prompts(codec, min(128, room))
    prompt = prompts["non_repetitive"]

    greedy = routed_calls(model, lambda: generate(WholeModel(model), prompt, 1 + QUICK_STEPS))[MOE_LAYERS:]  # after the prefill

    def verify_steps(width: int) -> None:  # the fan-out scenario's wide forwards, at a fixed context
        stepper = Stepper(model)
        token = int(stepper.forward(prompt)[-1].argmax())
        for _ in range(QUICK_STEPS):
            stepper.forward([token] + prompt[len(prompt) - width + 1:])
            stepper.crop(len(prompt))

    wide = routed_calls(model, lambda: verify_steps(QUICK_WIDTHS[1]))[MOE_LAYERS:]
    generations = {(kind, speculate): generate(WholeModel(model), ids, QUICK_NEW_TOKENS, speculate, codec=codec, draft="ngram")
                   for kind, ids in prompts.items() for speculate in (0, SPECULATE)}
    return {"codec": codec, "prompts": prompts, "decode": exact_traffic(greedy, FOUR_WORKERS),
            "fanout": {1: exact_traffic(greedy, FOUR_WORKERS), QUICK_WIDTHS[1]: exact_traffic(wide, FOUR_WORKERS)},
            "generations": generations}


def _of(result: dict, scenario: str) -> list[dict]:
    return [r for r in result["rows"] if r["scenario"] == scenario]


def test_meta(wan_result, wan_model, local):
    meta = wan_result["meta"]
    assert (meta["model"], meta["model_type"], meta["moe_layers"], meta["hidden_size"]) == (wan_model, "qwen2_moe", MOE_LAYERS, HIDDEN)
    assert (meta["workers"], meta["quick"], meta["speculate"]) == (WORKERS, True, SPECULATE)
    assert (meta["steps_per_config"], meta["repeats"], meta["new_tokens"]) == (QUICK_STEPS, 1, QUICK_NEW_TOKENS)
    assert meta["prompts"] == {kind: len(ids) for kind, ids in local["prompts"].items()}
    assert meta["tokenizer"] == local["codec"].name
    assert meta["command"] == f"moeswarm bench wan --model {wan_model} --quick --scenarios {BUILT_IN_SCENARIOS}"
    assert [r["scenario"] for r in wan_result["rows"]] == ["petals"] * 11 + ["fanout"] * 4 + ["speculation"] * 5


def test_petals_rows(wan_result, local):
    petals = _of(wan_result, "petals")
    links = [(r["link"], r["rtt_ms"], r["bandwidth_bps"], r["wire"]) for r in petals]
    assert links == [("local", None, None, "local"), ("direct", None, None, "exact-f32"), ("direct", None, None, "wan-int8")] + [
        ("wan", 1e3 * rtt, bandwidth, wire) for rtt in PETALS_RTT_S for bandwidth in PETALS_BANDWIDTH_BPS
        for wire in ("exact-f32", "wan-int8")]
    for row in petals:
        assert row["steps"] == QUICK_STEPS and row["steps_per_s"] == 1 / row["step_s"]
        assert row["prompt_tokens"] == len(local["prompts"]["non_repetitive"])
        assert row["round_trip_ms"] == row["rtt_ms"]
        if row["link"] == "local":
            assert row["remote_layers_per_step"] == 0.0 and "ping_ms" not in row and "bytes_out_per_token_layer" not in row
            assert (row["mode"], row["wire_dispatch"], row["wire_combine"]) == (None, None, None)
            continue
        assert row["remote_layers_per_step"] == MOE_LAYERS  # every decode step reaches the workers once per MoE layer
        if row["wire"] == "exact-f32":
            assert (row["mode"], row["wire_dispatch"], row["wire_combine"]) == ("exact", None, None)
            decode = local["decode"]
            assert row["bytes_out_per_token_layer"] == sum(t.bytes_out for t in decode) / len(decode)
            assert row["bytes_in_per_token_layer"] == sum(t.bytes_in for t in decode) / len(decode)
        else:
            assert (row["mode"], row["wire_dispatch"], row["wire_combine"]) == ("partial", "int8-b128", "int8-b128")
            _check_partial_decode_bytes(row)


def _check_partial_decode_bytes(row: dict) -> None:
    """One decode token per layer call: every DISPATCH frame has one row, every partial RESULT one
    row, so the bytes are a whole number of each. The lossy wire may route otherwise than local,
    so the number of frames F (a token's 2 experts reach 1 or 2 workers) is read, then checked."""
    one_token = Dispatch(0, torch.zeros(1, HIDDEN), torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]]),
                         row["mode"], row["wire_dispatch"], row["wire_combine"])
    dispatch_bytes = frame_size(one_token)
    result_bytes = frame_size(Result(0, row["mode"], torch.zeros(1, HIDDEN), [], [], row["wire_combine"]))
    calls = QUICK_STEPS * MOE_LAYERS
    frames = round(row["bytes_out_per_token_layer"] * calls / dispatch_bytes)
    assert calls <= frames <= 2 * calls
    assert row["bytes_out_per_token_layer"] == frames * dispatch_bytes / calls
    assert row["bytes_in_per_token_layer"] == frames * result_bytes / calls


def test_fanout_rows(wan_result, local):
    fanout = _of(wan_result, "fanout")
    rtt_ms = [1e3 * rtt for rtt in FANOUT_RTT_S]
    assert [(r["fanout"], r["tokens_per_step"]) for r in fanout] == [(name, w) for name in ("star", "chain") for w in QUICK_WIDTHS]
    for row in fanout:
        reached = [[rtt_ms[w] for w in call.workers] for call in local["fanout"][row["tokens_per_step"]]]
        combine, nominal = (max, max(rtt_ms)) if row["fanout"] == "star" else (sum, sum(rtt_ms))
        assert row["link_rtts_ms"] == rtt_ms and row["nominal_layer_ms"] == nominal
        assert row["steps"] == QUICK_STEPS and row["steps_per_s"] == 1 / row["step_s"]
        assert row["remote_layers_per_step"] == MOE_LAYERS
        assert row["workers_per_call"] == statistics.fmean(map(len, reached))
        assert row["expected_layer_ms"] == row["round_trip_ms"] == statistics.fmean(combine(r) for r in reached)
        assert row["layer_call_over_expected"] == row["layer_call_ms"] / row["expected_layer_ms"]


def test_speculation_rows(wan_result, local):
    verify, *spec = _of(wan_result, "speculation")
    assert (verify["prompt"], verify["speculate"], verify["rtt_ms"], verify["round_trip_ms"]) == ("verify-cost", SPECULATE, 80.0, 80.0)
    assert verify["break_even_tokens_per_step"] == verify["step_verify_s"] / verify["step_1_token_s"]
    assert [(r["prompt"], r["speculate"]) for r in spec] == [(k, s) for k in ("repetitive", "non_repetitive") for s in (0, SPECULATE)]
    for plain, fast in (spec[0:2], spec[2:4]):
        for row in (plain, fast):
            expected = local["generations"][(row["prompt"], row["speculate"])]
            assert (row["new_tokens"], row["steps"], row["drafted"], row["accepted"]) == (
                len(expected.tokens), expected.steps, expected.drafted, expected.accepted)
            assert row["new_tokens"] == 1 + row["steps"] + row["accepted"]
            assert row["tokens_per_step"] == (row["new_tokens"] - 1) / row["steps"]
            assert row["tokens_match_plain"] is True
            assert row["remote_layers_per_step"] == MOE_LAYERS
            assert row["prompt_tokens"] == len(local["prompts"][row["prompt"]])
            assert row["steps_per_s"] == 1 / row["step_s"]
            assert row["break_even_tokens_per_step"] == row["step_s"] / plain["step_s"]
            assert row["speedup_vs_plain"] == row["tokens_per_step"] * plain["step_s"] / row["step_s"]
        assert (plain["drafted"], plain["accepted"], plain["steps"]) == (0, 0, plain["new_tokens"] - 1)


def test_limit_line(wan_result):
    for row in wan_result["rows"]:
        networked = row.get("remote_layers_per_step") and row.get("round_trip_ms")
        if not networked:
            assert (row["round_trips_ms"], row["overhead_ratio"], row["beyond_round_trips_ms"]) == (None, None, None)
            continue
        limit_ms = row["remote_layers_per_step"] * row["round_trip_ms"]
        assert row["round_trips_ms"] == limit_ms
        assert row["overhead_ratio"] == 1e3 * row["step_s"] / limit_ms
        assert row["beyond_round_trips_ms"] == 1e3 * row["step_s"] - limit_ms
    unlimited = [(r["scenario"], r.get("link"), r.get("prompt")) for r in wan_result["rows"] if r["round_trips_ms"] is None]
    assert unlimited == [("petals", "local", None), ("petals", "direct", None), ("petals", "direct", None),
                         ("speculation", None, "verify-cost")]


def test_report_renders(wan_result, tmp_path):
    pytest.importorskip("matplotlib")
    from moeswarm_bench.bench.report import tables, write_report

    page = write_report(wan_result, docs=tmp_path)

    assert page == tmp_path / "bench.md"
    text = page.read_text()
    assert "emulated" in text and wan_result["meta"]["model"] in text and wan_result["meta"]["command"] in text
    for name, table in tables(wan_result).items():
        assert table in text, name
    assert json.loads((tmp_path / "bench" / "wan.json").read_text()) == wan_result
    for name in ("petals.png", "fanout_limit.png", "speculation.png"):
        assert (tmp_path / "bench" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
