"""Speculation on by default over real workers (engine/speculation.py): the goodput rule drafts where
drafts are kept, stays bit-identical to the local eager model, and stops drafting on text whose
drafts are never kept (sampling at a high temperature).

Two worker processes of the bundled model (tests/conftest.py's trained_workers); `generate` runs in
this process, as a user runs it, with no --speculate flag."""

from __future__ import annotations

import json

from moeswarm.bundled import TRAINED
from moeswarm.generation.draft_names import AUTO_SPECULATE

REPEATING = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"


def _generate(capsys, workers, *flags: str) -> dict:
    from moeswarm.cli import main

    assert main(["generate", "--model", str(TRAINED), "--workers", ",".join(workers), "--threads", "1", "--json",
                 *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_default_drafts_over_workers_and_stays_bit_identical(trained_workers, capsys):
    report = _generate(capsys, trained_workers, "--prompt", REPEATING, "--max-new-tokens", "24", "--check-local")
    plain = _generate(capsys, trained_workers, "--prompt", REPEATING, "--max-new-tokens", "24", "--speculate", "0")

    assert (report["speculate"], report["speculate_policy"], report["draft"]) == (AUTO_SPECULATE, "goodput", "suffix")
    assert (report["bit_identical"], report["check"]) == (True, "exact")
    assert report["tokens"] == plain["tokens"] and len(plain["tokens"]) == 24
    assert report["accepted"] > 0 and report["steps"] < plain["steps"] == 23  # drafts kept: fewer steps
    assert report["mean_accepted_per_step"] == report["accepted"] / report["steps"]
    assert len(report["speculate_per_step"]) == report["steps"] and max(report["speculate_per_step"]) > 0
    assert all(0 <= k <= AUTO_SPECULATE for k in report["speculate_per_step"])
    assert sum(report["accepted_per_position"]) == report["accepted"]  # drafts kept at positions 1, 2, ...
    assert report["accepted_per_position"] == sorted(report["accepted_per_position"], reverse=True)
    assert all(0 <= a <= 1 for a in report["acceptance_per_position"]) and report["acceptance_per_position"][0] > 0.5
    assert (plain["speculate"], plain["drafted"], plain["speculate_per_step"]) == (0, 0, [])


def test_on_random_text_k_stays_at_zero_and_the_seed_keeps_its_tokens(trained_workers, capsys):
    # temperature 50 over the 128 likeliest tokens: nearly uniform, so a token recurs (a suffix match,
    # a draft) within a few dozen, and a draft is kept about once in 128
    hot = ("--prompt", REPEATING, "--max-new-tokens", "64", "--temperature", "50", "--top-k", "128", "--seed", "7")
    report = _generate(capsys, trained_workers, *hot, "--check-local")
    plain = _generate(capsys, trained_workers, *hot, "--speculate", "0")

    assert report["bit_identical"] is True
    assert report["tokens"] == plain["tokens"]  # drafts never change a seed's tokens (sampling.py's coupled rule)
    per_step = report["speculate_per_step"]
    assert sum(1 for k in per_step if k) <= 6, per_step  # drafts the text barely supports are not fed (or soon not)
    assert per_step[-16:].count(0) >= 14, per_step  # and keep it there (a noisy step cost may let a draft through)
    assert report["acceptance_per_position"][0] < 0.1


def test_serve_drafts_by_default_and_shows_acceptance_in_metrics_and_dashboard(trained_workers):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from moeswarm_bench.serve_process import ServeProcess

    with ServeProcess(str(TRAINED), trained_workers, "--model-name", "pymoe") as server:
        server.wait_ready()
        body = {"model": "pymoe", "prompt": REPEATING, "max_tokens": 24, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        dashboard = httpx.get(server.url + "/v1/dashboard", timeout=10).json()["speculation"]

    samples = {(s.name, s.labels.get("position")): s.value
               for family in text_string_to_metric_families(metrics) for s in family.samples}
    drafts = samples["vllm:spec_decode_num_drafts_total", None]
    drafted = samples["vllm:spec_decode_num_draft_tokens_total", None]
    accepted = samples["vllm:spec_decode_num_accepted_tokens_total", None]
    per_position = [samples["vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i)]
                    for i in range(len(dashboard["accepted_per_position"]))]
    assert 0 < accepted <= drafted and drafts > 0  # on by default over workers, and kept on repeating text
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)
    assert samples["moeswarm_accepted_drafts_total", None] == accepted  # the same drafts the older counter counts
    assert (dashboard["drafts"], dashboard["draft_tokens"], dashboard["accepted_tokens"]) == (drafts, drafted, accepted)
    assert (dashboard["cap"], dashboard["adaptive"]) == (AUTO_SPECULATE, True)
    assert dashboard["accepted_per_position"] == per_position
    assert dashboard["mean_accepted_per_draft"] == accepted / drafts
