"""A backbone's model from an invite (`generate`/`serve --swarm INVITE` without `--model`).

The invite pins the model's manifest by its hash and names a seeder of the whole file
(discovery/invite.py). A backbone runs every tensor but the routed experts, which the swarm's
members serve, so it fetches the backbone slice (gguf/gguf_slice.py: every non-expert tensor, no
expert) into the cache directory and loads that as its model: every piece hashed against the
manifest on arrival, a broken fetch resumed by the next run (slices/fetch.py). `--check-local`
runs the whole model here too, so with it the whole model is fetched (a slice of every expert with
the backbone). A file already there is reused when its fingerprint is the invite's model's (one
that is not is fetched again); backbones starting together on one machine take turns
(slices/locks.py), the later ones reusing the first one's file.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Callable
from pathlib import Path

from moeswarm.discovery.invite import Invite
from moeswarm.errors import MoeSwarmError, ModelError
from moeswarm.slices.locks import held

SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}\.gguf$")  # the owner's file name, as the model's id


def cache_dir() -> Path:
    """Where members and backbones keep what they fetch from invites: $XDG_CACHE_HOME/moeswarm/join
    (~/.cache when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moeswarm" / "join"


def make_dir(directory: Path, hint: str = "give --dir") -> Path:
    """`directory`, made with its parents when absent; MoeSwarmError in one line, ending in `hint`,
    when it cannot be."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise MoeSwarmError(f"cannot make {directory}: {error.strerror or error} ({hint})") from None
    return directory


def model_path(directory: str | Path, invite: Invite, file_name: object, whole: bool) -> Path:
    """Where the backbone slice (or, `whole`, the whole model) of the invite's model is kept: a
    folder per model and choice, the file named as the owner's (`file_name`, from the manifest:
    the model's id in the API) when that is a plain GGUF file name, else by the fingerprint."""
    name = file_name if isinstance(file_name, str) and SAFE_NAME.match(file_name) else f"{invite.model}.gguf"
    return Path(directory) / f"{invite.model}.{'whole' if whole else 'backbone'}" / name


def model_from_invite(invite: Invite, directory: str | Path, tls: ssl.SSLContext | None, timeout_s: float,
                      whole: bool, say: Callable[[str], None]) -> Path:
    """The invite's model for a backbone here: its backbone slice, or with `whole` every expert too,
    fetched from the invite's seeder (or reused); FetchError or MoeSwarmError in one line."""
    from moeswarm.discovery.joining import layout
    from moeswarm.slices.fetch import fetch_slice
    from moeswarm.slices.manifest_fetch import fetch_manifest

    directory = make_dir(Path(directory), "set XDG_CACHE_HOME, or give --model")
    manifest = fetch_manifest(invite.manifest_seed, invite.manifest, invite.manifest_bytes,
                              directory / f"{invite.manifest}.manifest.json", tls, timeout_s)
    _, num_experts = layout(manifest, invite)
    out = model_path(directory, invite, manifest.data.get("file"), whole)
    out.parent.mkdir(exist_ok=True)
    with held(out.parent / ".lock"):  # another backbone fetching it here now: wait, then reuse its file
        if _reusable(out, invite.model):
            say(f"reusing {out}")
            return out
        experts = list(range(num_experts)) if whole else []
        report = fetch_slice(invite.seed, manifest, experts, out, None, True, tls, 3, timeout_s)
    what = "the whole model (--check-local)" if whole else "the backbone (every tensor but the routed experts)"
    say(f"fetched {what}: {report['fetched_bytes']} bytes ({report['resumed_bytes']} resumed) from {invite.seed} "
        f"into {out}")
    return out


def _reusable(out: Path, fingerprint: str) -> bool:
    """Whether `out` is a GGUF file of the model `fingerprint` (one that is not is removed)."""
    from moeswarm.gguf.gguf_file import GGUFFile

    if not out.is_file():
        return False
    try:
        if GGUFFile.open(out).fingerprint == fingerprint:
            return True
    except ModelError:
        pass
    out.unlink()
    return False
