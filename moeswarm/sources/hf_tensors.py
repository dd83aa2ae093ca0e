"""Handing chosen safetensors tensors of a model directory to transformers' own loader.

transformers' key renaming and conversion (per-expert checkpoints stacked into the fused
`gate_up_proj`/`down_proj` parameters, mixtral's `w1/w3/w2` renamed...) run unchanged, so every
family loads the way transformers loads it. What differs is which tensors are handed over: a
`keep` test on the renamed target, and a `select` that may rename a key or narrow a tensor to
some rows (`Rows`) before anything is read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    convert_and_load_state_dict_in_model,
    rename_source_key,
)
from transformers.modeling_utils import LoadStateDictConfig

from moeswarm.errors import ModelError

Select = Callable[[str, object], "tuple[str, object] | None"]  # (key, lazy slice) -> (key, slice) or None to skip


def load_tensors(model: PreTrainedModel, tensors: dict[str, object], where: object, keep: Callable[[str], bool],
                 select: Select | None = None) -> None:
    """Load the checkpoint tensors whose renamed target passes `keep` into `model`.

    tensors: {checkpoint key: lazy safetensors slice}; where: the directory, for error messages.
    """
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    meta_state = model.state_dict()
    chosen = {}
    for key, tensor in tensors.items():
        target, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_state)
        if not keep(target):
            continue
        picked = (key, tensor) if select is None else select(key, tensor)
        if picked is not None:
            chosen[picked[0]] = picked[1]
    info, _ = convert_and_load_state_dict_in_model(model, chosen, LoadStateDictConfig(weight_mapping=mapping))
    if info.mismatched_keys or info.conversion_errors:
        raise ModelError(
            f"{where}: tensors do not fit the model: "
            f"{sorted(info.mismatched_keys)[:5] or list(info.conversion_errors.items())[:3]}"
        )


class Rows:
    """A lazy safetensors slice narrowed to some rows of its first axis, read one contiguous run at a time."""

    def __init__(self, tensor, runs: Sequence[range]):
        self._tensor, self._runs = tensor, list(runs)

    def __getitem__(self, item) -> torch.Tensor:
        parts = [self._tensor[run.start : run.stop] for run in self._runs]  # each [len(run), ...]
        return parts[0] if len(parts) == 1 else torch.cat(parts)  # [sum of lens, ...]

    def get_shape(self) -> list[int]:
        return [sum(len(run) for run in self._runs), *self._tensor.get_shape()[1:]]

    def get_dtype(self):
        return self._tensor.get_dtype()
