"""The placement planner, its simulation, the RTT-aware chooser, and workers started from a plan.

Pure parts on synthetic routing whose best placement is known; the chooser in process (alone,
then inside the dispatcher over fake links with set round trips); then real worker processes
started with `--plan` and a per-layer `--experts`, and a generation over them torch.equal to
local eager.

Legend: T = rows (tokens), k = top-k, E = experts per layer.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_dispatcher import FakeLink, _routing, reference

from moeswarm.cli import main
from moeswarm.dispatch.dispatcher import Dispatcher
from moeswarm.errors import MoeSwarmError
from moeswarm.forward.stepper import Stepper
from moeswarm.local.workers import stop, wait_listening
from moeswarm.placement.calibrate import count_routing
from moeswarm.sources.loading import load_local
from moeswarm.placement.chooser import choose_for_call, choose_owners
from moeswarm.placement.plan_file import Plan, WorkerSpec, format_layer_experts, parse_layer_experts, read_plan
from moeswarm.placement.planner import (LayerRouting, contiguous_plan, plan_placement, routing_from_profile,
                                        routing_from_rows)
from moeswarm.placement.profile import RoutingStats
from moeswarm.placement.simulate import simulate
from moeswarm.placement.table import build_table
from moeswarm.swarm import open_swarm

RTTS = (20.0, 40.0, 60.0, 80.0)
GROUP_SHARE = (0.4, 0.3, 0.2, 0.1)  # how often each group of co-selected experts is chosen


def grouped_rows(layers: int = 2) -> dict[int, torch.Tensor]:
    """{layer: [1000, 4]}: 16 experts in 4 groups {g, g+4, g+8, g+12}; a row chooses one whole
    group, group g in GROUP_SHARE[g] of the rows. The contiguous split puts one expert of each
    group on every worker; the best placement puts each group on one worker, the hottest nearest."""
    rows = [torch.tensor([g, g + 4, g + 8, g + 12]) for g, share in enumerate(GROUP_SHARE) for _ in range(int(1000 * share))]
    return {layer: torch.stack(rows) for layer in range(layers)}  # [T, k]


def workers(capacity: int) -> list[WorkerSpec]:
    return [WorkerSpec(f"w{i}", capacity, rtt) for i, rtt in enumerate(RTTS)]


def skewed_routing(e: int = 8, tokens: int = 100) -> LayerRouting:
    """Expert e chosen by 80, 70, 60, ... rows; pairs as if independent."""
    counts = torch.tensor([80 - 10 * x for x in range(e)])  # [E]
    pairs = (counts[:, None] * counts[None, :] // tokens).fill_diagonal_(0) + torch.diag(counts)  # [E, E]
    return LayerRouting(tokens, counts, pairs)


def test_co_selected_groups_land_on_one_worker_each_hottest_nearest():
    rows = grouped_rows()
    routing = routing_from_rows(rows, 16)
    plan = plan_placement(routing, workers(4))
    for layer in rows:
        assert [plan.workers[i].experts[layer] for i in range(4)] == [(g, g + 4, g + 8, g + 12) for g in range(4)]
    planned, naive = simulate(plan, rows), simulate(contiguous_plan(16, list(rows), workers(4)), rows)
    assert planned["workers_per_token_layer"] == 1.0 and naive["workers_per_token_layer"] == 4.0
    assert planned["layer_call_ms"] == pytest.approx(sum(s * r for s, r in zip(GROUP_SHARE, RTTS)))  # 40 ms
    assert naive["layer_call_ms"] == 80.0


def test_planner_is_pure_and_deterministic():
    routing = routing_from_rows(grouped_rows(), 16)
    before = {layer: (r.counts.clone(), r.pairs.clone()) for layer, r in routing.items()}
    first = plan_placement(routing, workers(5), replicas=4)
    assert plan_placement(routing, workers(5), replicas=4).to_json() == first.to_json()
    assert all(torch.equal(r.counts, before[l][0]) and torch.equal(r.pairs, before[l][1]) for l, r in routing.items())
    assert Plan.from_json(json.loads(json.dumps(first.to_json()))) == first


def test_capacities_are_respected_every_expert_is_held_and_replicas_go_to_the_hottest():
    routing = {layer: skewed_routing() for layer in (0, 3)}
    specs = [WorkerSpec("near", 4, 10.0), WorkerSpec("mid", 3, 30.0), WorkerSpec("far", 3, 90.0)]
    plan = plan_placement(routing, specs, replicas=2)
    for layer in (0, 3):
        held = [w.experts[layer] for w in plan.workers]
        assert [len(h) for h in held] == [4, 3, 3]  # nearest filled first; 8 experts + 2 replicas
        copies = [sum(e in h for h in held) for e in range(8)]
        assert copies == [2, 2, 1, 1, 1, 1, 1, 1]  # the two hottest (80 and 70 rows; 80/2 < 60)
        assert set(held[0]) == {0, 1, 2, 3}  # the hottest nearest
    with pytest.raises(MoeSwarmError, match=r"^the workers hold 10 experts per layer in all: not enough for 8 experts "
                                            r"and 3 replicas \(raise capacities or lower --replicas\)$"):
        plan_placement(routing, specs, replicas=3)


def test_chooser_keeps_the_slowest_rtt_lowest_and_reuses_holders_reached_anyway():
    #           expert:  0       1     2       3
    table = build_table({0: {0: [0, 2]}, 1: {0: [0, 3]}, 2: {0: [1, 2, 3]}}, 4)  # holders A, B, C
    rtt = [0.08, 0.02, 0.06]  # A far, B near, C between
    assert choose_for_call(table, 0, [0, 1, 2], rtt).tolist() == [1, 2, 2, -1]  # 0 -> B: 20 ms beats A's 80
    assert choose_for_call(table, 0, [1, 3], rtt).tolist() == [-1, 2, -1, 2]  # 3: C is reached for 1 anyway
    assert choose_for_call(table, 0, [0, 3], rtt).tolist() == [1, -1, -1, 1]  # within 20 ms: B alone
    assert choose_for_call(table, 0, [0, 3], rtt, usable=lambda w: w != 1).tolist() == [0, -1, -1, 2]  # B down
    assert choose_for_call(table, 0, [0, 3], rtt, preferred={0}).tolist() == [0, -1, -1, 1]  # this process first
    # nothing measured: all as near as each other; C is reached for 1 anyway, so 2 and 3 go there too
    unmeasured = [None, None, None]
    assert choose_for_call(table, 0, range(4), unmeasured).tolist() == [0, 2, 2, 2]
    twice = build_table({0: {0: [0, 1, 2, 3]}, 1: {0: [0, 1, 2, 3]}}, 4)  # no call forces a holder in: turns
    assert choose_for_call(twice, 0, range(4), unmeasured).tolist() == choose_owners(twice, 0).tolist() == [0, 1, 0, 1]


def test_the_dispatcher_chooses_replicas_per_call_by_measured_round_trips():
    far, near = FakeLink("far", list(range(8))), FakeLink("near", [0, 1, 2, 3])
    dispatcher = Dispatcher([far, near], build_table({0: far.info.held, 1: near.info.held}, 8))
    for holder, seconds in zip(dispatcher.holders, (0.08, 0.02)):
        for _ in range(100):
            holder.round_trips.record(seconds, 1)
    hidden, index, weights = _routing(6, 3)
    for experts, answered in (([0, 1], ["near"]), ([0, 5], ["far"]), ([2, 3], ["near"])):
        routed = torch.tensor([experts] * 6)  # [T, k]
        out = dispatcher.combine(dispatcher.dispatch(0, hidden, routed, weights))
        assert torch.equal(out, reference(hidden, routed, weights))
        assert list(dispatcher.accounting.calls[-1].worker_seconds) == answered
    out = dispatcher.combine(dispatcher.dispatch(0, hidden, index, weights))  # a mixed step: exact all the same
    assert torch.equal(out, reference(hidden, index, weights))


def test_plan_file_and_per_layer_expert_lists_round_trip_and_bad_ones_are_named(tmp_path):
    assert parse_layer_experts("0:1-4,9;1:2-5") == {0: (1, 2, 3, 4, 9), 1: (2, 3, 4, 5)}
    assert format_layer_experts({1: (2, 3, 4, 5), 0: (1, 2, 3, 4, 9)}) == "0:1-4,9;1:2-5"
    with pytest.raises(ValueError, match="layer 0 appears twice"):
        parse_layer_experts("0:1;0:2")
    plan = plan_placement(routing_from_rows(grouped_rows(), 16), workers(5), replicas=2).to_json()
    bad = {"over capacity": (lambda p: p["workers"][0]["experts"].update({"0": list(range(6))}),
                             "worker 0 (w0): layer 0 must list at most 5 (its capacity) distinct ascending expert ids below 16"),
           "out of range": (lambda p: p["workers"][1]["experts"].update({"1": [3, 16]}),
                            "worker 1 (w1): layer 1 must list at most 5 (its capacity) distinct ascending expert ids below 16"),
           "twice": (lambda p: p["workers"][1].update(name="w0"), "worker names must be distinct, got w0, w0, w2, w3"),
           "not a plan": (lambda p: p.update(format="x"), "not a placement plan")}
    for name, (spoil, message) in bad.items():
        data = json.loads(json.dumps(plan))
        spoil(data)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(MoeSwarmError) as caught:
            read_plan(path)
        assert str(caught.value).startswith(f"{path}: ") and message in str(caught.value), name


def test_plan_command_prints_startable_workers_and_its_estimate(tmp_path, capsys):
    stats = RoutingStats(16)
    for layer, rows in grouped_rows().items():
        stats.update(layer, rows)
    profile, out = tmp_path / "profile.json", tmp_path / "plan.json"
    profile.write_text(json.dumps(stats.to_json()))
    assert main(["plan", "--profile", str(profile), "--workers", "w0:4:20,w1:4:40,w2:4:60,w3:4:80", "-o", str(out),
                 "--model", "M"]) == 0
    text = capsys.readouterr().out
    assert "  moeswarm worker --model M --experts '0:3,7,11,15;1:3,7,11,15'" in text  # the coldest group, farthest
    assert f"  moeswarm worker --model M --plan {out} --plan-worker w3" in text
    assert read_plan(out).worker("w0").experts == {0: (0, 4, 8, 12), 1: (0, 4, 8, 12)}
    estimate = json.loads(out.read_text())["estimate"]  # on rows drawn from the profile's counts and pairs
    assert estimate["contiguous"]["workers_per_token_layer"] > 3.9 and estimate["contiguous"]["layer_call_ms"] > 79
    assert estimate["planned"]["workers_per_token_layer"] < 1.1 and estimate["layer_call_change"] < -0.45
    with pytest.raises(SystemExit) as caught:
        main(["plan", "--profile", str(profile), "--workers", "w0:4"])
    assert caught.value.code == 2
    assert "argument --workers: bad worker 'w0:4': expected NAME:CAPACITY:RTT_MS" in capsys.readouterr().err
    assert main(["plan", "--profile", str(profile), "--workers", "w0:4:20,w1:4:40"]) == 2
    assert capsys.readouterr().err == ("moeswarm plan: error: the workers hold 8 experts per layer in all: not enough for "
                                       "16 experts and 0 replicas (raise capacities or lower --replicas)\n")


@pytest.fixture(scope="module")
def planned(qwen2_moe, tmp_path_factory):
    """A plan for the tiny qwen2_moe (8 experts, 3 MoE layers) over 2 workers with 2 replicas
    per layer; w0 started with --plan, w1 with the per-layer --experts `moeswarm plan` prints."""
    import subprocess
    import sys

    local = load_local(qwen2_moe)
    stats = count_routing(local, [list(range(i, i + 40)) for i in range(0, 200, 40)])  # calibration prompts
    plan = plan_placement(routing_from_profile(stats), [WorkerSpec("w0", 5, 20), WorkerSpec("w1", 5, 80)], replicas=2)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    command = [sys.executable, "-m", "moeswarm.cli", "worker", "--model", qwen2_moe, "--threads", "1"]
    selections = [["--plan", str(path), "--plan-worker", "w0"], ["--experts", format_layer_experts(plan.worker("w1").experts)]]
    processes = [subprocess.Popen(command + s, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in selections]
    try:
        yield plan, [wait_listening(p) for p in processes], local
    finally:
        stop(processes)


def test_workers_from_a_plan_announce_it_and_decode_is_exact_whichever_replica_answers(planned, qwen2_moe):
    plan, addresses, local = planned
    prompt = [3, 14, 15, 9, 2, 6, 5, 3]
    with open_swarm(qwen2_moe, addresses) as swarm:
        assert [held for _, held in swarm.holdings()] == [dict(w.experts) for w in plan.workers]
        assert any(len(holders) > 1 for holders in swarm._dispatcher.table.candidates[0])  # replicas to choose among
        recorder = swarm.interpose(Recorder)
        for far_rtt in (None, 0.08):  # loopback as it is, then w1 made to look far
            if far_rtt is not None:
                for _ in range(300):
                    swarm._dispatcher.holders[1].round_trips.record(far_rtt, 1)
                swarm.reset_accounting()
                recorder.routed.clear()
            remote, eager = Stepper(swarm.model), Stepper(local)
            for tokens in (prompt, [7], [11], [1]):
                assert torch.equal(remote.forward(tokens), eager.forward(tokens))
        # w1 far: a call reaches it only for an expert it alone holds, and then w0 only for one w0 alone holds
        alone = {(w, layer): set(plan.workers[w].experts[layer]) - set(plan.workers[1 - w].experts[layer])
                 for w in (0, 1) for layer in range(3)}
        calls = swarm.layer_calls()
        assert len(calls) == len(recorder.routed) == 4 * 3
        needed = []
        for call, (layer, experts) in zip(calls, recorder.routed):
            reached = {addresses.index(a) for a in call.worker_seconds}
            needed.append(bool(experts & alone[1, layer]))
            assert reached == ({1} | ({0} if experts & alone[0, layer] else set()) if needed[-1] else {0})
        assert any(needed) and not all(needed)  # both kinds of call happened


class Recorder:
    """A pass-through in front of the dispatcher that notes each call's (layer, routed experts)."""

    def __init__(self, dispatcher):
        self.dispatcher, self.routed = dispatcher, []

    def dispatch(self, layer, hidden, top_k_index, top_k_weights):
        self.routed.append((layer, set(top_k_index[top_k_index >= 0].tolist())))
        return self.dispatcher.dispatch(layer, hidden, top_k_index, top_k_weights)

    def combine(self, handle):
        return self.dispatcher.combine(handle)


def test_worker_plan_flags_are_checked(qwen2_moe, tmp_path, capsys):
    plan = plan_placement(routing_from_rows({0: torch.tensor([[0, 1], [2, 3]])}, 8), workers(3))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    wider = tmp_path / "wider.json"  # a plan for a model with 16 experts per layer
    wider.write_text(json.dumps(plan_placement(routing_from_rows(grouped_rows(), 16), workers(4)).to_json()))
    base = ["worker", "--model", qwen2_moe, "--threads", "1"]
    for argv, message in (
            (["--plan", str(wider), "--plan-worker", "w0"], f"{wider}: a plan for 16 experts per layer, the model has 8"),
            (["--plan", str(path)], "--plan and --plan-worker go together"),
            (["--plan", str(path), "--plan-worker", "w9"], "the plan has no worker 'w9' (its workers: w0, w1, w2, w3)"),
            (["--plan", str(path), "--plan-worker", "w0", "--experts", "0-3"], "--plan names the experts itself"),
            (["--experts", "0:1-3;7:2"], "experts asked for layers 7, which are not MoE layers of this model"),
            (["--experts", "0:1-3;1:2", "--layers", "0-1"], "per-layer --experts names its layers: drop --layers")):
        assert main(base + argv) == 2
        assert message in capsys.readouterr().err
