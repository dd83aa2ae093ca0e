"""The commands as users run them: real processes, real TCP, JSON out."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _moeswarm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeswarm.cli", *args], capture_output=True, text=True, timeout=timeout)


def _generate(model: str, workers: list[str], *extra: str) -> dict:
    done = _moeswarm("generate", "--model", model, "--workers", ",".join(workers), "--prompt", "def add(a, b):\n",
                     "--max-new-tokens", "12", "--threads", "1", "--json", *extra)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_generate_check_local_is_bit_identical(qwen2_moe, qwen2_workers):
    report = _generate(qwen2_moe, qwen2_workers, "--check-local")
    assert report["bit_identical"] is True and report["tokens_match_local"] is True
    assert len(report["tokens"]) == 12 and report["steps"] == 11
    assert report["round_trips"] == 12 * report["moe_layers"]  # star: one round trip per MoE layer per forward
    assert report["bytes_out_per_token_layer"] > 32 * 4 and report["bytes_in_per_token_layer"] > 32 * 4
    for key in ("text", "tokens_per_s", "bytes_out_per_token_layer", "bytes_in_per_token_layer"):
        assert key in report


def test_speculation_keeps_greedy_tokens_and_saves_round_trips(qwen2_moe, qwen2_workers):
    plain = _generate(qwen2_moe, qwen2_workers)
    fast = _generate(qwen2_moe, qwen2_workers, "--speculate", "4", "--check-local")
    assert fast["tokens"] == plain["tokens"]
    assert fast["bit_identical"] is True
    assert fast["steps"] == 11 - fast["accepted"]
    assert fast["round_trips"] == (1 + fast["steps"]) * fast["moe_layers"]


def test_chain_fanout_same_tokens_more_round_trips(qwen2_moe, qwen2_workers):
    star = _generate(qwen2_moe, qwen2_workers)
    chain = _generate(qwen2_moe, qwen2_workers, "--fanout", "chain")
    assert chain["tokens"] == star["tokens"]
    assert chain["round_trips"] > star["round_trips"]


def test_demo_json_on_a_given_model(qwen2_moe):
    done = _moeswarm("demo", "--model", qwen2_moe, "--max-new-tokens", "6", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["bit_identical"] is True and len(report["workers"]) == 2 and len(report["tokens"]) == 6


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--model", "x", "--workers", "nohost", "--prompt", "a"], "bad address 'nohost'"),
        (["generate", "--model", "x", "--workers", "h:1", "--prompt", "a", "--max-new-tokens", "0"], "must be at least 1"),
        (["worker", "--model", "x", "--experts", "5-2"], "bad experts range '5-2'"),
        (["generate", "--model", "x", "--workers", "h:1", "--prompt-ids", "1,b"], "bad token id list"),
    ],
)
def test_bad_flags_are_named(args, message):
    done = _moeswarm(*args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_missing_model_is_one_clear_line(tmp_path):
    done = _moeswarm("worker", "--model", str(tmp_path / "nope"), "--experts", "0-3")
    assert done.returncode == 2
    assert "nope: not a model directory" in done.stderr and "Traceback" not in done.stderr


def test_generate_against_a_dead_worker_names_it(qwen2_moe):
    done = _moeswarm("generate", "--model", qwen2_moe, "--workers", "127.0.0.1:1", "--prompt", "a")
    assert done.returncode == 2 and "worker 127.0.0.1:1: cannot connect" in done.stderr
