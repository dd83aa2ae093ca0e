"""A member joining from an invite (`moeswarm join`): the trust check, the coverage read, the share.

The order, and what each step relies on:

1. the `--swarm-key` given must match the invite (a keyed invite names its swarm's certificate);
2. the manifest is fetched and checked against the invite's hash (slices/manifest_fetch.py); it
   gives the model's MoE layers, its experts and each expert's bytes;
3. the DHT is joined and the members' announcements read (what each holds, as it claims: only a
   worker's HELLO is trusted by backbones, so a lying record can skew a share, never an answer);
4. `plan_share` (pure: placement/share.py) picks the experts where the swarm is weakest, as many
   as `--memory` holds, weighing each (layer, expert) by the load its holders announce
   (placement/load.py), the shares other joiners are still fetching counted as held
   (`joining_holders`); the choice is stored at once for later joiners (discovery/joining_record.py)
   and withdrawn once the worker is announced;
5. `fetch_share` fetches exactly those bytes (slices/fetch.py: hashed, resumable) and the command
   serves them, moving the share later when the swarm needs it (node/rebalancing.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from moeswarm.discovery.invite import Invite
from moeswarm.errors import MoeSwarmError
from moeswarm.ids import format_ids
from moeswarm.placement.load import swarm_load
from moeswarm.placement.share import Share, choose_share, coverage_of, experts_for_memory, joiner_order
from moeswarm.slices.manifest import Manifest


def check_key(invite: Invite, key_file: str | None) -> None:
    """MoeSwarmError unless `key_file` fits the invite: none for an unkeyed swarm, a member file of
    its swarm for a keyed one."""
    if invite.swarm is None:
        if key_file:
            raise MoeSwarmError("the invite is for an unkeyed swarm: drop --swarm-key (its members speak plain TCP)")
        return
    if not key_file:
        raise MoeSwarmError("the invite is for a keyed swarm: pass your member file of it as --swarm-key "
                            "(`moeswarm keygen --member NAME --swarm-key swarm.key`, made by the swarm's owner)")
    from moeswarm.transport.member_cert import Authority

    found = hashlib.sha256(Authority.load(key_file).certificate_der).hexdigest()
    if found != invite.swarm:
        raise MoeSwarmError(f"--swarm-key {key_file} belongs to another swarm (certificate {found[:16]}..., the "
                            f"invite's is {invite.swarm[:16]}...)")


def layout(manifest: Manifest, invite: Invite) -> tuple[list[int], int]:
    """(the MoE layers, experts per layer) of the invite's model; MoeSwarmError when the manifest is
    not of the whole model the invite names."""
    if manifest.fingerprint != invite.model:
        raise MoeSwarmError(f"the manifest is of model {manifest.fingerprint}, the invite names {invite.model}")
    ids = manifest.data["expert_ids"]
    layers = manifest.moe_layers()
    if not layers or ids != list(range(len(ids))):
        raise MoeSwarmError("the invite's manifest is not of a whole MoE model (a slice's, or one without experts)")
    return layers, len(ids)


def plan_share(manifest: Manifest, layers: Sequence[int], num_experts: int,
               members: Iterable[tuple[Mapping[int, Sequence[int]], Mapping[int, Sequence[int]] | None]],
               memory_bytes: int, seed: bytes) -> Share:
    """The experts this joiner takes: `memory_bytes` worth, where `members` (each one's ({layer:
    experts}, its announced load or None)) cover the model least, weighted by the measured load
    (placement/load.py); ties in the order `seed` draws."""
    members = list(members)
    count = experts_for_memory(memory_bytes, manifest.expert_bytes(), num_experts)
    coverage = coverage_of((held for held, _ in members), layers, num_experts)
    load = swarm_load(members, layers, num_experts)
    return choose_share(coverage, count, load, order=joiner_order(seed, num_experts))


def joining_holders(records: Iterable, layers: Sequence[int]) -> list[tuple[dict[int, tuple[int, ...]], None]]:
    """The shares other joiners chose and are still fetching or loading (discovery/joining_record.py
    JoiningRecords with experts), as `plan_share`'s members: held in every MoE layer, no load yet."""
    return [({layer: record.experts for layer in layers}, None) for record in records if record.experts is not None]


def joining_address(dht_address: str) -> str:
    """HOST:PORT of a DHT node from its multiaddr (/ip4/H/tcp/P/..., /ip6/H/tcp/P/...): the subkey
    a joiner's JoiningRecord is stored under (one per node)."""
    from moeswarm.transport.path import canonical_address

    parts = dht_address.split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        raise MoeSwarmError(f"the DHT node's address {dht_address[:100]!r} is not /ip4 or /ip6 over tcp")
    host = f"[{parts[2]}]" if parts[1] == "ip6" else parts[2]
    return canonical_address(f"{host}:{parts[4]}")


def announce_joining(dht, record, ttl_s: float, say: Callable[[str], None]):
    """The Announcer keeping `record` (this joiner's JoiningRecord) on the DHT until stopped, or None
    when no peer took it (`say` says so: later joiners then choose without it, and rebalancing
    repairs what they double)."""
    from moeswarm.discovery.announce import Announcer
    from moeswarm.discovery.joining_record import JOINING

    announcer = Announcer(dht, record, ttl_s, kind=JOINING)
    try:
        announcer.start()
    except MoeSwarmError as error:
        say(f"the choice not announced to other joiners: {error}")
        return None
    return announcer


def share_path(directory: str | Path, fingerprint: str, experts: Sequence[int]) -> Path:
    """Where the slice of `experts` is kept: the same share, run again, resumes or reuses it."""
    return Path(directory) / f"{fingerprint}.experts-{format_ids(experts).replace(',', '_')}.gguf"


def drop_share(directory: str | Path, fingerprint: str, experts: Sequence[int]) -> int:
    """Remove the slice of `experts` from `directory`, with its kept pieces and any partial fetch
    (a member that moved away from that share: its disk holds one share, not every one it held).
    Returns the bytes freed; files already gone are skipped."""
    return remove_slice(share_path(directory, fingerprint, experts))


def remove_slice(out: Path) -> int:
    """Remove slice `out` with its kept pieces and any partial fetch; the bytes freed (files already
    gone are skipped)."""
    from moeswarm.slices.kept import pieces_paths

    freed = 0
    partial = (out.with_name(out.name + ".partial"), out.with_name(out.name + ".partial.done"),
               out.with_name(out.name + ".writing"))
    for path in (out, *partial, *pieces_paths(out)):
        try:
            freed += path.stat().st_blocks * 512  # what the disk gets back (the pieces file is sparse)
            path.unlink()
        except FileNotFoundError:
            continue
    return freed


def fetch_share(invite: Invite, manifest: Manifest, experts: Sequence[int], directory: str | Path, tls,
                timeout_s: float, say: Callable[[str], None], sources: Sequence | None = None,
                keep_pieces: bool = False, reuse: Sequence[str | Path] = ()) -> Path:
    """The slice of `experts` in `directory`: reused when there, else fetched from `sources`
    (slices/sources.py: members' seeds, then the invite's seeder; None: the invite's seeder alone),
    FetchError naming what went wrong. keep_pieces: keep the pieces for this member's seed. reuse:
    slices whose kept pieces are copied rather than fetched (a move: slices/kept.py). `say` gets
    one line: what was fetched, from whom, or reused."""
    from moeswarm.slices.fetch import fetch_slice

    out = share_path(directory, invite.model, experts)
    if out.is_file():
        say(f"reusing {out}")
        return out
    report = fetch_slice(invite.seed if sources is None else sources, manifest, experts, out, None, False, tls, 3,
                         timeout_s, keep_pieces, reuse)
    origins = ", ".join(f"{count} from {address}" for address, count in sorted(report["from"].items()))
    say(f"fetched {report['fetched_bytes']} bytes ({report['resumed_bytes']} resumed, {report['reused_bytes']} copied "
        f"from the slice held before) into {out}"
        + (f" ({origins})" if origins else ""))
    return out
