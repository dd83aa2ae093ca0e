"""The local mode: `generate` / `open_swarm` with no workers hold every expert in this process and
call each layer's experts module where the model calls it (dispatch/in_process.py): the same
logits as `load_local`, bit for bit, with no round trip, through the library and the command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from moeswarm.forward.stepper import Stepper
from moeswarm.sources.loading import load_local
from moeswarm.swarm import open_swarm

PROMPT = [5, 18, 31, 44, 57, 70]
TRAINED_Q4_K_M = Path(__file__).resolve().parent.parent / "models" / "pymoe" / "gguf" / "pymoe-Q4_K_M.gguf"


def _decode(stepper: Stepper, steps: int) -> list[torch.Tensor]:
    """Logits of the prompt, then of `steps` greedy tokens fed one at a time."""
    logits = [stepper.forward(PROMPT)]
    for _ in range(steps):
        logits.append(stepper.forward([int(logits[-1][-1].argmax())]))
    return logits


def test_no_workers_runs_the_whole_model_here_bit_identical_to_load_local(qwen2_moe):
    reference = _decode(Stepper(load_local(qwen2_moe)), 4)
    with open_swarm(qwen2_moe, []) as swarm:
        assert swarm.workers == ["local"] and all(len(e) == 8 for e in swarm.local_held().values())
        got = _decode(Stepper(swarm.model), 4)
        summary = swarm.accounting()
        routing = swarm.routing_stats()
    assert all(torch.equal(a, b) for a, b in zip(got, reference))
    assert summary["layer_calls"] == 5 * len(swarm.moe_layers) and summary["round_trips"] == 0
    assert summary["bytes_out"] == 0 and summary["trip_share"] == 0
    first = swarm.moe_layers[0]
    assert routing.tokens[first] == len(PROMPT) + 4  # routing is counted as for dispatched layers


def test_layers_held_whole_skip_the_dispatcher_and_the_rest_go_remote(qwen2_moe, qwen2_workers):
    """--local-experts with some layers whole: those run in process, the others travel, still exact."""
    reference = Stepper(load_local(qwen2_moe))
    with open_swarm(qwen2_moe, qwen2_workers, local_experts={1: tuple(range(8)), 2: (0, 3)}) as swarm:
        remote = Stepper(swarm.model)
        feed = PROMPT
        for _ in range(3):
            got, want = remote.forward(feed), reference.forward(feed)
            assert torch.equal(got, want)
            feed = [int(got[-1].argmax())]
        trips = [call for call in swarm.layer_calls() if call.layer == 1]
    assert trips and all(call.round_trips == 0 and call.bytes_out == 0 for call in trips)


def test_generate_without_workers_from_the_command_line():
    """`moeswarm generate --model FILE.gguf` with no --workers: QuantExperts in process, --check-local exact."""
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--model", str(TRAINED_Q4_K_M),
                           "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "6", "--check-local",
                           "--json", "--quiet"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["workers"] == ["local"] and report["round_trips"] == 0
    assert report["check"] == "exact" and report["check_passed"] is True and report["bit_identical"] is True
    assert len(report["tokens"]) == 6


def test_a_prompt_computes_only_its_last_logits_where_the_bits_are_the_same(qwen2_moe):
    """A GGUF head kept in its blocks computes each row on its own: the prompt's last logits alone
    (what generate samples from) have the full forward's bits. A float head keeps every row."""
    quantized = [Stepper(load_local(TRAINED_Q4_K_M)) for _ in range(2)]
    assert quantized[0].head_rows_independent
    last = quantized[0].forward(PROMPT, last_only=True)
    assert last.shape[0] == 1 and torch.equal(last, quantized[1].forward(PROMPT)[-1:])
    assert torch.equal(quantized[0].forward([7]), quantized[1].forward([7]))  # the caches agree too
    plain = Stepper(load_local(qwen2_moe))
    assert not plain.head_rows_independent and plain.forward(PROMPT, last_only=True).shape[0] == len(PROMPT)
