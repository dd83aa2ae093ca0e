"""Stages (issue: islands): a gateway over a chain of `moeswarm stage` processes is bit-identical
to the whole model run locally, through prompts, decode steps, draft branches, copies and crops;
bad input to a stage gets one ERROR line and the stage keeps serving."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
import torch
from openai import OpenAI

from moeswarm.errors import ProtocolError
from moeswarm.forward.cache_journal import Journal
from moeswarm.forward.packed import PackedStepper, install
from moeswarm.forward.sequence_cache import SequenceCache
from moeswarm.sources.loading import load_local
from moeswarm.stages.caches import CacheLimits, StageCaches
from moeswarm.stages.gateway import open_gateway
from moeswarm.stages.protocol import Segment, Step
from moeswarm.local.stages import local_stages
from moeswarm.local.workers import local_workers, wait_listening
from moeswarm_bench.serve_process import ServeProcess
from moeswarm.wire.frames import Frame, Opcode
from moeswarm.wire.stream import recv_frame, send_frame

MODEL = "models/pymoe/hf"  # 6 decoder layers, 32 experts
THREADS = 2  # the stages' threads; the gateway's may differ (test_stages_at_other_thread_counts_...)


@pytest.fixture(scope="module")
def two_stages():
    with local_stages(MODEL, ["0-2", "3-5"], threads=THREADS) as addresses:
        yield addresses


def _start_generate(*flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moeswarm.cli", "generate", "--model", MODEL, "--prompt", "def main(",
                             "--json", "--check-local", "--threads", str(THREADS), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _report(generating: subprocess.Popen) -> dict:
    """The JSON report of a `_start_generate` process, once it has exited with status 0."""
    try:
        out, err = generating.communicate(timeout=300)
    finally:
        if generating.poll() is None:
            generating.kill()
            generating.wait()
    assert generating.returncode == 0, (err[-2000:], out[-3000:])
    return json.loads(out.strip().splitlines()[-1])


def _generate(*flags: str) -> dict:
    return _report(_start_generate(*flags))


def test_generate_through_two_stage_processes_is_bit_identical(two_stages):
    report = _generate("--stages", ",".join(two_stages), "--max-new-tokens", "16", "--speculate", "4")
    assert report["bit_identical"] is True and report["positions_checked"] >= 18


def test_stages_at_other_thread_counts_than_the_gateway_stay_bit_identical(two_stages):
    """The gateway and its local reference at 1 thread, the stages at 2, verify forwards of several
    rows: float products give the same bits at any thread count (tests/test_float_threads.py)."""
    report = _generate("--stages", ",".join(two_stages), "--max-new-tokens", "24", "--speculate", "3",
                       "--threads", "1")  # without MKL's strict mode this check fails (measured)
    assert report["bit_identical"] is True and report["positions_checked"] >= 26


def _unused_address() -> str:
    """An address where nothing listens (a port the kernel just gave and took back)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_a_span_whose_first_replica_is_down_at_start_runs_on_the_next(two_stages):
    """`--stages A,B|C` with B down when the gateway starts: C serves the span, bit-identical; with no
    replica left, one line names the stage that cannot be reached."""
    down = _unused_address()
    report = _generate("--stages", f"{two_stages[0]},{down}|{two_stages[1]}", "--max-new-tokens", "8")
    assert report["bit_identical"] is True and report["positions_checked"] >= 10
    refused = subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--model", MODEL, "--prompt", "x",
                              "--stages", f"{two_stages[0]},{down}"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and f"stage {down}: cannot connect" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.fixture
def stage_threads():
    """This process computes the reference with the stages' thread count (conftest sets 1): the same
    computation as the gateway's."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


def test_branches_copies_and_crops_are_replayed_by_every_stage(two_stages, stage_threads):
    reference = load_local(MODEL)
    install(reference)
    with open_gateway(MODEL, two_stages) as gateway:
        install(gateway.model)
        got, want = PackedStepper(gateway.model), PackedStepper(reference)
        assert torch.equal(got.forward([5, 6, 7, 8, 9]), want.forward([5, 6, 7, 8, 9]))
        assert torch.equal(got.forward_rows([[1, 2], [3, 4], [5, 6]]), want.forward_rows([[1, 2], [3, 4], [5, 6]]))
        got.keep_row(2), want.keep_row(2)
        got.crop(6), want.crop(6)  # the second drafted token rejected
        assert torch.equal(got.forward([11, 12]), want.forward([11, 12]))
        twin_got, twin_want = PackedStepper(gateway.model), PackedStepper(reference)
        twin_got.cache, twin_want.cache = got.cache.copy(4), want.cache.copy(4)  # a sibling sharing the prompt
        assert torch.equal(twin_got.forward([40]), twin_want.forward([40]))
        assert torch.equal(got.forward([13]), want.forward([13]))  # the original is untouched by its copy


def test_a_stage_with_its_own_workers_and_a_swarm_key_stays_exact(tmp_path):
    """Every link under the swarm key (gateway -> stages, stage -> stage, stage -> its workers):
    bit-identical; a gateway without the key gets one line."""
    key = str(tmp_path / "swarm.key")
    subprocess.run([sys.executable, "-m", "moeswarm.cli", "keygen", "-o", key], check=True, capture_output=True)
    keyed = ["--swarm-key", key]
    with local_workers(MODEL, [list(range(16)), list(range(16, 32))], extra_args=["--layers", "0-3", *keyed]) as workers, \
            local_stages(MODEL, ["0-3", "4-5"], workers=[workers, []], threads=THREADS, extra_args=keyed) as stages:
        refusing = subprocess.Popen([sys.executable, "-m", "moeswarm.cli", "generate", "--model", MODEL, "--prompt", "x",
                                     "--stages", ",".join(stages)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:  # side by side with the keyed run: their starts overlap
            report = _generate("--stages", ",".join(stages), "--max-new-tokens", "8", *keyed)
            refused = subprocess.CompletedProcess(refusing.args, None, *refusing.communicate(timeout=120))
            refused.returncode = refusing.returncode
        finally:
            if refusing.poll() is None:
                refusing.kill()
                refusing.wait()
    assert report["bit_identical"] is True
    assert refused.returncode == 2 and f"stage {stages[0]}: cannot connect" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_serve_over_stages_answers_the_openai_client_with_the_local_text(two_stages):
    """Concurrent requests in two groups in flight through the chain: the check against local counts
    no mismatch, and a greedy answer is the text generate gives in local mode."""
    from concurrent.futures import ThreadPoolExecutor

    generating_locally = _start_generate("--max-new-tokens", "10")  # side by side with serve's start
    with ServeProcess(MODEL, [], "--stages", ",".join(two_stages), "--check-local", "--groups", "2",
                      threads=THREADS) as serve:
        local = _report(generating_locally)
        serve.wait_ready()
        client = OpenAI(base_url=f"{serve.url}/v1", api_key="none")
        prompts = ["def main(", "import os", "class Foo:", "for i in range(", "return x +"]
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: client.completions.create(model="pymoe", prompt=p, max_tokens=10,
                                                                        temperature=0), prompts))
        metrics = serve.metrics()
    assert answers[0].choices[0].text == local["text"]
    assert metrics["moeswarm_check_local_mismatched_logits_total"] == 0
    assert metrics["moeswarm_check_local_logits_total"] >= 50


def test_generate_refuses_stages_with_workers_of_its_own(two_stages):
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--model", MODEL, "--prompt", "x",
                           "--stages", two_stages[0], "--workers", "127.0.0.1:1"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "with --stages the experts are the stages' own" in done.stderr
    assert "Traceback" not in done.stderr


def _hello(address: str, session: str = "s1") -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    from moeswarm.sources.source import open_source

    send_frame(sock, Frame(Opcode.HELLO, 0, {"role": "gateway", "session": session,
                                            "fingerprint": open_source(MODEL).fingerprint}))
    reply, _ = recv_frame(sock, time.monotonic() + 30)
    assert reply.opcode == Opcode.HELLO and reply.meta["layers"] == [0, 2]
    return sock


def _step(segments, hidden, records=(), step=1, session="s1") -> Frame:
    return Step(session, step, (), tuple(records), tuple(segments), hidden).to_frame()


def test_bad_steps_get_one_error_line_and_the_stage_keeps_serving(two_stages):
    sock = _hello(two_stages[0])
    hidden = torch.randn(3, 128)
    cases = [
        (_step([Segment(1, None, 0, 3, 5)], hidden), "is not held here"),  # a sequence this stage never saw
        (_step([Segment(2, None, 0, 2, 0)], hidden), "segments cover 2 of the step's 3 rows"),
        (_step([Segment(3, None, 0, 3, 0)], torch.randn(3, 64)), "hidden states must be"),
        (Frame(Opcode.STEP, 9, {"session": "s1", "step": 9, "route": "x", "records": [], "segments": [],
                                "tensors": []}), "'route'"),
        (_step([Segment(4, None, 0, 3, 0)], hidden, records=[["drop", 4]]), "cache record 0"),
        (Frame(Opcode.DISPATCH, 10, {}), "a stage does not take DISPATCH"),
    ]
    for frame, expected in cases:
        send_frame(sock, frame)
        reply, _ = recv_frame(sock, time.monotonic() + 60)
        assert reply.opcode == Opcode.ERROR and expected in reply.meta["message"], reply.meta
        assert "\n" not in reply.meta["message"]
    send_frame(sock, Frame(Opcode.PING, 11))
    assert recv_frame(sock, time.monotonic() + 30)[0].opcode == Opcode.PONG
    send_frame(sock, _step([Segment(5, None, 0, 3, 0)], hidden, step=12))  # a good one: the last stage of no route
    reply, _ = recv_frame(sock, time.monotonic() + 60)
    assert reply.opcode == Opcode.STEP_RESULT and reply.request_id == 12
    sock.close()


def test_a_stage_started_without_a_terminal_draws_no_progress_bars():
    """stderr is not a terminal: no bar of transformers' loading (the command's module loads transformers
    while its flags are parsed, so the quiet settings come before the parser)."""
    from moeswarm.local.stages import spawn_stage

    process = spawn_stage(MODEL, "0-2", threads=1)
    try:
        wait_listening(process)
    finally:
        process.terminate()
        _, err = process.communicate(timeout=30)
    assert "Loading weights" not in err and "it/s" not in err, err[-2000:]


def test_a_wrong_model_is_refused_at_hello(two_stages):
    host, port = two_stages[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        send_frame(sock, Frame(Opcode.HELLO, 0, {"role": "gateway", "session": "x", "fingerprint": "hf-other"}))
        reply, _ = recv_frame(sock, time.monotonic() + 30)
    assert reply.opcode == Opcode.ERROR and "another model" in reply.meta["message"]


def test_step_metadata_fuzz_raises_only_protocol_errors():
    """Random metadata and payloads: a Step or a ProtocolError, never anything else."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings, strategies as st

    values = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=8),
                          lambda inner: st.lists(inner, max_size=6), max_leaves=20)
    keys = st.sampled_from(["session", "step", "route", "records", "segments", "tensors"])

    @settings(max_examples=300, deadline=None)
    @given(st.dictionaries(keys, values), st.binary(max_size=64))
    def check(meta, payload):
        try:
            Step.from_frame(Frame(Opcode.STEP, 1, meta, payload), 4, 16)
        except ProtocolError:
            pass

    check()


def test_stage_caches_expire_evict_and_replay_records():
    clock = [0.0]
    caches = StageCaches(CacheLimits(max_sequences=2, max_bytes=1 << 30, ttl_s=10), clock=lambda: clock[0])
    first = caches.take("s", (Segment(1, None, 0, 2, 0),))[0]
    first.append(0, torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), None)
    caches.apply("s", (("copy", 2, 1, 1),))
    assert len(caches) == 2 and caches.take("s", (Segment(2, None, 0, 1, 1),))[0].length == 1
    caches.take("s", (Segment(3, None, 0, 1, 0),))  # a third: the least recently used (1) makes room
    with pytest.raises(ProtocolError, match="is not held here"):
        caches.take("s", (Segment(1, None, 0, 1, 2),))
    clock[0] = 11.0
    caches.settle("s", ())
    assert len(caches) == 0  # idle past the ttl


def test_journal_records_what_the_stages_must_replay():
    journal = Journal()
    cache = SequenceCache(journal)
    empty = torch.zeros(1, 0, 3, 0)
    cache.append(0, empty, empty, None)
    cache.append(0, torch.zeros(1, 0, 2, 0), torch.zeros(1, 0, 2, 0), 1)
    cache.keep_row(1)
    cache.crop(4)
    twin = cache.copy(2)
    seq, twin_seq = cache.id, twin.id
    del twin
    import gc

    gc.collect()
    assert journal.drain() == [("keep", seq, 1), ("crop", seq, 4), ("copy", twin_seq, seq, 2), ("close", twin_seq)]
    assert journal.drain() == []


def test_a_dead_stage_is_replaced_by_its_replica_and_the_steps_replayed_bit_identical(two_stages, stage_threads):
    from moeswarm.local.stages import spawn_stage
    from moeswarm.local.workers import stop, wait_listening

    first = two_stages[0]  # the module's first stage (0-2) leads; the second and its replica are this test's own to kill
    processes = [spawn_stage(MODEL, span, threads=THREADS) for span in ("3-5", "3-5")]
    try:
        second, replica = [wait_listening(p) for p in processes]
        reference = load_local(MODEL)
        install(reference)
        with open_gateway(MODEL, [[first], [second, replica]]) as gateway:
            install(gateway.model)
            chain = gateway.model.base_model.layers[0].chain
            got, want = PackedStepper(gateway.model), PackedStepper(reference)
            feed = list(range(10, 30))
            for _ in range(3):
                out, expected = got.forward(feed), want.forward(feed)
                assert torch.equal(out, expected)
                feed = [int(out[-1].argmax())]
            processes[0].kill()  # the second stage dies between two steps
            processes[0].wait()
            deadline = time.monotonic() + 30  # the gateway's reader sees the close before the next step is sent
            while not any(link.dead for link in chain._links) and time.monotonic() < deadline:
                time.sleep(0.01)
            for _ in range(3):
                out, expected = got.forward(feed), want.forward(feed)
                assert torch.equal(out, expected)
                feed = [int(out[-1].argmax())]
            assert chain.failovers == 1 and chain.route == [first, replica]
            assert chain.replayed_steps == 3  # the steps before the kill: the dead stage is found before the next is sent
            assert chain.last_replay_s is not None
    finally:
        stop(processes)


def test_a_live_stage_survives_mutated_steps(two_stages):
    """The worker fuzzer's idea against a stage: valid STEPs with one field mutated at a time, each
    answered by ERROR (or a result, when the mutation is harmless), then a PING and a good step."""
    import random

    rng = random.Random(7)
    sock = _hello(two_stages[0], session="fuzz")
    good = _step([Segment(900, None, 0, 2, 0)], torch.randn(2, 128), step=1, session="fuzz")
    junk = [None, True, -1, 2**63, "x" * 300, [], [[]], [[1, 2]], {"a": 1}, 1.5, [-5, None, 0, 1, 0]]
    for case in range(60):
        meta = dict(good.meta)
        field_name = rng.choice(sorted(meta))
        meta[field_name] = rng.choice(junk)
        payload = bytes(rng.randrange(0, 2048)) if rng.random() < 0.3 else good.payload
        send_frame(sock, Frame(Opcode.STEP, 100 + case, meta, payload))
        reply, _ = recv_frame(sock, time.monotonic() + 60)
        assert reply.opcode in (Opcode.ERROR, Opcode.STEP_RESULT), reply
        if reply.opcode == Opcode.ERROR:
            assert reply.meta["message"] and "\n" not in reply.meta["message"]
    send_frame(sock, Frame(Opcode.PING, 500))
    assert recv_frame(sock, time.monotonic() + 30)[0].opcode == Opcode.PONG
    sock.close()
