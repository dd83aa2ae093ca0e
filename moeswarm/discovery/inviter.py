"""A swarm's first member (`moeswarm invite`): a DHT node, seeders of the model and its manifest, and the invite.

The inviter holds the whole model file. In a stages swarm (`--stages`) its invite says how many
spans the model is cut into (placement/stage_cut.py), and joiners serve spans, not experts. It hashes it into a manifest (or reuses one beside it
that matches the file), joins or starts the swarm's DHT, serves the model's pieces and the
manifest file with two seeders (slices/seed.py), and makes the invite (discovery/invite.py) that
names all three. It serves no experts itself: joiners hold them (`moeswarm join`).

With a swarm key the DHT node is keyed (only members' signed records count), both seeders speak
mutual TLS with the key's members only, and the invite carries the hash of the swarm's
certificate, not the key.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moeswarm.discovery.dht import SwarmDht
from moeswarm.discovery.invite import Invite, format_invite
from moeswarm.errors import MoeSwarmError
from moeswarm.slices.manifest import FORMAT, ManifestError, build_manifest, load_manifest, write_manifest
from moeswarm.slices.seed import Seeder


@dataclass(frozen=True)
class InviterConfig:
    """What `moeswarm invite` is told (each a flag)."""

    model: str
    manifest: str | None = None  # None: MODEL.manifest.json beside the model (made when absent or stale)
    peers: tuple[str, ...] = ()  # DHT peers of an existing swarm to attach to; (): start a new one
    host: str = "127.0.0.1"
    announce_host: str | None = None  # the address joiners dial the seeders at (default: host)
    dht_port: int = 0
    seed_port: int = 0
    manifest_port: int = 0
    swarm_key: str | None = None
    stages: int | None = None  # a stages swarm cut into this many spans (0: the default cut); None: experts only


def prepare_manifest(model: str, manifest: str | None) -> tuple[Path, str]:
    """(the manifest's path, its sha256) for `model`: the given file or MODEL.manifest.json, made anew
    unless it already describes this very file (format, size and fingerprint)."""
    from moeswarm.gguf.gguf_file import GGUFFile

    path = Path(manifest) if manifest else Path(model).with_name(Path(model).name + ".manifest.json")
    if not Path(model).is_file():
        raise MoeSwarmError(f"{model}: no such GGUF file to invite to")
    if path.is_file():
        try:
            found = load_manifest(path)
            fingerprint = GGUFFile.open(model).fingerprint
            if (found.data.get("format") == FORMAT and found.file_size == Path(model).stat().st_size
                    and found.fingerprint == fingerprint):
                return path, found.sha256
        except ManifestError:
            pass  # made anew below
    try:
        return path, write_manifest(build_manifest(model), path)
    except OSError as error:
        raise MoeSwarmError(f"cannot write the manifest {path}: {error.strerror or error} (give --manifest)") from None


def swarm_certificate_hash(key_file: str) -> str:
    """sha256 of the swarm's certificate (DER) in a swarm key or member file: the invite's trust material."""
    from moeswarm.transport.member_cert import Authority

    return hashlib.sha256(Authority.load(key_file).certificate_der).hexdigest()


class Inviter:
    """The DHT node and the two seeders, and the invite naming them."""

    def __init__(self, config: InviterConfig, manifest_path: Path, manifest_sha256: str, fingerprint: str,
                 dht: SwarmDht, tls: ssl.SSLContext | None, stages: int | None = None):
        self.config = config
        self.stages = stages  # the spans of a stages swarm's cut; None: an experts swarm
        self.dht = dht
        self.fingerprint = fingerprint
        self.manifest_path = manifest_path
        self.manifest_sha256 = manifest_sha256
        self.model_seeder = Seeder(config.model, tls)
        self.manifest_seeder = Seeder(manifest_path, tls)
        self.invite: Invite | None = None

    async def start(self) -> str:
        """Start both seeders; return the invite's text."""
        from moeswarm.discovery.announce import announce_address

        config = self.config
        _, seed_port = await self.model_seeder.start(config.host, config.seed_port)
        _, manifest_port = await self.manifest_seeder.start(config.host, config.manifest_port)
        self.invite = Invite(tuple(self.dht.addresses()[:8]), self.fingerprint, self.manifest_sha256,
                             self.manifest_path.stat().st_size,
                             announce_address(config.host, seed_port, config.announce_host),
                             announce_address(config.host, manifest_port, config.announce_host),
                             swarm_certificate_hash(config.swarm_key) if config.swarm_key else None, self.stages)
        return format_invite(self.invite)

    async def close(self) -> None:
        await self.model_seeder.close()
        await self.manifest_seeder.close()
        self.dht.close()


def open_inviter(config: InviterConfig) -> Inviter:
    """Hash the model (or reuse its manifest), then join or start the DHT; MoeSwarmError (one line) on failure."""
    from moeswarm.discovery.announce import announce_address

    announce_address(config.host, 1, config.announce_host)  # 0.0.0.0 needs an announce host: say so before hashing
    path, digest = prepare_manifest(config.model, config.manifest)
    manifest = load_manifest(path, digest)
    fingerprint, stages = manifest.fingerprint, _stage_count(config.stages, manifest.block_count())
    keys, tls = {}, None
    if config.swarm_key:
        from moeswarm.transport.member_cert import Authority, Identity
        from moeswarm.transport.tls import server_context

        keys = {"authority": Authority.load(config.swarm_key), "identity": Identity.load(config.swarm_key)}
        tls = server_context(config.swarm_key)
    dht = SwarmDht.open(list(config.peers), host=config.host, port=config.dht_port, **keys)
    return Inviter(config, path, digest, fingerprint, dht, tls, stages)


def _stage_count(asked: int | None, num_layers: int) -> int | None:
    """The spans of a stages swarm's cut: `asked`, or the default for 0; None for an experts swarm."""
    from moeswarm.placement.stage_cut import MAX_STAGES, default_stage_count

    if asked is None:
        return None
    count = asked or default_stage_count(num_layers)
    if not 1 <= count <= min(num_layers, MAX_STAGES):
        raise MoeSwarmError(f"--stages {count}: the model has {num_layers} decoder layers, so 1 to "
                            f"{min(num_layers, MAX_STAGES)} stages")
    return count


async def serve_until(inviter: Inviter, stop: asyncio.Event, on_invite: Sequence = ()) -> None:
    """Start, hand the invite's text to each of `on_invite`, serve until `stop`, close."""
    try:
        text = await inviter.start()
        for say in on_invite:
            say(text)
        await stop.wait()
    finally:
        await inviter.close()
