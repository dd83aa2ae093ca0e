"""Is a RESULT plausible? Each row's norm against what the layer's answers have shown so far.

A liar can answer finite values that are absurd (1e30 on one row): the exact comparison catches
it only when its share is spot-checked. Here every answer's rows are measured (the max norm,
largest |value| of a row, which no finite row overflows; vectorised, O(n x d), no per-row Python) against the layer's running statistics: the largest log10 row
norm of an answer, smoothed over answers (an EMA). A row more than `decades` above it is
implausible. Until `warmup` answers of the layer were seen, the bound is relative to the rows
sent instead: `bootstrap` x their largest |value| (an expert's output is a weighted MLP of a
normalised hidden state; nothing honest is 10^4 times larger). After it, the bound never falls
under `floor` x the rows sent: a liar answering zeros must not pull the statistics down until
honest answers look implausible.

Legend: n = rows of a RESULT, d = hidden size, T_w = rows sent to the worker.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from moeswarm.kernels.qkernels import peak

_NUMPY = (torch.float32, torch.float16, torch.float64)  # numpy's reductions: no OpenMP region to wake, as torch's open


class NormGate:
    def __init__(self, decades: float = 3.0, warmup: int = 8, bootstrap: float = 1e4, floor: float = 1e2,
                 alpha: float = 0.05):
        self.decades, self.warmup, self.bootstrap, self.floor, self.alpha = decades, warmup, bootstrap, floor, alpha
        self._ema: dict[int, float] = {}  # layer -> smoothed log10 of an answer's largest row norm
        self._seen: dict[int, int] = {}  # layer -> answers learned from

    def bound(self, layer: int, hidden: torch.Tensor) -> float:
        """The largest plausible row norm of an answer to `hidden` [T_w, d] at `layer`."""
        sent = _peak(hidden) if hidden.numel() else 1.0
        sent = max(1.0, sent if math.isfinite(sent) else 1.0)
        learned = self._learned(layer)
        return self.bootstrap * sent if learned is None else max(self.floor * sent, learned)

    def learned(self, layer: int) -> float | None:
        """The bound the layer's answers have shown (None during the warm-up): an answer whose largest
        |value| is at most this is plausible whatever was sent (then `learn` from it)."""
        return self._learned(layer)

    def learn(self, layer: int, top: float) -> None:
        """Learn from a plausible answer whose largest |value| is `top` (as `judge` does)."""
        self._learn(layer, math.log10(max(top, 1e-30)))

    def _learned(self, layer: int) -> float | None:
        """The bound the layer's answers have shown (None during the warm-up): a floor of `bound`."""
        if self._seen.get(layer, 0) < self.warmup:
            return None
        return 10.0 ** (self._ema[layer] + self.decades)

    def problem(self, layer: int, outputs: torch.Tensor, hidden: torch.Tensor) -> str | None:
        """What is implausible about `outputs` [n, d] answering `hidden` [T_w, d], or None; a
        plausible answer is learned from."""
        if outputs.numel() == 0:
            return None
        return self.judge(layer, _peak(outputs), lambda: outputs, hidden)

    def judge(self, layer: int, top: float, outputs: Callable[[], torch.Tensor], hidden: torch.Tensor) -> str | None:
        """`problem` of an answer whose largest |value| is `top` (its rows [n, d] from `outputs()`,
        looked at only when they are over the bound)."""
        if not math.isfinite(top):  # non-finite rows for non-finite inputs: checks.py judged them
            return None
        # Under the learned bound an answer is plausible whatever was sent: the rows sent need no look.
        learned = self._learned(layer)
        bound = learned if learned is not None and top <= learned else self.bound(layer, hidden)
        if top > bound:
            norms = _row_max(outputs())  # [n]
            over = int((norms > bound).sum())
            return (f"implausible RESULT: {over} of {norms.size} rows have a norm above {bound:.3g} "
                    f"(largest {top:.3g}) for layer {layer}")
        self.learn(layer, top)
        return None

    def _learn(self, layer: int, log_top: float) -> None:
        seen = self._seen.get(layer, 0)
        self._seen[layer] = seen + 1
        previous = self._ema.get(layer)
        self._ema[layer] = log_top if previous is None else previous + self.alpha * (log_top - previous)


def _peak(tensor: torch.Tensor) -> float:
    """The largest |value| of a tensor with values (NaN when one is NaN): float32 in one C pass."""
    if tensor.dtype == torch.float32:
        return peak(tensor.detach().numpy())
    return float(_row_max(tensor).max())


def _row_max(tensor: torch.Tensor) -> np.ndarray:
    """[n, d] -> [n] float: the largest |value| of each row."""
    if tensor.dtype in _NUMPY:
        rows = tensor.detach().numpy()
        return np.maximum(rows.max(axis=1), -rows.min(axis=1)).astype(np.float64)
    if tensor.dtype == torch.bfloat16:  # |x|'s bits without the sign order as |x| does: max them, widen to float32
        magnitude = (tensor.detach().view(torch.int16).numpy() & 0x7FFF).max(axis=1).astype(np.uint32)
        return (magnitude << 16).view(np.float32).astype(np.float64)
    return tensor.detach().abs().amax(dim=1).double().numpy()
