"""The wire configurations moeswarm uses by default.

EXACT is what `--check-local` and the foundation use: per-expert outputs in the model's dtype,
bit-identical to local. WAN is the cheapest configuration that passes the argmax/cosine gate on
the bundled trained model's Q4_K_M weights (see docs/wire.md for the gate's figures).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WireConfig:
    mode: str  # "exact" or "partial"
    wire_dispatch: str | None  # codec for hidden states; None: lossless
    wire_combine: str | None  # codec for expert outputs; None: lossless


EXACT = WireConfig("exact", None, None)
WAN = WireConfig("partial", "int8-b128", "int8-b128")
