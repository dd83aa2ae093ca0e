"""llama.cpp's own converter and quantizer, for benches and tests that need GGUF files made by llama.cpp.

- `convert_hf`: llama.cpp's `convert_hf_to_gguf.py` (from the llama-cpp-python source archive,
  with its vendored gguf-py first on sys.path), run in a subprocess, for f32 / f16 / bf16 / q8_0.
- `quantize`: `llama_cpp.llama_model_quantize` (llama.cpp's quantizer) for Q8_0 and the K-quants.
- `bpe_tokenizer`: a byte-level BPE tokenizer the converter accepts.

Neither llama.cpp's source nor llama-cpp-python is a moeswarm dependency: the source archive is
downloaded once (`pip download`, into ~/.cache/moeswarm) and llama-cpp-python is imported where
used. The converter refuses a BPE pre-tokenizer it does not know by hash; the wrapper names ours
(DESIGN.md: override `get_vocab_base_pre`), and makes llama-arch models (Mixtral) take the BPE
vocabulary path instead of sentencepiece.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from moeswarm.errors import MoeSwarmError

LLAMA_CPP_PYTHON = "0.3.36"
CACHE = Path.home() / ".cache" / "moeswarm"

_WRAPPER = r"""
import sys
root = sys.argv.pop(1)
sys.path.insert(0, root + "/gguf-py")
sys.path.insert(0, root)
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: PRE
base.TextModel._set_vocab_sentencepiece = lambda self, *args, **kwargs: self._set_vocab_gpt2()  # ERNIE and kin
base.TextModel._set_vocab_llama_hf = lambda self: self._set_vocab_gpt2()  # Jamba
import conversion.hunyuan as hunyuan  # HunYuan-MoE's own reads a tiktoken vocabulary
hunyuan.HunYuanMoEModel.set_vocab = lambda self: self._set_vocab_gpt2()
import conversion.llama as llama  # our tokenizers are byte-level BPE, never sentencepiece
llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv[0] = root + "/convert_hf_to_gguf.py"
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""

QUANT_TYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
               "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K"}

# Text the BPE merges are learnt from: any text works, the models are random.
_TRAINING_TEXT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
                  "The quick brown fox jumps over the lazy dog. Mixture of experts models route tokens to experts.\n") * 4


def llama_cpp_source() -> Path:
    """llama.cpp's source tree as vendored by llama-cpp-python's sdist (downloaded once; only the
    converter and gguf-py are unpacked). MOESWARM_LLAMACPP_SRC names another tree."""
    override = os.environ.get("MOESWARM_LLAMACPP_SRC")
    if override:
        return Path(override)
    root = CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    archive = CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not archive.is_file():
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                               f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(CACHE)], capture_output=True, text=True)
        if done.returncode != 0 or not archive.is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise MoeSwarmError(f"could not download llama.cpp's converter (llama-cpp-python=={LLAMA_CPP_PYTHON} "
                                f"source archive): {last}")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name
                   and ("/gguf-py/" in m.name or "/conversion/" in m.name or m.name.endswith("convert_hf_to_gguf.py"))]
        tar.extractall(CACHE, members=members, filter="data")
    return root


def convert_hf(model_dir: str | Path, out: str | Path, outtype: str = "f32", pre: str = "gpt-2") -> Path:
    """`convert_hf_to_gguf.py MODEL --outtype OUTTYPE --outfile OUT`, in a subprocess; `pre` is the
    pre-tokenizer name written to the file (one llama.cpp knows: "gpt-2", "qwen2", ...)."""
    out = Path(out)
    script = _WRAPPER.replace("PRE", repr(pre))
    command = [sys.executable, "-c", script, str(llama_cpp_source()), str(model_dir), "--outtype", outtype,
               "--outfile", str(out)]
    # NO_LOCAL_GGUF: the converter's own gguf-py, not the installed one; one OpenMP thread: the
    # converter's torch only casts.
    env = {**os.environ, "NO_LOCAL_GGUF": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not out.is_file():
        raise MoeSwarmError(f"convert_hf_to_gguf.py failed for {model_dir}:\n{done.stderr[-3000:]}")
    return out


_MANY = r"""
import json
jobs = json.loads(sys.argv.pop(1))
failed = []
for model_dir, outtype, out, extra in jobs:
    sys.argv = [root + "/convert_hf_to_gguf.py", model_dir, "--outtype", outtype, "--outfile", out, *extra]
    try:
        convert_hf_to_gguf.main()
    except (Exception, SystemExit) as error:
        failed.append(f"{model_dir}: {type(error).__name__}: {error}")
if failed:
    sys.exit("\n".join(failed))
"""


def convert_hf_many(jobs: list[tuple[str | Path, str | Path, str, tuple[str, ...]]], pre: str = "gpt-2") -> None:
    """`convert_hf` for each (model_dir, out, outtype, extra converter arguments such as
    "--no-mtp"), all in one subprocess (one start-up)."""
    script = _WRAPPER.replace("PRE", repr(pre)).replace("convert_hf_to_gguf.main()\n", "") + _MANY
    payload = json.dumps([[str(model_dir), outtype, str(out), list(extra)] for model_dir, out, outtype, extra in jobs])
    command = [sys.executable, "-c", script, str(llama_cpp_source()), payload]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "NO_LOCAL_GGUF": "1", "OMP_NUM_THREADS": "1"})
    missing = [str(out) for _, out, _, _ in jobs if not Path(out).is_file()]
    if done.returncode != 0 or missing:
        raise MoeSwarmError(f"convert_hf_to_gguf.py failed for {missing or 'some models'}:\n{done.stderr[-3000:]}")


def quantize(source: str | Path, out: str | Path, kind: str, threads: int = 1) -> Path:
    """llama.cpp's quantizer: `kind` is one of QUANT_TYPES (Q8_0, Q4_K_M, Q5_K_M, Q6_K)."""
    llama_cpp = require_llama_cpp("quantizing with llama.cpp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT_TYPES[kind])
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    if status != 0:
        raise MoeSwarmError(f"llama_model_quantize({source} -> {kind}) returned {status}")
    return Path(out)


def require_llama_cpp(what: str):
    """llama-cpp-python with llama.cpp's log silenced, or a one-line error saying `what` needs it."""
    try:
        import llama_cpp
    except ImportError:
        raise MoeSwarmError(f"{what} needs llama-cpp-python: pip install 'llama-cpp-python=={LLAMA_CPP_PYTHON}'") from None
    silence(llama_cpp)
    return llama_cpp


@functools.cache
def silence(llama_cpp) -> None:
    """Drop llama.cpp's log lines (every tensor quantized, every model loaded): stderr is for progress."""
    @llama_cpp.llama_log_callback
    def ignore(level, text, user_data):
        pass

    _LOG_CALLBACK.append(ignore)  # llama.cpp keeps the pointer: the callback must outlive this call
    llama_cpp.llama_log_set(ignore, None)


_LOG_CALLBACK: list = []


def bpe_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with real merges (llama.cpp requires merges) and Qwen2's split regex,
    of at most `vocab_size` tokens (fewer when the training text runs out of merges: a model's config
    may then declare a larger vocabulary, and the converter pads it with unused [PADn] tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from moeswarm.gguf.gguf_tokenizer import PRE_TOKENIZER_REGEX

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
