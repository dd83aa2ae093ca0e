"""A model's routing profile made from calibration prompts (calibrate.py counts, placement/profile.py
holds the counts): what `moeswarm profile` writes for `--local-experts N|P% --profile FILE`.

The whole model runs here, in this process; threads are the caller's to set.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moeswarm.bundled import PROMPTS, demo_model
from moeswarm.errors import MoeSwarmError
from moeswarm.placement.calibrate import count_routing, read_prompts
from moeswarm.model.experts import num_experts_in_config
from moeswarm.sources.loading import load_local
from moeswarm.sources.source import open_source
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm.placement.profile import RoutingStats


@dataclass(frozen=True)
class ProfileWritten:
    path: str
    prompts: int
    tokens: int  # fed, over every prompt
    moe_layers: int


def write_routing_profile(output: str, model: str | Path | None = None, prompts: str | Path | None = None,
                          max_tokens: int = 256, before_load: Callable[[], None] = lambda: None) -> ProfileWritten:
    """Count the routing of `model` (None: the bundled one) over `prompts` (None: the bundled prompts),
    each cut to `max_tokens` (and to the model's positions), and write the profile to `output`.
    before_load(): once the prompts are read, before the model loads (the caller's process settings)."""
    source = open_source(model or demo_model())
    if prompts is None and not PROMPTS.is_file():
        raise MoeSwarmError(f"no bundled prompts at {PROMPTS}: give --prompts FILE")
    texts = read_prompts(prompts or PROMPTS)
    if not texts:
        raise MoeSwarmError(f"{prompts}: no prompts in it")
    config = source.config
    codec = load_text_codec(source, config.vocab_size)
    limit = min(max_tokens, getattr(config, "max_position_embeddings", None) or max_tokens)
    encoded = [codec.encode(text)[:limit] for text in texts]
    before_load()
    stats = RoutingStats(num_experts_in_config(config), source.fingerprint, config.model_type)
    count_routing(load_local(source), encoded, stats)
    try:
        with open(output, "w") as out:
            json.dump(stats.to_json(), out)
    except OSError as error:
        raise MoeSwarmError(f"cannot write {output}: {error.strerror or error}") from None
    return ProfileWritten(output, len(encoded), sum(len(p) for p in encoded), len(stats.layers))
