"""Progress bars on stderr for long operations, shown only to a person watching a terminal.

One switch for the whole process: a command's `--quiet` calls `set_quiet(True)`. A stderr that
is not a terminal (a pipe, a log file, a test) gets no bars either, so logs and JSON output stay
clean. Bars are transient (`leave=False`): once an operation ends, its bar is erased and the
command's own lines are all that remain.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")

_quiet = False


def set_quiet(quiet: bool) -> None:
    """Turn every progress bar of this process off (True) or back to the terminal test (False)."""
    global _quiet
    _quiet = bool(quiet)


def enabled() -> bool:
    """Whether bars are drawn: not quiet, and stderr is a terminal."""
    isatty = getattr(sys.stderr, "isatty", None)
    return not _quiet and bool(isatty and isatty())


def progress(iterable: Iterable[T] | None = None, *, desc: str, total: int | None = None, unit: str = "it") -> tqdm:
    """A tqdm bar on stderr over `iterable` (or updated by hand when None); disabled unless `enabled()`."""
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, disable=not enabled(), leave=False,
                dynamic_ncols=True)


def status(desc: str) -> tqdm:
    """A one-step bar for a phase with no natural count ("loading the backbone"); use as a context manager."""
    return tqdm(desc=desc, total=None, file=sys.stderr, disable=not enabled(), leave=False,
                bar_format="{desc}... {elapsed}")


def chunks(items: Sequence[T], most: int) -> Iterator[Sequence[T]]:
    """`items` cut into at most `most` consecutive pieces of near-equal length (for a bar updated per piece)."""
    count = min(most, len(items))
    for i in range(count):
        yield items[round(i * len(items) / count): round((i + 1) * len(items) / count)]
