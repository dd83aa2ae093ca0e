"""Slice files: a standalone GGUF holding some experts of some layers, byte for byte.

An expert e of a stacked tensor `blk.L.ffn_{gate,up,down}_exps` is the byte range
[e*nb2, (e+1)*nb2) (ne[2], the expert axis, is outermost): a slice file stores the hosted experts'
blocks untouched, stacked again with ne[2] = the number of hosted experts. It keeps the model's
metadata (so `{arch}.expert_count` still says how many experts the model has) and adds:

- moeswarm.fingerprint: the full model's fingerprint (a slice is the same model to a backbone),
- moeswarm.expert_first / moeswarm.expert_ids: the global ids of the stored experts,
- moeswarm.layers: the MoE layers whose experts are stored.

With `with_backbone`, every non-expert tensor is copied too, so one file serves a backbone and a
worker. llama.cpp itself cannot run a slice file (its expert tensors are short); moeswarm can.
"""

from __future__ import annotations

import re
from pathlib import Path

from gguf import GGUFValueType, GGUFWriter

from moeswarm.errors import ModelError
from moeswarm.weights.gguf_file import (
    EXPERT_FIRST_KEY,
    EXPERT_IDS_KEY,
    FINGERPRINT_KEY,
    LAYERS_KEY,
    SLICE_PREFIX,
    GGUFFile,
)

EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)$")


def expert_layer(name: str) -> int | None:
    """The layer of a stacked routed-expert tensor, or None for any other tensor."""
    match = EXPERT_TENSOR.match(name)
    return int(match.group(1)) if match else None


def write_slice(source: str | Path, out: str | Path, experts: tuple[int, int], layers: tuple[int, int] | None = None,
                with_backbone: bool = False) -> dict:
    """Write experts [low, high] of the MoE layers in `layers` (all when None) of `source` to `out`."""
    f = GGUFFile.open(source)
    low, high = experts
    held = f.expert_ids if f.expert_ids is not None else list(range(int(f.require("expert_count"))))
    lacking = [e for e in range(low, high + 1) if e not in held]
    if lacking:
        raise ModelError(f"{f.path}: has experts {held[0]}-{held[-1]}, not {lacking[0]}-{lacking[-1]} (asked {low}-{high})")
    moe_layers = sorted({layer for name in f.tensors if (layer := expert_layer(name)) is not None})
    chosen = [layer for layer in moe_layers if layers is None or layers[0] <= layer <= layers[1]]
    if not chosen:
        raise ModelError(f"{f.path}: no MoE layer in range {layers}; its MoE layers are {moe_layers}")
    rows = slice(low - f.expert_first, high + 1 - f.expert_first)

    writer = GGUFWriter(str(out), f.arch)
    for key, field in f.reader.fields.items():
        if key.startswith("GGUF.") or key.startswith(SLICE_PREFIX) or key == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    if f.get("vocab_size") is None and "token_embd.weight" in f.tensors:  # a slice may lack the embedding
        writer.add_uint32(f"{f.arch}.vocab_size", int(f.tensors["token_embd.weight"].shape[1]))
    writer.add_key_value(FINGERPRINT_KEY, f.fingerprint, GGUFValueType.STRING)
    writer.add_key_value(EXPERT_FIRST_KEY, low, GGUFValueType.UINT32)
    writer.add_key_value(EXPERT_IDS_KEY, list(range(low, high + 1)), GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
    writer.add_key_value(LAYERS_KEY, chosen, GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)

    copied = {"expert_tensors": 0, "backbone_tensors": 0, "bytes": 0}
    for tensor in f.reader.tensors:
        layer = expert_layer(tensor.name)
        if layer is None and not with_backbone:
            continue
        if layer is not None and layer not in chosen:
            continue
        data = tensor.data if layer is None else tensor.data[rows]  # experts: rows of the outermost (ne[2]) axis
        writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
        copied["expert_tensors" if layer is not None else "backbone_tensors"] += 1
        copied["bytes"] += data.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"source": str(f.path), "out": str(out), "fingerprint": f.fingerprint, "experts": [low, high],
            "layers": chosen, **copied}
