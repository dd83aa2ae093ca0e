"""Quantized GGUF experts of gpt-oss (clamped swiglu + biases) and DeepSeek-V3 (MLA, grouped routing).

llama.cpp's converter and quantizer make the files (hidden 256, so rows fit K-quants):
Q8_0 (every expert Q8_0), Q4_K_M (gate/up Q4_K, down Q4_K or Q6_K) and, for gpt-oss, MXFP4_MOE
(the type real gpt-oss GGUFs ship their experts in). For each file:

- the expert tensors are of those types, and a worker's loader holds them as `QuantExperts`
  views of the file's blocks (no float32 fallback), with gpt-oss's biases, alpha and limit;
- `generate --check-local` through real worker processes stays bit-identical;
- the maths from the blocks is the family's: each layer's QuantExperts vs transformers' experts
  module on gguf-py's dequantization of the same blocks; gpt-oss's expert step by step against
  HF's `_apply_gate` with the clamp biting; the whole model vs the float32 experts path;
- with the F32 file's backbone, the Q8_0 file's experts stay within mean cosine 0.99 of the F32
  experts; gpt-oss's quantized files agree with llama.cpp on the same file.

The tolerances hold whether the kernels take the float path (decoded weights times float32 x) or
round activations to int8 blocks as llama.cpp does (qkernels.matmul's int8_activations).

Why not the whole quantized file against the F32 file: with random weights, DeepSeek's grouped
routing sits on a near-tie at one position, which Q8_0 rounding of the backbone flips (measured:
that position's cosine 0.17, the others > 0.999), whatever computes the experts or the backbone.

llama-cpp-python is required: without it these tests fail, unless MOESWARM_SKIP_LLAMACPP=1 is set.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from moeswarm.forward.stepper import Stepper
from moeswarm.model.experts import experts_modules
from moeswarm.sources.loading import load_experts, load_local
from moeswarm.sources.source import open_source
from moeswarm.kernels import qkernels
from moeswarm.gguf.gguf_file import GGUFFile
from moeswarm.kernels.quant_experts import QuantExperts

from llamacpp_fixtures import llama_cpp_logits, make_fixture_ggufs, require_llama_cpp

llama_cpp = require_llama_cpp("tests/test_quant_families.py")


pytestmark = pytest.mark.skipif(not qkernels.available(), reason="moeswarm's C kernels are not built")

TOKENS = [5, 18, 31, 44, 57, 70, 83, 96, 109, 122, 135, 148]
# gpt-oss's sliding window (6) is shorter than the prompt; DeepSeek-V3: MLA with q-lora, layer 0 dense.
_MLA = dict(num_key_value_heads=4, head_dim=8, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
FAMILIES = {"gpt_oss": {"sliding_window": 6}, "deepseek_v3": dict(_MLA, q_lora_rank=16)}
ACTIVATION = {"gpt_oss": "gpt_oss", "deepseek_v3": "silu"}
# (family, kind) -> {layer: (gate, up, down) types}, as llama.cpp's quantizer lays them out.
EXPERT_TYPES = {
    ("gpt_oss", "Q8_0"): {0: (Q.Q8_0,) * 3, 1: (Q.Q8_0,) * 3},
    ("gpt_oss", "Q4_K_M"): {0: (Q.Q4_K, Q.Q4_K, Q.Q4_K), 1: (Q.Q4_K, Q.Q4_K, Q.Q6_K)},
    ("gpt_oss", "MXFP4"): {0: (Q.MXFP4,) * 3, 1: (Q.MXFP4,) * 3},
    ("deepseek_v3", "Q8_0"): {1: (Q.Q8_0,) * 3},
    ("deepseek_v3", "Q4_K_M"): {1: (Q.Q4_K, Q.Q4_K, Q.Q6_K)},
}
CASES = sorted(EXPERT_TYPES)


def _quantize_mxfp4(source, out):
    """llama.cpp's MXFP4_MOE: experts in MXFP4, the other matrices Q8_0."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_MXFP4_MOE, 1
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) == 0
    return out


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """family -> {"HF": dir, "F32": file, "Q8_0": ..., "Q4_K_M": ...(, "MXFP4": ...)}, made once."""
    made: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in made:
            out = tmp_path_factory.mktemp(f"quant-{family}")
            files = make_fixture_ggufs(family, out, types=("F32", "Q8_0", "Q4_K_M"), **FAMILIES[family])
            if family == "gpt_oss":
                files["MXFP4"] = _quantize_mxfp4(files["F32"], out / f"{family}-MXFP4.gguf")
            made[family] = {kind: str(path) for kind, path in files.items()}
        return made[family]

    return get


def _mean_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """a, b: [n, V] logits -> mean over positions of their cosine."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean())


@pytest.mark.parametrize("family, kind", CASES)
def test_workers_hold_the_experts_in_the_files_blocks(family, kind, ggufs):
    path = ggufs(family)[kind]
    file = GGUFFile.open(path)
    for layer, types in EXPERT_TYPES[family, kind].items():
        stored = tuple(Q(file.tensors[f"blk.{layer}.ffn_{r}_exps.weight"].tensor_type) for r in ("gate", "up", "down"))
        assert stored == types, f"{family} {kind} layer {layer}: expert types {stored}"

    hosted, source, num_experts = load_experts(path, [1, 3, 4])  # what `moeswarm worker --experts 1,3,4` loads
    assert num_experts == 8 and sorted(hosted) == sorted(EXPERT_TYPES[family, kind])
    config = source.config
    for layer, types in EXPERT_TYPES[family, kind].items():
        module = hosted[layer].module
        assert isinstance(module, QuantExperts) and module.num_experts == 3, f"layer {layer}: {type(module).__name__}"
        assert module.activation == ACTIVATION[family]
        assert (Q(module.gate.qtype), Q(module.up.qtype), Q(module.down.qtype)) == types  # no float32 fallback
        stored = file.tensors[f"blk.{layer}.ffn_down_exps.weight"]
        assert np.shares_memory(module.down.experts[1], source.file.header.data), "a view of the mapped file"
        assert module.down.experts[1].tobytes() == np.asarray(stored.data[3]).tobytes()  # hosted expert 1 is expert 3
        if family == "gpt_oss":
            assert (module.alpha, module.limit) == (pytest.approx(config.swiglu_alpha), config.swiglu_limit)
            for role, width in (("gate_bias", config.intermediate_size), ("up_bias", config.intermediate_size),
                                ("down_bias", config.hidden_size)):
                bias = file.tensors[f"blk.{layer}.ffn_{role.split('_')[0]}_exps.bias"]
                assert module.biases[role].shape == (3, width)
                assert torch.equal(module.biases[role][1], torch.from_numpy(np.array(bias.data[3])))
        else:
            assert module.biases == {}


# gpt-oss in the type its real GGUFs use; DeepSeek in K-quants (each case starts 2 workers: ~10 s).
@pytest.mark.parametrize("family, kind", [("gpt_oss", "MXFP4"), ("deepseek_v3", "Q4_K_M")])
def test_generate_check_local_is_bit_identical_through_workers(family, kind, ggufs, capsys):
    """The CLI a user runs, with two real worker processes holding non-contiguous expert sets."""
    from moeswarm.cli import main
    from moeswarm.local.workers import local_workers

    path = ggufs(family)[kind]
    with local_workers(path, [[0, 2, 5], [1, 3, 4, 6, 7]]) as addresses:
        status = main(["generate", "--model", path, "--workers", ",".join(addresses), "--prompt-ids",
                       ",".join(map(str, TOKENS[:8])), "--max-new-tokens", "6", "--threads", "1",
                       "--check-local", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["bit_identical"] is True, report
    assert len(report["tokens"]) == 6


@pytest.mark.parametrize("family, kind", CASES)
def test_each_layers_experts_equal_the_familys_module(family, kind, ggufs):
    """Every layer's QuantExperts vs the family's own experts module on the same file's weights,
    dequantized by gguf-py (experts_dtype f32), every expert routed on every row: the
    right tensors, roles, expert order and activation. Measured: ~1e-6 with the kernels' float
    path, 1-2% where they round activations to int8 blocks; a wrong role or activation is O(1)."""
    path = ggufs(family)[kind]
    quantized = experts_modules(load_local(path))
    plain = experts_modules(load_local(open_source(path, experts_dtype="f32")))
    generator = torch.Generator().manual_seed(0)
    for layer, (_, module) in quantized.items():
        reference = plain[layer][1]
        assert isinstance(module, QuantExperts) and not isinstance(reference, QuantExperts)
        x = 4.0 * torch.randn(16, module.config.hidden_size, generator=generator)  # [S=16, H]
        index = torch.arange(8).repeat(16, 1)  # [S, k=8]
        weights = torch.softmax(torch.randn(16, 8, generator=generator), -1)  # [S, k]
        with torch.no_grad():
            ours, theirs = module(x, index, weights), reference(x, index, weights)  # [S, H]
        error = float((ours - theirs).norm() / theirs.norm())
        print(f"{family} {kind} layer {layer}: relative error {error:.2e}")
        assert error < 0.05, f"{family} {kind} layer {layer}: relative error {error:.2e} vs the family's module"


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K_M", "MXFP4"])
def test_gpt_oss_expert_is_hfs_clamped_swiglu_with_biases(kind, ggufs):
    """One gpt-oss expert, step by step: the activation is HF's `_apply_gate` (alpha, limit, the
    +1 on up) on the products plus gate/up biases, and the down product gets the down bias.
    Inputs are large (x30) so that the clamp at `limit` bites on both gate and up."""
    path = ggufs("gpt_oss")[kind]
    quantized = experts_modules(load_local(path))
    plain = experts_modules(load_local(open_source(path, experts_dtype="f32")))
    generator = torch.Generator().manual_seed(1)
    for layer, (_, module) in quantized.items():
        reference = plain[layer][1]  # transformers' GptOssExperts
        assert (module.alpha, module.limit) == (pytest.approx(reference.alpha), pytest.approx(reference.limit))
        for expert in (0, 5):
            x = 30.0 * torch.randn(16, module.config.hidden_size, generator=generator)  # [S, H]
            gate = module.gate.product(expert, x, 1) + module.biases["gate_bias"][expert]  # [S, I]
            up = module.up.product(expert, x, 1) + module.biases["up_bias"][expert]  # [S, I]
            clamped = float((gate > module.limit).float().mean()), float((up.abs() > module.limit).float().mean())
            assert min(clamped) > 0.05, f"the clamp bites on too few values: {clamped}"
            gate_up = torch.stack([gate, up], -1).flatten(-2)  # [S, 2I]: HF interleaves gate and up
            h = qkernels.oss_glu(gate, up, module.alpha, module.limit)  # [S, I]
            assert torch.allclose(h, reference._apply_gate(gate_up), rtol=1e-5, atol=1e-5)
            expected = module.down.product(expert, h, 1) + module.biases["down_bias"][expert]  # [S, H]
            got = module.expert(expert, x)  # [S, H]
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max())), \
                f"layer {layer} expert {expert}: max abs diff {(got - expected).abs().max():.3g}"


@pytest.mark.parametrize("family, kind", CASES)
def test_the_blocks_compute_the_familys_maths(family, kind, ggufs):
    """Quantized experts vs the same file's experts dequantized into the family's own module."""
    path = ggufs(family)[kind]
    quantized = load_local(path)
    assert all(isinstance(m, QuantExperts) for _, m in experts_modules(quantized).values())
    plain = load_local(open_source(path, experts_dtype="f32"))
    assert not any(isinstance(m, QuantExperts) for _, m in experts_modules(plain).values())
    cosine = _mean_cosine(Stepper(quantized).forward(TOKENS), Stepper(plain).forward(TOKENS))
    print(f"{family} {kind}: quantized vs float32 experts, mean cosine {cosine:.5f}")
    assert cosine > 0.998, f"{family} {kind}: mean cosine {cosine:.5f} between quantized and float32 experts"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_q8_0_experts_stay_close_to_the_f32_files(family, ggufs):
    """The F32 file's model with the Q8_0 file's experts, loaded as a worker loads them, vs the F32 file."""
    files = ggufs(family)
    reference = Stepper(load_local(files["F32"])).forward(TOKENS)  # [n, V]
    model = load_local(files["F32"])
    hosted, _, _ = load_experts(files["Q8_0"])
    for layer, (name, _) in experts_modules(model).items():
        model.set_submodule(name, hosted[layer].module)
    assert all(isinstance(m, QuantExperts) for _, m in experts_modules(model).values())
    cosine = _mean_cosine(Stepper(model).forward(TOKENS), reference)
    print(f"{family}: Q8_0 experts vs F32, mean cosine {cosine:.5f}")
    assert cosine > 0.99, f"{family}: mean cosine {cosine:.5f} between Q8_0 and F32 experts"


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K_M", "MXFP4"])
def test_gpt_oss_agrees_with_llama_cpp(kind, ggufs):
    """llama.cpp, an independent reader of the same file. The median over positions, not the mean:
    llama.cpp rounds activations to int8 blocks, and with random weights a routing near-tie at one
    position flips (measured with the kernels' float path: Q8_0 one position at 0.78, MXFP4 at
    0.73, the median 0.999 and 0.997)."""
    path = ggufs("gpt_oss")[kind]
    ours = Stepper(load_local(path)).forward(TOKENS)  # [n, V]
    theirs = torch.from_numpy(llama_cpp_logits(path, TOKENS))  # [n, V]
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)  # [n]
    print(f"gpt_oss {kind}: vs llama.cpp, cosine per position {[round(float(c), 3) for c in cosine]}")
    assert float(cosine.median()) > 0.99, f"gpt_oss {kind}: median cosine {float(cosine.median()):.5f} vs llama.cpp"
