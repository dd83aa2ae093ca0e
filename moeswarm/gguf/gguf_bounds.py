"""A GGUF file's metadata checked against its bounds and against its own tensors, before any use.

The header walk (gguf_header.py) proves the file's structure: counts, dims, types, data ranges.
This proves what the loaders then trust, so that nothing sized from metadata is allocated, looped
over or handed to the C kernels unchecked:

- the hyperparameters that size a model (BOUNDS): integers (a per-layer list where allowed, as
  long as block_count), inside their bounds; every float hyperparameter finite;
- block_count: every `blk.N` tensor has N < block_count, and a whole model file (not a slice)
  has tensors for every layer (but the nextn_predict_layers last, which converters may drop): 4 bytes of metadata cannot make a 6-layer file a 100,000-layer model;
- routed experts: every stacked expert tensor holds exactly the experts the metadata says (ne[2]
  = expert_count in a whole file, the number of `moeswarm.expert_ids` in a slice); the slice's
  ids and layers distinct, ascending and inside expert_count and block_count;
- shapes: embedding_length equals token_embd's ne[0]; the head counts divide as attention needs;
- the tokenizer's lists of the right item types and lengths, its special token ids inside the
  vocabulary; every tensor of a type moeswarm can decode; every string value UTF-8 (the items
  of string lists, the vocabulary's ~450k at a 152k vocabulary, when they are read).

Each refusal is a ModelError of one line naming the file and the field.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from gguf import GGUFValueType

from moeswarm.errors import ModelError

if TYPE_CHECKING:
    from moeswarm.gguf.gguf_file import GGUFFile

MAX_BLOCKS = 256  # decoder layers (the largest MoE models have <100): bounds the skeleton's size and build time
MAX_EXPERTS = 4096  # routed experts per layer (the largest have 384-512)
MAX_WIDTH = 1 << 18  # hidden, intermediate and head sizes
MAX_HEADS = 1 << 12
MAX_VOCAB = 1 << 22
MAX_CONTEXT = 1 << 24
_INTEGER_TYPES = {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
                  GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64}
_FLOAT_TYPES = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}

# `{arch}.KEY`: (least, most, per-layer list allowed). Absent keys are not checked here.
BOUNDS: dict[str, tuple[int, int, bool]] = {
    "block_count": (1, MAX_BLOCKS, False),
    "expert_count": (1, MAX_EXPERTS, False),
    "expert_used_count": (1, MAX_EXPERTS, False),
    "expert_shared_count": (0, MAX_EXPERTS, False),
    "expert_group_count": (0, MAX_EXPERTS, False),
    "expert_group_used_count": (0, MAX_EXPERTS, False),
    "leading_dense_block_count": (0, MAX_BLOCKS, False),
    "nextn_predict_layers": (0, MAX_BLOCKS, False),
    "interleave_moe_layer_step": (0, MAX_BLOCKS, False),
    "embedding_length": (1, MAX_WIDTH, False),
    "context_length": (1, MAX_CONTEXT, False),
    "vocab_size": (1, MAX_VOCAB, False),
    "feed_forward_length": (0, MAX_WIDTH, True),
    "expert_feed_forward_length": (1, MAX_WIDTH, False),
    "expert_shared_feed_forward_length": (0, MAX_WIDTH, False),
    "attention.head_count": (0, MAX_HEADS, True),
    "attention.head_count_kv": (0, MAX_HEADS, True),
    "attention.key_length": (1, MAX_WIDTH, False),
    "attention.value_length": (1, MAX_WIDTH, False),
    "attention.key_length_mla": (1, MAX_WIDTH, False),
    "attention.value_length_mla": (1, MAX_WIDTH, False),
    "attention.kv_lora_rank": (0, MAX_WIDTH, False),
    "attention.q_lora_rank": (0, MAX_WIDTH, False),
    "attention.sliding_window": (0, MAX_CONTEXT, False),
    "rope.dimension_count": (0, MAX_WIDTH, False),
    "rope.scaling.original_context_length": (0, MAX_CONTEXT, False),
    "ssm.conv_kernel": (0, 1 << 10, False),
    "ssm.inner_size": (0, MAX_WIDTH, False),
    "ssm.state_size": (0, MAX_WIDTH, False),
    "ssm.time_step_rank": (0, MAX_WIDTH, False),
    "ssm.group_count": (0, MAX_HEADS, False),
}
_SPECIAL_TOKENS = ("bos", "eos", "padding", "unknown", "seperator", "cls", "mask", "eot", "eom")
_LAYER = re.compile(r"^blk\.(\d+)\.")
_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.(weight|bias)$")


def check_model(f: GGUFFile) -> None:
    """Refuse (ModelError, one line naming the field) a file whose metadata breaks its bounds or its tensors."""
    from moeswarm.gguf.gguf_dequant import check_supported

    for tensor in f.header.tensors:
        check_supported(f.path, tensor)
    for key, field in f.header.fields.items():
        if field.kind == GGUFValueType.STRING:
            f.metadata[key]  # noqa: B018: a string value that is not UTF-8 is refused now (list items: when read)
    arch = f.metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch or len(arch) > 64:
        raise ModelError(f"{f.path}: general.architecture is missing or not a short string")
    values = {key: _hyperparameter(f, f"{arch}.{key}", *bound) for key, bound in BOUNDS.items()
              if f"{arch}.{key}" in f.metadata}
    _check_floats(f, arch)
    blocks = values.get("block_count")
    if blocks is not None:
        _check_layers(f, arch, blocks, values)
    _check_experts(f, arch, values)
    _check_attention(f, arch, values)
    _check_tokenizer(f)


def _fail(f: GGUFFile, message: str) -> ModelError:
    return ModelError(f"{f.path}: {message}")


def _integer(f: GGUFFile, key: str, least: int, most: int, per_layer: bool = False) -> int | list[int]:
    field = f.header.fields[key]
    is_list = field.kind == GGUFValueType.ARRAY
    kind = field.item if is_list else field.kind
    if kind not in _INTEGER_TYPES or (is_list and not per_layer):
        raise _fail(f, f"{key} is not an integer{' or a list of integers' if per_layer else ''} "
                       f"(GGUF value type {field.kind}{f' of {field.item}' if is_list else ''})")
    value = f.metadata[key]
    for item in value if is_list else [value]:
        if not least <= item <= most:
            raise _fail(f, f"{key} = {item} is outside {least}-{most}")
    return value


def _hyperparameter(f: GGUFFile, key: str, least: int, most: int, per_layer: bool) -> int | list[int]:
    if per_layer and f.header.fields[key].kind == GGUFValueType.ARRAY and f.header.fields[key].count > MAX_BLOCKS:
        raise _fail(f, f"{key} lists {f.header.fields[key].count} layers (at most {MAX_BLOCKS})")
    return _integer(f, key, least, most, per_layer)


def _check_floats(f: GGUFFile, arch: str) -> None:
    for key, field in f.header.fields.items():
        if key.startswith(arch + ".") and (field.item if field.kind == GGUFValueType.ARRAY else field.kind) in _FLOAT_TYPES:
            value = f.metadata[key]
            if not all(math.isfinite(v) for v in (value if isinstance(value, list) else [value])):
                raise _fail(f, f"{key} is not finite ({value if not isinstance(value, list) else 'a list item'})")


def _check_layers(f: GGUFFile, arch: str, blocks: int, values: dict) -> None:
    """Tensors of layers below block_count only; a whole file has every layer's; per-layer lists as long."""
    layers = {int(m.group(1)) for name in f.tensors if (m := _LAYER.match(name))}
    if layers and max(layers) >= blocks:
        raise _fail(f, f"{arch}.block_count is {blocks} but the file has tensors of layer {max(layers)}")
    trunk = blocks - values.get("nextn_predict_layers", 0)  # a converter may drop the multi-token-prediction layers
    if not f.is_slice and not set(range(trunk)) <= layers:
        raise _fail(f, f"{arch}.block_count is {blocks} but the file has tensors for {len(layers)} layers")
    for key, value in values.items():
        if isinstance(value, list) and len(value) != blocks:
            raise _fail(f, f"{arch}.{key} lists {len(value)} layers, block_count is {blocks}")
    for key in ("leading_dense_block_count", "nextn_predict_layers"):
        if values.get(key, 0) >= blocks:
            raise _fail(f, f"{arch}.{key} = {values[key]} is not below block_count {blocks}")
    if f.is_slice and "moeswarm.layers" in f.metadata:
        held = _id_list(f, "moeswarm.layers", blocks)
        stored = {int(m.group(1)) for name in f.tensors if (m := _EXPERTS.match(name))}
        if not stored <= set(held):
            raise _fail(f, f"moeswarm.layers {held} lacks layers {sorted(stored - set(held))} whose experts the file holds")


def _id_list(f: GGUFFile, key: str, below: int) -> list[int]:
    """An array of distinct ascending ids, each below `below`."""
    field = f.header.fields[key]
    if field.kind != GGUFValueType.ARRAY or field.item not in _INTEGER_TYPES or not 1 <= field.count <= below:
        raise _fail(f, f"{key} is not a list of 1-{below} integers")
    ids = f.metadata[key]
    if ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= below:
        raise _fail(f, f"{key} is not distinct ascending ids below {below}")
    return ids


def _check_experts(f: GGUFFile, arch: str, values: dict) -> None:
    """Every stacked expert tensor holds the experts the metadata says it does."""
    count = values.get("expert_count")
    if count is not None and values.get("expert_used_count", 1) > count:
        raise _fail(f, f"{arch}.expert_used_count {values['expert_used_count']} exceeds expert_count {count}")
    if values.get("expert_group_used_count", 0) > values.get("expert_group_count", 0):
        raise _fail(f, f"{arch}.expert_group_used_count exceeds expert_group_count")
    stacked = [t for name, t in f.tensors.items() if _EXPERTS.match(name)]
    if not stacked:
        return
    if count is None:
        raise _fail(f, f"the file has stacked expert tensors but no {arch}.expert_count")
    stored = count
    if f.is_slice:
        if "moeswarm.expert_ids" not in f.header.fields:
            raise _fail(f, "the slice holds expert tensors but no moeswarm.expert_ids")
        ids = _id_list(f, "moeswarm.expert_ids", count)
        if "moeswarm.expert_first" in f.metadata and f.metadata["moeswarm.expert_first"] != ids[0]:
            raise _fail(f, f"moeswarm.expert_first is not the first of moeswarm.expert_ids ({ids[0]})")
        stored = len(ids)
    for tensor in stacked:
        ne = [int(n) for n in tensor.shape]
        axis = 1 if tensor.name.endswith(".bias") else 2
        if len(ne) != axis + 1 or ne[axis] != stored:
            raise _fail(f, f"tensor {tensor.name} has ne {ne}: its experts dimension (ne[{axis}]) must be {stored}, "
                           f"the {'slice' if f.is_slice else 'model'}'s number of experts"
                           f"{'' if f.is_slice else f' ({arch}.expert_count)'}")


def _check_attention(f: GGUFFile, arch: str, values: dict) -> None:
    heads, kv = values.get("attention.head_count"), values.get("attention.head_count_kv")
    if heads is None:
        return
    heads_list = heads if isinstance(heads, list) else None
    most = max(heads) if heads_list else heads
    if most < 1:
        raise _fail(f, f"{arch}.attention.head_count is 0")
    hidden = values.get("embedding_length")
    if hidden is not None and "attention.key_length" not in values and hidden % most:
        raise _fail(f, f"{arch}.embedding_length {hidden} is not a multiple of attention.head_count {most}")
    if kv is not None:
        pairs = zip(heads_list or [heads] * (len(kv) if isinstance(kv, list) else 1), kv if isinstance(kv, list) else [kv])
        for h, k in pairs:
            if (k == 0 and not isinstance(kv, list)) or (k and (h % k if h else k > most)):
                raise _fail(f, f"{arch}.attention.head_count_kv {k} does not divide attention.head_count {h or most}")
    if hidden is not None and "token_embd.weight" in f.tensors:
        width = int(f.tensors["token_embd.weight"].shape[0])
        if width != hidden:
            raise _fail(f, f"{arch}.embedding_length is {hidden} but token_embd.weight rows hold {width} values")


def _check_tokenizer(f: GGUFFile) -> None:
    fields = f.header.fields
    for key, item in (("tokenizer.ggml.tokens", GGUFValueType.STRING), ("tokenizer.ggml.merges", GGUFValueType.STRING),
                      ("tokenizer.ggml.token_type", None), ("tokenizer.ggml.scores", None)):
        if key in fields:
            field = fields[key]
            ok = field.kind == GGUFValueType.ARRAY and (field.item == item if item is not None
                                                        else field.item in _INTEGER_TYPES | _FLOAT_TYPES)
            if not ok or field.count > MAX_VOCAB * 4:
                raise _fail(f, f"{key} is not a list of {'strings' if item else 'numbers'} (at most {MAX_VOCAB * 4})")
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is not None and "tokenizer.ggml.token_type" in fields and fields["tokenizer.ggml.token_type"].count != tokens.count:
        raise _fail(f, f"tokenizer.ggml.token_type has {fields['tokenizer.ggml.token_type'].count} items, "
                       f"tokenizer.ggml.tokens {tokens.count}")
    if "tokenizer.ggml.model" in fields and fields["tokenizer.ggml.model"].kind != GGUFValueType.STRING:
        raise _fail(f, "tokenizer.ggml.model is not a string")
    vocab = int(f.tensors["token_embd.weight"].shape[1]) if "token_embd.weight" in f.tensors else (
        tokens.count if tokens is not None else None)
    for name in _SPECIAL_TOKENS:
        key = f"tokenizer.ggml.{name}_token_id"
        if key in fields:
            token = _integer(f, key, 0, MAX_VOCAB)
            if vocab is not None and token >= vocab:
                raise _fail(f, f"{key} {token} is outside the vocabulary of {vocab}")
