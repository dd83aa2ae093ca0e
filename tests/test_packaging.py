"""A wheel built from the repository ships the bundled model and the command, and runs from anywhere.

The wheel is built from a copy of the sources that a wheel takes (pyproject.toml, README.md,
moeswarm/, models/pymoe/), so the build leaves nothing in the checkout. It is installed into a
throwaway venv that sees this machine's packages (torch and the rest) but not the checkout:
`moeswarm info` and `moeswarm demo` run from an empty directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "moeswarm", src / "moeswarm", ignore=shutil.ignore_patterns("__pycache__"))
    (src / "models" / "pymoe").mkdir(parents=True)
    shutil.copytree(REPO / "models" / "pymoe" / "hf", src / "models" / "pymoe" / "hf")
    shutil.copy(REPO / "models" / "pymoe" / "prompts.jsonl", src / "models" / "pymoe" / "prompts.jsonl")
    # The C kernels the install built from these very sources go where the build looks for them first
    # (build_ext compiles again only when a source is newer: copies keep their times), so the wheel
    # ships them without a minute of -O3 compiling.
    for kernels in (REPO / "moeswarm").glob("_qkernels.*.so"):
        built_lib = src / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}" / "moeswarm"
        built_lib.mkdir(parents=True, exist_ok=True)
        shutil.copy2(kernels, built_lib / kernels.name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    (built,) = out.glob("moeswarm-*.whl")
    return built


def test_wheel_holds_the_bundled_model_every_module_and_the_command(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
        shipped_weights = archive.getinfo("moeswarm/pymoe/hf/model.safetensors").file_size
    for name in MODEL_FILES:
        assert f"moeswarm/pymoe/hf/{name}" in names
    assert "moeswarm/pymoe/prompts.jsonl" in names
    assert shipped_weights == (REPO / "models" / "pymoe" / "hf" / "model.safetensors").stat().st_size
    assert "moeswarm = moeswarm.cli:main" in entry_points
    modules = {str(p.relative_to(REPO)) for p in (REPO / "moeswarm").rglob("*.py") if "__pycache__" not in p.parts}
    assert modules <= names, f"modules missing from the wheel: {sorted(modules - names)}"
    assert "moeswarm/serve/dashboard.html" in names  # serve's page at /
    # only the model the demo runs (not its GGUF files; moeswarm/gguf/ is the format's package)
    assert not any(n.startswith(("models/", "moeswarm/pymoe/gguf/")) or n.endswith(".gguf") for n in names)


def test_installed_wheel_runs_from_anywhere_and_says_when_the_model_is_gone(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    python, command = venv / "bin" / "python", venv / "bin" / "moeswarm"
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}

    info = subprocess.run([str(command), "info", "--json"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert info.returncode == 0, info.stderr
    summary = json.loads(info.stdout)
    installed = venv.resolve()
    assert Path(summary["path"]).resolve().is_relative_to(installed)  # the wheel's copy, not the checkout's
    assert (summary["family"], summary["experts_per_layer"], summary["top_k"], summary["moe_layers"]) == ("qwen2_moe", 32, 8, list(range(6)))
    assert summary["split"]["experts"] == ["0-15", "16-31"]

    weights = Path(summary["path"]) / "model.safetensors"
    weights.unlink()
    demo = subprocess.run([str(command), "demo"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert demo.returncode == 2
    assert demo.stderr.count("\n") == 1 and "the bundled model is missing" in demo.stderr, demo.stderr
    assert "Traceback" not in demo.stderr
