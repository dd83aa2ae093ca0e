"""One forward for many sequences: their tokens packed in one row, each attending to its own cache.

A step of the engine feeds every active sequence a few tokens (a prompt chunk, or its last token
and its drafts, or several alternative draft rows). Here they go through the model as ONE packed
row of T tokens: every weight (attention projections, routers, shared experts, the output head)
is read once per step, and each MoE layer makes one expert call for all T rows. Only attention
itself is per sequence: each segment's queries attend to that sequence's own keys and values
(`SequenceCache`), with the mask the sequence would have alone, through the model's own attention
function (sdpa or its eager one). Position ids are each sequence's own positions.

How it rides in transformers: the model is switched to the attention implementation registered
here (`install`), which falls through to the original one for any ordinary forward; the packed
forward passes a `RaggedCache` as past_key_values (its `update` files each segment's new keys and
values in that sequence's cache) and the segment layout as the attention mask, which the model's
mask building hands back untouched (`ragged_mask`).

Multi-head latent attention (DeepSeek V2/V3, GLM-4.7-Flash) caches a latent and expands it
into keys and values after the cache, in the module (`expand_kv`). For those layers `update` files
the new latents, then returns every segment's whole context packed one after the other, and the
attention takes each segment's part from where its context lies in the packed run
(`Layout.contexts`). Where it costs less the module passes them on unexpanded and the attention
runs absorbed (forward/latent.py); else the module expands them all at once, and a segment
alone gets its cache's own tensor back: the very expansion an ordinary forward makes.

Legend: T = tokens of the step (all segments), n = one segment's tokens, p = its cached positions,
H = key/value heads, D = head size, V = vocabulary.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from moeswarm.forward import latent
from moeswarm.forward.sequence_cache import SequenceCache
from moeswarm.model.attention_threads import is_sdpa, sdpa_one_thread

RAGGED = "moeswarm_ragged"
_INNER = "_moeswarm_inner_attention"
JOURNAL = "_moeswarm_journal"  # set on a gateway's model: the journal its sequence caches record in  # set on each config: the implementation a plain forward keeps using
KV_DTYPE = "_moeswarm_kv_dtype"  # set on a model (set_kv_cache): the dtype its packed forwards' caches keep
KV_CACHES = {"model": None, "f16": torch.float16}  # --kv-cache: None keeps keys and values in the model's dtype
_LAYER_TYPES = {"full_attention", "sliding_attention"}
_LATENT = "kv_lora_rank"  # an attention module with this caches a latent it expands after the cache
_LATENT_LAYERS = "_moeswarm_latent_layers"  # set on a model: its latent attention layers, found once


@dataclass(frozen=True)
class Segment:
    """One row of one sequence in the packed step: tokens [start, end) of the packed row."""

    cache: SequenceCache
    row: int | None  # the branch these tokens extend (None: the committed context)
    start: int
    end: int
    past: int  # positions before this segment's first token


class Layout:
    """The step's segments, handed to every layer as its prepared attention mask (through the
    model's mask building, which hands it back: `ragged_mask`)."""

    ndim = 1  # not a 2D padding mask, to transformers' mask preprocessing

    def __init__(self, segments: list[Segment], shapes: dict[int, latent.Shape | None] | None = None):
        """shapes: the layers whose attention caches a latent, with their sizes where they may run
        absorbed (`latent_layers`)."""
        self.segments = segments
        self.latent = shapes or {}
        self.contexts: dict[int, list[tuple[int, int]]] = {}  # latent layer -> per segment (start, length) in the packed run
        self._masks: dict[tuple, torch.Tensor | None] = {}

    def mask(self, segment: Segment, window: int | None, dtype: torch.dtype, sdpa: bool) -> torch.Tensor | None:
        """The additive mask [1, 1, n, p + n] segment's queries get alone (None where none is needed:
        one query within the window, or a whole causal prompt on sdpa, which then uses is_causal)."""
        n, p = segment.end - segment.start, segment.past
        if n == 1 and (window is None or p + 1 <= window):
            return None
        if p == 0 and window is None and sdpa:
            return None
        key = (n, p, window, dtype)
        if key not in self._masks:
            query_pos = torch.arange(p, p + n)[:, None]  # [n, 1]
            key_pos = torch.arange(p + n)[None, :]  # [1, p + n]
            allowed = key_pos <= query_pos
            if window is not None:
                allowed &= query_pos - key_pos < window
            blocked = torch.zeros(n, p + n, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
            self._masks[key] = blocked[None, None]  # [1, 1, n, p + n]
        return self._masks[key]


class RaggedCache:
    """The past_key_values of a packed forward: files each segment's new keys and values in its cache."""

    is_compileable = False

    def __init__(self, layout: Layout):
        self.layout = layout

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states, value_states [1, H, T, D]: returned as they are (the attention reads each
        sequence's cache). At a latent layer ([1, 1, T, r] latents): every segment's whole context,
        packed one after the other ([1, 1, sum(p + n), r]) in the model's dtype, for the module to
        expand or, marked, to pass on unexpanded; where each one lies goes in the layout."""
        segments = self.layout.segments
        for segment in segments:
            segment.cache.append(layer_idx, key_states[:, :, segment.start : segment.end],
                                 value_states[:, :, segment.start : segment.end], segment.row)
        if layer_idx not in self.layout.latent:
            return key_states, value_states
        contexts = [segment.cache.view(layer_idx, segment.row) for segment in segments]  # ([1, 1, p + n, r*] x2)
        lengths = [keys.shape[2] for keys, _ in contexts]
        starts = itertools.accumulate(lengths, initial=0)
        self.layout.contexts[layer_idx] = [(start, length) for start, length in zip(starts, lengths)]
        if len(contexts) == 1:
            latents, rotary = contexts[0]
        else:
            latents, rotary = (torch.cat(parts, dim=2) for parts in zip(*contexts))
        latents, rotary = latents.to(key_states.dtype), rotary.to(value_states.dtype)  # a float16 cache widens here
        shape = self.layout.latent[layer_idx]
        pairs = sum((s.end - s.start) * length for s, length in zip(segments, lengths))
        if shape is not None and shape.absorbs_cheaper(key_states.shape[2], sum(lengths), pairs):
            latent.pass_latents(latents)  # the module passes them on unexpanded (forward/latent.py)
        return latents, rotary

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come as position_ids; nothing may derive them from here

    def get_query_offset(self, layer_idx: int | None = None) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int | None = None) -> tuple[int, int]:
        return query_length, 0  # only sizes a mask that `ragged_mask` replaces by the layout


def _inner_attention(module: torch.nn.Module):
    name = getattr(module.config, _INNER, "sdpa")
    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def ragged_attention(module, query, key, value, attention_mask, **kwargs):
    """The registered attention: per segment through the model's own attention when handed a Layout;
    an ordinary forward goes straight to that attention. query [1, Hq, T, D]; returns [1, T, Hq, Dv]."""
    inner = _inner_attention(module)
    if not isinstance(attention_mask, Layout):
        return inner(module, query, key, value, attention_mask, **kwargs)
    layout, layer = attention_mask, module.layer_idx
    window = kwargs.get("sliding_window")
    sdpa = is_sdpa(inner)
    outputs = []
    contexts = layout.contexts.get(layer)  # a latent layer's: key, value [1, H, sum(p + n), D] expanded from them
    if contexts is not None and latent.passed(key):
        return _absorbed(module, query, key, value, layout, contexts, inner, window, **kwargs)
    cached = layout.segments[0].cache.keys[layer]  # [1, H, capacity, D]
    if contexts is None and (key.shape[1] != cached.shape[1] or key.shape[-1] != cached.shape[-1]):
        raise ValueError(f"{type(module).__name__} attends to other keys than it caches: it cannot be packed")
    for i, segment in enumerate(layout.segments):
        if contexts is not None:
            start, length = contexts[i]
            keys, values = key[:, :, start : start + length], value[:, :, start : start + length]  # [1, H, p + n, D]
        else:
            keys, values = segment.cache.view(layer, segment.row)  # [1, H, p + n, D]
        if keys.dtype != query.dtype and inner is not sdpa_one_thread:  # a float16 cache (sequence_cache.py)
            keys, values = keys.to(query.dtype), values.to(query.dtype)  # only the C one-query call reads it as it is
        mask = layout.mask(segment, window, query.dtype, sdpa)
        out, _ = inner(module, query[:, :, segment.start : segment.end], keys, values, mask, **kwargs)
        outputs.append(out)  # [1, n, Hq, Dv]
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


def _absorbed(module, query, latents, rotary, layout: Layout, contexts, inner, window, **kwargs):
    """A latent layer's attention, absorbed (forward/latent.py): query [1, H, T, nope + rope],
    latents [1, 1, sum(p + n), r] and rotary [1, 1, sum(p + n), rope] as the cache packed them;
    returns [1, T, H, v]."""
    absorbed = latent.query(module, query)  # [1, H, T, r + rope]
    keys = latent.keys(latents, rotary)  # [1, 1, sum(p + n), r + rope]: one key head, every query head's
    outputs = []
    for segment, (start, length) in zip(layout.segments, contexts):
        seen = slice(start, start + length)
        mask = layout.mask(segment, window, query.dtype, sdpa=False)  # [1, 1, n, p + n], or None: one query
        out = latent.attend(module, inner, absorbed[:, :, segment.start : segment.end], keys[:, :, seen],
                            latents[:, :, seen], mask, **kwargs)
        outputs.append(out)  # [1, n, H, r]
    return latent.output(module, outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


def ragged_mask(*args, config=None, **kwargs):
    """A packed forward's mask is its layout; an ordinary forward's, the one its own attention
    implementation builds."""
    if isinstance(kwargs.get("attention_mask"), Layout):
        return kwargs["attention_mask"]
    return ALL_MASK_ATTENTION_FUNCTIONS[getattr(config, _INNER, "sdpa")](*args, config=config, **kwargs)


AttentionInterface.register(RAGGED, ragged_attention)
AttentionMaskInterface.register(RAGGED, ragged_mask)


def supports_ragged(model: PreTrainedModel) -> bool:
    """Whether packed forwards fit `model`: every layer is plain or sliding-window attention through
    transformers' attention interface (recurrent and linear-attention layers keep a state packing
    cannot hold)."""
    config = model.config.get_text_config()
    if not set(getattr(config, "layer_types", None) or ["full_attention"]) <= _LAYER_TYPES:
        return False
    attentions = [m for m in model.modules() if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention")]
    chained = any(getattr(m, "takes_layout", False) for m in model.modules())  # layers held by stages (stages/)
    return bool(attentions or chained) and all(_through_the_interface(type(m)) for m in attentions) \
        and not any(_keeps_other_state(type(m)) for m in model.modules())


def keeps_recurrent_state(model: PreTrainedModel) -> bool:
    """Whether some of `model`'s layers carry a recurrent state (linear attention, Mamba, short
    convolutions): a state folded over every token so far, which cannot be cut back to an earlier
    length, so rejected drafts could not be taken back (drafts are off on such models)."""
    config = model.config.get_text_config()
    kinds = set(getattr(config, "layer_types", None) or []) | set(getattr(config, "layers_block_type", None) or [])
    return bool(kinds - _LAYER_TYPES - {"attention", "moe", "mlp", "dense"})


def latent_layers(model: PreTrainedModel) -> dict[int, latent.Shape | None]:
    """{layer: its sizes where it may run absorbed, else None} for the layers of `model` whose
    attention caches a latent (multi-head latent attention), found once."""
    found = getattr(model, _LATENT_LAYERS, None)
    if found is None:
        found = {m.layer_idx: latent.shape_of(m) for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, _LATENT)}
        setattr(model, _LATENT_LAYERS, found)
    return found


@functools.cache
def _keeps_other_state(module: type) -> bool:
    """Whether a module class files state of its own in the cache (a sparse attention's indexer
    keys: DeepSeek V3.2), which a packed forward's cache does not hold."""
    forward = getattr(module, "forward", None)
    try:
        return forward is not None and "past_key_values.update_" in inspect.getsource(forward)
    except (OSError, TypeError):  # no source (a C or generated class): nothing of the kind
        return False


@functools.cache
def _through_the_interface(attention: type) -> bool:
    """Whether an attention class calls transformers' attention interface (its source read once:
    `generate` builds an engine per call)."""
    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(attention.forward)


def install(model: PreTrainedModel) -> None:
    """Switch `model` to the ragged attention (ordinary forwards still use the one it had). Its
    latent layers are made ready to run absorbed whatever its config says: a config shared with a
    model installed before says RAGGED already, and that model's modules are not this one's."""
    if model.config._attn_implementation != RAGGED:
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and not hasattr(config, _INNER):
                setattr(config, _INNER, config._attn_implementation or "sdpa")
        model.set_attn_implementation(RAGGED)
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, _LATENT) and latent.absorbs(module):
            latent.install(module)


def set_kv_cache(model: PreTrainedModel, name: str) -> None:
    """Keep the keys and values of `model`'s packed forwards as `name` says (KV_CACHES; sequence_cache.py)."""
    if name not in KV_CACHES:
        raise ValueError(f"--kv-cache {name!r}: one of {', '.join(KV_CACHES)}")
    setattr(model, KV_DTYPE, KV_CACHES[name])


def kv_dtype(model: PreTrainedModel) -> torch.dtype | None:
    """The dtype `model`'s sequence caches keep (None: the model's own)."""
    return getattr(model, KV_DTYPE, None)


def kv_cache_name(model: PreTrainedModel) -> str:
    """`model`'s --kv-cache choice (a stage says it at HELLO: its gateway must keep its own cache alike)."""
    return next(name for name, dtype in KV_CACHES.items() if dtype == kv_dtype(model))


@dataclass
class Item:
    """One sequence's part of a packed forward."""

    cache: SequenceCache
    feed: list[int] | list[list[int]]  # tokens, or B rows of n tokens (branches)
    keep: str = "all"  # which logits come back: "all" rows, the "last" row (a prompt chunk)


@functools.cache
def _takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


@torch.inference_mode()
def forward_packed(model: PreTrainedModel, items: list[Item]) -> list[torch.Tensor]:
    """Every item's logits, in float32, from one forward: [n, V] for a token list (or [1, V] with
    keep "last"), [B, n, V] for B rows."""
    segments, ids, kept = [], [], []
    for item in items:
        rows = item.feed if item.feed and isinstance(item.feed[0], list) else None
        past = item.cache.length
        if rows is None:
            if item.cache.pending:
                raise ValueError("the cache holds branches: keep one first")
            tokens = item.feed
            segments.append(Segment(item.cache, None, len(ids), len(ids) + len(tokens), past))
            ids += tokens
            kept += list(range(len(ids) - (1 if item.keep == "last" else len(tokens)), len(ids)))
        else:
            if item.cache.rows not in (1, len(rows)):
                raise ValueError(f"cannot feed {len(rows)} branches to a cache of {item.cache.rows}")
            grown = item.cache.pending_length
            item.cache.rows = len(rows)
            for row, tokens in enumerate(rows):
                segments.append(Segment(item.cache, row, len(ids), len(ids) + len(tokens), past + grown))
                ids += tokens
                kept += range(len(ids) - len(tokens), len(ids))
    positions = [segment.past + i for segment in segments for i in range(segment.end - segment.start)]
    layout = Layout(segments, latent_layers(model))
    options = {}
    if _takes_logits_to_keep(type(model)) and len(kept) < len(ids):
        options["logits_to_keep"] = torch.tensor(kept, dtype=torch.long)
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), position_ids=torch.tensor([positions]),
                past_key_values=RaggedCache(layout), attention_mask=layout, use_cache=True, **options)
    logits = out.logits[0].float()  # [K, V]: the kept rows, in packed order
    if "logits_to_keep" not in options and len(kept) < len(ids):
        logits = logits[kept]
    results, at = [], 0
    for item in items:
        rows = item.feed if item.feed and isinstance(item.feed[0], list) else None
        if rows is None:
            count = 1 if item.keep == "last" else len(item.feed)
            results.append(logits[at : at + count])  # [n, V]
        else:
            count = sum(len(r) for r in rows)
            results.append(logits[at : at + count].reshape(len(rows), len(rows[0]), -1))  # [B, n, V]
        at += count
    return results


class PackedStepper:
    """A model and one sequence's cache, with Stepper's interface (forward/stepper.py), over packed
    forwards: a forward of one sequence alone takes the same path as a step of many, so the engine
    and a drafter share one cache."""

    branchable = True  # branch rows keep their entries aside: any attention layer can branch

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.journal = getattr(model, JOURNAL, None)  # a gateway's: its stages mirror every cache (stages/)
        self.dtype = kv_dtype(model)
        self._cache = SequenceCache(self.journal, self.dtype)

    @property
    def cache(self) -> SequenceCache:
        return self._cache

    @cache.setter
    def cache(self, cache: SequenceCache | None) -> None:
        self._cache = cache if cache is not None else SequenceCache(self.journal, self.dtype)  # None: afresh, as Stepper

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def rows(self) -> int:
        return self.cache.rows

    def forward(self, tokens: list[int], last_only: bool = False) -> torch.Tensor:
        """Logits [n, V] (float32) of `tokens` fed after the cache; [1, V] with last_only."""
        return forward_packed(self.model, [Item(self.cache, tokens, "last" if last_only else "all")])[0]

    def forward_rows(self, rows: list[list[int]]) -> torch.Tensor:
        """B rows of n tokens as B branches after the cache: logits [B, n, V]."""
        return forward_packed(self.model, [Item(self.cache, rows)])[0]

    def keep_row(self, row: int) -> None:
        if self.cache.pending or self.cache.rows > 1:
            self.cache.keep_row(row)

    def crop(self, length: int) -> None:
        self.cache.crop(length)
