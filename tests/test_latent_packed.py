"""Multi-head latent attention in packed forwards (generation/ragged.py): DeepSeek V3's layers keep
their latents in each sequence's cache, float16 ones with `--kv-cache f16`, and a model of that
family generates through workers and through stages bit for bit as its local reference does.

The tiny DeepSeek V3 (moeswarm/tools/tiny.py): 3 layers, the first dense, kv_lora_rank 16, rotary
part 8, 4 heads of 8 + 8 (keys) and 8 (values), 8 routed experts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import torch

from moeswarm.generation.ragged import PackedStepper, install, latent_layers
from moeswarm.generation.sampling import SamplingParams
from moeswarm.model.loading import load_local
from moeswarm.model.tokenizer import load_text_codec
from moeswarm.serve.engine import Engine, EngineConfig
from moeswarm.serve.job import Delta, Finished, Job
from moeswarm.swarm import open_swarm
from moeswarm.swarm_config import SwarmConfig
from moeswarm.tools.local_stages import local_stages
from moeswarm.tools.local_workers import local_workers, split_experts

PROMPT = "3,41,7,99,12,5,250,18"


def _generate(model: str, *flags: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--model", model, "--prompt-ids", PROMPT,
                           "--json", "--check-local", *flags], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_latent_layer_caches_its_latents_and_float16_halves_them(tiny_models):
    path = tiny_models("deepseek_v3")
    assert latent_layers(load_local(path)) == frozenset({0, 1, 2})
    with open_swarm(path, []) as wide, open_swarm(path, [], SwarmConfig(kv_cache="f16")) as narrow:
        install(wide.model), install(narrow.model)
        steppers = PackedStepper(wide.model), PackedStepper(narrow.model)
        for feed in ([3, 41, 7, 99], [12], [5]):
            logits = [stepper.forward(feed) for stepper in steppers]
        for stepper, dtype in zip(steppers, (torch.float32, torch.float16)):
            keys, values = stepper.cache.view(1, None)
            assert keys.shape == (1, 1, 6, 16) and values.shape == (1, 1, 6, 8)  # the latent, its rotary part
            assert keys.dtype is dtype and values.dtype is dtype
        assert steppers[1].cache.nbytes * 2 == steppers[0].cache.nbytes
        assert not torch.equal(logits[0], logits[1])  # the latents' float16 rounding shows in the last places
        assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


def test_deepseek_v3_through_two_workers_with_drafts_and_a_float16_cache_is_bit_identical(tiny_models):
    path = tiny_models("deepseek_v3")
    with local_workers(path, split_experts(8, 2)) as workers:
        report = _generate(path, "--workers", ",".join(workers), "--kv-cache", "f16", "--max-new-tokens", "12",
                           "--speculate", "3")
    assert report["bit_identical"] is True and report["positions_checked"] >= 12


def test_deepseek_v3_through_two_stages_is_bit_identical(tiny_models):
    """The stages run the gateway's thread count: a float (not GGUF) model's matrices are torch's,
    whose bits depend on it (weights/row_invariant.py)."""
    path = tiny_models("deepseek_v3")
    with local_stages(path, ["0-1", "2-2"], threads=2) as stages:
        report = _generate(path, "--stages", ",".join(stages), "--threads", "2", "--max-new-tokens", "10",
                           "--speculate", "3")
    assert report["bit_identical"] is True and report["positions_checked"] >= 10


def test_the_serving_engine_batches_deepseek_v3_and_every_step_equals_its_local_reference(tiny_models):
    """Three greedy jobs on one engine (experts in this process, drafts on): one packed forward a step
    for all of them, each step compared bit for bit with the same step on the local model."""
    path = tiny_models("deepseek_v3")
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [5, 6, 7, 5, 6, 7, 5, 6], list(range(11, 41))]
    tokens, ends, done = [[] for _ in prompts], [None] * len(prompts), threading.Semaphore(0)

    def emit_for(i: int):
        def emit(event) -> None:
            if isinstance(event, Delta):
                tokens[i] += event.tokens
            else:
                ends[i] = event
                done.release()
        return emit

    with open_swarm(path, [], local_experts=list(range(8))) as swarm:
        codec = load_text_codec(swarm.source, swarm.model.config.vocab_size)
        engine = Engine(swarm, codec, EngineConfig(context=128, speculate=3, prefill_chunk=8), reference=load_local(path))
        assert engine.packed
        engine.start()
        try:
            for i, prompt in enumerate(prompts):
                engine.submit(Job(prompt, 10, SamplingParams(), emit_for(i)))
            assert all(done.acquire(timeout=120) for _ in prompts)
        finally:
            engine.stop()
    assert ends == [Finished("length", len(prompt), 10, 0) for prompt in prompts]
    assert engine.checked_rows > 0 and engine.mismatched_rows == 0
    assert engine.steps < sum(len(t) for t in tokens)  # a step carries every active sequence
