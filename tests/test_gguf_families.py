"""One runner for every GGUF architecture: a tiny random model of each family, converted by
llama.cpp's own converter (F32) and quantizer (Q8_0), and for each file:

- the F32 GGUF's logits through moeswarm match the HF directory's (prefill and decode steps);
- llama.cpp's logits on the same file agree with moeswarm's (mean cosine, argmax agreement);
- the Q8_0 file cut into two slice files (experts 0-3 with the backbone, experts 4-7 alone), two
  workers serving them over TCP: logits torch.equal to the whole Q8_0 file run locally.

Adding an architecture is an entry in each table of moeswarm/gguf/gguf_{config,routing,names,
support}.py and a line in FAMILIES. The tiny configs set the scales and routing options the GGUF
must carry (multipliers, renormalisation, routed scaling, groups) away from their defaults, so a
key mapped wrongly shows in the logits.

llama-cpp-python is required: without it these tests fail, unless MOESWARM_SKIP_LLAMACPP=1 is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from moeswarm.forward.stepper import Stepper
from moeswarm.sources.loading import load_experts, load_local
from moeswarm.swarm import open_swarm
from moeswarm.gguf.gguf_config import ARCHITECTURES
from moeswarm.gguf.gguf_file import GGUFFile
from moeswarm.gguf.gguf_names import QUIRKS
from moeswarm.gguf.gguf_routing import ROUTING
from moeswarm.gguf.gguf_slice import write_slice
from moeswarm.gguf.gguf_support import SUPPORTED, UNSUPPORTED
from moeswarm.worker.server import WorkerServer
from moeswarm.worker.store import ExpertStore

from llamacpp_fixtures import llama_cpp_logits, make_many_fixture_ggufs, require_llama_cpp, slice_workers

require_llama_cpp("tests/test_gguf_families.py")

# hidden 64: rows fit Q8_0's 32-value blocks; 2 layers; 8 experts, top-2.
SMALL = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=320)
_MLA = dict(num_key_value_heads=4, head_dim=8, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
_SCALED = dict(routed_scaling_factor=2.5, norm_topk_prob=True)
_GRANITE = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0)

@dataclass(frozen=True)
class Family:
    arch: str  # the GGUF architecture llama.cpp's converter writes
    keys: dict = field(default_factory=dict)  # the tiny config's keys beyond SMALL
    loads_as: str | None = None  # the transformers model type moeswarm builds, where it is another
    convert_args: tuple[str, ...] = ()  # extra arguments to convert_hf_to_gguf.py
    checkpoint: dict = field(default_factory=dict)  # config.json keys as released checkpoints write them


FAMILIES: dict[str, Family] = {
    "qwen2_moe": Family("qwen2moe"),
    "qwen3_moe": Family("qwen3moe", {"norm_topk_prob": True}),  # llama.cpp always renormalises qwen3moe
    "olmoe": Family("olmoe", {"num_key_value_heads": 4}),  # llama.cpp's olmoe k-norm is hidden-sized: kv heads = heads
    "mixtral": Family("llama"),
    # MLA with full-rank q, greedy top-k. llama.cpp's deepseek2 reads a full-rank q only at
    # DeepSeek-V2-Lite's depth (26 or 27 layers): the tiny model has 27.
    "deepseek_v2": Family("deepseek2", dict(_MLA, q_lora_rank=None, num_hidden_layers=27)),
    # MLA with q-lora, grouped routing; real checkpoints say scoring_func "sigmoid" (transformers
    # ignores it; llama.cpp's converter writes it, and without it llama.cpp scores with softmax).
    "deepseek_v3": Family("deepseek2", dict(_MLA, q_lora_rank=16, scoring_func="sigmoid", **_SCALED)),
    "glm4_moe": Family("glm4moe", dict(_SCALED)),  # GGUF block_count includes the MTP layer
    # gpt-oss's sliding window (6) is shorter than the prompt: its sliding layers' mask is exercised.
    "gpt_oss": Family("gpt-oss", {"sliding_window": 6}),
    "granitemoe": Family("granitemoe", dict(_GRANITE)),
    "granitemoeshared": Family("granitemoe", dict(_GRANITE)),
    # llama.cpp's dots1 has as many kv heads as heads, and reads its sigmoid scores from the file
    # (the converter writes them from the checkpoint's scoring_func, which transformers ignores).
    "dots1": Family("dots1", dict(_SCALED, num_key_value_heads=4, scoring_func="sigmoid")),
    # llama.cpp sizes ERNIE's shared expert as intermediate_size // kv heads (the converter's rule).
    "ernie4_5_moe": Family("ernie4_5-moe", dict(moe_intermediate_size=32, moe_num_shared_experts=1)),
    # Gated-delta linear attention in layers 0 and 2, full attention in layer 1. transformers drops
    # the checkpoint's MTP layers, so the converter is told there are none (--no-mtp).
    "qwen3_next": Family("qwen3next", dict(num_hidden_layers=3), convert_args=("--no-mtp",)),
    # The same hybrid, separate projections; 4 value heads over 2 key heads, so the converter's
    # value-head reorder (grouped -> tiled) is exercised and undone. Its multimodal RoPE sections
    # must fit the tiny rotary width (4 of head_dim 16): llama.cpp asserts it.
    "qwen3_5_moe_text": Family("qwen35moe", dict(num_hidden_layers=3, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[1, 1, 0])),
        convert_args=("--no-mtp",)),
    # Partial RoPE as its checkpoints say it (rotary_dim), sigmoid scores (scoring_func).
    "minimax_m2": Family("minimax-m2", dict(rotary_dim=8, scoring_func="sigmoid")),
    # GLM-4.7-Flash: DeepSeek-V3's MLA and routing, written as deepseek2 (loaded as deepseek_v3).
    "glm4_moe_lite": Family("deepseek2", dict(_MLA, q_lora_rank=16, scoring_func="sigmoid", first_k_dense_replace=1, **_SCALED),
                            loads_as="deepseek_v3"),
    # Short convolutions in layers 0 and 2, attention in 1; layer 0 dense; tied embeddings (as LFM2).
    # The converter writes no routed_scaling_factor: released LFM2-MoE models have 1.0, as here.
    "lfm2_moe": Family("lfm2moe", dict(num_hidden_layers=3, tie_word_embeddings=True)),
    # Granite 4 (-H): Mamba-2 in layers 0 and 2, attention without RoPE in 1 (the converter writes
    # every Mamba hybrid as NoPE, as released). Its released configs name layer types "mamba" /
    # "attention", which the converter reads (transformers 5.23 saves "linear_attention" / "full_attention").
    "granitemoehybrid": Family("granitehybrid", dict(_GRANITE, num_hidden_layers=3, mamba_n_heads=8, mamba_d_head=16),
                               checkpoint={"layer_types": ["mamba", "attention", "mamba"]}),
    # Nemotron 3 (Nemotron-H MoE): Mamba-2, MoE (squared-ReLU experts, grouped sigmoid routing), attention.
    "nemotron_h": Family("nemotron_h_moe", dict(num_hidden_layers=3, **_SCALED)),
    # Hunyuan-A13B's released config gives per-layer lists, which the converter requires.
    "hunyuan_v1_moe": Family("hunyuan-moe", checkpoint=dict(moe_intermediate_size=[64, 64], moe_topk=[2, 2],
                                                              num_shared_expert=[1, 1])),
    # Mamba in layers 0, 2, 3, attention in layer 1; experts in layers 1 and 3, dense MLPs in 0 and 2.
    "jamba": Family("jamba", dict(num_hidden_layers=4, expert_layer_period=2, expert_layer_offset=1)),
    # Arcee Trinity: layers 0-2 sliding (window 6, shorter than the prompt), layer 3 global, layer 0
    # dense; its released configs say score_func "sigmoid" and route_norm, which the converter writes.
    "afmoe": Family("afmoe", dict(num_hidden_layers=4, sliding_window=6, route_scale=2.5, mup_enabled=True),
                    checkpoint=dict(score_func="sigmoid", route_norm=True)),
    # K-EXAONE: grouped sigmoid routing (scoring_func as released, which llama.cpp requires), a sliding
    # window (6) shorter than the prompt in layers 0-2, a global layer 3, layer 0 dense.
    "exaone_moe": Family("exaone-moe", dict(_SCALED, num_hidden_layers=4, sliding_window=6,
                                            layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                            mlp_layer_types=["dense"] + ["sparse"] * 3),
                         checkpoint=dict(scoring_func="sigmoid")),
    # Architectures gguf-py 0.19 lacks (loaded with another's name map). Mellum: layer 0 sliding
    # (window 6 < prompt), layer 1 global. One RoPE base for both: llama.cpp's mellum graph applies
    # the global base to sliding layers too (it ignores rope.freq_base_swa, which moeswarm maps as
    # the HF model uses it; measured with 500000 / 10000: moeswarm == HF, vs llama.cpp mean cosine 0.973).
    "mellum": Family("mellum", dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                                    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                                                     "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}})),
    # HY-V3: layer 0 dense, sigmoid routing with a correction bias and router scaling.
    "hy_v3": Family("hy_v3", dict(router_scaling_factor=2.5)),
    # Laguna: layer 0 global and dense, layers 1-3 sliding (window 6 < prompt), each layer type with
    # its own RoPE base and rotary width; gated attention; sigmoid routing with a correction bias.
    "laguna": Family("laguna", dict(num_hidden_layers=4, sliding_window=6, moe_routed_scaling_factor=2.5,
                                    layer_types=["full_attention"] + ["sliding_attention"] * 3,
                                    mlp_layer_types=["dense"] + ["sparse"] * 3, num_attention_heads_per_layer=[4] * 4)),
    # Cohere2-MoE: layers 0-2 sliding (window 6 < prompt, with RoPE), layer 3 global (NoPE); logit scale.
    "cohere2_moe": Family("cohere2moe", dict(num_hidden_layers=4, sliding_window=6, logit_scale=0.5,
                                             layer_types=["sliding_attention"] * 3 + ["full_attention"])),
    # Granite with SWA: layer 0 global, layer 1 sliding (window 6 < prompt); attention sinks.
    "granitemoe_swa": Family("granite_swa", dict(_GRANITE, sliding_window=6, layer_types=["full_attention", "sliding_attention"])),
}

TOKENS = [5, 18, 31, 44, 57, 70, 83, 96, 109, 122, 135, 148]
DECODE_STEPS = 3
LOW, HIGH = [0, 1, 2, 3], [4, 5, 6, 7]


@pytest.fixture(scope="session")
def family_files(request, tmp_path_factory):
    """family -> {"HF": dir, "F32": file, "Q8_0": file}, made by llama.cpp's tools once per session:
    every family the selected tests need, in one run of the converter."""
    needed = {item.callspec.params["family"] for item in request.session.items
              if hasattr(item, "callspec") and item.callspec.params.get("family") in FAMILIES}
    specs = {name: (name, FAMILIES[name].keys, FAMILIES[name].convert_args, FAMILIES[name].checkpoint) for name in sorted(needed)}
    made = make_many_fixture_ggufs(specs, tmp_path_factory.mktemp("gguf-families"), **SMALL)

    def get(family: str) -> dict[str, Path]:
        if isinstance(made[family], str):
            pytest.fail(made[family])
        return made[family]

    return get


def _steps(stepper: Stepper, feeds: list[list[int]]) -> list[torch.Tensor]:
    return [stepper.forward(feed) for feed in feeds]  # [n, V] each


def _feeds(model: torch.nn.Module) -> list[list[int]]:
    """The prompt, then DECODE_STEPS greedy tokens of `model` (the same feed for every side)."""
    stepper, feeds = Stepper(model), [TOKENS]
    for _ in range(DECODE_STEPS):
        feeds.append([int(stepper.forward(feeds[-1])[-1].argmax())])
    return feeds


def _cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a), torch.as_tensor(b), dim=-1)  # [n]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_converter_writes_the_architecture(family, family_files):
    assert GGUFFile.open(family_files(family)["F32"]).arch == FAMILIES[family].arch


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_f32_gguf_logits_match_hf_directory(family, family_files):
    files = family_files(family)
    reference, from_gguf = load_local(files["HF"]), load_local(files["F32"])
    assert from_gguf.config.model_type == (FAMILIES[family].loads_as or reference.config.model_type)
    if hasattr(reference.config, "rope_parameters"):  # not in NoPE families (Nemotron-H)
        assert reference.config.rope_parameters == from_gguf.config.rope_parameters
    assert getattr(reference.config, "layer_types", None) == getattr(from_gguf.config, "layer_types", None)
    feeds = _feeds(reference)
    expected, got = torch.cat(_steps(Stepper(reference), feeds)), torch.cat(_steps(Stepper(from_gguf), feeds))
    cosine = _cosines(got, expected)
    print(f"{family}: F32 GGUF vs HF directory, cosine min {float(cosine.min()):.7f}, "
          f"max abs diff {float((got - expected).abs().max()):.3g}")
    assert torch.allclose(got, expected, atol=1e-4, rtol=0), \
        f"{family}: max abs diff {float((got - expected).abs().max()):.3g} between the F32 GGUF and the HF directory"


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_agree_with_llama_cpp(family, kind, family_files):
    path = family_files(family)[kind]
    ours = Stepper(load_local(path)).forward(TOKENS)  # [n, V]
    theirs = torch.from_numpy(llama_cpp_logits(path, TOKENS))  # [n, V]
    cosine = _cosines(ours, theirs)
    argmax = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    print(f"{family} {kind}: vs llama.cpp, cosine mean {float(cosine.mean()):.5f} min {float(cosine.min()):.5f}, "
          f"argmax agreement {argmax:.2f}")
    if kind == "F32":
        assert float(cosine.mean()) >= 0.99, f"{family} {kind}: mean cosine {float(cosine.mean()):.5f} vs llama.cpp"
    else:
        # llama.cpp rounds activations to int8 blocks for Q8_0 products; with random weights a routing
        # near-tie can flip at a position (measured: granitemoe, one position at 0.85, the rest > 0.998;
        # laguna, 3 MoE layers, positions 1, 5, 9 at 0.80, 0.84, 0.74, where llama.cpp's Q8_0 is as far
        # from its own F32 run and moeswarm's Q8_0 stays >= 0.995 of its F32 run).
        assert float(cosine.median()) >= 0.99 and float(cosine.mean()) >= 0.9, \
            f"{family} {kind}: cosine median {float(cosine.median()):.5f} mean {float(cosine.mean()):.5f} vs llama.cpp"
    # Random weights give flat logits, so argmax agreement is loose where llama.cpp rounds activations
    # (measured Q8_0 minimum: qwen3_next 0.75); F32 agrees everywhere (measured 1.00).
    assert argmax >= (0.9 if kind == "F32" else 0.6), f"{family} {kind}: argmax agreement {argmax:.2f} vs llama.cpp"


@contextlib.contextmanager
def _workers(paths: list[Path], expert_sets: list[list[int]]):
    """One WorkerServer per slice file over TCP on loopback, each on its own asyncio loop in a thread."""
    loops, servers, addresses = [], [], []
    try:
        for path, experts in zip(paths, expert_sets):
            hosted, source, num_experts = load_experts(str(path), experts)
            server = WorkerServer(ExpertStore(hosted, num_experts, source.config.hidden_size), source.fingerprint,
                                  source.config.model_type)
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True).start()
            loops.append(loop)
            host, port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0), loop).result(30)
            servers.append(server)
            addresses.append(f"{host}:{port}")
        yield addresses
    finally:
        for loop, server in zip(loops, servers):
            asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        for loop in loops:
            loop.call_soon_threadsafe(loop.stop)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_slice_files_through_two_workers_equal_local(family, family_files, tmp_path):
    whole = family_files(family)["Q8_0"]
    low, high = tmp_path / "low.gguf", tmp_path / "high.gguf"
    write_slice(whole, low, LOW, with_backbone=True)
    write_slice(whole, high, HIGH)
    local = load_local(whole)
    feeds = _feeds(local)
    expected = _steps(Stepper(local), feeds)
    with _workers([low, high], [LOW, HIGH]) as addresses, open_swarm(str(low), addresses) as swarm:
        got = _steps(Stepper(swarm.model), feeds)
        assert set(swarm.accounting()["worker_rtt_ms_mean"]) == set(swarm.workers), "both workers served experts"
    for step, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"{family}: logits through 2 workers differ from local at step {step}"


def test_the_tables_agree():
    """One support table, and each concern's table has exactly the supported architectures."""
    assert set(ARCHITECTURES) == set(ROUTING) == set(QUIRKS) == set(SUPPORTED)
    assert not set(SUPPORTED) & set(UNSUPPORTED)
    assert {family.arch for family in FAMILIES.values()} == set(SUPPORTED), "every supported architecture is in the runner"
    docs = (Path(__file__).parent.parent / "docs" / "models.md").read_text()
    for arch in [*SUPPORTED, *UNSUPPORTED]:
        assert re.search(rf"`{re.escape(arch)}`", docs), f"docs/models.md does not name `{arch}`"


@pytest.mark.parametrize("family", ["qwen3_5_moe_text"])
def test_the_gate_command_info_prints_runs_on_a_gguf_file(family, family_files, tmp_path, capsys):
    """`moeswarm info FILE` prints the gate for a lossy wire; that command, run as printed (2 worker
    processes), gates the file's own weights: a hybrid (Qwen3.5 MoE, linear-attention state in the
    backbone) in Q8_0. Measured (random weights, 2 prompts, 24 positions): argmax agreement 0.958,
    cosine mean 0.9920, min 0.827. One position is a near-tie that the int8 wire flips, and the
    gate fails the file at its defaults (0.99, 0.998), as it should. With the routers' products in
    torch (before kernels/row_invariant.py) these prompts missed the tie (1.0, 0.99907), and four
    other prompts give 0.962 and 0.99905 either way."""
    import json
    import shlex

    from moeswarm.cli import main

    path = str(family_files(family)["Q8_0"])
    assert main(["info", path, "--json"]) == 0
    command = shlex.split(json.loads(capsys.readouterr().out)["gate_command"])
    assert command[:2] == ["moeswarm", "gate"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "def fibonacci(n): return n"}\n{"text": "The quick brown fox jumps over"}\n')
    status = main([*command[1:], "--prompts", str(prompts), "--json", "--quiet"])
    report = json.loads(capsys.readouterr().out)
    print(f"gate on {path}: {report}")
    assert (report["wire_dispatch"], report["wire_combine"]) == ("int8-b128", "int8-b128")
    assert report["positions"] > 10 and report["cosine_mean"] > 0.99 and report["argmax_agreement"] >= 0.9
    assert status == (0 if report["passed"] else 1)


@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "qwen3_next", "glm4_moe_lite"])
def test_generate_check_local_through_worker_processes_on_slice_files(family, family_files, tmp_path, capsys):
    """What a user runs: `moeswarm slice` the Q8_0 file into two parts, one `moeswarm worker`
    process on each part, `moeswarm generate --check-local` on the whole file: bit-identical, on a
    hybrid whose linear-attention state the backbone holds (the engine runs these one forward per
    sequence; its reference computes the shared expert where the block calls it), and on latent
    attention (GLM-4.7-Flash as deepseek2: packed forwards, decode steps absorbed in the backbone
    and in its reference, two models built from one GGUF source)."""
    import json

    from moeswarm.cli import main

    whole = str(family_files(family)["Q8_0"])
    low, high = str(tmp_path / "low.gguf"), str(tmp_path / "high.gguf")
    assert main(["slice", whole, "--experts", "0-3", "-o", low]) == 0
    assert main(["slice", whole, "--experts", "4-7", "-o", high]) == 0
    capsys.readouterr()
    with slice_workers([(low, LOW), (high, HIGH)]) as addresses:
        status = main(["generate", "--model", whole, "--workers", ",".join(addresses), "--prompt-ids",
                       ",".join(map(str, TOKENS[:8])), "--max-new-tokens", "5", "--threads", "1", "--check-local", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["bit_identical"] is True, report
    assert len(report["tokens"]) == 5
