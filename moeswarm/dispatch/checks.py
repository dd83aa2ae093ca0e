"""Does a RESULT answer what was asked? Checked before any of it is combined.

Legend: T_w = tokens sent to the worker, d = hidden size, n_e = rows routed to expert e.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from moeswarm.dispatch.plan import WorkerShare
from moeswarm.kernels.qkernels import peak
from moeswarm.wire.config import CombineMode
from moeswarm.wire.messages import Result


def expected_rows(share: WorkerShare) -> tuple[list[int], list[int]]:
    """The experts an exact answer to `share` covers, ascending, and each one's rows (n_e)."""
    index = share.top_k_index.numpy()
    found, found_counts = np.unique(index[index >= 0], return_counts=True)
    return found.tolist(), found_counts.tolist()


def result_problem(share: WorkerShare, layer: int, mode: CombineMode, width: int, result: Result,
                   hidden: torch.Tensor | None = None, expected: tuple[list[int], list[int]] | None = None) -> str | None:
    """What is wrong with `result` as the answer to `share`, or None.

    hidden    [T_w, d] the rows sent: when they are all finite, so must the outputs be.
    expected  exact mode: `expected_rows(share)`, when the caller has it already.
    """
    if result.layer != layer or result.mode != mode:
        return f"RESULT for layer {result.layer} ({result.mode.value}), asked layer {layer} ({mode.value})"
    if mode == CombineMode.EXACT:
        experts, counts = expected if expected is not None else expected_rows(share)
        if result.experts != experts or result.counts != counts:
            return f"RESULT covers experts {result.experts} x {result.counts} rows, expected {experts} x {counts}"
        rows = sum(counts)
    else:
        rows = share.tokens.numel()
    if tuple(result.outputs.shape) != (rows, width):
        return f"RESULT has shape {list(result.outputs.shape)}, expected [{rows}, {width}]"
    if not result.outputs.dtype.is_floating_point:
        return f"RESULT outputs are {result.outputs.dtype}, expected floating point"
    if not _finite(result.outputs) and (hidden is None or _finite(hidden)):
        bad = int((~torch.isfinite(result.outputs)).any(dim=1).sum())
        return f"RESULT has NaN or inf in {bad} of {rows} rows for finite inputs"
    return None


def _finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite: float32 in one C pass (qkernels.peak), numpy's test where it has
    the dtype (a few us where torch's takes ~6)."""
    if tensor.dtype == torch.float32:
        return math.isfinite(peak(tensor.detach().numpy()))
    if tensor.dtype in (torch.float16, torch.float64):
        return bool(np.isfinite(tensor.detach().numpy()).all())
    return bool(torch.isfinite(tensor).all())
