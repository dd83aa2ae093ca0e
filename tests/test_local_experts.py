"""Hot experts on the backbone: per-layer local sets next to remote workers stay bit-identical to
eager; a row travels only when one of its experts is remote, and a layer whose rows are all local
makes no round trip; `--local-experts` refuses bad values in one line, exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from moeswarm.cli import main
from moeswarm.forward.stepper import Stepper
from moeswarm.model.experts import experts_modules
from moeswarm.sources.loading import load_local
from moeswarm.swarm import open_swarm

DECODE_STEPS = 6
NO_WORKER = "127.0.0.1:1"  # never reached: each error is found before the backbone connects


def _routing_of(model) -> list[tuple[int, torch.Tensor]]:
    """Record (layer, top_k_index [T, k]) of every experts call of `model`, in call order."""
    seen: list[tuple[int, torch.Tensor]] = []
    for layer, (_, module) in experts_modules(model).items():
        module.register_forward_pre_hook(lambda _m, args, layer=layer: seen.append((layer, args[1].clone())))
    return seen


def test_per_layer_local_experts_are_exact_and_travel_only_cold_rows(qwen2_moe, qwen2_workers):
    local = load_local(qwen2_moe)
    routing = _routing_of(local)
    layers = list(experts_modules(local))
    held = {layers[0]: tuple(range(8)), layers[1]: (1, 5)}  # layer 0 all local; layer 1 two hot; the rest remote
    with open_swarm(qwen2_moe, qwen2_workers, local_experts=held) as swarm:
        assert swarm.local_held() == held and swarm.local_store.held == held
        remote, eager = Stepper(swarm.model), Stepper(local)
        feed = list(range(3, 20))
        for step in range(1 + DECODE_STEPS):
            remote_logits, local_logits = remote.forward(feed), eager.forward(feed)
            assert torch.equal(remote_logits, local_logits), f"logits differ at step {step}"
            feed = [int(remote_logits[-1].argmax())]
        calls, stats = swarm.layer_calls(), swarm.routing_stats()
    assert [c.layer for c in calls] == [layer for layer, _ in routing]
    for call, (layer, index) in zip(calls, routing):
        local_ids = torch.tensor(held.get(layer, ()), dtype=torch.long)
        cold_rows = int((~torch.isin(index, local_ids)).any(dim=1).sum())  # rows with a remote expert
        assert call.remote_tokens == cold_rows
        assert call.round_trips == (1 if cold_rows else 0)
    assert all(c.round_trips == 0 and c.bytes_out == 0 for c in calls if c.layer == layers[0])
    for layer in layers:  # the live counts are the routing's
        index = torch.cat([i for l, i in routing if l == layer])
        assert torch.equal(stats.counts[layer], torch.bincount(index.flatten(), minlength=8))
        assert stats.tokens[layer] == index.shape[0]


def test_all_experts_local_makes_no_round_trip(qwen2_moe):
    with open_swarm(qwen2_moe, [], local_experts=list(range(8))) as swarm:
        Stepper(swarm.model).forward([5, 6, 7, 8])
        summary = swarm.accounting()
    assert summary["layer_calls"] == len(swarm.moe_layers)
    assert summary["round_trips"] == 0 and summary["bytes_out"] == 0 and summary["trip_share"] == 0


def _error(capsys, *argv: str) -> str:
    """Run `moeswarm ARGV` in this process; the one line it printed, having exited with status 2."""
    try:
        status = main(list(argv))
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


def test_bad_local_experts_values(qwen2_moe, tmp_path, capsys):
    base = ("generate", "--model", qwen2_moe, "--workers", NO_WORKER, "--prompt-ids", "1,2,3")
    prefix = "moeswarm generate: error: "
    assert _error(capsys, *base, "--local-experts", "hot") == (
        prefix + "argument --local-experts: 'hot' is neither a count N, a percentage P% nor an existing file "
                 "(see moeswarm generate --help)")
    assert _error(capsys, *base, "--local-experts", "150%") == (
        prefix + "argument --local-experts: bad percentage '150%': expected 0% to 100% of each layer's experts "
                 "(see moeswarm generate --help)")
    assert _error(capsys, *base, "--local-experts", "4") == (
        prefix + "--local-experts N|P% holds each layer's hottest experts: give a routing profile, --profile "
                 "PROFILE.json (make one with: moeswarm profile --model M -o PROFILE.json)")
    held = tmp_path / "held.json"
    held.write_text(json.dumps({"1": [0, 9]}))
    assert _error(capsys, *base, "--local-experts", str(held)) == (
        prefix + "local experts of layer 1: 9 out of range (the model has 8 experts per layer)")
    held.write_text(json.dumps({"7": [0]}))
    assert _error(capsys, *base, "--local-experts", str(held)) == (
        prefix + "local experts name layers 7, which are not MoE layers of this model (MoE layers: 0-2)")
    held.write_text(json.dumps({"1": "all"}))
    assert _error(capsys, *base, "--local-experts", str(held)) == (
        prefix + f"{held}: entry '1' must map a layer id to a list of expert ids")
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"format": "moeswarm-routing-profile", "version": 1, "num_experts": 8,
                                   "layers": [], "tokens": {}, "counts": {}, "pairs": {}}))
    assert _error(capsys, *base, "--local-experts", str(profile)) == (
        prefix + f"--local-experts: {profile} is a routing profile: say how many experts to hold, "
                 f"--local-experts N or P% --profile {profile}")
    assert _error(capsys, *base, "--local-experts", "9", "--profile", str(profile)) == (
        prefix + "--local-experts 9: the model has 8 experts per layer")


def test_bad_local_experts_value_as_a_user_runs_it(qwen2_moe):
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "serve", "--model", qwen2_moe, "--workers", NO_WORKER,
                           "--local-experts", "-3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr == (
        "moeswarm serve: error: argument --local-experts: '-3' is neither a count N, a percentage P% nor an "
        "existing file (see moeswarm serve --help)\n")


@pytest.mark.parametrize("spec, expected", [("2", 2), ("25%", 2), ("0", 0)])
def test_local_experts_from_a_profile_are_the_hottest(qwen2_moe, tmp_path, spec, expected):
    """N and P% pick each layer's most counted experts (ties: the lower id)."""
    import argparse

    from moeswarm.commands._local import local_experts_spec, resolve
    from moeswarm.sources.source import open_source

    layers = sorted(experts_modules(load_local(qwen2_moe)))
    counts = {str(l): [0, 5, 1, 9, 9, 0, 2, 3] for l in layers}
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"format": "moeswarm-routing-profile", "version": 1, "num_experts": 8,
                                   "layers": layers, "tokens": {str(l): 10 for l in layers}, "counts": counts,
                                   "pairs": {str(l): [[3, 4, 9]] for l in layers}}))
    args = argparse.Namespace(local_experts=local_experts_spec(spec), profile=str(profile))
    held = resolve(args, open_source(qwen2_moe))
    assert held == ({l: (3, 4) for l in layers} if expected else None)


def test_generate_json_reports_routing_and_local_experts(qwen2_moe, qwen2_workers, tmp_path, capsys):
    held = tmp_path / "held.json"
    held.write_text(json.dumps({"1": [7, 6, 5, 4, 3, 2, 1, 0]}))  # all of layer 1: it never travels
    assert main(["generate", "--model", qwen2_moe, "--workers", ",".join(qwen2_workers), "--prompt-ids", "5,6,7,8",
                 "--max-new-tokens", "4", "--local-experts", str(held), "--check-local", "--json", "--threads", "1",
                 "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["check_passed"] is True and report["local_experts"] == {"1": list(range(8))}
    assert report["trip_share"] == 2 / 3  # layers 0 and 2 always travel, layer 1 never
    routing = report["routing"]["layers"]
    forwarded = 4 + len(report["tokens"]) - 1  # the prompt, then every new token but the last
    assert sorted(routing) == ["0", "1", "2"]
    for layer in routing.values():
        assert layer["tokens"] == forwarded and sum(layer["counts"]) == 2 * forwarded  # top-2
