"""A stages swarm's cut of the model, and the span a joiner takes in it (pure).

A swarm started with `moeswarm invite --stages N` cuts a model of L decoder layers into N
contiguous spans (`cut_layers`: as even as can be, the earlier spans one layer longer when N does
not divide L); every stage of the swarm serves one of them, so any stage of each span makes a
route. A joiner (`moeswarm join INVITE`) takes the span with the fewest stages announced now
(`choose_span`), among those whose bytes fit its memory; ties go to the lowest layer, so joiners
arriving one after another fill the spans in layer order and then replicate them evenly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from moeswarm.errors import MoeSwarmError

LAYERS_PER_STAGE = 8  # the default cut: spans of about this many layers
MAX_STAGES = 256  # an invite's bound on N (discovery/invite.py)


def default_stage_count(num_layers: int) -> int:
    """N when `--stages` is given without one: spans of about LAYERS_PER_STAGE layers, at least 2
    (one stage holding every layer is no swarm) unless the model has a single layer."""
    return min(num_layers, max(2, -(-num_layers // LAYERS_PER_STAGE)))


def cut_layers(num_layers: int, count: int) -> list[range]:
    """Layers 0..num_layers-1 cut into `count` contiguous spans, in order, lengths differing by at
    most one (the longer ones first); ValueError unless 1 <= count <= num_layers."""
    if not 1 <= count <= num_layers:
        raise ValueError(f"cannot cut {num_layers} decoder layers into {count} stages (1 to {num_layers})")
    base, extra = divmod(num_layers, count)
    spans, at = [], 0
    for i in range(count):
        length = base + (i < extra)
        spans.append(range(at, at + length))
        at += length
    return spans


def holders_per_span(cut: Sequence[range], announced: Iterable[range]) -> list[int]:
    """How many of the `announced` stages hold exactly each span of `cut` (a stage of any other span
    counts for none: a route over the cut cannot use it)."""
    counts = {(span.start, span.stop): 0 for span in cut}
    for span in announced:
        key = (span.start, span.stop)
        if key in counts:
            counts[key] += 1
    return [counts[(span.start, span.stop)] for span in cut]


def choose_span(cut: Sequence[range], holders: Sequence[int], span_bytes: Sequence[int],
                memory_bytes: int) -> range:
    """The span of `cut` a joiner takes: of those whose `span_bytes` fit `memory_bytes`, the one
    with the fewest `holders`, the lowest layer on a tie. MoeSwarmError (one line) when none fits."""
    if not (len(cut) == len(holders) == len(span_bytes)) or not cut:
        raise ValueError("cut, holders and span_bytes must be equally long and not empty")
    fitting = [i for i in range(len(cut)) if span_bytes[i] <= memory_bytes]
    if not fitting:
        smallest = min(range(len(cut)), key=lambda i: span_bytes[i])
        raise MoeSwarmError(f"no stage span of this swarm fits in {memory_bytes / 1e9:.3g} GB: the smallest, layers "
                            f"{cut[smallest].start}-{cut[smallest].stop - 1}, takes "
                            f"{span_bytes[smallest] / 1e9:.3g} GB (give a larger --memory)")
    return cut[min(fitting, key=lambda i: (holders[i], cut[i].start))]
