"""`--local-experts N|P%|FILE` and `--profile FILE`: which experts the backbone holds itself.

N experts per layer, or P % of each layer's experts, the hottest by a routing profile (`moeswarm
profile` writes one); or FILE, a JSON object {"layer": [experts]}. Parsing here imports no torch;
`resolve` reads the files and the model's layers once the command runs.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LocalExpertsSpec:
    count: int | None = None  # experts per layer
    fraction: float | None = None  # of each layer's experts
    path: str | None = None  # {"layer": [experts]}


def local_experts_spec(text: str) -> LocalExpertsSpec:
    if text.isdigit():
        return LocalExpertsSpec(count=int(text))
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            percent = float("nan")
        if not 0 <= percent <= 100:  # nan fails too
            raise argparse.ArgumentTypeError(f"bad percentage {text!r}: expected 0% to 100% of each layer's experts")
        return LocalExpertsSpec(fraction=percent / 100)
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count N, a percentage P% nor an existing file")
    return LocalExpertsSpec(path=text)


def add_local_experts(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local-experts", type=local_experts_spec, default=None, metavar="N|P%|FILE",
                        help="hold experts in this process, no round trip for them: N per layer or P%% of each layer's, "
                             "the hottest by --profile; or FILE, a JSON object {\"layer\": [experts]}")
    parser.add_argument("--profile", default=None, metavar="PROFILE.json",
                        help="the routing profile that ranks the experts for --local-experts N|P%% (moeswarm profile)")


SHIPPED_PROFILE = "routing_profile.json"  # a model directory's own routing profile (the bundled model has one)


def use_shipped_profile(args: argparse.Namespace, source) -> None:
    """--local-experts N|P% without --profile: the profile shipped beside the model (DIR/routing_profile.json,
    or FILE.routing_profile.json beside a GGUF file) when it is a profile of this very model."""
    from pathlib import Path

    from moeswarm.placement.profile import read_json

    spec = args.local_experts
    if spec is None or spec.path is not None or args.profile is not None:
        return
    path = Path(source.path)
    shipped = path / SHIPPED_PROFILE if path.is_dir() else path.with_name(f"{path.stem}.{SHIPPED_PROFILE}")
    if shipped.is_file() and getattr(read_json(shipped), "get", lambda _: None)("model") == source.fingerprint:
        args.profile = str(shipped)


def resolve(args: argparse.Namespace, source) -> dict[int, tuple[int, ...]] | None:
    """{layer: experts} to hold locally, or None: checked against the model (layers, experts)."""
    from moeswarm.errors import MoeSwarmError
    from moeswarm.model.experts import experts_modules, num_experts_in_config
    from moeswarm.model.loading import empty_model
    from moeswarm.placement.profile import check_held, hot_sets, is_profile, parse_held, read_json, read_profile

    spec: LocalExpertsSpec | None = args.local_experts
    if spec is None:
        if args.profile is not None:
            raise MoeSwarmError("--profile ranks experts for --local-experts N|P%: give --local-experts too")
        return None
    use_shipped_profile(args, source)
    num_experts = num_experts_in_config(source.config)
    layers = list(experts_modules(empty_model(source)))
    if spec.path is not None:
        if args.profile is not None:
            raise MoeSwarmError("--local-experts FILE names the experts itself: drop --profile")
        data = read_json(spec.path)
        if is_profile(data):
            raise MoeSwarmError(f"--local-experts: {spec.path} is a routing profile: say how many experts to hold, "
                                f"--local-experts N or P% --profile {spec.path}")
        held = parse_held(data, spec.path)
    else:
        if args.profile is None:
            raise MoeSwarmError("--local-experts N|P% holds each layer's hottest experts: give a routing profile, "
                                "--profile PROFILE.json (make one with: moeswarm profile --model M -o PROFILE.json)")
        stats = read_profile(args.profile)
        if stats.num_experts != num_experts:
            raise MoeSwarmError(f"{args.profile}: a profile of a model with {stats.num_experts} experts per layer, "
                                f"this one has {num_experts}")
        share = spec.count if spec.count is not None else spec.fraction
        if spec.count is not None and spec.count > num_experts:
            raise MoeSwarmError(f"--local-experts {spec.count}: the model has {num_experts} experts per layer")
        held = hot_sets(stats, layers, share)
    check_held(held, layers, num_experts)  # before the backbone loads
    return {layer: experts for layer, experts in held.items() if experts} or None
