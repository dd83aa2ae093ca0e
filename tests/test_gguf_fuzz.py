"""Hostile GGUF files: the findings of the file fuzzer (issue 62) and a seeded fuzz of the header checks.

Each mutated file is the bundled model's Q4_K_M export with one field changed
(bench/moeswarm_bench/bench/file_mutations.py). A file either opens (and its config builds) or is
refused with a one-line ModelError naming the file; anything else (another exception, a
traceback from `moeswarm info`, a worker that starts on it) is a bug. The longer run is
`moeswarm bench fuzz --files N` (docs/gguf.md, "Hostile files").
"""

from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest
from gguf import GGMLQuantizationType

from moeswarm.bundled import PYMOE
from moeswarm.errors import ModelError
from moeswarm_bench.bench.file_mutations import (Layout, mutate, with_array_string_byte, with_dim, with_int,
                                                 with_string_byte, with_type)
from moeswarm.gguf.gguf_config import config_from_gguf
from moeswarm.gguf.gguf_file import GGUFFile

BASE = PYMOE / "gguf" / "pymoe-Q4_K_M.gguf"
FUZZ_CASES = 200
SEED = 62


@pytest.fixture(scope="module")
def layout() -> Layout:
    return Layout(BASE.read_bytes())


def _refusal(path, data: bytes) -> str:
    """The one-line ModelError opening `data` (written to `path`) gives, building its config too."""
    path.write_bytes(data)
    with pytest.raises(ModelError) as error:
        config_from_gguf(GGUFFile.open(path))
    message = str(error.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    return message


# -- the findings, one by one -------------------------------------------------------------


def test_an_expert_tensor_shorter_than_expert_count_is_refused(tmp_path, layout):
    message = _refusal(tmp_path / "m.gguf", with_dim(layout, "blk.1.ffn_down_exps.weight", 2, 1))
    assert "tensor blk.1.ffn_down_exps.weight has ne [64, 128, 1]: its experts dimension (ne[2]) must be 32" in message


@pytest.mark.parametrize("blocks", [100000, 2**31 - 1, 7, 0])
def test_block_count_beyond_the_tensors_is_refused_at_once(tmp_path, layout, blocks):
    start = time.monotonic()
    message = _refusal(tmp_path / "m.gguf", with_int(layout, "qwen2moe.block_count", blocks))
    assert time.monotonic() - start < 2.0
    assert "qwen2moe.block_count" in message and str(blocks) in message


@pytest.mark.parametrize("count", [2**20, 31, 0])
def test_expert_count_other_than_the_tensors_is_refused(tmp_path, layout, count):
    message = _refusal(tmp_path / "m.gguf", with_int(layout, "qwen2moe.expert_count", count))
    assert "qwen2moe.expert_count" in message or "experts dimension (ne[2]) must be" in message


def test_a_metadata_string_not_utf8_is_refused(tmp_path, layout):
    message = _refusal(tmp_path / "m.gguf", with_string_byte(layout, "general.name", 0, 0xFF))
    assert "metadata general.name: the string at byte" in message and "is not valid UTF-8" in message


def test_a_token_not_utf8_is_refused_when_the_tokenizer_is_read(tmp_path, layout):
    path = tmp_path / "m.gguf"
    path.write_bytes(with_array_string_byte(layout, "tokenizer.ggml.tokens", 10, 0, 0xFF))
    f = GGUFFile.open(path)  # the vocabulary is decoded when asked for, not on open
    with pytest.raises(ModelError, match=r"m\.gguf: metadata tokenizer\.ggml\.tokens: the string at byte \d+ is not valid UTF-8"):
        f.fingerprint  # noqa: B018


@pytest.mark.parametrize("key, value, expected", [
    ("qwen2moe.attention.head_count", 0, "qwen2moe.attention.head_count is 0"),
    ("qwen2moe.attention.head_count", 2**32 - 1, "qwen2moe.attention.head_count = 4294967295 is outside"),
    ("qwen2moe.attention.head_count_kv", 3, "qwen2moe.attention.head_count_kv 3 does not divide attention.head_count 4"),
    ("qwen2moe.embedding_length", 3, "qwen2moe.embedding_length 3 is not a multiple of attention.head_count 4"),
    ("qwen2moe.embedding_length", 64, "qwen2moe.embedding_length is 64 but token_embd.weight rows hold 128 values"),
    ("qwen2moe.expert_used_count", 33, "qwen2moe.expert_used_count 33 exceeds expert_count 32"),
    ("qwen2moe.expert_shared_feed_forward_length", 2**32 - 1, "expert_shared_feed_forward_length = 4294967295 is outside"),
    ("tokenizer.ggml.padding_token_id", 5000, "tokenizer.ggml.padding_token_id 5000 is outside the vocabulary of 4096"),
])
def test_hyperparameters_out_of_bounds_are_refused(tmp_path, layout, key, value, expected):
    assert expected in _refusal(tmp_path / "m.gguf", with_int(layout, key, value))


def test_an_f64_tensor_is_refused_on_open(tmp_path, layout):
    f64 = Layout(with_type(layout, "blk.0.attn_k.bias", int(GGMLQuantizationType.F64)))
    data = with_dim(f64, "blk.0.attn_k.bias", 0, 64)  # 64 F64 values: the 512 bytes of the 128 F32 ones
    message = _refusal(tmp_path / "m.gguf", data)
    assert "tensor blk.0.attn_k.bias has quantization type F64, which moeswarm cannot dequantize" in message


@pytest.mark.parametrize("ggml_type, expected", [
    (99, "tensor 'blk.0.attn_q.weight': unknown ggml type 99"),
    (int(GGMLQuantizationType.Q8_0), "its data overlaps tensor 'blk.0.attn_q.weight'"),  # Q8_0 rows: longer than Q5_0's
])
def test_tensor_types_are_checked(tmp_path, layout, ggml_type, expected):
    assert expected in _refusal(tmp_path / "m.gguf", with_type(layout, "blk.0.attn_q.weight", ggml_type))


def test_a_tensor_dim_past_the_file_is_refused_before_any_view(tmp_path, layout):
    message = _refusal(tmp_path / "m.gguf", with_dim(layout, "token_embd.weight", 1, 2**40))
    assert "tensor 'token_embd.weight': its data" in message and "runs past the end of the file" in message


def test_a_broken_merge_is_one_line(tmp_path, layout):
    from moeswarm.gguf.gguf_tokenizer import gguf_tokenizer

    path = tmp_path / "m.gguf"
    path.write_bytes(with_array_string_byte(layout, "tokenizer.ggml.merges", 4, 1, ord("x")))  # "s e" -> "sxe"
    with pytest.raises(ModelError, match=r"m\.gguf: tokenizer\.ggml\.merges\[4\] 'sxe' is not two vocabulary tokens"):
        gguf_tokenizer(GGUFFile.open(path))


# -- the seeded fuzz ----------------------------------------------------------------------------


def test_seeded_fuzz_every_file_opens_or_is_refused_in_one_line(tmp_path, layout):
    rng, path = random.Random(SEED), tmp_path / "mutant.gguf"
    outcomes = {"opened": 0, "refused": 0}
    start = time.monotonic()
    for case in range(FUZZ_CASES):
        data, what = mutate(layout.data, layout, rng)
        path.write_bytes(data)
        try:
            f = GGUFFile.open(path)
            if not f.header.tensors or f.tensors.get("blk.0.ffn_gate_exps.weight") is None:
                raise ModelError(f"{path}: (the case left no experts to check)")
            config_from_gguf(f)
            outcomes["opened"] += 1
        except ModelError as error:
            message = str(error)
            assert message.startswith(f"{path}: ") and "\n" not in message, (case, what, message)
            outcomes["refused"] += 1
        except Exception as error:  # noqa: BLE001: any other exception is the finding
            pytest.fail(f"case {case} ({what}): {type(error).__name__}: {error}")
    assert outcomes["refused"] >= FUZZ_CASES // 3 and outcomes["opened"] >= FUZZ_CASES // 10, outcomes
    assert time.monotonic() - start < 60


# -- the commands, as a user runs them ----------------------------------------------------------


def _moeswarm(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeswarm.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_info_on_a_hostile_file_is_exit_2_and_one_line(tmp_path, layout):
    path = tmp_path / "m.gguf"
    path.write_bytes(with_int(layout, "qwen2moe.block_count", 2**31 - 1))
    result = _moeswarm("info", str(path))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [f"moeswarm info: error: {path}: qwen2moe.block_count = 2147483647 is outside 1-256"]


def test_a_worker_refuses_a_short_expert_tensor_at_startup(tmp_path, layout):
    path = tmp_path / "m.gguf"
    path.write_bytes(with_dim(layout, "blk.1.ffn_down_exps.weight", 2, 1))
    result = _moeswarm("worker", "--model", str(path), "--experts", "0-7", "--port", "0", "--quiet")
    assert result.returncode == 2 and "listening" not in result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"moeswarm worker: error: {path}: tensor blk.1.ffn_down_exps.weight")
