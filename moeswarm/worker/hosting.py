"""A worker's experts loaded: `--experts` (one list for every layer, or per layer as "0:1-4,9;1:2-5")
with `--layers`, or `--plan PLAN.json --plan-worker NAME` (a worker's part of a `moeswarm plan`).

Every combination is checked against the model before its experts load; a bad one is a
MoeSwarmError naming it.
"""

from __future__ import annotations

from moeswarm.errors import MoeSwarmError
from moeswarm.ids import format_ids
from moeswarm.model.experts import experts_modules, num_experts_in_config
from moeswarm.sources.loading import empty_model, load_experts
from moeswarm.sources.source import ModelSource, open_source
from moeswarm.placement.plan_file import LayerExperts, read_plan
from moeswarm.worker.local_link import hold_local
from moeswarm.worker.config import Hosting
from moeswarm.worker.store import ExpertStore


def load_hosted(hosting: Hosting) -> tuple[ExpertStore, ModelSource]:
    """(the experts to serve, their model's source) for `hosting`."""
    per_layer, plan_experts = _per_layer(hosting)
    if per_layer is None:
        hosted, source, num_experts = load_experts(hosting.model, hosting.experts, hosting.layers)
        return ExpertStore(hosted, num_experts, source.config.hidden_size), source
    source = open_source(hosting.model)
    num_experts = num_experts_in_config(source.config)
    if plan_experts is not None and plan_experts != num_experts:
        raise MoeSwarmError(f"{hosting.plan}: a plan for {plan_experts} experts per layer, the model has {num_experts}")
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


def _per_layer(hosting: Hosting) -> tuple[LayerExperts | None, int | None]:
    """({layer: experts} from the plan or a per-layer list, or None for the one-list form;
    the plan's experts per layer, to check against the model)."""
    if (hosting.plan is None) != (hosting.plan_worker is None):
        raise MoeSwarmError("--plan and --plan-worker go together: the plan file and which of its workers this is")
    if hosting.plan is not None:
        if hosting.experts is not None or hosting.layers is not None:
            raise MoeSwarmError("--plan names the experts itself: drop --experts and --layers")
        plan = read_plan(hosting.plan)
        worker = plan.worker(hosting.plan_worker)
        if not worker.experts:
            raise MoeSwarmError(f"{hosting.plan}: worker {hosting.plan_worker} holds no experts in this plan")
        return dict(worker.experts), plan.num_experts
    if isinstance(hosting.experts, dict):
        if hosting.layers is not None:
            raise MoeSwarmError("per-layer --experts names its layers: drop --layers")
        return hosting.experts, None
    return None, None
