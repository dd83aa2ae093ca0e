#!/usr/bin/env python
"""Convert the pymoe HF checkpoint to GGUF with llama.cpp's own tools: F16, Q8_0, Q4_K_M.

llama.cpp is the independent oracle, so we use its converter and quantizer, not our own writer:

1. Converter: ``convert_hf_to_gguf.py`` + ``gguf-py`` vendored in the llama-cpp-python source
   archive. It must match the installed llama-cpp-python (same llama.cpp revision). Fetched with::

       V=$(python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")
       mkdir -p /tmp/lcpp_sdist && cd /tmp/lcpp_sdist
       pip download --no-binary :all: --no-deps llama-cpp-python==$V -d .
       tar xzf llama_cpp_python-$V.tar.gz
       # -> /tmp/lcpp_sdist/llama_cpp_python-$V/vendor/llama.cpp/{convert_hf_to_gguf.py,conversion/,gguf-py/}

   This script does exactly that when the directory is missing (``--llama-src`` overrides it).
   Built and tested with llama-cpp-python 0.3.36.
2. The converter identifies a BPE pre-tokenizer by hashing how a test string is tokenized and
   refuses unknown hashes. pymoe's tokenizer is home-made but uses Qwen2's pre-tokenizer regex
   verbatim (``scripts/train_pymoe.py: QWEN2_PRETOK``), which is llama.cpp's ``qwen2``
   pre-tokenizer, so we patch ``TextModel.get_vocab_base_pre`` to return ``"qwen2"``.
   ``scripts/eval_pymoe.py`` checks that llama.cpp's tokenization equals transformers' on the
   held-out text.
3. F16 via ``--outtype f16``; an F32 GGUF (temporary) is the source for ``llama_model_quantize``
   to Q8_0 and Q4_K_M (quantizing from F32 avoids a double rounding through F16).
4. The checkpoint's chat template goes into every file (``scripts/gguf_chat_template.py``), so
   that ``serve`` on a GGUF file chats with no ``--chat-template``.
5. Reports the tensor types found in each file (``gguf.GGUFReader``) and checks that each file
   loads in ``llama_cpp.Llama`` and greedily continues a prompt. With hidden=128 and
   moe_intermediate_size=64, rows are not multiples of 256, so llama.cpp falls back from K-quants
   for those tensors: the report says which types were actually written.

    python scripts/convert_pymoe_gguf.py            # models/pymoe/hf -> models/pymoe/gguf/
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import importlib.metadata
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def llama_src_dir(arg: str | None) -> pathlib.Path:
    if arg:
        return pathlib.Path(arg)
    ver = importlib.metadata.version("llama-cpp-python")
    base = pathlib.Path("/tmp/lcpp_sdist")
    d = base / f"llama_cpp_python-{ver}" / "vendor" / "llama.cpp"
    if not (d / "convert_hf_to_gguf.py").exists():
        base.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={ver}", "-d", str(base)], check=True)
        subprocess.run(["tar", "xzf", f"llama_cpp_python-{ver}.tar.gz"], cwd=base, check=True)
    return d


def convert(hf_dir: pathlib.Path, outfile: pathlib.Path, outtype: str, src: pathlib.Path) -> None:
    """Run the vendored converter in a child process (it owns sys.argv, logging and gguf imports)."""
    code = f"""
import sys
sys.path.insert(0, {str(src)!r}); sys.path.insert(1, {str(src / 'gguf-py')!r})
import conversion.base as base
# Home-made BPE with Qwen2's pre-tokenizer regex: llama.cpp's "qwen2" pre-tokenizer (see docstring).
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
import convert_hf_to_gguf as c
sys.argv = ["convert_hf_to_gguf.py", {str(hf_dir)!r}, "--outfile", {str(outfile)!r}, "--outtype", {outtype!r}]
c.main()
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def quantize(src_gguf: pathlib.Path, dst: pathlib.Path, ftype_name: str) -> None:
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype_name)
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src_gguf).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({ftype_name}) returned {rc}")


def tensor_types(path: pathlib.Path) -> dict:
    """Count of tensors per GGML type, plus the type of each kind of tensor (by name suffix)."""
    from gguf import GGUFReader
    r = GGUFReader(str(path))
    counts = collections.Counter(t.tensor_type.name for t in r.tensors)
    by_kind: dict[str, set] = collections.defaultdict(set)
    for t in r.tensors:
        kind = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
        by_kind[kind].add(t.tensor_type.name)
    return {"counts": dict(counts), "by_tensor": {k: sorted(v) for k, v in sorted(by_kind.items())}}


def smoke_generate(path: pathlib.Path, prompt: str, n: int = 32) -> str:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, logits_all=True, verbose=False,
                          seed=0)
    out = llm.create_completion(prompt, max_tokens=n, temperature=0.0, top_k=1)
    return out["choices"][0]["text"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", default=str(ROOT / "models/pymoe/hf"))
    ap.add_argument("--out", default=str(ROOT / "models/pymoe/gguf"))
    ap.add_argument("--llama-src", default=None, help="vendor/llama.cpp dir of the matching llama-cpp-python sdist")
    args = ap.parse_args()
    hf, out = pathlib.Path(args.hf), pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = llama_src_dir(args.llama_src)

    files = {"F16": out / "pymoe-F16.gguf", "Q8_0": out / "pymoe-Q8_0.gguf", "Q4_K_M": out / "pymoe-Q4_K_M.gguf"}
    convert(hf, files["F16"], "f16", src)
    with tempfile.TemporaryDirectory() as td:
        f32 = pathlib.Path(td) / "pymoe-F32.gguf"
        convert(hf, f32, "f32", src)
        quantize(f32, files["Q8_0"], "LLAMA_FTYPE_MOSTLY_Q8_0")
        quantize(f32, files["Q4_K_M"], "LLAMA_FTYPE_MOSTLY_Q4_K_M")
    template = json.loads((hf / "tokenizer_config.json").read_text()).get("chat_template")
    if template:  # the converter takes it from tokenizer_config.json too; set here whatever its revision does
        from gguf_chat_template import with_template  # scripts/, beside this file

        for path in files.values():
            with_template(path, template)

    report = {"llama_cpp_python": importlib.metadata.version("llama-cpp-python"), "files": {}}
    prompt = "def fibonacci(n):\n"
    for name, p in files.items():
        report["files"][name] = {
            "path": str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p),
            "bytes": p.stat().st_size,
            "tensor_types": tensor_types(p),
            "greedy_prompt": prompt,
            "greedy_continuation": smoke_generate(p, prompt),
        }
    print(json.dumps(report, indent=1))
    (out / "convert_report.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
