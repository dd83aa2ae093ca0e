"""Bad GGUF input: each case a ModelError naming the file and what is wrong (no llama.cpp needed)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from moeswarm.errors import ModelError
from moeswarm.sources.loading import load_backbone, load_experts
from moeswarm.gguf.gguf_slice import write_slice

HIDDEN, EXPERTS, FF = 32, 4, 32


def _write(path, arch="qwen2moe", embedding_type=None) -> str:
    """A minimal one-layer qwen2moe-shaped GGUF written with gguf-py (random F32 weights)."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), arch)
    for key, value in {"block_count": 1, "embedding_length": HIDDEN, "feed_forward_length": FF, "attention.head_count": 4,
                       "attention.head_count_kv": 2, "expert_count": EXPERTS, "expert_used_count": 2,
                       "expert_feed_forward_length": FF, "context_length": 64}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    embedding = rng.standard_normal((50, HIDDEN)).astype(np.float32)
    if embedding_type is not None:
        writer.add_tensor("token_embd.weight", embedding.astype(np.int32), raw_dtype=embedding_type)
    else:
        writer.add_tensor("token_embd.weight", embedding)
    for role, shape in (("gate", (EXPERTS, FF, HIDDEN)), ("up", (EXPERTS, FF, HIDDEN)), ("down", (EXPERTS, HIDDEN, FF))):
        writer.add_tensor(f"blk.0.ffn_{role}_exps.weight", rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("{}\n")
    with pytest.raises(ModelError, match=r"model\.gguf: not a GGUF file"):
        load_backbone(str(path))


def test_truncated_file(tmp_path):
    full = _write(tmp_path / "full.gguf")
    cut = tmp_path / "cut.gguf"
    data = open(full, "rb").read()
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelError, match=r"cut\.gguf: truncated"):
        load_experts(str(cut), [0, 1])
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:40])
    with pytest.raises(ModelError, match=r"header\.gguf: truncated or corrupt GGUF file"):
        load_backbone(str(header_only))


def test_unsupported_architecture(tmp_path):
    path = _write(tmp_path / "bert.gguf", arch="bert")
    with pytest.raises(ModelError, match=r"bert\.gguf: unsupported GGUF architecture 'bert'"):
        load_backbone(path)


def test_unsupported_quantization_type(tmp_path):
    path = _write(tmp_path / "int.gguf", embedding_type=GGMLQuantizationType.I32)
    with pytest.raises(ModelError, match=r"int\.gguf: tensor token_embd\.weight has quantization type I32"):
        load_backbone(path)


def test_slice_lacking_requested_experts(tmp_path):
    full = _write(tmp_path / "full.gguf")
    part = tmp_path / "part.gguf"
    write_slice(full, part, [2, 3])
    hosted, source, num_experts = load_experts(str(part))  # what the slice file holds
    assert num_experts == EXPERTS and source.fingerprint == load_experts(full, [2, 3])[1].fingerprint
    assert {layer: h.experts for layer, h in hosted.items()} == {0: (2, 3)}
    with pytest.raises(ModelError, match=r"part\.gguf: this slice file holds experts 2-3, not the requested experts 0-1 "
                                         r"\(requested 0-3\)$"):
        load_experts(str(part), [0, 1, 2, 3])
    with pytest.raises(ModelError, match=r"part\.gguf: the GGUF file lacks backbone tensors"):
        load_backbone(str(part))


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    from moeswarm.gguf.gguf_support import SUPPORTED

    path = _write(tmp_path / "bert.gguf", arch="bert")
    with pytest.raises(ModelError) as error:
        load_backbone(path)
    message = str(error.value)
    assert "\n" not in message and message.endswith("see docs/models.md")
    assert all(arch in message for arch in SUPPORTED)


def test_known_moe_architecture_not_supported_says_why(tmp_path):
    path = _write(tmp_path / "phi.gguf", arch="phimoe")
    with pytest.raises(ModelError, match=r"phi\.gguf: unsupported GGUF architecture 'phimoe' \(llama\.cpp and transformers "
                                         r"disagree on it .*\); supported: .*; see docs/models\.md$"):
        load_backbone(path)


def test_info_names_the_support_status_and_the_gate_command(tmp_path, capsys):
    import json

    from moeswarm.cli import main

    path = _write(tmp_path / "small.gguf")
    assert main(["info", path]) == 0
    out = capsys.readouterr().out
    assert "  GGUF architecture   qwen2moe: supported (transformers qwen2_moe): loads, slices, serves\n" in out
    assert f"    moeswarm gate --model {path} --combine partial --wire-dispatch int8-b128 --wire-combine int8-b128" in out
    assert main(["info", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["gguf_architecture"], info["family"]) == ("qwen2moe", "qwen2_moe")
    assert info["gate_command"].startswith(f"moeswarm gate --model {path} ")


def test_info_on_an_unsupported_file_is_one_line(tmp_path):
    import subprocess
    import sys

    path = _write(tmp_path / "phi.gguf", arch="phimoe")
    run = subprocess.run([sys.executable, "-m", "moeswarm.cli", "info", path], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and run.stdout == ""
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert "unsupported GGUF architecture 'phimoe' (llama.cpp and transformers disagree" in lines[0]
    assert lines[0].endswith("see docs/models.md")
