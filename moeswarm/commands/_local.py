"""`--local-experts N|P%|FILE` and `--profile FILE`: which experts the backbone holds itself.

N experts per layer, or P % of each layer's experts, the hottest by a routing profile (`moeswarm
profile` writes one); or FILE, a JSON object {"layer": [experts]}. Parsing here imports no torch;
`resolve` hands the flags to placement/held.py once the command runs.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from moeswarm.errors import MoeSwarmError


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


def resolve(args: argparse.Namespace, source) -> dict[int, tuple[int, ...]] | None:
    """{layer: experts} to hold locally, or None: checked against the model (layers, experts)."""
    spec: LocalExpertsSpec | None = args.local_experts
    if spec is None:
        if args.profile is not None:
            raise MoeSwarmError("--profile ranks experts for --local-experts N|P%: give --local-experts too")
        return None
    from moeswarm.placement.held import held_experts

    return held_experts(source, spec.count, spec.fraction, spec.path, args.profile)
