"""GGUF fixtures made by llama.cpp's own tools from moeswarm's small HF models (test tooling).

Lives in tests/, not in the package: it downloads llama.cpp's source and needs llama-cpp-python,
neither of which a moeswarm user installs. Test modules import it as `llamacpp_fixtures` (pytest
puts tests/ on sys.path for rootdir-relative test files without __init__.py).

- `convert_hf`: llama.cpp's `convert_hf_to_gguf.py` (from the llama-cpp-python source archive,
  with its vendored gguf-py first on sys.path), run in a subprocess, for f32 / f16 / bf16 / q8_0.
- `quantize`: `llama_cpp.llama_model_quantize` (llama.cpp's quantizer) for Q8_0 and Q4_K_M.

The converter refuses a BPE pre-tokenizer it does not know by hash; the wrapper names ours
"gpt-2" (DESIGN.md: override `get_vocab_base_pre`), and makes llama-arch models (Mixtral) take
the BPE vocabulary path instead of sentencepiece.
"""

from __future__ import annotations

import contextlib

import os
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"


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
_CACHE = Path.home() / ".cache" / "moeswarm"

_WRAPPER = r"""
import sys
root = sys.argv.pop(1)
sys.path.insert(0, root + "/gguf-py")
sys.path.insert(0, root)
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: PRE
import conversion.llama as llama  # our tokenizers are byte-level BPE, never sentencepiece
llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv[0] = root + "/convert_hf_to_gguf.py"
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""

QUANT_TYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
               "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K"}


def llama_cpp_source() -> Path:
    """llama.cpp's source tree as vendored by llama-cpp-python's sdist (downloaded once)."""
    override = os.environ.get("MOESWARM_LLAMACPP_SRC")
    if override:
        return Path(override)
    root = _CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    _CACHE.mkdir(parents=True, exist_ok=True)
    archive = _CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not archive.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(_CACHE)], check=True, capture_output=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name
                   and ("/gguf-py/" in m.name or "/conversion/" in m.name or m.name.endswith("convert_hf_to_gguf.py"))]
        tar.extractall(_CACHE, members=members, filter="data")
    return root


def convert_hf(model_dir: str | Path, out: str | Path, outtype: str = "f32", pre: str = "gpt-2") -> Path:
    """`convert_hf_to_gguf.py MODEL --outtype OUTTYPE --outfile OUT`, in a subprocess."""
    out = Path(out)
    script = _WRAPPER.replace("PRE", repr(pre))
    command = [sys.executable, "-c", script, str(llama_cpp_source()), str(model_dir), "--outtype", outtype, "--outfile", str(out)]
    env = {**os.environ, "NO_LOCAL_GGUF": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed for {model_dir}:\n{done.stderr[-3000:]}")
    return out


def quantize(source: str | Path, out: str | Path, kind: str) -> Path:
    """llama.cpp's quantizer: `kind` is Q8_0, Q4_K_M, Q5_K_M or Q6_K."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT_TYPES[kind])
    params.nthread = 1
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({source} -> {kind}) returned {status}")
    return Path(out)


@contextlib.contextmanager
def _without_extra_buffer_types():
    """Load models without llama.cpp's CPU "extra buffer types" (moeswarm.bench.worker_real_llamacpp)."""
    import llama_cpp.llama_cpp as low

    from moeswarm.bench.worker_real_llamacpp import plain_cpu_buffers

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
_TRAINING_TEXT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
                  "The quick brown fox jumps over the lazy dog. Mixture of experts models route tokens to experts.\n") * 4


def bpe_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with real merges (llama.cpp requires merges), Qwen2's split regex."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from moeswarm.weights.gguf_tokenizer import PRE_TOKENIZER_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX["qwen2"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    # GLM's converter looks up its own special tokens by name; they cost nothing elsewhere.
    specials = ["<|endoftext|>", "<s>", "[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|observation|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([_TRAINING_TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")


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
