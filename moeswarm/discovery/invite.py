"""The invite string: everything a new member needs to join a swarm, in one line (`moeswarm invite`).

    moeswarm-invite-1.<base64url of a compact JSON object, no padding>

The JSON object (version 1; every field required but "stages", no other field):

    {"dht": ["/ip4/H/tcp/P/p2p/ID", ...],  DHT peers to join by (1 to MAX_PEERS multiaddrs)
     "model": "<fingerprint>",              the model's fingerprint (gguf/gguf_file.py)
     "manifest": "<sha256 hex>",            the owner's manifest (slices/manifest.py), pinned by its hash
     "manifest_bytes": N,                   its length: a joiner fetches exactly that many bytes
     "seed": "HOST:PORT",                   a seeder of the model file's pieces (slices/seed.py)
     "manifest_seed": "HOST:PORT",          a seeder of the manifest file itself
     "swarm": "<sha256 hex>" | null,        keyed swarm: sha256 of the swarm's certificate (DER); null: unkeyed
     "stages": N}                           optional: a stages swarm, the model cut into N spans of layers
                                            (placement/stage_cut.py); absent: an experts swarm

An experts swarm's invite carries no "stages" field, so it reads the same as before the field
existed, and an invite written before it reads as an experts swarm's.

Nothing in it is secret. The manifest's hash makes every fetched byte checkable; the swarm's
certificate hash tells a joiner which `--swarm-key` (member file) belongs to this swarm: a member
file of another swarm is refused before anything is fetched. The key itself never travels in an
invite (docs/network.md, Invites).

`parse_invite` reads text from a user (a paste, a chat message): the length, the encoding, every
field's type and size are checked before use, and each problem is one line (InviteError).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass

from moeswarm.errors import MoeSwarmError
from moeswarm.placement.stage_cut import MAX_STAGES

PREFIX = "moeswarm-invite-1."
MAX_INVITE = 4096  # characters of the whole string
MAX_PEERS = 8
MAX_PEER = 300
MAX_NAME = 128
MAX_ADDRESS = 300
MAX_MANIFEST_BYTES = 256 << 20  # slices/manifest.py's bound on a manifest file
FIELDS = ("dht", "model", "manifest", "manifest_bytes", "seed", "manifest_seed", "swarm")
OPTIONAL = ("stages",)
_HEX64 = re.compile(r"[0-9a-f]{64}")
_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")


class InviteError(MoeSwarmError):
    """A string that is not a usable invite (its text says why, in one line)."""


@dataclass(frozen=True)
class Invite:
    """What an invite says (see the module's docstring for each field)."""

    dht: tuple[str, ...]
    model: str
    manifest: str
    manifest_bytes: int
    seed: str
    manifest_seed: str
    swarm: str | None = None
    stages: int | None = None  # a stages swarm: the model cut into this many spans; None: an experts swarm

    def to_json(self) -> dict:
        value = {"dht": list(self.dht), "model": self.model, "manifest": self.manifest,
                 "manifest_bytes": self.manifest_bytes, "seed": self.seed, "manifest_seed": self.manifest_seed,
                 "swarm": self.swarm}
        if self.stages is not None:
            value["stages"] = self.stages
        return value


def format_invite(invite: Invite) -> str:
    """The invite's one-line text; InviteError when `invite` itself breaks a bound (parse_invite reads it back)."""
    body = json.dumps(invite.to_json(), separators=(",", ":"), sort_keys=True).encode()
    text = PREFIX + base64.urlsafe_b64encode(body).decode().rstrip("=")
    parse_invite(text)  # what is written must read back: the bounds live in one place
    return text


def looks_like_invite(text: str) -> bool:
    """Whether `text` claims to be an invite (of any version): then it is parsed as one, not as peers."""
    return text.strip().startswith("moeswarm-invite-")


def parse_invite(text: str) -> Invite:
    """The invite in `text`; InviteError naming what is wrong."""
    text = text.strip()
    if not text.startswith("moeswarm-invite-"):
        raise InviteError("not a moeswarm invite: it starts with 'moeswarm-invite-1.' (printed by `moeswarm invite`)")
    if not text.startswith(PREFIX):
        version = text[len("moeswarm-invite-"):].split(".", 1)[0][:20]
        raise InviteError(f"an invite of version {version!r}; this moeswarm reads version 1")
    if len(text) > MAX_INVITE:
        raise InviteError(f"the invite is {len(text)} characters long, over the {MAX_INVITE} an invite may have")
    encoded = text[len(PREFIX):]
    if not _BASE64URL.fullmatch(encoded):
        raise InviteError("the invite holds characters outside base64url (A-Z a-z 0-9 - _): was it cut or altered?")
    try:
        raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
        value = json.loads(raw)
    except (binascii.Error, ValueError, RecursionError):
        raise InviteError("the invite does not decode (it was cut or altered): copy the whole line again") from None
    if not isinstance(value, dict):
        raise InviteError("the invite does not hold a JSON object")
    if not set(FIELDS) <= set(value) <= set(FIELDS + OPTIONAL):
        unknown, lacking = sorted(set(value) - set(FIELDS + OPTIONAL))[:4], sorted(set(FIELDS) - set(value))
        raise InviteError(f"the invite's fields are wrong (missing {lacking}, unknown {[f[:40] for f in unknown]})")
    return Invite(_peers(value["dht"]), _text(value, "model", MAX_NAME), _hash(value, "manifest"),
                  _manifest_bytes(value["manifest_bytes"]), _address(value, "seed"),
                  _address(value, "manifest_seed"), None if value["swarm"] is None else _hash(value, "swarm"),
                  _stages(value.get("stages")))


def _stages(raw: object) -> int | None:
    if raw is None:
        return None
    if type(raw) is not int or not 1 <= raw <= MAX_STAGES:
        raise InviteError(f"the invite's stages is not an integer in 1-{MAX_STAGES} (the spans the model is cut into)")
    return raw


def _peers(raw: object) -> tuple[str, ...]:
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_PEERS:
        raise InviteError(f"the invite's dht is not a list of 1 to {MAX_PEERS} multiaddrs")
    for peer in raw:
        if not (isinstance(peer, str) and 0 < len(peer) <= MAX_PEER and peer.isprintable()
                and peer.startswith("/") and "/p2p/" in peer):
            raise InviteError(f"the invite's dht holds {str(peer)[:80]!r}, not a multiaddr /ip4/HOST/tcp/PORT/p2p/ID")
    return tuple(raw)


def _text(value: dict, name: str, limit: int) -> str:
    text = value[name]
    if not (isinstance(text, str) and 0 < len(text) <= limit and text.isprintable()):
        raise InviteError(f"the invite's {name} is not printable text of 1 to {limit} characters")
    return text


def _hash(value: dict, name: str) -> str:
    text = value[name]
    if not (isinstance(text, str) and _HEX64.fullmatch(text)):
        raise InviteError(f"the invite's {name} is not a sha256 (64 lowercase hex digits)")
    return text


def _manifest_bytes(raw: object) -> int:
    if type(raw) is not int or not 0 < raw <= MAX_MANIFEST_BYTES:
        raise InviteError(f"the invite's manifest_bytes is not an integer in 1-{MAX_MANIFEST_BYTES}")
    return raw


def _address(value: dict, name: str) -> str:
    from moeswarm.ids import parse_address

    text = _text(value, name, MAX_ADDRESS)
    try:
        parse_address(text)
    except ValueError as error:
        raise InviteError(f"the invite's {name}: {error}") from None
    return text
