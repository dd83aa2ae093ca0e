"""A member joining a stages swarm (`moeswarm join INVITE` where the invite says `stages`): its span, its slice.

The order, and what each step relies on (the trust check and the manifest as in discovery/joining.py):

1. the swarm's cut is the model's decoder layers (the manifest's `blk.N` tensors) cut into the
   invite's number of spans (placement/stage_cut.py);
2. the stage records announced on the DHT now (discovery/stage_record.py; online ones of this
   model) say how many stages hold each span; `choose_span` (pure) takes the one with the fewest
   that fits `--memory` (a span's bytes: every tensor of its blocks, all its experts included);
3. `fetch_stage_slice` fetches that span's slice (slices/fetch.py: hashed, resumable): every
   expert of the span's MoE layers and the model's whole trunk (every non-expert tensor: the
   model's configuration is read off the file's tensor index, so a slice without the other
   layers' trunk would read as another model; the stage loads only its own span's), from the
   seeds other members announce and the invite's seeder (slices/sources.py), keeping the pieces
   for this member's own seed (`stage_seed_layers`: what its seed record claims);
4. the command runs a stage of that span on the slice, its experts held in its own process,
   announced on the swarm (commands/_join_stage.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from moeswarm.discovery.invite import Invite
from moeswarm.errors import MoeSwarmError
from moeswarm.placement.stage_cut import choose_span, cut_layers, holders_per_span
from moeswarm.slices.manifest import Manifest


def swarm_cut(manifest: Manifest, invite: Invite) -> list[range]:
    """The spans of the invite's stages swarm; MoeSwarmError when its count does not fit the model."""
    layers = manifest.block_count()
    try:
        return cut_layers(layers, invite.stages)
    except ValueError as error:
        raise MoeSwarmError(f"the invite's stages swarm: {error}") from None


def span_bytes(manifest: Manifest, span: range) -> int:
    """What a stage of `span` holds: every tensor of blocks span.start..span.stop-1, in the file's bytes."""
    def block(name: str) -> int | None:
        parts = name.split(".")
        return int(parts[1]) if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() else None

    return sum(t["bytes"] for t in manifest.data["tensors"] if block(t["name"]) in span)


def plan_span(manifest: Manifest, invite: Invite, announced: Iterable, memory_bytes: int) -> tuple[range, list[int]]:
    """(the span this joiner takes, the holders of each span of the cut) from the stage records
    `announced` (StageRecords: the online ones of the invite's model count)."""
    cut = swarm_cut(manifest, invite)
    spans = [r.layers for r in announced if r.online and r.fingerprint == invite.model]
    holders = holders_per_span(cut, spans)
    return choose_span(cut, holders, [span_bytes(manifest, s) for s in cut], memory_bytes), holders


def stage_slice_path(directory: str | Path, fingerprint: str, span: range) -> Path:
    """Where the slice of `span` is kept: the same span, joined again, reuses it."""
    return Path(directory) / f"{fingerprint}.layers-{span.start}-{span.stop - 1}.gguf"


def stage_seed_layers(manifest: Manifest, span: range) -> tuple[int, int]:
    """(first, last) MoE layers of `span`: a stage slice holds every expert of these and the whole
    trunk; MoeSwarmError when the span holds no MoE layer (it cannot be fetched as a slice)."""
    moe = [layer for layer in manifest.moe_layers() if layer in span]
    if not moe:
        raise MoeSwarmError(f"layers {span.start}-{span.stop - 1} hold no MoE layer: a stage of dense layers only "
                            "cannot be fetched as a slice (cut the swarm into fewer stages)")
    return moe[0], moe[-1]


def fetch_stage_slice(invite: Invite, manifest: Manifest, span: range, directory: str | Path, tls, timeout_s: float,
                      say: Callable[[str], None], sources: str | Sequence | None = None,
                      keep_pieces: bool = False, reuse: Sequence[str | Path] = ()) -> Path:
    """The slice of `span` in `directory`: reused when there, else fetched from `sources`
    (slices/sources.py; None: the invite's seeder alone); FetchError naming what went wrong.
    keep_pieces: keep the pieces for this member's seed. reuse: slices whose kept pieces are copied
    rather than fetched (a move: the trunk both spans' slices hold; slices/kept.py). `say` gets one
    line: what was fetched, from whom, or reused."""
    from moeswarm.slices.fetch import fetch_slice
    from moeswarm.slices.manifest import ManifestError

    out = stage_slice_path(directory, invite.model, span)
    if out.is_file():
        say(f"reusing {out}")
        return out
    layers = stage_seed_layers(manifest, span)
    try:
        report = fetch_slice(sources or invite.seed, manifest, manifest.data["expert_ids"], out, layers,
                             True, tls, 3, timeout_s, keep_pieces, reuse)
    except ManifestError as error:
        raise MoeSwarmError(f"layers {span.start}-{span.stop - 1}: {error}") from None
    origins = ", ".join(f"{count} from {address}" for address, count in sorted(report["from"].items()))
    say(f"fetched {report['fetched_bytes']} bytes ({report['resumed_bytes']} resumed, {report['reused_bytes']} copied "
        f"from the slice held before) into {out}"
        + (f" ({origins})" if origins else ""))
    return out


def drop_stage_slice(directory: str | Path, fingerprint: str, span: range) -> int:
    """Remove the slice of `span` from `directory`, with its kept pieces and any partial fetch (a
    member that moved away from that span); the bytes freed."""
    from moeswarm.discovery.joining import remove_slice

    return remove_slice(stage_slice_path(directory, fingerprint, span))
