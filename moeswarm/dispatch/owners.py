"""Who serves each expert of a layer call: placement (placement/chooser.py) over the pool's usable holders.

For a layer without replicas the choice is the same every call and is cached; for a layer with
replicas each call chooses among them by the holders' measured round trips (`choose_for_call`).
Degraded holders serve only experts nobody else holds. When some routed expert has no usable
holder, its holders are probed at once (the pool's last resort) before the call fails naming them.

Legend: T = tokens in the step, k = router top-k, E = routed experts.
"""

from __future__ import annotations

import torch

from moeswarm.dispatch.errors import ExpertsUnavailable
from moeswarm.dispatch.plan import WorkerShare, plan_layer
from moeswarm.dispatch.pool import HolderPool
from moeswarm.errors import MoeSwarmError
from moeswarm.ids import LayerId
from moeswarm.placement.chooser import choose_for_call, choose_owners, has_choice


class Owners:
    def __init__(self, pool: HolderPool):
        self.pool = pool
        self._owners: dict[LayerId, torch.Tensor] = {}  # [E] per layer, over the standing of `_for`
        self._choices: dict[LayerId, bool] = {}  # per layer: has replicas, so each call chooses
        self._for: tuple = ()  # (pool epoch, each holder's usable + 2 x degraded)

    def plan(self, layer: LayerId, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> list[WorkerShare]:
        """The call's shares, one per holder; ExpertsUnavailable when some routed experts have no
        usable holder even after probing theirs. top_k_index [T, k] long, top_k_weights [T, k]."""
        pool = self.pool
        if layer not in pool.table.candidates:
            raise MoeSwarmError(f"no worker serves MoE layer {layer}")
        try:
            return plan_layer(self.of(layer, top_k_index), top_k_index, top_k_weights)
        except LookupError:
            pass
        pool.probe_holders({layer: self._lacking(layer, top_k_index)})
        try:
            return plan_layer(self.of(layer, top_k_index), top_k_index, top_k_weights)
        except LookupError:
            pass
        lacking = self._lacking(layer, top_k_index)
        holders = sorted({w for e in lacking for w in pool.table.holders(layer, e)})
        worker = holders[0] if holders else None
        cause = pool.holders[worker].cause if worker is not None else "no holder"
        address = pool.address_of(worker) if worker is not None else "none"
        raise ExpertsUnavailable(address, cause or "out of use", layer, lacking)

    def replicated(self, layer: LayerId) -> bool:
        """Whether some expert of `layer` has more than one holder (known once the layer was planned)."""
        return self._choices.get(layer, True)

    def _lacking(self, layer: LayerId, top_k_index: torch.Tensor) -> list[int]:
        """The routed experts of `top_k_index` [T, k] with no usable holder, ascending."""
        return sorted(set(top_k_index[self.of(layer)[top_k_index] < 0].tolist()))

    def of(self, layer: LayerId, top_k_index: torch.Tensor | None = None) -> torch.Tensor:
        """[E] holder per expert: the layer's cached choice; for a layer with replicas and a call's
        routing top_k_index [T, k], the choice for that call's experts by the holders' measured
        round trips (placement/chooser.py `choose_for_call`)."""
        pool = self.pool
        holders = pool.holders
        standing = (pool.epoch, tuple(h.usable + 2 * h.degraded for h in holders))
        if standing != self._for:
            self._owners, self._for, self._choices = {}, standing, {}
        fit = lambda w: holders[w].usable and not holders[w].degraded  # noqa: E731
        if layer not in self._owners:  # degraded holders only where nobody else holds the expert
            owners = choose_owners(pool.table, layer, fit, pool.trusted)  # [E]
            fallback = choose_owners(pool.table, layer, lambda w: holders[w].usable, pool.trusted)  # [E]
            self._owners[layer] = torch.where(owners >= 0, owners, fallback)
            self._choices[layer] = has_choice(pool.table, layer)
        if top_k_index is None or not self._choices[layer]:
            return self._owners[layer]
        rtt_s = [h.round_trips.quantile(0.5, 1) if len(h.round_trips) >= pool.policy.min_samples else None
                 for h in holders]  # a few samples (a prefill's) say little: unmeasured until then
        experts = torch.unique(top_k_index[top_k_index >= 0]).tolist()
        owners = torch.as_tensor(choose_for_call(pool.table, layer, experts, rtt_s, fit, pool.trusted))  # [E]
        if bool((owners[experts] < 0).any()):  # some expert held only by degraded holders
            fallback = choose_for_call(pool.table, layer, experts, rtt_s, lambda w: holders[w].usable, pool.trusted)
            owners = torch.where(owners >= 0, owners, torch.as_tensor(fallback))
        return owners
