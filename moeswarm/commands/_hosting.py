"""Which experts `moeswarm worker` serves: `--experts` (one list for every layer, or per layer as
"0:1-4,9;1:2-5") or `--plan PLAN.json --plan-worker NAME` (a worker's part of a `moeswarm plan`).

Parsing imports no torch; worker/hosting.py loads the experts once the command runs.
"""

from __future__ import annotations

import argparse

from moeswarm.ids import parse_experts
from moeswarm.placement.plan_file import LayerExperts, parse_layer_experts
from moeswarm.worker.config import Hosting


def experts_arg(text: str) -> list[int] | LayerExperts:
    """argparse type: "0-3,9" (every layer) or "0:1-4,9;1:2-5" (per layer)."""
    try:
        return parse_layer_experts(text) if ":" in text else parse_experts(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    plan = parser.add_argument_group("plan", "serve one worker's part of a placement plan (moeswarm plan)")
    plan.add_argument("--plan", default=None, metavar="PLAN.json", help="a plan written by `moeswarm plan -o`")
    plan.add_argument("--plan-worker", default=None, metavar="NAME", help="which of the plan's workers this one is")


def hosting_from(args: argparse.Namespace) -> Hosting:
    """The Hosting `--model`, `--experts`, `--layers`, `--plan` and `--plan-worker` ask for."""
    return Hosting(args.model, args.experts, args.layers, args.plan, args.plan_worker)
