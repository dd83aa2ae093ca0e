"""The wire configuration: one value for the combine mode and the two codecs, checked once.

`exact` combine with lossless codecs is what `--check-local` and the foundation use: per-expert
outputs in the model's dtype, bit-identical to local. `WAN` is the cheapest configuration that
passes the argmax/cosine gate on the bundled trained model's Q4_K_M weights (docs/wire.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from moeswarm.errors import MoeSwarmError
from moeswarm.wire.codecs import FLOAT_CODECS


class CombineMode(str, Enum):
    EXACT = "exact"  # per-expert outputs, added on the backbone in eager's order: bit-identical
    PARTIAL = "partial"  # one weighted sum per token per worker: fewer bytes back

    @classmethod
    def parse(cls, text: str) -> "CombineMode":
        try:
            return cls(text)
        except ValueError:
            raise MoeSwarmError(f"unknown combine mode {text!r} (choose from {', '.join(COMBINE_MODES)})") from None


COMBINE_MODES = tuple(mode.value for mode in CombineMode)


@dataclass(frozen=True)
class WireConfig:
    """How a layer's tensors travel. A codec of None means lossless (the tensor's own dtype).

    timings: ask every worker to say its experts' CPU time in each RESULT (a few bytes more each
    way: for benches and profiling, where a call's time must split into the experts' and the rest)."""

    mode: CombineMode = CombineMode.EXACT
    dispatch_codec: str | None = None  # hidden states, backbone -> worker
    combine_codec: str | None = None  # experts' outputs, worker -> backbone
    timings: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", CombineMode.parse(self.mode) if isinstance(self.mode, str) else self.mode)
        for what, codec in (("dispatch", self.dispatch_codec), ("combine", self.combine_codec)):
            if codec is not None and codec not in FLOAT_CODECS:
                raise MoeSwarmError(f"unknown {what} codec {codec!r} (choose from {', '.join(FLOAT_CODECS)})")

    @property
    def lossless(self) -> bool:
        return self.dispatch_codec is None and self.combine_codec is None

    @property
    def exact(self) -> bool:
        """Bit-identical to a local run: exact combine over lossless codecs."""
        return self.mode is CombineMode.EXACT and self.lossless

    def describe(self) -> str:
        return f"{self.mode.value} combine, dispatch {self.dispatch_codec or 'lossless'}, combine {self.combine_codec or 'lossless'}"

    @classmethod
    def from_flags(cls, preset: str = "exact", combine: str | None = None, dispatch_codec: str | None = None,
                   combine_codec: str | None = None) -> "WireConfig":
        """A preset (`exact`, `wan`) with any of its three parts overridden by flags."""
        try:
            base = PRESETS[preset]
        except KeyError:
            raise MoeSwarmError(f"unknown wire preset {preset!r} (choose from {', '.join(PRESETS)})") from None
        return cls(CombineMode.parse(combine) if combine else base.mode,
                   dispatch_codec or base.dispatch_codec, combine_codec or base.combine_codec)


EXACT = WireConfig()
WAN = WireConfig(CombineMode.PARTIAL, "int8-b128", "int8-b128")
PRESETS = {"exact": EXACT, "wan": WAN}
