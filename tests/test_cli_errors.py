"""A user's mistake ends in one line on stderr naming the cause and the fix, exit status 2, no traceback.

Real processes, as a user runs them. None of these loads a model's weights or reaches a worker:
every check runs before that (the tiny qwen2_moe gives the config and tokenizer where one is needed).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest
from test_gguf_errors import _write as write_gguf  # a tiny GGUF file written with gguf-py

from moeswarm import __version__
from moeswarm.cli import COMMANDS, build_parser

NO_WORKER = "127.0.0.1:1"  # never reached: each error is found before the backbone connects


def _moeswarm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeswarm.cli", *args], capture_output=True, text=True, timeout=120)


def _error(*args: str) -> str:
    """The one line a failing command prints on stderr."""
    done = _moeswarm(*args)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    return done.stderr.rstrip("\n")


def test_busy_port_is_found_before_the_model_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # The model does not exist: had the worker looked at it first, the error would name it.
        line = _error("worker", "--model", str(tmp_path / "nope"), "--port", str(port))
    assert line == (f"moeswarm worker: error: port {port} on 127.0.0.1 is already in use: "
                    f"choose another --port, or --port 0 for any free one")


def test_empty_prompt():
    assert _error("generate", "--model", "x", "--workers", NO_WORKER, "--prompt", "") == (
        "moeswarm generate: error: argument --prompt: the prompt is empty: give some text "
        "(see moeswarm generate --help)")
    assert _error("demo", "--prompt", "") == (
        "moeswarm demo: error: argument --prompt: the prompt is empty: give some text (see moeswarm demo --help)")


def test_prompt_id_out_of_the_vocabulary(qwen2_moe):
    assert _error("generate", "--model", qwen2_moe, "--workers", NO_WORKER, "--prompt-ids", "1,2,99999") == (
        "moeswarm generate: error: token id 99999 is out of range: the model's vocabulary has 260 ids (0 to 259)")


def test_prompt_and_new_tokens_past_the_models_positions(qwen2_moe):
    ids = ",".join(["7"] * 250)  # the tiny qwen2_moe has 256 positions
    assert _error("generate", "--model", qwen2_moe, "--workers", NO_WORKER, "--prompt-ids", ids) == (
        "moeswarm generate: error: the prompt (250 tokens) plus --max-new-tokens (32) is 282 tokens, more than the "
        "model's 256 positions (max_position_embeddings): shorten the prompt or lower --max-new-tokens")


def test_slice_into_a_missing_directory(tmp_path):
    model = write_gguf(tmp_path / "model.gguf")
    out = tmp_path / "missing" / "part.gguf"
    assert _error("slice", model, "--experts", "0-1", "-o", str(out)) == (
        f"moeswarm slice: error: cannot write {out}: there is no directory {out.parent} "
        f"(create it, or choose another -o)")


def test_bad_flag_values_are_one_line():
    assert _error("generate", "--model", "x", "--workers", NO_WORKER, "--prompt", "a", "--max-new-tokens", "-3") == (
        "moeswarm generate: error: argument --max-new-tokens: must not be negative, got -3 "
        "(see moeswarm generate --help)")
    assert _error("worker", "--model", "x", "--experts", "5-2") == (
        "moeswarm worker: error: argument --experts: bad experts range '5-2' in '5-2': expected A-B with A <= B "
        "(see moeswarm worker --help)")
    assert _error("worker", "--model", "x", "--port", "70000") == (
        "moeswarm worker: error: argument --port: a port is 0 to 65535, got 70000 (see moeswarm worker --help)")
    assert _error("nosuch") == (
        "moeswarm: error: argument COMMAND: invalid choice: 'nosuch' (choose from 'demo', 'worker', 'stage', 'generate', "
        "'serve', 'gate', 'bench', 'make-model', 'slice', 'wan', 'info', 'keygen', 'ping', 'relay', 'profile', 'plan', "
            "'dht', 'manifest', 'seed', 'invite', 'join', 'status', 'fetch-slice') (see moeswarm --help)")


def test_debug_shows_the_traceback(tmp_path):
    done = _moeswarm("--debug", "generate", "--model", str(tmp_path / "nope"), "--workers", NO_WORKER, "--prompt", "a")
    assert done.returncode == 1 and "Traceback" in done.stderr and "nope: not a model directory" in done.stderr


def test_version_loads_neither_torch_nor_transformers():
    code = ("import sys\nfrom moeswarm.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit as e:\n"
            "    assert e.code == 0\nprint(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"moeswarm {__version__}", "[]"] and __version__ == "0.1.0"


def test_every_flag_has_help():
    def flags_without_help(parser: argparse.ArgumentParser, path: str) -> list[str]:
        lacking = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    lacking += flags_without_help(sub, f"{path} {name}")
            elif action.option_strings and not action.help:
                lacking.append(f"{path} {action.option_strings[-1]}")
        return lacking

    assert [flag for command in COMMANDS for flag in flags_without_help(build_parser([command]), "moeswarm")] == []
    help_text = build_parser(["generate"])._subparsers._group_actions[0].choices["generate"].format_help()
    assert "most tokens to generate (default: 32)" in " ".join(help_text.split())


def test_sampling_stop_and_prompt_file_flags_are_one_line(tmp_path, capsys):
    good, empty, missing = tmp_path / "prompt.txt", tmp_path / "empty.txt", tmp_path / "nope.txt"
    good.write_text("def f(")
    empty.write_text("")
    cases = {
        ("--temperature", "-1"): "argument --temperature: must be from 0 (greedy) to 100, got -1",
        ("--temperature", "nan"): "argument --temperature: must be from 0 (greedy) to 100, got nan",
        ("--temperature", "hot"): "argument --temperature: expected a number, got 'hot'",
        ("--top-p", "0"): "argument --top-p: must be more than 0 and at most 1 (1: off), got 0",
        ("--top-p", "1.5"): "argument --top-p: must be more than 0 and at most 1 (1: off), got 1.5",
        ("--top-k", "-2"): "argument --top-k: must not be negative, got -2",
        ("--seed", "-1"): "argument --seed: must not be negative, got -1",
        ("--seed", str(2**64)): f"argument --seed: must be at most 2**64 - 1, got {2**64}",
        ("--stop", ""): "argument --stop: a stop string must not be empty",
        ("--prompt-file", str(good)): "argument --prompt-file: not allowed with argument --prompt",
    }
    for flags, message in cases.items():
        argv = ["generate", "--model", "x", "--workers", NO_WORKER, "--prompt", "a", *flags]
        with pytest.raises(SystemExit) as caught:
            build_parser(argv).parse_args(argv)
        assert caught.value.code == 2
        assert capsys.readouterr().err == f"moeswarm generate: error: {message} (see moeswarm generate --help)\n"
    # As a user runs it: the file named, one line.
    base = ("generate", "--model", "x", "--workers", NO_WORKER)
    assert _error(*base, "--prompt-file", str(missing)) == (
        f"moeswarm generate: error: argument --prompt-file: cannot read {missing}: No such file or directory "
        f"(see moeswarm generate --help)")
    assert _error(*base, "--prompt-file", str(empty)) == (
        f"moeswarm generate: error: argument --prompt-file: {empty} is empty: write the prompt in it "
        f"(see moeswarm generate --help)")
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", *base, "--prompt", "-"], input="", capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stderr) == (2, "moeswarm generate: error: argument --prompt: standard input is empty: "
                                                 "pipe the prompt into it (see moeswarm generate --help)\n")
