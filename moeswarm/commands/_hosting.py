"""Which experts `moeswarm worker` serves: `--experts` (one list for every layer, or per layer as
"0:1-4,9;1:2-5") or `--plan PLAN.json --plan-worker NAME` (a worker's part of a `moeswarm plan`).

Parsing imports no torch; `load_hosted` loads the experts once the command runs.
"""

from __future__ import annotations

import argparse

from moeswarm.placement.plan_file import LayerExperts, parse_layer_experts


def experts_arg(text: str) -> list[int] | LayerExperts:
    """argparse type: "0-3,9" (every layer) or "0:1-4,9;1:2-5" (per layer)."""
    from moeswarm.ids import parse_experts

    try:
        return parse_layer_experts(text) if ":" in text else parse_experts(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    plan = parser.add_argument_group("plan", "serve one worker's part of a placement plan (moeswarm plan)")
    plan.add_argument("--plan", default=None, metavar="PLAN.json", help="a plan written by `moeswarm plan -o`")
    plan.add_argument("--plan-worker", default=None, metavar="NAME", help="which of the plan's workers this one is")


def load_hosted(args: argparse.Namespace):
    """(ExpertStore, ModelSource) for the worker's flags; MoeSwarmError naming a bad combination."""
    from moeswarm.errors import MoeSwarmError
    from moeswarm.model.loading import load_experts
    from moeswarm.worker.store import ExpertStore

    per_layer, plan_experts = _per_layer(args)
    if per_layer is None:
        hosted, source, num_experts = load_experts(args.model, args.experts, args.layers)
        return ExpertStore(hosted, num_experts, source.config.hidden_size), source
    from moeswarm.ids import format_ids
    from moeswarm.model.experts import experts_modules, num_experts_in_config
    from moeswarm.model.loading import empty_model
    from moeswarm.model.source import open_source
    from moeswarm.transport.local import hold_local

    source = open_source(args.model)
    num_experts = num_experts_in_config(source.config)
    if plan_experts is not None and plan_experts != num_experts:
        raise MoeSwarmError(f"{args.plan}: a plan for {plan_experts} experts per layer, the model has {num_experts}")
    moe_layers = list(experts_modules(empty_model(source)))
    strays = sorted(set(per_layer) - set(moe_layers))
    if strays:
        raise MoeSwarmError(f"experts asked for layers {format_ids(strays)}, which are not MoE layers of this model "
                            f"(MoE layers: {format_ids(moe_layers)})")
    for layer, ids in sorted(per_layer.items()):
        if ids and ids[-1] >= num_experts:
            raise MoeSwarmError(f"layer {layer} experts {format_ids(ids)} out of range: the model has experts "
                                f"0-{num_experts - 1}")
    store = hold_local(source, per_layer, moe_layers, num_experts, source.config.hidden_size)
    if store is None:
        raise MoeSwarmError("no experts to serve: every layer's list is empty")
    return store, source


def _per_layer(args: argparse.Namespace) -> tuple[LayerExperts | None, int | None]:
    """({layer: experts} from --plan or a per-layer --experts, or None for the one-list form;
    the plan's experts per layer, to check against the model)."""
    from moeswarm.errors import MoeSwarmError

    if (args.plan is None) != (args.plan_worker is None):
        raise MoeSwarmError("--plan and --plan-worker go together: the plan file and which of its workers this is")
    if args.plan is not None:
        if args.experts is not None or args.layers is not None:
            raise MoeSwarmError("--plan names the experts itself: drop --experts and --layers")
        from moeswarm.placement.plan_file import read_plan

        plan = read_plan(args.plan)
        worker = plan.worker(args.plan_worker)
        if not worker.experts:
            raise MoeSwarmError(f"{args.plan}: worker {args.plan_worker} holds no experts in this plan")
        return dict(worker.experts), plan.num_experts
    if isinstance(args.experts, dict):
        if args.layers is not None:
            raise MoeSwarmError("per-layer --experts names its layers: drop --layers")
        return args.experts, None
    return None, None
