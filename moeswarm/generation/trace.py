"""Where a `--check-local` mismatch begins: per-row fingerprints of every decoder layer's residual stream.

With the local check in exact mode, the swarm's model and the reference each carry a `LayerTrace`:
hooks on each decoder layer record, for the forwards of one step, a fingerprint per row of the
residual stream at two points:

  attention   after the layer's attention (what its post-attention norm reads), where the family
              has that norm;
  layer       after the whole layer (its MoE or dense block added).

When a step's logits first differ, `first_difference` names the first point whose rows differ
and which rows: "layer 0 after attention, rows 26-51 of 52". A layer's attention is the
backbone's own computation, so a difference there is the backbone's; one that appears only after
the layer points at the experts' answers or their combination.

A row's fingerprint is the sum of its float32 values' bit patterns (read as int32, summed in
int64): any change of a row's bits changes it but for a vanishing chance. The two models run a
step's groups in different orders where the swarm runs them concurrently, so a step is located
only where it ran as one group; else the mismatch is reported without a place.

Legend: T = rows of a forward (a packed forward's every sequence's), d = hidden size.
"""

from __future__ import annotations

import threading

import torch

from moeswarm.ids import format_ids

ATTENTION, LAYER = "attention", "layer"
_WHERE = {ATTENTION: "after attention", LAYER: "after the layer"}


class LayerTrace:
    """Fingerprints of the residual stream of `model`'s decoder layers, appended as forwards run."""

    def __init__(self, model: torch.nn.Module):
        self.points: list[tuple[int, str, torch.Tensor]] = []  # (layer, ATTENTION or LAYER, [T] int64)
        self._lock = threading.Lock()
        self._hooks = []
        layers = getattr(getattr(model, "model", None), "layers", None)
        for index, layer in enumerate(layers if isinstance(layers, torch.nn.ModuleList) else []):
            norm = getattr(layer, "post_attention_layernorm", None)
            if isinstance(norm, torch.nn.Module):
                self._hooks.append(norm.register_forward_pre_hook(
                    lambda _module, args, index=index: self._record(index, ATTENTION, args[0])))
            self._hooks.append(layer.register_forward_hook(
                lambda _module, _args, output, index=index: self._record(index, LAYER, output)))

    @property
    def traced(self) -> bool:
        return bool(self._hooks)

    def begin(self) -> None:
        """A new step: forget the last one's points."""
        with self._lock:
            self.points = []

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _record(self, layer: int, point: str, hidden) -> None:
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        if not isinstance(hidden, torch.Tensor) or hidden.dtype is not torch.float32:
            return
        rows = hidden.detach().reshape(-1, hidden.shape[-1]).contiguous()  # [T, d]
        fingerprint = rows.view(torch.int32).sum(dim=-1, dtype=torch.int64)  # [T]
        with self._lock:
            self.points.append((layer, point, fingerprint))


def first_difference(got: LayerTrace, expected: LayerTrace) -> str | None:
    """The first point where the two traces' rows differ, in words (None: nowhere, or the traces
    are not comparable: other points, or other row counts)."""
    if len(got.points) != len(expected.points):
        return None
    for (layer, point, mine), (other_layer, other_point, theirs) in zip(got.points, expected.points):
        if (layer, point) != (other_layer, other_point) or mine.shape != theirs.shape:
            return None
        differing = (mine != theirs).nonzero().flatten().tolist()
        if differing:
            rows = "row" if len(differing) == 1 else "rows"
            return f"layer {layer} {_WHERE[point]}, {rows} {format_ids(differing)} of {mine.numel()}"
    return None
