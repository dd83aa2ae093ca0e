"""GGUF models, with llama.cpp as the oracle: its converter and quantizer make the fixtures.

- an F32 GGUF through moeswarm (backbone + 2 `moeswarm worker` processes over TCP) is
  torch.equal to the same model run from its HF directory;
- moeswarm's logits vs llama.cpp's on the same file and tokens (F32, F16, Q8_0, Q4_K_M): a mean
  cosine below 0.99 fails;
- slice files: byte-identical expert blocks, a worker serving from a slice alone;
- the GGUF tokenizer round-trips and tokenizes as llama.cpp does;
- every architecture's own proof (F32 vs the HF directory, vs llama.cpp, slices through two
  workers) is the shared runner, tests/test_gguf_families.py.

llama-cpp-python is required (CI installs it): without it these tests fail, unless
MOESWARM_SKIP_LLAMACPP=1 is set.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from moeswarm.errors import ModelError
from moeswarm.forward.stepper import Stepper
from moeswarm.local.workers import local_workers, split_experts
from moeswarm.sources.loading import load_experts, load_local
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm.swarm import open_swarm
from moeswarm.gguf.gguf_file import GGUFFile
from moeswarm.gguf.gguf_slice import write_slice
from moeswarm.kernels.row_invariant import RowInvariantWeight, make_rows_invariant
from moeswarm.kernels.row_ops import use_row_ops

from llamacpp_fixtures import FIXTURE_TYPES, llama_cpp_logits, make_fixture_ggufs, require_llama_cpp, slice_workers

llama_cpp = require_llama_cpp("tests/test_gguf.py")


torch.set_num_threads(1)
FAMILIES = {"qwen2_moe": {}, "qwen3_moe": {"norm_topk_prob": True}}
TOKENS = [5, 18, 31, 44, 57, 70, 83, 96, 109, 122, 135, 148, 161, 174, 187, 200, 213, 226, 239, 252]
MIN_MEAN_COSINE = 0.99


@pytest.fixture(scope="session")
def gguf_fixtures(tmp_path_factory):
    """family -> {"HF": dir, "F32": file, "F16": ..., "Q8_0": ..., "Q4_K_M": ...}, made once per session."""
    made: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in made:
            made[family] = make_fixture_ggufs(family, tmp_path_factory.mktemp(f"gguf-{family}"), **FAMILIES[family])
        return made[family]

    return get


def _realigned(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights in torch's (64-byte aligned) allocations, as moeswarm's GGUF loader makes them.

    CPU matmul kernels choose code paths by the weights' alignment: an HF model whose parameters
    are merely cloned gives other low-order bits (measured: 1e-6..3e-5). Comparing bit for bit
    needs both sides' weights at equally aligned addresses; the values are checked equal first.
    """
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    return model


def test_f32_gguf_swarm_equals_hf_directory(gguf_fixtures):
    files = gguf_fixtures("qwen2_moe")
    reference = _realigned(load_local(files["HF"]))
    from_gguf = load_local(files["F32"]).state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(tensor, from_gguf[name]), f"{name} differs between the HF directory and the F32 GGUF"
    # a GGUF file's F32 matrices take the row-invariant products: the HF model here too, to compare bits
    assert make_rows_invariant(reference) and all(isinstance(from_gguf[name], RowInvariantWeight)
                                                  for name in make_rows_invariant(reference))
    assert use_row_ops(reference)  # and its norms, as a GGUF file's backbone takes them (kernels/row_ops.py)
    local = Stepper(reference)
    with local_workers(str(files["F32"]), split_experts(8, 2)) as addresses:
        with open_swarm(str(files["F32"]), addresses) as swarm:
            remote = Stepper(swarm.model)
            feed = TOKENS[:10]
            for step in range(4):
                remote_logits, local_logits = remote.forward(feed), local.forward(feed)
                assert torch.equal(remote_logits, local_logits), f"logits differ at step {step}"
                feed = [int(remote_logits[-1].argmax())]


@pytest.mark.parametrize("kind", FIXTURE_TYPES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_agree_with_llama_cpp(family, kind, gguf_fixtures):
    path = gguf_fixtures(family)[kind]
    ours = Stepper(load_local(path)).forward(TOKENS).numpy()  # [n, V]
    theirs = llama_cpp_logits(path, TOKENS)  # [n, V]
    cosine = (ours * theirs).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(theirs, axis=-1))
    argmax = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    print(f"{family} {kind}: cosine min {cosine.min():.5f} mean {cosine.mean():.5f}, argmax agreement {argmax:.2f}")
    assert cosine.mean() >= MIN_MEAN_COSINE, f"{family} {kind}: mean cosine {cosine.mean():.5f} vs llama.cpp"


@pytest.mark.parametrize("kind", ["Q4_K_M", "F16"])
def test_slice_blocks_are_byte_identical(kind, gguf_fixtures, tmp_path):
    source = GGUFFile.open(gguf_fixtures("qwen2_moe")[kind])
    part = tmp_path / "part.gguf"
    write_slice(source.path, part, [2, 3, 4, 5], layers=(1, 1))
    sliced = GGUFFile.open(part)
    assert sliced.fingerprint == source.fingerprint
    assert sliced.expert_ids == [2, 3, 4, 5] and sliced.sliced_layers == [1]
    experts = [name for name in sliced.tensors if "_exps" in name]
    assert sorted(experts) == sorted(f"blk.1.ffn_{r}_exps.weight" for r in ("gate", "up", "down"))
    assert not any(not name.startswith("blk.1.ffn_") for name in sliced.tensors), "no backbone tensor without --with-backbone"
    for name in experts:
        full, cut = source.tensors[name], sliced.tensors[name]
        assert cut.tensor_type == full.tensor_type and int(cut.shape[2]) == 4
        nb2 = full.n_bytes // int(full.shape[2])
        start = full.data_offset + 2 * nb2
        assert source.reader.data[start : start + 4 * nb2].tobytes() == sliced.reader.data[cut.data_offset : cut.data_offset + cut.n_bytes].tobytes()


def test_workers_serve_from_slice_files(gguf_fixtures, tmp_path):
    """`moeswarm slice` then workers on PART files alone; the backbone on a --with-backbone slice."""
    from moeswarm.cli import main

    full = gguf_fixtures("qwen2_moe")["Q4_K_M"]
    low, high = tmp_path / "low.gguf", tmp_path / "high.gguf"
    assert main(["slice", str(full), "--experts", "0-3", "--with-backbone", "-o", str(low)]) == 0
    assert main(["slice", str(full), "--experts", "4-7", "-o", str(high)]) == 0
    local = Stepper(load_local(full))
    with slice_workers([(low, [0, 1, 2, 3]), (high, [4, 5, 6, 7])]) as addresses:
        with open_swarm(str(low), addresses) as swarm:
            logits = Stepper(swarm.model).forward(TOKENS)
    assert torch.equal(logits, local.forward(TOKENS))
    with pytest.raises(ModelError, match=r"high\.gguf.*holds experts 4-7.*requested experts 2-3"):
        load_experts(str(high), [2, 3, 4, 5])


def test_tokenizer_round_trips_and_matches_llama_cpp(gguf_fixtures):
    path = gguf_fixtures("qwen2_moe")["F32"]
    codec = load_text_codec(path, 320)
    model = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        for text in ["def fibonacci(n):\n    return n", "The quick brown fox, 1234 experts!", "héllo wörld  \n\n end"]:
            ids = codec.encode(text)
            assert codec.decode(ids) == text
            assert ids == model.tokenize(text.encode(), add_bos=False, special=False), text
    finally:
        model.close()
    assert codec.eos_token_id == GGUFFile.open(path).metadata["tokenizer.ggml.eos_token_id"]
