"""The model a `moeswarm bench swarm` run seeds: its file, its facts for the report, and the reference
every segment of the stream must equal (the segment decoded with every expert in this process)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from moeswarm.errors import MoeSwarmError
from moeswarm_bench.bench.swarm_settings import Settings
from moeswarm_bench.bench.swarm_stream import segment_tokens, stream_prompt


def model_path(model: str, work: Path) -> tuple[Path, str]:
    """(the GGUF file the swarm serves, its name in the report). The bundled model is copied into
    `work` (the invite writes its manifest beside the file)."""
    if model == "bundled":
        from moeswarm.bundled import PYMOE

        source = PYMOE / "gguf" / "pymoe-Q4_K_M.gguf"
        if not source.is_file():
            raise MoeSwarmError(f"the bundled model's GGUF file is missing ({source})")
        copy = work / source.name
        shutil.copy(source, copy)
        return copy, "bundled pymoe-Q4_K_M.gguf"
    if model == "olmoe":
        from moeswarm_bench.bench.real_build import DEFAULT_CACHE, model_file
        from moeswarm_bench.bench.real_shapes import SHAPES

        return model_file(SHAPES["olmoe"], DEFAULT_CACHE), "OLMoE-1B-7B-shaped Q4_K_M (random weights, `bench real`'s file)"
    path = Path(model)
    if not path.is_file() or path.suffix.lower() != ".gguf":
        raise MoeSwarmError(f"--model {model}: give bundled, olmoe or a GGUF file (an invite seeds a GGUF file)")
    return path, path.name


def model_facts(path: Path) -> dict:
    manifest = manifest_of(path)
    return {"path": str(path), "file_bytes": path.stat().st_size, "experts": len(manifest.data["expert_ids"]),
            "moe_layers": len(manifest.moe_layers()), "expert_bytes": manifest.expert_bytes()}


def manifest_of(path: Path):
    from moeswarm.slices.manifest import load_manifest

    return load_manifest(Path(f"{path}.manifest.json"))


@dataclass(frozen=True)
class Reference:
    prompt: list[int]
    tokens: list[int]
    model: object | None  # the local eager model, with --check-local


def make_reference(path: Path, settings: Settings, say) -> Reference:
    """The stream's segment decoded with every expert in this process: what every segment must equal."""
    from moeswarm.engine.generate import generate
    from moeswarm.sources.source import open_source
    from moeswarm.swarm import open_swarm

    source = open_source(str(path))
    prompt = stream_prompt(source.config.vocab_size)
    tokens = segment_tokens(getattr(source.config, "max_position_embeddings", None), len(prompt), settings.segment_tokens)
    say(f"reference: {tokens} tokens decoded locally")
    with open_swarm(source, []) as local:
        reference = generate(local, prompt, tokens)
    eager = None
    if settings.check_local:
        from moeswarm.sources.loading import load_local

        eager = load_local(source)
    return Reference(prompt, list(reference.tokens), eager)
