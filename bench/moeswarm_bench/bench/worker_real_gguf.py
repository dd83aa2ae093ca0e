"""One-layer qwen3moe GGUF files at a `LayerShape`, random weights, quantized by llama.cpp.

The F16 file is written tensor by tensor with gguf-py's GGUFWriter (one tensor in memory at a
time), quantized with llama.cpp's own quantizer (`llama_cpp.llama_model_quantize`, from
llama-cpp-python) and deleted; the quantized files are kept in a cache directory keyed by shape
and type, so a rerun builds nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from moeswarm_bench.bench.llamacpp_convert import quantize, silence
from moeswarm_bench.bench.worker_real_shapes import LayerShape
from moeswarm.errors import MoeSwarmError
from moeswarm.progress import status

DEFAULT_CACHE = Path.home() / ".cache" / "moeswarm" / "bench-worker"
FORMAT_VERSION = 1  # bump when the files written change: a new cache key

VOCAB = 512
HEADS, KV_HEADS = 4, 2


def require_llama_cpp():
    """llama-cpp-python, or one line saying it is needed."""
    try:
        import llama_cpp
    except ImportError:
        raise MoeSwarmError("moeswarm bench worker needs llama-cpp-python to quantize its files: "
                            "pip install 'llama-cpp-python==0.3.36'") from None
    silence(llama_cpp)
    return llama_cpp




def layer_files(shape: LayerShape, qtypes: tuple[str, ...], cache: Path, inner: int | None = None) -> dict[str, Path]:
    """{type: the cached quantized one-layer file for `shape`}, experts of `inner` (default the
    shape's); what the cache lacks is built from one F16 file, written once and deleted. The
    quantizer uses every core: building is not measured."""
    inner = inner or shape.inner
    key = f"v{FORMAT_VERSION}-qwen3moe-d{shape.hidden}-e{shape.experts}-i{inner}-k{shape.top_k}"
    files = {qtype: cache / f"{key}-{qtype}.gguf" for qtype in qtypes}
    missing = [qtype for qtype, path in files.items() if not path.is_file()]
    if not missing:
        return files
    require_llama_cpp()
    cache.mkdir(parents=True, exist_ok=True)
    source = cache / f"{key}-F16.gguf.part"
    try:
        with status(f"writing {source.name} (random weights)"):
            write_f16(shape, inner, source)
        for qtype in missing:
            partial = files[qtype].with_suffix(".gguf.part")
            with status(f"quantizing to {qtype} with llama.cpp"):
                quantize(source, partial, qtype, os.cpu_count() or 1)
            partial.rename(files[qtype])  # only a whole file is ever found in the cache
    finally:
        source.unlink(missing_ok=True)
    return files


def write_f16(shape: LayerShape, inner: int, path: Path, seed: int = 0) -> None:
    """A one-layer qwen3moe model: d = shape.hidden, E experts of `inner`, random N(0, 0.02) weights."""
    import gguf
    import torch

    d, head_dim = shape.hidden, 128 if shape.hidden % 128 == 0 and shape.hidden >= 512 else 64
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    arch = "qwen3moe"
    for key, value in (("block_count", 1), ("context_length", 4096), ("embedding_length", d),
                       ("feed_forward_length", inner), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS), ("attention.key_length", head_dim),
                       ("attention.value_length", head_dim), ("expert_count", shape.experts),
                       ("expert_used_count", shape.top_k), ("expert_feed_forward_length", inner)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", 1e6)
    writer.add_uint32("general.file_type", 1)  # MOSTLY_F16
    writer.add_string("general.name", f"moeswarm bench worker layer d{d} e{shape.experts} i{inner}")
    _add_tokenizer(writer)
    tensors = _tensor_shapes(d, inner, shape.experts, head_dim)  # name -> numpy shape (ne reversed)
    for name, dims in tensors.items():
        dtype = np.float32 if len(dims) == 1 else np.float16  # norms stay F32, as llama.cpp's converter keeps them
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    generator = torch.Generator().manual_seed(seed)
    for dims in tensors.values():  # in the order of their infos
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            values = torch.empty(dims, dtype=torch.float16)
            for row in values.view(-1, dims[-1]).split(4096):  # in pieces: no float32 copy of a whole tensor
                row.copy_(torch.randn(row.shape, generator=generator) * 0.02)
            writer.write_tensor_data(values.numpy())
            del values
    writer.close()


def _tensor_shapes(d: int, inner: int, experts: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    """The qwen3moe tensors of one layer, in numpy order ([rows, columns], experts first)."""
    return {
        "token_embd.weight": (VOCAB, d),
        "output_norm.weight": (d,),
        "output.weight": (VOCAB, d),
        "blk.0.attn_norm.weight": (d,),
        "blk.0.attn_q.weight": (HEADS * head_dim, d),
        "blk.0.attn_k.weight": (KV_HEADS * head_dim, d),
        "blk.0.attn_v.weight": (KV_HEADS * head_dim, d),
        "blk.0.attn_output.weight": (d, HEADS * head_dim),
        "blk.0.attn_q_norm.weight": (head_dim,),
        "blk.0.attn_k_norm.weight": (head_dim,),
        "blk.0.ffn_norm.weight": (d,),
        "blk.0.ffn_gate_inp.weight": (experts, d),
        "blk.0.ffn_gate_exps.weight": (experts, inner, d),
        "blk.0.ffn_up_exps.weight": (experts, inner, d),
        "blk.0.ffn_down_exps.weight": (experts, d, inner),
    }


def _add_tokenizer(writer) -> None:
    """A byte-level BPE vocabulary llama.cpp accepts: the 256 byte symbols, merges of letter pairs, an EOS."""
    from moeswarm.model.tiny import BYTE_TO_UNICODE  # GPT-2's byte -> printable character table

    symbols = [BYTE_TO_UNICODE[b] for b in range(256)]
    letters = [symbols[ord(c)] for c in "abcdefghijklmnopqrstuvwxyz"]
    pairs = [(a, b) for a in letters for b in letters][: VOCAB - 256 - 1]
    tokens = symbols + [a + b for a, b in pairs] + ["<|endoftext|>"]
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "qwen2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [1] * (len(tokens) - 1) + [3])
    writer.add_array("tokenizer.ggml.merges", [f"{a} {b}" for a, b in pairs])
    writer.add_uint32("tokenizer.ggml.eos_token_id", len(tokens) - 1)
    writer.add_uint32("tokenizer.ggml.bos_token_id", len(tokens) - 1)


def expert_bytes(path: Path) -> tuple[int, dict[str, str]]:
    """(bytes of one expert's gate + up + down in the file, {role: the tensor's GGML type})."""
    from moeswarm.gguf.gguf_file import GGUFFile, type_name

    f = GGUFFile.open(path)
    total, types = 0, {}
    for role in ("gate", "up", "down"):
        tensor = f.tensors[f"blk.0.ffn_{role}_exps.weight"]
        experts = int(tensor.shape[2])  # ne = [columns, rows, experts]
        total += int(tensor.n_bytes) // experts
        types[role] = type_name(tensor.tensor_type)
    return total, types

