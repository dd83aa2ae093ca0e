"""A worker loads only what it uses: its experts and the config, never the tokenizer's vocabulary.

Two GGUF files that differ only in their vocabulary (tokens, merges, token types, embeddings and
head): loading a worker's experts from either takes the same memory, because no metadata value is
decoded until something asks for it (gguf/gguf_header.py). gguf-py's own reader makes numpy
objects per vocabulary item on open (~160 MB more for the 60k-token file here than the 1k one). The lazily decoded
metadata and the fingerprint are exactly what gguf-py's reader gives.
"""

from __future__ import annotations

import hashlib
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from moeswarm.sources.loading import load_experts
from moeswarm.sources.source import open_source
from moeswarm.gguf.gguf_file import GGUFFile

D, INNER, EXPERTS, TOP_K, HEADS, KV_HEADS, HEAD_DIM = 64, 64, 4, 2, 2, 1, 32
SMALL_VOCAB, LARGE_VOCAB = 1000, 60_000


def vocabulary(size: int) -> tuple[list[str], list[str]]:
    """(tokens, merges) of a byte-level BPE: the 256 byte symbols, then pairs of them, then an end token."""
    from moeswarm.model.tiny import BYTE_TO_UNICODE

    symbols = [BYTE_TO_UNICODE[b] for b in range(256)]
    pairs = [(a, b) for a in symbols for b in symbols][: size - 256 - 1]
    return symbols + [a + b for a, b in pairs] + ["<|end|>"], [f"{a} {b}" for a, b in pairs[: size // 2]]


def write_model(path: Path, vocab: int) -> Path:
    """A one-layer qwen3moe file with `vocab` tokens; each tensor's values depend on its name only."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, value in (("block_count", 1), ("context_length", 256), ("embedding_length", D),
                       ("feed_forward_length", INNER), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS), ("attention.key_length", HEAD_DIM),
                       ("attention.value_length", HEAD_DIM), ("expert_count", EXPERTS),
                       ("expert_used_count", TOP_K), ("expert_feed_forward_length", INNER)):
        writer.add_uint32(f"qwen3moe.{key}", value)
    writer.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("qwen3moe.rope.freq_base", 1e6)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "qwen2")
    tokens, merges = vocabulary(vocab)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [1] * (vocab - 1) + [3])
    writer.add_array("tokenizer.ggml.merges", merges)
    writer.add_array("tokenizer.ggml.scores", [float(i) / 7 for i in range(8)])  # a float32 array, exact values
    writer.add_uint32("tokenizer.ggml.eos_token_id", vocab - 1)
    shapes = {"token_embd.weight": (vocab, D), "output_norm.weight": (D,), "output.weight": (vocab, D),
              "blk.0.attn_norm.weight": (D,), "blk.0.attn_q.weight": (HEADS * HEAD_DIM, D),
              "blk.0.attn_k.weight": (KV_HEADS * HEAD_DIM, D), "blk.0.attn_v.weight": (KV_HEADS * HEAD_DIM, D),
              "blk.0.attn_output.weight": (D, HEADS * HEAD_DIM), "blk.0.attn_q_norm.weight": (HEAD_DIM,),
              "blk.0.attn_k_norm.weight": (HEAD_DIM,), "blk.0.ffn_norm.weight": (D,),
              "blk.0.ffn_gate_inp.weight": (EXPERTS, D), "blk.0.ffn_gate_exps.weight": (EXPERTS, INNER, D),
              "blk.0.ffn_up_exps.weight": (EXPERTS, INNER, D), "blk.0.ffn_down_exps.weight": (EXPERTS, D, INNER)}
    for name, dims in shapes.items():
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        values = np.ones(dims, dtype=np.float32) if len(dims) == 1 else rng.standard_normal(dims, dtype=np.float32) * 0.02
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[int, Path]:
    folder = tmp_path_factory.mktemp("vocab")
    return {vocab: write_model(folder / f"vocab{vocab}.gguf", vocab) for vocab in (SMALL_VOCAB, LARGE_VOCAB)}


def _peak_loading_experts(path: Path) -> tuple[int, dict]:
    """Peak bytes Python allocated while a worker's part is loaded (source, config, every expert)."""
    tracemalloc.start()
    try:
        hosted, source, _ = load_experts(str(path))
        source.fingerprint  # noqa: B018  (a worker announces it)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, hosted


def test_loading_a_workers_experts_takes_the_same_memory_whatever_the_vocabulary(models):
    _peak_loading_experts(models[SMALL_VOCAB])  # first imports and caches are not what is measured
    small, hosted_small = _peak_loading_experts(models[SMALL_VOCAB])
    large, hosted_large = _peak_loading_experts(models[LARGE_VOCAB])
    # 59,000 more tokens and 29,500 more merges: gguf-py's reader (and the values it decodes) held
    # ~160 MB more for them
    assert large - small < 1 << 20, (small, large)
    layer_small, layer_large = hosted_small[0].module, hosted_large[0].module
    x, ids, weights = torch.randn(3, D), torch.tensor([[0], [1], [3]]), torch.rand(3, 1)
    with torch.inference_mode():  # the experts are the same: the vocabulary changed nothing else
        assert torch.equal(layer_small(x, ids, weights), layer_large(x, ids, weights))


def test_metadata_and_fingerprint_are_what_gguf_py_reads(models):
    """Every value decoded on demand equals gguf-py's ReaderField.contents() (a float32 scalar as its
    shortest decimal), and the fingerprint keeps its definition: sha256 over key=repr(value) lines
    (sorted), tensor names, types and shapes, the data region's size and its first and last 64 KiB."""
    from gguf import GGUFReader, GGUFValueType

    path = models[LARGE_VOCAB]
    f = GGUFFile.open(path)
    reader = GGUFReader(path)
    expected = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types == [GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))
        expected[key] = value
    assert list(f.metadata) == list(expected)
    for key, value in expected.items():
        assert f.metadata[key] == value and type(f.metadata[key]) is type(value), key
    assert f.metadata["qwen3moe.attention.layer_norm_rms_epsilon"] == 1e-6
    assert f.metadata_length("tokenizer.ggml.tokens") == LARGE_VOCAB

    digest = hashlib.sha256()
    for key in sorted(expected):
        digest.update(f"{key}={expected[key]!r}\n".encode())
    for t in reader.tensors:
        digest.update(f"{t.name}:{int(t.tensor_type)}:{[int(n) for n in t.shape]}\n".encode())
    data = reader.data[reader.data_offset :]
    digest.update(str(len(data)).encode())
    digest.update(data[: 1 << 16].tobytes())
    digest.update(data[-(1 << 16) :].tobytes())
    assert f.fingerprint == "gguf-" + digest.hexdigest()[:32]
    assert open_source(path).fingerprint == f.fingerprint

    for mine, theirs in zip(f.tensors.values(), reader.tensors):
        assert (mine.name, mine.tensor_type, mine.n_bytes, mine.data_offset) == \
            (theirs.name, theirs.tensor_type, theirs.n_bytes, theirs.data_offset)
        assert np.array_equal(mine.data, theirs.data) and mine.data.shape == theirs.data.shape


def test_the_tokenizer_is_still_there_for_whoever_asks(models):
    tokenizer = open_source(models[SMALL_VOCAB]).load_tokenizer()
    tokens, _ = vocabulary(SMALL_VOCAB)
    assert tokenizer.convert_ids_to_tokens(300) == tokens[300]
    assert tokenizer.eos_token == "<|end|>"
    assert tokenizer.decode(tokenizer.encode("hello moe")) == "hello moe"
