"""GGUF fixtures made by llama.cpp's own tools from moeswarm's small HF models (test tooling).

Lives in tests/, not in the package: it needs llama-cpp-python, which a moeswarm user does not
install. Test modules import it as `llamacpp_fixtures` (pytest puts tests/ on sys.path for
rootdir-relative test files without __init__.py).

The converter and quantizer wrappers live in the package, for `moeswarm bench real` too
(bench/moeswarm_bench/bench/llamacpp_convert.py): `convert_hf` runs llama.cpp's `convert_hf_to_gguf.py`,
`quantize` its quantizer, `bpe_tokenizer` makes a tokenizer the converter accepts.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from moeswarm.errors import MoeSwarmError

from moeswarm_bench.bench.llamacpp_convert import (LLAMA_CPP_PYTHON, QUANT_TYPES, bpe_tokenizer, convert_hf, convert_hf_many,
                                              quantize)


def require_llama_cpp(test_file: str):
    """llama_cpp, for a test module that needs it: without it the module fails with the command that
    installs it, or is skipped when MOESWARM_SKIP_LLAMACPP=1. Call at module level."""
    try:
        import llama_cpp
    except ImportError:
        if os.environ.get("MOESWARM_SKIP_LLAMACPP") == "1":
            import pytest

            pytest.skip("llama-cpp-python not installed and MOESWARM_SKIP_LLAMACPP=1", allow_module_level=True)
        raise ImportError(f"{test_file} needs llama-cpp-python (pip install llama-cpp-python=={LLAMA_CPP_PYTHON}); "
                          "set MOESWARM_SKIP_LLAMACPP=1 to skip") from None
    return llama_cpp


@contextlib.contextmanager
def slice_workers(parts):
    """One `moeswarm worker` per (model file, experts), as `local_workers` starts them but on files
    of their own, every process started before the first is waited for; yields their addresses."""
    from moeswarm.local.workers import spawn_worker, stop, wait_listening

    processes = []
    try:
        for model, experts in parts:
            processes.append(spawn_worker(str(model), experts))
        yield [wait_listening(process) for process in processes]
    finally:
        stop(processes)


@contextlib.contextmanager
def _without_extra_buffer_types():
    """Load models without llama.cpp's CPU "extra buffer types" (moeswarm_bench.bench.worker_real_llamacpp)."""
    import llama_cpp.llama_cpp as low

    from moeswarm_bench.bench.worker_real_llamacpp import plain_cpu_buffers

    default = low.llama_model_default_params
    low.llama_model_default_params = plain_cpu_buffers(default)
    try:
        yield
    finally:
        low.llama_model_default_params = default


def llama_cpp_logits(path: str | Path, tokens: list[int]):
    """llama.cpp's logits [n, V] (float32 numpy) for `tokens` fed as one batch from position 0."""
    import llama_cpp
    import numpy as np

    with _without_extra_buffer_types():
        model = llama_cpp.Llama(str(path), logits_all=True, n_ctx=max(64, len(tokens) + 8), n_threads=1,
                                n_batch=max(64, len(tokens)), verbose=False)
    try:
        model.eval(tokens)
        return np.array(model.scores[: len(tokens)], dtype=np.float32)
    finally:
        model.close()


FIXTURE_SHAPE = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=320)
FIXTURE_TYPES = ("F32", "F16", "Q8_0", "Q4_K_M")


def make_fixture_model(family: str, out: str | Path, seed: int = 0, **overrides) -> Path:
    """A tiny random HF model whose rows fit K-quants (hidden 256) and whose tokenizer llama.cpp reads."""
    from moeswarm.model.tiny import make_tiny_model

    shape = {**FIXTURE_SHAPE, **overrides}
    path = make_tiny_model(family, out, seed, **shape)
    tokenizer = bpe_tokenizer(shape["vocab_size"])
    tokenizer.save_pretrained(path)
    return path


def make_fixture_ggufs(family: str, out_dir: str | Path, types=FIXTURE_TYPES, **overrides) -> dict[str, Path]:
    """{"HF": model dir, "F32": ..., "F16": ..., "Q8_0": ..., "Q4_K_M": ...} made by llama.cpp's tools."""
    out_dir = Path(out_dir)
    made = {"HF": make_fixture_model(family, out_dir / f"{family}-hf", **overrides)}
    made["F32"] = convert_hf(made["HF"], out_dir / f"{family}-F32.gguf", "f32", pre="qwen2")
    if "F16" in types:
        made["F16"] = convert_hf(made["HF"], out_dir / f"{family}-F16.gguf", "f16", pre="qwen2")
    for kind in types:
        if kind in QUANT_TYPES:
            made[kind] = quantize(made["F32"], out_dir / f"{family}-{kind}.gguf", kind)
    return made


def make_many_fixture_ggufs(specs: dict[str, tuple[str, dict, tuple[str, ...], dict]], out_dir: str | Path,
                            types=("F32", "Q8_0"), **shape) -> dict[str, dict[str, Path] | str]:
    """`make_fixture_ggufs` for several models, converted in one run of llama.cpp's converter.

    specs: name -> (family, the tiny config's keys beyond `shape`, extra converter arguments,
    config.json keys as the family's released checkpoints write them where transformers 5.23 saves
    them otherwise: the converter reads a copy of the directory with those keys).
    Returns name -> {"HF": dir, "F32": ..., "Q8_0": ...}, or name -> the error for a model llama.cpp's
    tools could not convert or quantize."""
    out_dir = Path(out_dir)
    made: dict[str, dict[str, Path] | str] = {}
    sources: dict[str, Path] = {}
    for name, (family, overrides, _, checkpoint) in specs.items():
        made[name] = {"HF": make_fixture_model(family, out_dir / f"{name}-hf", **{**shape, **overrides}),
                      "F32": out_dir / f"{name}-F32.gguf"}
        sources[name] = _as_released(made[name]["HF"], out_dir / f"{name}-checkpoint", checkpoint) if checkpoint else made[name]["HF"]
    error = ""
    try:
        convert_hf_many([(sources[name], files["F32"], "f32", specs[name][2]) for name, files in made.items()], pre="qwen2")
    except MoeSwarmError as failure:
        error = str(failure)
    for name, files in made.items():
        if not files["F32"].is_file():
            made[name] = f"llama.cpp's converter could not convert {name}: {error[-2000:]}"
            continue
        try:
            for kind in types:
                if kind in QUANT_TYPES:
                    files[kind] = quantize(files["F32"], out_dir / f"{name}-{kind}.gguf", kind)
        except MoeSwarmError as failure:
            made[name] = f"llama.cpp's quantizer failed on {name}: {failure}"
    return made


def _as_released(model_dir: Path, out: Path, keys: dict) -> Path:
    """A copy of `model_dir` (files linked) whose config.json has `keys` (None deletes a key)."""
    import json

    out.mkdir()
    for item in model_dir.iterdir():
        if item.name != "config.json":
            (out / item.name).symlink_to(item.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    for key, value in keys.items():
        config.pop(key, None) if value is None else config.__setitem__(key, value)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
