"""`--kv-cache f16`: each sequence's keys and values kept as float16, as llama.cpp keeps them.

The decode query's attention reads the float16 cache directly and gives the float32 kernel's bits on
the widened values; every entry is rounded once, as it is filed, so remote, local, stage and
reference runs that keep the same cache stay bit-identical; a stage keeping another cache than its
gateway is refused at HELLO."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from moeswarm.forward.packed import PackedStepper, install
from moeswarm.forward.sequence_cache import SequenceCache, cache_bytes
from moeswarm.swarm import open_swarm
from moeswarm.swarm_config import SwarmConfig
from moeswarm.local.stages import local_stages
from moeswarm.kernels import qkernels

MODEL = "models/pymoe/hf"  # the bundled trained model: float32, 6 decoder layers, 32 experts
PROMPT = [5, 17, 42, 8, 99, 23, 11, 60, 7, 3]

pytestmark = pytest.mark.skipif(not qkernels.available(), reason="the C kernels are not built")


@pytest.mark.parametrize("B, Hq, Hkv, p, D, Dv", [(1, 16, 16, 100, 128, 128), (2, 8, 2, 37, 72, 40),
                                                  (1, 4, 1, 1, 64, 64), (1, 2, 2, 5, 13, 11)])
def test_a_float16_cache_attends_as_the_float32_kernel_on_its_widened_values(B, Hq, Hkv, p, D, Dv):
    torch.manual_seed(p)
    q = torch.randn(B, Hq, 1, D)
    keys = torch.randn(B, Hkv, p + 7, D).half()[:, :, :p]  # strided views of a grown buffer, as the cache gives
    values = torch.randn(B, Hkv, p + 7, Dv).half()[:, :, :p]
    got = qkernels.attend_one(q, keys, values, D ** -0.5)
    assert torch.equal(got, qkernels.attend_one(q, keys.float(), values.float(), D ** -0.5))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, keys.float().repeat_interleave(Hq // Hkv, 1), values.float().repeat_interleave(Hq // Hkv, 1))
    assert torch.allclose(got, expected.transpose(1, 2), atol=1e-5)


def test_the_baseline_float16_path_gives_the_same_bits_as_f16c():
    """Without F16C (forced here as the scalar implementation) halves are widened one at a time."""
    torch.manual_seed(3)
    q = torch.randn(2, 8, 1, 72)
    keys, values = torch.randn(2, 2, 41, 72).half(), torch.randn(2, 2, 41, 40).half()
    fast = qkernels.attend_one(q, keys, values, 0.1, 2)
    try:
        assert qkernels.use_isa("scalar") == "scalar"
        plain = qkernels.attend_one(q, keys, values, 0.1, 2)
    finally:
        qkernels.use_isa(None)
    assert torch.equal(plain, fast) and torch.equal(plain, qkernels.attend_one(q, keys.float(), values.float(), 0.1))


def test_a_float16_sequence_cache_rounds_every_entry_once_branches_included():
    cache = SequenceCache(dtype=torch.float16)
    first, second = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 2, 4)
    cache.append(0, first, -first, None)
    cache.append(0, second, -second, 1)  # a branch row, kept aside
    keys, values = cache.view(0, 1)
    assert keys.dtype is values.dtype is torch.float16
    assert torch.equal(keys, torch.cat([first, second], dim=2).half()) and torch.equal(values, -keys)
    cache.keep_row(1)
    twin = cache.copy(4)
    assert twin.dtype is torch.float16 and torch.equal(twin.view(0, None)[0], keys[:, :, :4])
    assert cache.length == 5 and torch.equal(cache.view(0, None)[0], keys)


def test_a_cache_counts_the_bytes_it_holds_and_float16_holds_half():
    from transformers import DynamicCache

    caches = {dtype: SequenceCache(dtype=dtype) for dtype in (torch.float32, torch.float16)}
    for layer in (0, 1):
        for n in (5, 14):  # 19 positions: capacity 16, then doubled to 32
            keys, values = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 4)  # [1, H, n, D] and [1, H, n, Dv]
            for cache in caches.values():
                cache.append(layer, keys, values, None)
    assert caches[torch.float32].nbytes == 2 * 2 * 32 * (8 + 4) * 4 == 2 * caches[torch.float16].nbytes
    caches[torch.float32].crop(3)  # a crop keeps the buffers
    assert cache_bytes(caches[torch.float32]) == 2 * caches[torch.float16].nbytes
    caches[torch.float16].append(0, torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 4), row=1)  # a branch's entries aside
    assert caches[torch.float16].nbytes == 2 * 32 * (8 + 4) * 2 * 2 + 3 * 2 * (8 + 4) * 2
    threaded = DynamicCache()  # a family that is not packed keeps transformers' cache
    threaded.update(torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8), 0)
    assert cache_bytes(threaded) == 2 * 2 * 7 * 8 * 4 and cache_bytes(None) == 0


def test_a_float16_cache_changes_the_logits_a_little_and_is_what_the_stepper_keeps():
    with open_swarm(MODEL, []) as as_model, open_swarm(MODEL, [], SwarmConfig(kv_cache="f16")) as halved:
        install(as_model.model), install(halved.model)
        wide, narrow = PackedStepper(as_model.model), PackedStepper(halved.model)
        for feed in (PROMPT, [4], [9]):
            expected, got = wide.forward(feed), narrow.forward(feed)
        assert wide.cache.keys[0].dtype is torch.float32 and narrow.cache.keys[0].dtype is torch.float16
        assert not torch.equal(got, expected)  # the cache is float16: its rounding shows in the last places
        assert (got - expected).abs().max() < 1e-2 * expected.abs().max()


def _generate(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--model", MODEL, "--prompt", "def main(",
                           "--json", "--threads", "2", *flags], capture_output=True, text=True, timeout=300)


def test_generate_with_a_float16_cache_over_two_workers_is_bit_identical(trained_workers):
    done = _generate("--workers", ",".join(trained_workers), "--kv-cache", "f16", "--check-local",
                     "--max-new-tokens", "16", "--speculate", "4")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["bit_identical"] is True and report["positions_checked"] >= 18


def test_float16_stages_are_bit_identical_and_a_gateway_keeping_another_cache_is_refused():
    with local_stages(MODEL, ["0-2", "3-5"], threads=2, extra_args=("--kv-cache", "f16")) as stages:
        done = _generate("--stages", ",".join(stages), "--kv-cache", "f16", "--check-local", "--max-new-tokens", "12",
                         "--speculate", "3")
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout.strip().splitlines()[-1])["bit_identical"] is True
        refused = _generate("--stages", ",".join(stages), "--max-new-tokens", "4")
        assert refused.returncode != 0 and "Traceback" not in refused.stderr
        assert f"stage {stages[0]} keeps its keys and values as f16, this gateway as model: start both with the same " \
               "--kv-cache" in refused.stderr


def test_a_bad_kv_cache_choice_is_refused_by_name():
    done = _generate("--kv-cache", "q8", "--max-new-tokens", "1")
    assert done.returncode == 2 and "--kv-cache: invalid choice: 'q8'" in done.stderr


def test_a_float16_cache_on_layers_that_cannot_be_packed_is_refused_in_one_line(tiny_models):
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--model", tiny_models("jamba"),
                           "--prompt-ids", "3,4,5", "--max-new-tokens", "2", "--kv-cache", "f16"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "--kv-cache f16: jamba's layers keep a state packed forwards cannot hold" in done.stderr


def test_bench_kv_cache_reports_half_the_cache_bytes_side_by_side():
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "bench", "kv-cache", "--model", MODEL, "--contexts",
                           "48,160", "--tokens", "3", "--repeats", "1", "--json"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)["rows"]
    assert [row["context"] for row in rows] == [48, 160]
    for row in rows:
        assert row["f16_cache_mb"] * 2 == pytest.approx(row["model_cache_mb"]) and row["model_cache_mb"] > 0
        assert row["model_ms_per_token"] > 0 and row["f16_ms_per_token"] > 0


def test_serve_with_a_float16_cache_answers_each_prompt_as_a_float16_run_alone(trained_workers):
    """Concurrent greedy requests share steps (batched forwards, groups, drafts) and each equals the
    same prompt run alone in the local mode with a float16 cache; the server's local check agrees."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    from moeswarm.engine.generate import generate
    from moeswarm.sources.tokenizer import load_text_codec
    from moeswarm_bench.serve_process import ServeProcess

    prompts = ["def main(", "class Stack:", "import os\n", "for i in range("]
    with open_swarm(MODEL, [], SwarmConfig(kv_cache="f16")) as local:
        codec = load_text_codec(MODEL, local.model.config.vocab_size)
        alone = {p: codec.decode([t for t in generate(local, codec.encode(p), 12, codec=codec).tokens
                                  if t != codec.eos_token_id]) for p in prompts}
    with ServeProcess(MODEL, trained_workers, "--model-name", "pymoe", "--kv-cache", "f16", "--check-local",
                      "--speculate", "3") as server:
        server.wait_ready()
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(lambda p: client.completions.create(model="pymoe", prompt=p, max_tokens=12,
                                                                      temperature=0).choices[0].text, prompts))
        metrics = server.metrics()
    assert texts == [alone[p] for p in prompts]
    assert metrics["moeswarm_kv_cache_bytes"] > 0  # the finished sequences' caches, kept for their prefixes
    assert metrics["moeswarm_check_local_logits_total"] > 0
    assert metrics["moeswarm_check_local_mismatched_logits_total"] == 0
