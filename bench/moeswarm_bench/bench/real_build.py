"""The Q4_K_M files of `moeswarm bench real`, built once into a cache directory.

A shape's model is written as a Hugging Face directory (config.json, bf16 safetensors shards one
layer each, a byte-level BPE tokenizer), converted to an F16 GGUF by llama.cpp's own
`convert_hf_to_gguf.py` and quantized to Q4_K_M by llama.cpp's own quantizer; the HF directory
and the F16 file are deleted, only the Q4_K_M file is kept. Tensors are generated one at a time
and a shard (one layer, ~0.8 GB at OLMoE's shape) is the most held in memory; the disk holds at
most two forms at once (the HF directory and the F16 file: ~2 x 14 GB at OLMoE's shape). Measured
here (2 shared cores): ~13 minutes for OLMoE's shape, ~12 for Qwen3's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from moeswarm_bench.bench.llamacpp_convert import bpe_tokenizer, convert_hf, quantize, require_llama_cpp
from moeswarm_bench.bench.real_shapes import QUANT_TYPE, WEIGHT_STD, ModelShape
from moeswarm.progress import progress, status

DEFAULT_CACHE = Path.home() / ".cache" / "moeswarm" / "bench-real"
FORMAT_VERSION = 1  # bump when the files written change: a new cache key
TOKENIZER_VOCAB = 1024  # BPE tokens learnt; the converter pads the rest of the vocabulary with unused [PADn]
PRE_TOKENIZER = "qwen2"  # bpe_tokenizer's split regex


def model_file(shape: ModelShape, cache: Path) -> Path:
    """The cached Q4_K_M file of `shape`, built first when the cache lacks it."""
    path = cache / f"v{FORMAT_VERSION}-{shape.key()}-{QUANT_TYPE}.gguf"
    if path.is_file():
        return path
    require_llama_cpp("moeswarm bench real")
    cache.mkdir(parents=True, exist_ok=True)
    hf_dir = cache / f"{path.stem}.hf.part"
    f16 = cache / f"{path.stem}.F16.gguf.part"
    partial = path.with_suffix(".gguf.part")
    try:
        shutil.rmtree(hf_dir, ignore_errors=True)  # a build interrupted before
        write_hf(shape, hf_dir)
        with status(f"converting {shape.name} to F16 with llama.cpp's convert_hf_to_gguf.py"):
            convert_hf(hf_dir, f16, "f16", pre=PRE_TOKENIZER)
        shutil.rmtree(hf_dir)
        with status(f"quantizing {shape.name} to {QUANT_TYPE} with llama.cpp"):
            quantize(f16, partial, QUANT_TYPE, os.cpu_count() or 1)  # building is not measured: every core
        partial.rename(path)  # only a whole file is ever found in the cache
    finally:
        shutil.rmtree(hf_dir, ignore_errors=True)
        f16.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return path


def write_hf(shape: ModelShape, out: Path, seed: int = 0) -> Path:
    """A Hugging Face model directory of `shape` with random N(0, WEIGHT_STD) matrices and unit norms,
    in bf16 shards: the embeddings, one per layer, then the final norm and the head."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(shape.hf_config(), indent=1) + "\n")
    tokenizer = bpe_tokenizer(min(TOKENIZER_VOCAB, shape.vocab))
    tokenizer.save_pretrained(out)
    shards = _shards(shape.hf_tensors())
    generator = torch.Generator().manual_seed(seed)
    index = {}
    total = sum(len(names) for names in shards)
    with progress(desc=f"writing {shape.name} (random bf16 weights)", total=total, unit="tensor") as bar:
        for number, names in enumerate(shards):
            file = f"model-{number + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for name, dims in names.items():
                tensors[name] = _random(dims, generator)
                index[name] = file
                bar.update(1)
            save_file(tensors, str(out / file), metadata={"format": "pt"})
            del tensors
    weight_map = {"metadata": {"total_size": 2 * shape.parameters()}, "weight_map": index}
    (out / "model.safetensors.index.json").write_text(json.dumps(weight_map, indent=1) + "\n")
    return out


def _shards(tensors: dict[str, tuple[int, ...]]) -> list[dict[str, tuple[int, ...]]]:
    """The tensors grouped by layer (model.layers.N.*), the others each in a shard of their own kind."""
    groups: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, dims in tensors.items():
        parts = name.split(".")
        group = ".".join(parts[:3]) if parts[1] == "layers" else ("head" if "lm_head" in name or "norm" in name else name)
        groups.setdefault(group, {})[name] = dims
    return list(groups.values())


def _random(dims: tuple[int, ...], generator):
    """A bf16 tensor: ones for a vector (norm weights), else N(0, WEIGHT_STD), filled in row blocks so
    that no float32 copy of a whole embedding matrix (V x d) is ever held."""
    import torch

    if len(dims) == 1:
        return torch.ones(dims, dtype=torch.bfloat16)
    values = torch.empty(dims, dtype=torch.bfloat16)
    for rows in values.view(-1, dims[-1]).split(8192):  # [<=8192, columns]
        rows.copy_(torch.randn(rows.shape, generator=generator) * WEIGHT_STD)
    return values
