"""The experts a backbone holds itself (`--local-experts`): N per layer or a fraction of each layer's,
the hottest by a routing profile (`moeswarm profile` writes one); or a JSON file {"layer": [experts]}.
Checked against the model (its MoE layers and experts) before the backbone loads.
"""

from __future__ import annotations

from pathlib import Path

from moeswarm.errors import MoeSwarmError
from moeswarm.model.experts import experts_modules, num_experts_in_config
from moeswarm.sources.loading import empty_model
from moeswarm.sources.source import ModelSource
from moeswarm.placement.profile import check_held, hot_sets, is_profile, parse_held, read_json, read_profile

SHIPPED_PROFILE = "routing_profile.json"  # a model directory's own routing profile (the bundled model has one)


def held_experts(source: ModelSource, count: int | None = None, fraction: float | None = None, path: str | None = None,
                 profile: str | None = None) -> dict[int, tuple[int, ...]] | None:
    """{layer: experts} to hold locally, or None when every list is empty.

    count experts per layer, or fraction of each layer's, ranked by `profile` (None: the profile
    shipped beside the model, when it profiles this very model); or `path`, the file naming them.
    """
    if path is None and profile is None:
        profile = shipped_profile(source)
    num_experts = num_experts_in_config(source.config)
    layers = list(experts_modules(empty_model(source)))
    if path is not None:
        if profile is not None:
            raise MoeSwarmError("--local-experts FILE names the experts itself: drop --profile")
        data = read_json(path)
        if is_profile(data):
            raise MoeSwarmError(f"--local-experts: {path} is a routing profile: say how many experts to hold, "
                                f"--local-experts N or P% --profile {path}")
        held = parse_held(data, path)
    else:
        if profile is None:
            raise MoeSwarmError("--local-experts N|P% holds each layer's hottest experts: give a routing profile, "
                                "--profile PROFILE.json (make one with: moeswarm profile --model M -o PROFILE.json)")
        stats = read_profile(profile)
        if stats.num_experts != num_experts:
            raise MoeSwarmError(f"{profile}: a profile of a model with {stats.num_experts} experts per layer, "
                                f"this one has {num_experts}")
        if count is not None and count > num_experts:
            raise MoeSwarmError(f"--local-experts {count}: the model has {num_experts} experts per layer")
        held = hot_sets(stats, layers, count if count is not None else fraction)
    check_held(held, layers, num_experts)  # before the backbone loads
    return {layer: experts for layer, experts in held.items() if experts} or None


def shipped_profile(source: ModelSource) -> str | None:
    """The routing profile shipped beside the model (DIR/routing_profile.json, or FILE.routing_profile.json
    beside a GGUF file) when it is a profile of this very model; else None."""
    path = Path(source.path)
    shipped = path / SHIPPED_PROFILE if path.is_dir() else path.with_name(f"{path.stem}.{SHIPPED_PROFILE}")
    if shipped.is_file() and getattr(read_json(shipped), "get", lambda _: None)("model") == source.fingerprint:
        return str(shipped)
    return None
