"""argparse types shared by the commands: each raises ArgumentTypeError, which argparse prints naming the flag.

Nothing here imports torch: building a command's parser (and `--help`) stays fast.
"""

from __future__ import annotations

import argparse
import sys

from moeswarm.ids import parse_experts, parse_range


def prompt_text(text: str) -> str:
    """The prompt as given; `-` reads it from standard input."""
    if not text:
        raise argparse.ArgumentTypeError("the prompt is empty: give some text")
    return prompt_file("-") if text == "-" else text


def positive(text: str) -> int:
    value = non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


# The sampling flags' ranges: moeswarm.generation.sampling.SamplingParams checks the same for
# library callers (that module imports torch, so it is not consulted here).
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**64 - 1


def temperature(text: str) -> float:
    value = _number(text)
    if not 0 <= value <= MAX_TEMPERATURE:  # nan and inf fail too
        raise argparse.ArgumentTypeError(f"must be from 0 (greedy) to {MAX_TEMPERATURE:g}, got {text}")
    return value


def top_p(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 1 (1: off), got {text}")
    return value


def seed(text: str) -> int:
    value = non_negative(text)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be at most 2**64 - 1, got {value}")
    return value


def stop_string(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a stop string must not be empty")
    return text


def prompt_file(path: str) -> str:
    """The text of a prompt file, verbatim; `-` reads standard input."""
    name = "standard input" if path == "-" else path
    try:
        if path == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as file:
                data = file.read()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {name}: {error.strerror or error}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise argparse.ArgumentTypeError(f"{name} is not UTF-8 text (byte {error.start})") from None
    if not text:
        fix = "pipe the prompt into it" if path == "-" else "write the prompt in it"
        raise argparse.ArgumentTypeError(f"{name} is empty: {fix}")
    return text


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def seconds(text: str) -> float:
    """A positive, finite number of seconds (timeouts, deadlines)."""
    value = _number(text)
    if not 0 < value < float("inf"):  # nan fails too
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def non_negative_seconds(text: str) -> float:
    """A finite number of seconds, 0 or more (0: at once)."""
    value = _number(text)
    if not 0 <= value < float("inf"):  # nan fails too
        raise argparse.ArgumentTypeError(f"must be a number of seconds, 0 or more, got {text}")
    return value


def fraction(text: str) -> float:
    """A number from 0 to 1."""
    value = _number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {text}")
    return value


def port(text: str) -> int:
    """A TCP port, 0 to 65535 (0: any free one)."""
    value = non_negative(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {value}")
    return value


def expert_list(text: str) -> list[int]:
    """An expert list such as 0-3,9,17-20."""
    try:
        return parse_experts(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def layer_range(what: str):
    """The type of an inclusive range A-B of `what` (layers)."""
    def parse(text: str) -> tuple[int, int]:
        try:
            return parse_range(text, what)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse
