"""argparse types shared by the commands: each raises ArgumentTypeError, which argparse prints naming the flag.

Nothing here imports torch: building a command's parser (and `--help`) stays fast.
"""

from __future__ import annotations

import argparse


def prompt_text(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("the prompt is empty: give some text")
    return text


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
