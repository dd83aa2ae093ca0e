"""The manifest a GGUF file's owner publishes: sha256 of every piece a joining worker may fetch.

A piece is a byte range of the file with its own hash, so a fetched range is checked on arrival,
before it is kept. The file is cut into pieces as follows (`chunk_bytes` at most each):

- the header (metadata and tensor index, bytes [0, data_offset));
- the two samples the model's fingerprint reads (gguf/gguf_file.py: the data region's first and
  last 64 KiB), so that a fetched slice carries the very same fingerprint;
- every tensor: a stacked routed-expert tensor `blk.L.ffn_*_exps` per expert block (expert i of
  the file is bytes [i * block, (i + 1) * block) of the tensor), any other tensor as one unit;
  each unit in chunks.

The manifest is what makes a seeder's bytes trustworthy, so it must itself come from the owner:
the user passes the owner's file, and may pin it with its sha256 (`--manifest-sha256`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moeswarm.errors import MoeSwarmError, printable
from moeswarm.progress import progress
from moeswarm.gguf.gguf_file import GGUFFile
from moeswarm.gguf.gguf_slice import expert_layer

FORMAT = "moeswarm-manifest/1"
FINGERPRINT_SAMPLE = 1 << 16  # bytes at each end of the data region that the fingerprint reads (gguf_file.py)
DEFAULT_CHUNK = 4 << 20
MAX_CHUNK = 16 << 20  # the most a seeder sends for one request (slices/seed.py)
MAX_MANIFEST_BYTES = 256 << 20
MAX_FILE_SIZE = 1 << 44  # 16 TiB: beyond any model file, and beyond what a sparse partial file may claim


class ManifestError(MoeSwarmError):
    """A manifest that cannot be used: malformed, another file's, or not the one pinned."""


@dataclass(frozen=True)
class Piece:
    """One hashed byte range of the model file: [offset, offset + length)."""

    offset: int
    length: int
    sha256: str
    label: str  # what it is, for messages: "header", "blk.3.ffn_up_exps.weight expert 5", ...


@dataclass(frozen=True)
class Manifest:
    data: dict  # the JSON object, validated
    sha256: str  # of the manifest file's bytes

    @property
    def file_size(self) -> int:
        return self.data["file_size"]

    @property
    def fingerprint(self) -> str:
        return self.data["fingerprint"]

    def moe_layers(self) -> list[int]:
        """The file's MoE layers (those with stacked routed-expert tensors), ascending."""
        return sorted({layer for t in self.data["tensors"] if (layer := expert_layer(t["name"])) is not None})

    def block_count(self) -> int:
        """The file's decoder layers: 1 + the highest N of its `blk.N.*` tensors (0 when it has none)."""
        found = [int(t["name"].split(".")[1]) for t in self.data["tensors"]
                 if t["name"].startswith("blk.") and t["name"].split(".")[1].isdigit()]
        return max(found) + 1 if found else 0

    def expert_bytes(self) -> int:
        """The bytes one expert takes in the file over every MoE layer (a slice's share of them per expert)."""
        return sum(t["bytes"] // len(t["units"]) for t in self.data["tensors"] if expert_layer(t["name"]) is not None)

    def pieces(self, experts: Sequence[int], layers: tuple[int, int] | None, with_backbone: bool) -> list[Piece]:
        """What a slice of `experts` of the MoE layers in `layers` (all when None) needs, in file order:
        the header, the fingerprint's samples, the experts' blocks, and with_backbone every other tensor."""
        d = self.data
        where = {expert: i for i, expert in enumerate(d["expert_ids"])}  # global id -> block index in the file
        lacking = [e for e in experts if e not in where]
        if lacking:
            raise ManifestError(f"the manifest's file holds no experts {lacking} (it holds {len(where)} experts)")
        moe_layers = sorted({layer for t in d["tensors"] if (layer := expert_layer(t["name"])) is not None})
        chosen = {layer for layer in moe_layers if layers is None or layers[0] <= layer <= layers[1]}
        if not chosen:
            raise ManifestError(f"no MoE layer in range {layers}; the file's MoE layers are {moe_layers}")
        found = _chunks(0, d["header"], d["chunk_bytes"], "header")
        found += [Piece(offset, length, sha, f"fingerprint sample at byte {offset}") for offset, length, sha in d["samples"]]
        for tensor in d["tensors"]:
            layer = expert_layer(tensor["name"])
            if layer is None and not with_backbone or layer is not None and layer not in chosen:
                continue
            units = tensor["units"]
            block = tensor["bytes"] // len(units)
            wanted = range(len(units)) if layer is None else sorted(where[e] for e in experts)
            for unit in wanted:
                label = tensor["name"] if layer is None else f"{tensor['name']} expert {d['expert_ids'][unit]}"
                found += _chunks(tensor["offset"] + unit * block, units[unit], d["chunk_bytes"], label)
        return found


def _chunks(start: int, hashes: list[list], chunk: int, label: str) -> list[Piece]:
    """The pieces of a unit starting at `start`: `hashes` is [[length, sha256], ...], one per chunk."""
    return [Piece(start + i * chunk, length, sha, label if len(hashes) == 1 else f"{label} chunk {i}")
            for i, (length, sha) in enumerate(hashes)]


# -- writing ------------------------------------------------------------------------------------------


def build_manifest(path: str | Path, chunk_bytes: int = DEFAULT_CHUNK) -> dict:
    """The manifest of the GGUF file at `path` (reads the whole file once)."""
    if not 0 < chunk_bytes <= MAX_CHUNK:
        raise ManifestError(f"chunk size must be 1 byte to {MAX_CHUNK >> 20} MiB, got {chunk_bytes}")
    f = GGUFFile.open(path)
    size = f.path.stat().st_size
    data_offset = int(f.reader.data_offset)
    ids = f.expert_ids if f.expert_ids is not None else list(range(int(f.get("expert_count", 0) or 0)))
    with f.path.open("rb") as handle, progress(desc=f"hashing {f.path.name}", total=size, unit="B") as bar:
        def unit_hashes(start: int, length: int) -> list[list]:
            out = []
            for offset in range(start, start + length, chunk_bytes):
                take = min(chunk_bytes, start + length - offset)
                handle.seek(offset)
                out.append([take, hashlib.sha256(handle.read(take)).hexdigest()])
                bar.update(take)
            return out

        tensors = []
        for t in f.reader.tensors:
            offset, length = int(t.data_offset), int(t.n_bytes)
            experts = len(ids) if expert_layer(t.name) is not None else 1
            if length % experts:
                raise ManifestError(f"{f.path}: tensor {t.name} ({length} bytes) does not split into {experts} experts")
            block = length // experts
            tensors.append({"name": t.name, "offset": offset, "bytes": length,
                            "units": [unit_hashes(offset + i * block, block) for i in range(experts)]})
        header = unit_hashes(0, data_offset)
        region = size - data_offset
        sample = min(FINGERPRINT_SAMPLE, region)
        samples = []
        for start in sorted({data_offset, size - sample}):
            handle.seek(start)
            samples.append([start, sample, hashlib.sha256(handle.read(sample)).hexdigest()])
    return {"format": FORMAT, "file": f.path.name, "file_size": size, "data_offset": data_offset,
            "fingerprint": f.fingerprint, "chunk_bytes": chunk_bytes, "expert_ids": ids,
            "header": header, "samples": samples, "tensors": tensors}


def write_manifest(manifest: dict, out: str | Path) -> str:
    """Write it as JSON; return the file's sha256 (what a user may pin with --manifest-sha256)."""
    text = json.dumps(manifest, separators=(",", ":")).encode()
    Path(out).write_bytes(text)
    return hashlib.sha256(text).hexdigest()


# -- reading ------------------------------------------------------------------------------------------


def load_manifest(path: str | Path, sha256: str | None = None) -> Manifest:
    """The manifest at `path`, checked against `sha256` when given, and validated."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"manifest {path} not found (the model owner makes it with `moeswarm manifest MODEL.gguf`)")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest {path} is over {MAX_MANIFEST_BYTES >> 20} MiB: not a manifest")
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise ManifestError(f"cannot read manifest {path}: {error.strerror or error}") from None
    digest = hashlib.sha256(raw).hexdigest()
    if sha256 is not None and digest != sha256.lower():
        raise ManifestError(f"manifest {path} has sha256 {digest}, not the pinned {sha256}: it is not the owner's")
    try:
        data = json.loads(raw)
    except ValueError as error:  # UnicodeDecodeError and over-long integers included
        raise ManifestError(f"manifest {path} is not JSON ({printable(str(error), 200)})") from None
    except RecursionError:
        raise ManifestError(f"manifest {path} is not a manifest: its JSON is nested too deeply") from None
    problem = _problem(data)
    if problem:
        raise ManifestError(f"manifest {path} is malformed: {problem}")
    return Manifest(data, digest)


def _problem(d) -> str | None:
    """What is wrong with a parsed manifest, or None."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        return f"not a {FORMAT} object"
    ints = ("file_size", "data_offset", "chunk_bytes")
    if not all(_is_int(d.get(k)) and d[k] > 0 for k in ints) or d["chunk_bytes"] > MAX_CHUNK:
        return f"{', '.join(ints)} must be positive integers (chunk at most {MAX_CHUNK})"
    if d["file_size"] > MAX_FILE_SIZE:
        return f"file_size {d['file_size']} is over the {MAX_FILE_SIZE} bytes (16 TiB) a model file may have"
    size, chunk = d["file_size"], d["chunk_bytes"]
    if d["data_offset"] > size or not isinstance(d.get("fingerprint"), str):
        return "data_offset beyond the file, or no fingerprint"
    ids = d.get("expert_ids")
    if not isinstance(ids, list) or not all(_is_int(e) and e >= 0 for e in ids) or ids != sorted(set(ids)):
        return "expert_ids must be distinct ascending integers"
    if _units_problem(d.get("header"), d["data_offset"], chunk):
        return "header chunks do not cover [0, data_offset)"
    samples = d.get("samples")
    if not isinstance(samples, list) or not all(
            isinstance(s, list) and len(s) == 3 and _is_int(s[0]) and _is_int(s[1]) and _is_hash(s[2])
            and 0 <= s[0] and 0 < s[1] <= FINGERPRINT_SAMPLE and s[0] + s[1] <= size for s in samples):
        return "samples must be [offset, length, sha256] inside the file"
    tensors = d.get("tensors")
    if not isinstance(tensors, list):
        return "tensors must be a list"
    for t in tensors:
        if not (isinstance(t, dict) and isinstance(t.get("name"), str) and _is_int(t.get("offset"))
                and _is_int(t.get("bytes")) and isinstance(t.get("units"), list) and t["units"]):
            return "each tensor needs name, offset, bytes and units"
        if (t["offset"] < d["data_offset"] or t["bytes"] < 0 or t["offset"] + t["bytes"] > size
                or t["bytes"] % len(t["units"])):
            return f"tensor {t['name']!r:.80} lies outside the data region or does not split into its units"
        if expert_layer(t["name"]) is not None and len(t["units"]) != len(ids):
            return f"expert tensor {t['name']!r} has {len(t['units'])} units for {len(ids)} experts"
        block = t["bytes"] // len(t["units"])
        for i, unit in enumerate(t["units"]):
            if _units_problem(unit, block, chunk):
                return f"tensor {t['name']!r:.80}: unit {i}'s chunks do not cover it"
    return None


def _units_problem(hashes, length: int, chunk: int) -> bool:
    """True unless `hashes` is [[length, sha256], ...] in chunks of `chunk` covering `length` bytes."""
    if not isinstance(hashes, list) or len(hashes) != -(-length // chunk):
        return True
    for i, item in enumerate(hashes):
        want = min(chunk, length - i * chunk)
        if not (isinstance(item, list) and len(item) == 2 and item[0] == want and _is_hash(item[1])):
            return True
    return False


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hash(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
