"""Keep Python's cyclic garbage collector off what a long-lived process loaded once.

A decode step makes thousands of short-lived objects (a layer call's plan, frames, replies), so
the collector runs every few hundred allocations, and its older generations walk every object the
process holds: a model's modules and parameters, a tokenizer, a worker's experts. Frozen once
they are loaded (`gc.freeze`), they are left out of every later collection (the backbone's CPU
per layer call it saves: docs/measured.md, "heap").

For what a command keeps until it ends: garbage in cycles among frozen objects is not collected
until `thaw` (cli.main thaws when a command returns, so commands run in one process one after
another, as tests do, leave nothing behind).
"""

from __future__ import annotations

import gc


def freeze_loaded() -> None:
    """Collect what is garbage now, then leave every object alive out of later collections."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Put the frozen objects back under the collector (the oldest generation)."""
    gc.unfreeze()
