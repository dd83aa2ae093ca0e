"""What a model is, read from its config and tensor headers: no weight is read or converted.

`summarize(path, workers)` describes a model directory or a GGUF file (a slice file included):
family, layers and which are MoE, experts per layer and top-k, sizes, parameter counts (from the
model built on the meta device, so every family counts the same way), stored bytes and tensor
types (from the safetensors headers or the GGUF tensor index), and an even `--experts` split
over `workers` workers. `summary_lines` renders it for a terminal.
"""

from __future__ import annotations

import os
import re
from collections import Counter

from moeswarm.errors import ModelError
from moeswarm.ids import format_ids
from moeswarm.model.experts import experts_modules
from moeswarm.model.skeleton import meta_model
from moeswarm.sources.source import ModelSource, open_source

# Each family's config names for the same hyperparameter, first match wins (tiny.py lists them).
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_k", "moe_topk", "top_k_experts")
EXPERT_SIZE_KEYS = ("moe_intermediate_size", "intermediate_size")
SHARED_COUNT_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
SHARED_SIZE_KEYS = ("shared_expert_intermediate_size", "shared_experts_intermediate_size")

_ROUTED_HF_TENSOR = re.compile(r"\.experts\.")  # "mlp.experts.3.w1" or fused "mlp.experts.gate_up_proj", never "shared_experts."


def summarize(path: str | os.PathLike, workers: int = 2) -> dict:
    """The model at `path` as plain data (the `moeswarm info --json` object)."""
    source = open_source(path)
    config = source.config
    try:
        model = meta_model(config)  # modules on the meta device: counts without weights
    except ValueError as error:  # transformers cannot build this model type
        raise ModelError(f"{source.path}: cannot build a {config.model_type} model: {error}") from None
    modules = experts_modules(model)
    if not modules:
        raise ModelError(f"{source.path}: model type {config.model_type!r} has no routed experts (not a MoE model)")
    expert_params = sum(p.numel() for _, module in modules.values() for p in module.parameters())
    total_params = sum(p.numel() for p in model.parameters())
    num_experts = next(iter(modules.values()))[1].num_experts  # as the loaders count them
    stored = _stored_tensors(source)
    held_layers, held_experts = source.held_layers, source.held_experts
    return {
        "path": str(source.path),
        "kind": source.kind,
        "family": config.model_type,
        "fingerprint": source.fingerprint,
        "layers": int(config.num_hidden_layers),
        "moe_layers": sorted(int(layer) for layer in modules),
        "experts_per_layer": num_experts,
        "top_k": _first(config, TOP_K_KEYS),
        "hidden_size": int(config.hidden_size),
        "expert_intermediate_size": _first(config, EXPERT_SIZE_KEYS),
        "shared_experts": _shared_experts(config, model),
        "shared_expert_intermediate_size": _first(config, SHARED_SIZE_KEYS),
        "context_length": _first(config, ("max_position_embeddings",)),
        "vocab_size": _first(config, ("vocab_size",)),
        "parameters": {"backbone": total_params - expert_params, "experts": expert_params, "total": total_params},
        "bytes": {"backbone": stored["backbone_bytes"], "experts": stored["expert_bytes"],
                  "total": stored["backbone_bytes"] + stored["expert_bytes"]},
        "tensor_types": stored["types"],
        "quantization": _quantization(source, config),
        "held": None if held_experts is None and held_layers is None else {
            "layers": sorted(held_layers) if held_layers is not None else None,
            "experts": list(held_experts) if held_experts is not None else None},
        "split": split_suggestion(num_experts, workers, stored["expert_bytes"],
                                  len(held_experts) if held_experts is not None else num_experts),
    }


def split_suggestion(num_experts: int, workers: int, expert_bytes: int, stored_experts: int) -> dict:
    """An even contiguous split of the experts over `workers` workers, with each one's expert bytes.

    expert_bytes: routed-expert bytes stored in the file, which holds `stored_experts` experts
    per layer (all of them, or a slice file's).
    """
    from moeswarm.model.experts import split_experts

    workers = max(1, min(workers, num_experts))
    sets = split_experts(num_experts, workers)
    per_expert = expert_bytes / stored_experts if stored_experts else 0.0
    return {"workers": workers, "experts": [format_ids(s) for s in sets],
            "expert_bytes": [round(per_expert * len(s)) for s in sets]}


def _first(config, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _shared_experts(config, model) -> int:
    count = _first(config, SHARED_COUNT_KEYS)
    if count is not None:
        return count
    # qwen2_moe and kin: one shared expert, named by its size alone.
    return int(any("shared_expert" in name for name, _ in model.named_parameters()))


def _stored_tensors(source: ModelSource) -> dict:
    """Stored bytes of the routed experts and of the rest, and {tensor type: count}, from headers only."""
    types: Counter[str] = Counter()
    expert_bytes = backbone_bytes = 0
    for name, type_name, nbytes in _tensor_index(source):
        types[type_name] += 1
        if _is_routed(source.kind, name):
            expert_bytes += nbytes
        else:
            backbone_bytes += nbytes
    return {"expert_bytes": expert_bytes, "backbone_bytes": backbone_bytes, "types": dict(types.most_common())}


def _is_routed(kind: str, name: str) -> bool:
    if kind == "gguf":
        from moeswarm.gguf.gguf_slice import expert_layer  # blk.L.ffn_{gate,up,down}_exps; "_shexp" is shared

        return expert_layer(name) is not None
    return _ROUTED_HF_TENSOR.search(name) is not None


def _tensor_index(source: ModelSource):
    """(name, type name, stored bytes) of every tensor of the source, without reading its data."""
    if source.kind == "gguf":
        from moeswarm.gguf.gguf_file import type_name

        for tensor in source.file.reader.tensors:
            yield tensor.name, type_name(tensor.tensor_type), int(tensor.n_bytes)
        return
    from safetensors import safe_open

    for shard in source.shards:
        with safe_open(str(shard), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                view = handle.get_slice(key)
                dtype = view.get_dtype()
                yield key, dtype, _numel(view.get_shape()) * _DTYPE_BYTES.get(dtype, 1)


_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
                "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def _numel(shape) -> int:
    count = 1
    for n in shape:
        count *= int(n)
    return count


def _quantization(source: ModelSource, config) -> str | None:
    """The quantization scheme by name: a GGUF file's type (general.file_type), a directory's quant_method."""
    if source.kind == "gguf":
        from gguf import LlamaFileType

        file_type = source.file.metadata.get("general.file_type")
        try:
            return LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_") if file_type is not None else None
        except ValueError:
            return f"file type {file_type}"
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)
    return str(getattr(method, "value", method)) if method is not None else "quantized"


def summary_lines(info: dict) -> list[str]:
    """The summary for a terminal: one fact per line, with the `--experts` split to paste."""
    kind = "GGUF file" if info["kind"] == "gguf" else "model directory"
    moe = info["moe_layers"]
    shared = info["shared_experts"]
    shared_size = f" (intermediate size {info['shared_expert_intermediate_size']})" if shared and info["shared_expert_intermediate_size"] else ""
    types = ", ".join(f"{name} x{count}" for name, count in info["tensor_types"].items())
    params, sizes = info["parameters"], info["bytes"]
    lines = [
        f"{info['path']}: {info['family']} ({kind}), model {info['fingerprint']}",
        f"  layers              {info['layers']}, of which {len(moe)} MoE: {format_ids(moe)}",
        f"  experts per layer   {info['experts_per_layer']}, top-{info['top_k']}, expert intermediate size "
        f"{info['expert_intermediate_size']}",
        f"  shared experts      {shared}{shared_size}",
        f"  hidden size         {info['hidden_size']}, context length {info['context_length']}, vocabulary {info['vocab_size']}",
        f"  parameters          backbone {_count(params['backbone'])}, experts {_count(params['experts'])}, "
        f"total {_count(params['total'])}",
        f"  stored bytes        backbone {_bytes(sizes['backbone'])}, experts {_bytes(sizes['experts'])}, "
        f"total {_bytes(sizes['total'])}",
        f"  tensor types        {types}" + (f" (quantization {info['quantization']})" if info["quantization"] else ""),
    ]
    if info["held"] is not None:
        held = info["held"]
        lines.append(f"  slice file holds    experts {format_ids(held['experts'] or [])} of MoE layers "
                     f"{format_ids(held['layers'] or moe)}")
    split = info["split"]
    lines.append(f"  split over {split['workers']} workers:")
    lines += [f"    --experts {experts}  ({_bytes(size)} of experts)" for experts, size in zip(split["experts"], split["expert_bytes"])]
    return lines


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
