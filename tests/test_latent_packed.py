"""Multi-head latent attention in packed forwards (forward/packed.py, forward/latent.py):
DeepSeek V3's layers keep their latents in each sequence's cache, float16 ones with `--kv-cache
f16`; a decode step attends absorbed, without expanding the cache; and a model of that family
generates through workers and through stages bit for bit as its local reference does (the
serving engine: tests/test_serve_engine.py).

The tiny DeepSeek V3 (moeswarm/model/tiny.py): 3 layers, the first dense, kv_lora_rank 16, rotary
part 8, 4 heads of 8 + 8 (keys) and 8 (values), 8 routed experts.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from moeswarm.forward import latent
from moeswarm.forward.packed import PackedStepper, install, latent_layers
from moeswarm.forward.stepper import Stepper
from moeswarm.sources.loading import load_local
from moeswarm.swarm import open_swarm
from moeswarm.swarm_config import SwarmConfig
from moeswarm.local.stages import local_stages
from moeswarm.local.workers import local_workers, split_experts

PROMPT = "3,41,7,99,12,5,250,18"


def _generate(model: str, *flags: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--model", model, "--prompt-ids", PROMPT,
                           "--json", "--check-local", *flags], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _expansions(model) -> list[int]:
    """A counter of kv_b_proj's forwards (the cache's expansion), hooked on every latent layer."""
    count = [0]
    for module in model.modules():
        if hasattr(module, "kv_b_proj"):
            module.kv_b_proj.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


def test_decode_steps_attend_absorbed_and_a_prompt_from_nothing_expands(tiny_models):
    """An ordinary forward expands the whole cache at every layer. Packed, a layer runs absorbed
    where that costs fewer multiply-adds: a prompt fed to an empty cache expands (each of its
    queries would pay 2 r + rope a position absorbed, nope + rope + v expanded), a decode token and
    a 2-token draft do not call kv_b_proj at all. Logits within float rounding of the expanded
    forward's, greedy choices equal."""
    model = load_local(tiny_models("deepseek_v3"))
    plain = Stepper(model)
    expected = [plain.forward([3, 41, 7, 99]), plain.forward([12]), plain.forward([5, 6])]
    install(model)
    expansions = _expansions(model)
    packed = PackedStepper(model)
    got = [packed.forward([3, 41, 7, 99])]
    assert expansions[0] == 3  # the prompt: once a layer
    got += [packed.forward([12]), packed.forward([5, 6])]
    assert expansions[0] == 3  # the decode token and the draft: absorbed
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, atol=1e-5, rtol=0) and torch.equal(g.argmax(-1), e.argmax(-1))


def test_the_cheaper_form_by_multiply_adds_at_deepseek_v3s_shape():
    shape = latent.Shape(512, 128, 64, 128)
    assert shape.absorbs_cheaper(rows=1, positions=1025, pairs=1025)  # a decode step
    assert shape.absorbs_cheaper(rows=4 * 3, positions=4 * 1027, pairs=4 * 3 * 1027)  # 4 draft rows of 3
    assert shape.absorbs_cheaper(rows=64, positions=128, pairs=64 * 128)  # a prompt's second 64-token chunk
    assert not shape.absorbs_cheaper(rows=256, positions=256, pairs=256 * 256)  # a prompt's first chunk
    blocks = latent.Shape(512, 128, 64, 128, blocks=True)  # W_uk, W_uv in a GGUF file's blocks: absorbed always
    assert blocks.absorbs_cheaper(rows=256, positions=256, pairs=256 * 256)


def test_a_latent_module_not_known_to_absorb_is_expanded_as_alone(tiny_models, monkeypatch):
    """The fallback for a latent attention whose expansion is not DeepSeek's: every segment's context
    packed and expanded by the module itself, a sequence alone bit for bit an ordinary forward."""
    monkeypatch.setattr(latent, "absorbs", lambda module: False)
    model = load_local(tiny_models("deepseek_v3"))
    plain = Stepper(model)
    expected = [plain.forward([3, 41, 7, 99]), plain.forward([12])]
    install(model)
    expansions = _expansions(model)
    packed = PackedStepper(model)
    assert torch.equal(packed.forward([3, 41, 7, 99]), expected[0]) and torch.equal(packed.forward([12]), expected[1])
    assert expansions[0] == 2 * 3  # each forward, each of the 3 layers


def test_a_latent_layer_caches_its_latents_and_float16_halves_them(tiny_models):
    path = tiny_models("deepseek_v3")
    assert latent_layers(load_local(path)) == {layer: latent.Shape(16, 8, 8, 8) for layer in range(3)}
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
    whose bits depend on it (kernels/row_invariant.py)."""
    path = tiny_models("deepseek_v3")
    with local_stages(path, ["0-1", "2-2"], threads=2) as stages:
        report = _generate(path, "--stages", ",".join(stages), "--threads", "2", "--max-new-tokens", "10",
                           "--speculate", "3")
    assert report["bit_identical"] is True and report["positions_checked"] >= 10

