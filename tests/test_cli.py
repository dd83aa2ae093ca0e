"""The commands as users run them: real processes, real TCP, JSON out.

Every count in a report is checked against what it must be. Round trips and bytes are derived
in-process: the same forwards on the local eager model (whose routing the swarm reproduces bit
for bit) give every MoE layer call's routing; `plan_layer` splits it as the dispatcher does, and
the wire's own message classes size each DISPATCH and RESULT frame.
"""

from __future__ import annotations

import inspect
import io
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from moeswarm.dispatch.plan import plan_layer
from moeswarm.engine.generate import generate
from moeswarm.engine.whole_model import WholeModel
from moeswarm.local.workers import local_workers
from moeswarm.model.experts import experts_modules
from moeswarm.sources.loading import load_local
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm.wire.codecs import lossless_codec
from moeswarm.wire.messages import Dispatch, Result

PROMPT = "def add(a, b):\n"
DEMO_PROMPT = "def fibonacci(n):\n"  # moeswarm.bundled.DEMO_PROMPT, the demo's default
MAX_NEW_TOKENS = 12
MOE_LAYERS = 3  # the tiny qwen2_moe: every decoder layer is MoE
TWO_WORKERS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])  # owner [E]: experts 0-3 and 4-7 (conftest's qwen2_workers)


@dataclass(frozen=True)
class LayerTraffic:
    """One MoE layer call as the wire must carry it."""

    layer: int
    tokens: int
    workers: tuple[int, ...]  # reached, ascending
    bytes_out: int
    bytes_in: int


def routed_calls(model: torch.nn.Module, drive: Callable[[], object]) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every experts call (layer, hidden [T, d], top_k_index [T, k], top_k_weights [T, k]) made while `drive()` runs."""
    calls = []

    def record(layer):
        def hook(module, args, kwargs):
            bound = inspect.signature(module.forward).bind(*args, **kwargs)
            hidden, index, weights = list(bound.arguments.values())[:3]
            calls.append((layer, hidden.detach().clone(), index.clone(), weights.detach().clone()))

        return hook

    hooks = [module.register_forward_pre_hook(record(layer), with_kwargs=True)
             for layer, (_, module) in experts_modules(model).items()]
    try:
        drive()
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def exact_traffic(calls, owner: torch.Tensor) -> list[LayerTraffic]:
    """The frames of the exact lossless wire for these calls, sized by the wire's own encoders: a
    share whose experts come first in each of its tokens (every other expert of the token has a
    higher id; float32) asks for their sums, the others for each expert's rows."""
    traffic = []
    for layer, hidden, index, weights in calls:
        codec = lossless_codec(hidden.dtype)
        bytes_out = bytes_in = 0
        shares = plan_layer(owner, index, weights)
        for share in shares:
            summed = hidden.dtype == torch.float32 and all(
                max(e for e in mine if e >= 0) < min([e for e, m in zip(row, mine) if e >= 0 and m < 0], default=1 << 30)
                for mine, row in zip(share.top_k_index.tolist(), index[share.tokens].tolist()))
            mode = "partial" if summed else "exact"
            request = Dispatch(layer, hidden[share.tokens], share.top_k_index, share.top_k_weights, mode, codec, codec)
            bytes_out += frame_size(request)
            if summed:
                sums = torch.zeros(share.tokens.numel(), hidden.shape[1], dtype=hidden.dtype)  # [T_w, d]
                bytes_in += frame_size(Result(layer, "partial", sums, [], [], codec))
                continue
            routed = share.top_k_index[share.top_k_index >= 0]
            experts = torch.unique(routed).tolist()
            counts = [int((routed == e).sum()) for e in experts]
            outputs = torch.zeros(sum(counts), hidden.shape[1], dtype=hidden.dtype)  # [sum(n_e), d]
            bytes_in += frame_size(Result(layer, "exact", outputs, experts, counts, codec))
        traffic.append(LayerTraffic(layer, hidden.shape[0], tuple(s.worker for s in shares), bytes_out, bytes_in))
    return traffic


def frame_size(message) -> int:
    """Bytes on the socket: header, metadata and payload (the request id has a fixed width)."""
    return len(message.to_frame(1).to_bytes())


def local_generation(model_dir: str, prompt: str, max_new_tokens: int, speculate: int = 0):
    """(prompt ids, the local eager GenerationResult, every experts call it made)."""
    model = load_local(model_dir)
    codec = load_text_codec(model_dir, model.config.vocab_size)
    prompt_ids = codec.encode(prompt)
    out = {}
    calls = routed_calls(model, lambda: out.update(result=generate(WholeModel(model), prompt_ids, max_new_tokens, speculate,
                                                                     codec=codec, draft="ngram")))
    return prompt_ids, out["result"], calls, codec


def _moeswarm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeswarm.cli", *args], capture_output=True, text=True, timeout=timeout)


def _generate(model: str, workers: list[str], *extra: str) -> dict:
    done = _moeswarm("generate", "--model", model, "--workers", ",".join(workers), "--prompt", PROMPT,
                     "--max-new-tokens", str(MAX_NEW_TOKENS), "--threads", "1", "--json", *extra)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _check_traffic(report: dict, traffic: list[LayerTraffic], round_trips: int) -> None:
    decode = traffic[MOE_LAYERS:]  # every step after the prompt's (one forward): decode is counted by step
    token_layers = sum(t.tokens for t in traffic)
    assert report["round_trips"] == round_trips
    assert (report["bytes_out"], report["bytes_in"]) == (sum(t.bytes_out for t in traffic), sum(t.bytes_in for t in traffic))
    assert report["bytes_out_per_token_layer"] == report["bytes_out"] / token_layers
    assert report["bytes_in_per_token_layer"] == report["bytes_in"] / token_layers
    decode_token_layers = sum(t.tokens for t in decode)
    assert report["decode_bytes_out_per_token_layer"] == sum(t.bytes_out for t in decode) / decode_token_layers
    assert report["decode_bytes_in_per_token_layer"] == sum(t.bytes_in for t in decode) / decode_token_layers


@pytest.fixture(scope="module")
def plain_local(qwen2_moe):
    return local_generation(qwen2_moe, PROMPT, MAX_NEW_TOKENS)


def test_generate_check_local_is_bit_identical(qwen2_moe, qwen2_workers, plain_local):
    prompt_ids, local, calls, codec = plain_local
    report = _generate(qwen2_moe, qwen2_workers, "--check-local", "--speculate", "0")  # remote workers: drafts by default

    assert (report["bit_identical"], report["tokens_match_local"], report["first_mismatch"]) == (True, True, None)
    assert report["tokens"] == local.tokens and len(local.tokens) == MAX_NEW_TOKENS
    assert report["text"] == codec.decode(local.tokens)
    assert report["prompt_tokens"] == len(prompt_ids) == len(PROMPT.encode())  # byte-level tokenizer, no merges
    assert (report["steps"], report["speculate"], report["drafted"], report["accepted"]) == (11, 0, 0, 0)
    assert report["tokens_per_step"] == 1.0
    assert (report["model"], report["model_type"], report["moe_layers"]) == (qwen2_moe, "qwen2_moe", MOE_LAYERS)
    assert (report["workers"], report["fanout"], report["mode"]) == (qwen2_workers, "star", "exact")
    assert (report["wire_dispatch"], report["wire_combine"]) == ("lossless", "lossless")
    traffic = exact_traffic(calls, TWO_WORKERS)
    assert len(traffic) == MAX_NEW_TOKENS * MOE_LAYERS  # the prefill and 11 decode steps, each through every MoE layer
    _check_traffic(report, traffic, round_trips=MAX_NEW_TOKENS * MOE_LAYERS)  # star: one round trip per layer call
    assert sorted(report["worker_rtt_ms_mean"]) == sorted(qwen2_workers)
    assert report["tokens_per_s"] == MAX_NEW_TOKENS / report["seconds"]


def test_workers_at_another_thread_count_than_the_backbone_stay_bit_identical(qwen2_moe, qwen2_workers):
    """Workers at 1 thread, the backbone and its local reference at 2, verify forwards of several rows:
    float products give the same bits at any thread count (tests/test_float_threads.py)."""
    report = _generate(qwen2_moe, qwen2_workers, "--threads", "2", "--speculate", "3", "--max-new-tokens", "24",
                       "--check-local")  # without MKL's strict mode this check fails (measured)
    assert report["bit_identical"] is True and report["positions_checked"] >= 26


def test_speculation_keeps_greedy_tokens_and_saves_round_trips(qwen2_moe, qwen2_workers, plain_local, capsys):
    # the command in this process (test_generate_check_local_is_bit_identical runs it as its own process)
    _, plain = _generate_here(capsys, qwen2_moe, qwen2_workers, "--prompt", PROMPT, "--speculate", "0")
    _, fast = _generate_here(capsys, qwen2_moe, qwen2_workers, "--prompt", PROMPT, "--speculate", "4", "--draft", "ngram",
                             "--speculate-policy", "fixed", "--check-local")  # as local_generation drafts
    _, local, calls, _ = local_generation(qwen2_moe, PROMPT, MAX_NEW_TOKENS, speculate=4)

    assert fast["tokens"] == plain["tokens"] == local.tokens == plain_local[1].tokens
    assert (fast["bit_identical"], fast["tokens_match_local"]) == (True, True)
    assert (fast["steps"], fast["drafted"], fast["accepted"]) == (local.steps, local.drafted, local.accepted)
    assert fast["steps"] == 11 - fast["accepted"]
    assert fast["tokens_per_step"] == 11 / fast["steps"]
    _check_traffic(fast, exact_traffic(calls, TWO_WORKERS), round_trips=(1 + fast["steps"]) * MOE_LAYERS)
    assert plain["round_trips"] == MAX_NEW_TOKENS * MOE_LAYERS
    assert plain["bit_identical"] is None and plain["first_mismatch"] is None


def test_chain_fanout_same_tokens_one_round_trip_per_worker_reached(qwen2_moe, qwen2_workers, plain_local, capsys):
    _, star = _generate_here(capsys, qwen2_moe, qwen2_workers, "--prompt", PROMPT, "--speculate", "0")
    _, chain = _generate_here(capsys, qwen2_moe, qwen2_workers, "--prompt", PROMPT, "--fanout", "chain", "--speculate", "0")
    traffic = exact_traffic(plain_local[2], TWO_WORKERS)

    assert chain["tokens"] == star["tokens"] == plain_local[1].tokens
    assert chain["fanout"] == "chain"
    _check_traffic(star, traffic, round_trips=len(traffic))
    _check_traffic(chain, traffic, round_trips=sum(len(t.workers) for t in traffic))  # same frames, sent one by one


def test_non_contiguous_workers_are_bit_identical(qwen2_moe, plain_local, capsys):
    """`worker --experts 0,2,5-6` and `--experts 1,3-4,7`: generate --check-local stays bit-identical."""
    with local_workers(qwen2_moe, [[0, 2, 5, 6], [1, 3, 4, 7]]) as workers:
        _, report = _generate_here(capsys, qwen2_moe, workers, "--prompt", PROMPT, "--check-local")
    assert (report["bit_identical"], report["tokens_match_local"]) == (True, True)
    assert report["tokens"] == plain_local[1].tokens
    assert sorted(report["worker_rtt_ms_mean"]) == sorted(workers)


def test_demo_json_on_a_given_model(qwen2_moe):
    demo = subprocess.Popen([sys.executable, "-m", "moeswarm.cli", "demo", "--model", qwen2_moe, "--max-new-tokens", "6",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        prompt_ids, local, calls, _ = local_generation(qwen2_moe, DEMO_PROMPT, 6)  # while the demo runs
        out, err = demo.communicate(timeout=300)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 0, err
    report = json.loads(out)

    assert (report["bit_identical"], report["tokens_match_local"]) == (True, True)
    assert report["tokens"] == local.tokens and len(local.tokens) == 6
    assert (len(report["workers"]), report["fanout"], report["mode"]) == (2, "star", "exact")
    assert (report["prompt_tokens"], report["steps"]) == (len(prompt_ids), 5)
    _check_traffic(report, exact_traffic(calls, TWO_WORKERS), round_trips=6 * MOE_LAYERS)


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
    assert "Traceback" not in done.stderr


def test_missing_model_is_one_clear_line(tmp_path):
    done = _moeswarm("worker", "--model", str(tmp_path / "nope"), "--experts", "0-3")
    assert done.returncode == 2
    assert "nope: not a model directory" in done.stderr and "Traceback" not in done.stderr


def test_generate_against_a_dead_worker_names_it(qwen2_moe):
    done = _moeswarm("generate", "--model", qwen2_moe, "--workers", "127.0.0.1:1", "--prompt", "a")
    assert done.returncode == 2 and "worker 127.0.0.1:1: cannot connect" in done.stderr


def test_help_loads_neither_torch_nor_transformers():
    code = ("import sys\nfrom moeswarm.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"
    assert "usage: moeswarm" in done.stdout and "generate" in done.stdout


def _generate_here(capsys, model: str, workers: list[str], *extra: str) -> tuple[int, dict]:
    """`moeswarm generate ... --json` run in this process (no interpreter start): (exit status, report)."""
    from moeswarm.cli import main

    status = main(["generate", "--model", model, "--workers", ",".join(workers), "--max-new-tokens", str(MAX_NEW_TOKENS),
                   "--threads", "1", "--json", *extra])
    return status, json.loads(capsys.readouterr().out)


def _summary_here(capsys, model: str, workers: list[str], *extra: str) -> list[str]:
    """`moeswarm generate ...` (text, not --json) run in this process: its printed lines."""
    from moeswarm.cli import main

    main(["generate", "--model", model, "--workers", ",".join(workers), "--max-new-tokens", str(MAX_NEW_TOKENS),
          "--threads", "1", *extra])
    return capsys.readouterr().out.splitlines()


def test_generate_sampling_is_seeded_checked_and_stops(qwen2_moe, qwen2_workers, tmp_path, capsys):
    """Sampling with a seed repeats itself and stays bit-identical to local; a stop string cuts the text."""
    sampled = ("--temperature", "0.8", "--top-k", "20", "--top-p", "0.95", "--seed", "5", "--speculate", "3")
    status, first = _generate_here(capsys, qwen2_moe, qwen2_workers, "--prompt", PROMPT, *sampled, "--check-local")
    _, again = _generate_here(capsys, qwen2_moe, qwen2_workers, "--prompt", PROMPT, *sampled)

    assert again["tokens"] == first["tokens"] and len(first["tokens"]) == MAX_NEW_TOKENS
    assert (status, first["check"], first["check_passed"], first["bit_identical"]) == (0, "exact", True, True)
    assert (first["temperature"], first["top_p"], first["top_k"], first["seed"]) == (0.8, 0.95, 20, 5)
    assert (first["finish_reason"], first["stop"]) == ("length", [])
    # A stop: the first ASCII character the sampled output holds after its first token.
    codec = load_text_codec(qwen2_moe, 260)
    stop = next(codec.decode([t]) for t in first["tokens"][1:] if t < 128)
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT)
    _, stopped = _generate_here(capsys, qwen2_moe, qwen2_workers, "--prompt-file", str(prompt_file), *sampled,
                                "--stop", stop, "--stop", "never")
    assert stopped["text"] == first["text"][: first["text"].index(stop)] and stop not in stopped["text"]
    assert stopped["tokens"] == first["tokens"][: len(stopped["tokens"])] and codec.decode(stopped["tokens"][-1:]) == stop
    assert (stopped["finish_reason"], stopped["stop"], stopped["prompt_tokens"]) == ("stop", [stop, "never"], first["prompt_tokens"])


def test_generate_reads_the_prompt_from_stdin(qwen2_moe, qwen2_workers, plain_local, monkeypatch, capsys):
    for flag in ("--prompt", "--prompt-file"):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(PROMPT.encode())))
        status, report = _generate_here(capsys, qwen2_moe, qwen2_workers, flag, "-")
        assert status == 0 and report["tokens"] == plain_local[1].tokens and report["prompt_tokens"] == len(plain_local[0])
        assert (report["temperature"], report["seed"], report["check"]) == (0.0, None, None)


def test_generate_lossy_check_local_follows_the_gates_thresholds(qwen2_moe, qwen2_workers, monkeypatch, capsys):
    """Under a lossy wire --check-local reports argmax agreement and cosine; the exit status is the gate's verdict."""
    from moeswarm import gate

    status, report = _generate_here(capsys, qwen2_moe, qwen2_workers, "--prompt", PROMPT, "--check-local", "--wire", "wan",
                                    "--speculate", "0")  # one row per step (remote workers draft by default)
    thresholds = gate.GateConfig()
    assert (report["check"], report["mode"], report["wire_dispatch"]) == ("gate", "partial", "int8-b128")
    assert report["positions_checked"] == report["prompt_tokens"] + report["steps"]  # prefill rows, then one per step
    assert (report["min_argmax_agreement"], report["min_cosine_mean"]) == (thresholds.min_argmax_agreement, thresholds.min_cosine_mean)
    assert 0.0 <= report["argmax_agreement"] <= 1.0 and 0.9 < report["cosine_min"] <= report["cosine_mean"] < 1.0 + 1e-6
    assert report["check_passed"] is (report["argmax_agreement"] >= thresholds.min_argmax_agreement
                                      and report["cosine_mean"] >= thresholds.min_cosine_mean)
    assert report["check_passed"] and status == 0  # int8 both ways keeps the tiny model close
    lines = _summary_here(capsys, qwen2_moe, qwen2_workers, "--prompt", PROMPT, "--check-local", "--wire", "wan",
                          "--speculate", "0")
    assert lines[-1].startswith(f"close to local (lossy wire, gate check over {report['positions_checked']} positions)")

    monkeypatch.setattr(gate, "GateConfig", lambda: thresholds.__class__(min_cosine_mean=1.01))  # a gate nothing passes
    status, report = _generate_here(capsys, qwen2_moe, qwen2_workers, "--prompt", PROMPT, "--check-local", "--combine", "partial")
    assert (report["check"], report["wire_dispatch"], report["min_cosine_mean"]) == ("gate", "lossless", 1.01)
    assert (report["check_passed"], status) == (False, 1)
    lines = _summary_here(capsys, qwen2_moe, qwen2_workers, "--prompt", PROMPT, "--check-local", "--combine", "partial")
    assert lines[-1].endswith("FAILED")
