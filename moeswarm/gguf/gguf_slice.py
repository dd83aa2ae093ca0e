"""Slice files: a standalone GGUF holding some experts of some layers, byte for byte.

An expert e of a stacked tensor `blk.L.ffn_{gate,up,down}_exps` is the byte range
[e*nb2, (e+1)*nb2) (ne[2], the expert axis, is outermost): a slice file stores the hosted experts'
blocks untouched, stacked again with ne[2] = the number of hosted experts. It keeps the model's
metadata (so `{arch}.expert_count` still says how many experts the model has) and adds:

- moeswarm.fingerprint: the full model's fingerprint (a slice is the same model to a backbone),
- moeswarm.expert_first / moeswarm.expert_ids: the global ids of the stored experts,
- moeswarm.layers: the MoE layers whose experts are stored.

With `with_backbone`, every non-expert tensor is copied too, so one file serves a backbone and a
worker; with no experts at all it is a backbone slice (every non-expert tensor, none of the three
keys above: GGUF has no empty arrays), what a backbone fetches from an invite. llama.cpp itself
cannot run a slice file (its expert tensors are short); moeswarm can.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import GGUFValueType, GGUFWriter

from moeswarm.errors import ModelError
from moeswarm.ids import format_ids, runs
from moeswarm.progress import enabled, progress
from moeswarm.gguf.gguf_file import (
    EXPERT_FIRST_KEY,
    EXPERT_IDS_KEY,
    FINGERPRINT_KEY,
    LAYERS_KEY,
    SLICE_PREFIX,
    GGUFFile,
)

EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.(weight|bias)$")


def expert_layer(name: str) -> int | None:
    """The layer of a stacked routed-expert tensor, or None for any other tensor."""
    match = EXPERT_TENSOR.match(name)
    return int(match.group(1)) if match else None


def write_slice(source: str | Path, out: str | Path, experts: Sequence[int], layers: tuple[int, int] | None = None,
                with_backbone: bool = False) -> dict:
    """Write `experts` (ascending distinct ids) of the MoE layers in `layers` (all when None) of `source` to `out`."""
    f = GGUFFile.open(source)
    experts = [int(e) for e in experts]
    if experts != sorted(set(experts)) or not experts and not with_backbone:
        raise ModelError(f"experts must be distinct ascending ids, and some unless with_backbone, got {experts}")
    held = f.expert_ids if f.expert_ids is not None else list(range(int(f.require("expert_count"))))
    where = {expert: i for i, expert in enumerate(held)}  # global id -> index along ne[2]
    lacking = [e for e in experts if e not in where]
    if lacking:
        raise ModelError(f"{f.path}: has experts {format_ids(held)}, not {format_ids(lacking)} (asked {format_ids(experts)})")
    moe_layers = sorted({layer for name in f.tensors if (layer := expert_layer(name)) is not None})
    chosen = [layer for layer in moe_layers if layers is None or layers[0] <= layer <= layers[1]]
    if not chosen:
        raise ModelError(f"{f.path}: no MoE layer in range {layers}; its MoE layers are {moe_layers}")
    stored_runs = runs([where[e] for e in experts])  # contiguous index ranges along ne[2]

    writer = GGUFWriter(str(out), f.arch)
    for key, field in f.header.fields.items():  # the checked header's values (a list not UTF-8: a ModelError here)
        if key.startswith(SLICE_PREFIX) or key == "general.architecture":
            continue
        sub_type = GGUFValueType(field.item) if field.kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.metadata[key], GGUFValueType(field.kind), sub_type=sub_type)
    if f.get("vocab_size") is None and "token_embd.weight" in f.tensors:  # a slice may lack the embedding
        writer.add_uint32(f"{f.arch}.vocab_size", int(f.tensors["token_embd.weight"].shape[1]))
    writer.add_key_value(FINGERPRINT_KEY, f.fingerprint, GGUFValueType.STRING)
    if experts:  # a backbone slice (no experts) has none of these keys: GGUF has no empty arrays
        writer.add_key_value(EXPERT_FIRST_KEY, experts[0], GGUFValueType.UINT32)
        writer.add_key_value(EXPERT_IDS_KEY, experts, GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
        writer.add_key_value(LAYERS_KEY, chosen, GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)

    copied = {"expert_tensors": 0, "backbone_tensors": 0, "bytes": 0}
    for tensor in progress(f.header.tensors, desc=f"slicing {f.path.name}", unit="tensor"):
        layer = expert_layer(tensor.name)
        if layer is None and not with_backbone:
            continue
        if layer is not None and (layer not in chosen or not experts):
            continue
        data = tensor.data if layer is None else _rows(tensor.data, stored_runs)  # experts: rows of the outermost (ne[2]) axis
        writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
        copied["expert_tensors" if layer is not None else "backbone_tensors"] += 1
        copied["bytes"] += data.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=enabled())  # gguf's own bar, in bytes, on stderr
    writer.close()
    return {"source": str(f.path), "out": str(out), "fingerprint": f.fingerprint, "experts": experts,
            "layers": chosen if experts else [], **copied}


def _rows(data: np.ndarray, stored_runs: list[range]) -> np.ndarray:
    """The blocks of some experts of a stacked tensor, byte for byte (one read per contiguous run)."""
    pieces = [data[run.start : run.stop] for run in stored_runs]
    if [len(piece) for piece in pieces] != [len(run) for run in stored_runs]:  # numpy clips a slice past the end
        raise ModelError(f"an expert tensor holds {len(data)} experts, fewer than the ones asked for")
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
