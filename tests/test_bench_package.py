"""The benchmarks and the WAN emulator are the moeswarm-bench distribution (bench/), not the library's:
moeswarm's wheel holds none of them, and without them `moeswarm bench` / `moeswarm wan` say in one
line how to install them (exit status 2), never a traceback."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent


def packages(where: Path) -> list[str]:
    """What `pip install` of the pyproject.toml in `where` packs: its packages.find, as setuptools reads it."""
    find = tomllib.loads((where / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return find_packages(where=str(where), include=find["include"])


def test_the_library_wheel_holds_no_benchmark():
    library = packages(ROOT)
    assert "moeswarm" in library and "moeswarm.kernels" in library and "moeswarm.gguf" in library
    assert not [name for name in library if not (name == "moeswarm" or name.startswith("moeswarm."))]


def test_the_bench_wheel_holds_the_benchmarks_and_the_wan_emulator():
    tools = packages(ROOT / "bench")
    assert {"moeswarm_bench", "moeswarm_bench.bench", "moeswarm_bench.commands", "moeswarm_bench.wan"} <= set(tools)
    assert all(name.startswith("moeswarm_bench") for name in tools)


def test_the_bench_distribution_pins_this_checkouts_library():
    library = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    tools = tomllib.loads((ROOT / "bench" / "pyproject.toml").read_text())["project"]
    assert f"moeswarm=={library['version']}" in tools["dependencies"]
    assert tools["version"] == library["version"]


# A finder ahead of the others: `import moeswarm_bench` fails as it does where the distribution is not installed.
HIDDEN = """import sys
class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "moeswarm_bench":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hidden())
"""


@pytest.mark.parametrize("argv", [["bench", "--help"], ["wan", "--help"], ["bench", "loopback"], ["wan"]])
def test_without_the_bench_distribution_one_line_says_how_to_install_it(argv):
    code = HIDDEN + f"from moeswarm.cli import main\nsys.exit(main({argv!r}))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"moeswarm {argv[0]}: error: ") and "pip install -e bench/" in done.stderr


def test_with_the_bench_distribution_its_commands_load():
    pytest.importorskip("moeswarm_bench")
    for command in ("bench", "wan"):
        done = subprocess.run([sys.executable, "-m", "moeswarm.cli", command, "--help"], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: moeswarm {command}")
