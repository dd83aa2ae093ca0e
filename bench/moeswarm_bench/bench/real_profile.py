"""Where a backbone's decode step goes, by part: forward hooks on the model's own modules.

Parts (seconds summed over the steps profiled):
  attention  every decoder layer's `self_attn` (projections, rotary, cache, attention itself)
  moe_calls  every routed-experts module's call: the dispatcher's plan, send, wait and combine
             (in local mode the experts' own compute, in process)
  router     every `mlp` block less its experts call: the router's matrix and top-k
  head       the output head (the vocabulary's matrix)
  other      the step less all of the above: embeddings, norms, residual adds, the argmax
A hook costs a few microseconds; profiled steps are not the ones timed for tokens/s.
"""

from __future__ import annotations

import time

import torch

from moeswarm.model.experts import experts_modules

PARTS = ("attention", "moe_calls", "router", "head", "other")


class StepProfile:
    """Hooks on `model` summing each part's time, until `close`."""

    def __init__(self, model: torch.nn.Module):
        experts = [module for _, module in experts_modules(model).values()]
        modules = {"attention": [m for n, m in model.named_modules() if n.endswith(".self_attn")],
                   "mlp": [m for n, m in model.named_modules() if n.endswith(".mlp")],
                   "moe_calls": experts, "head": [model.get_output_embeddings()]}
        self.seconds = {part: 0.0 for part in modules}
        self._started: dict[int, float] = {}
        self._handles = []
        for part, found in modules.items():
            for module in found:
                self._handles.append(module.register_forward_pre_hook(self._start))
                self._handles.append(module.register_forward_hook(self._stop(part)))

    def _start(self, module, args) -> None:
        self._started[id(module)] = time.perf_counter()

    def _stop(self, part: str):
        def hook(module, args, output) -> None:
            self.seconds[part] += time.perf_counter() - self._started.pop(id(module))

        return hook

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def parts_ms(self, step_s: float, steps: int) -> dict[str, float]:
        """Per step, in ms: PARTS, given `steps` profiled steps that took `step_s` seconds in all."""
        per = {part: 1e3 * seconds / steps for part, seconds in self.seconds.items()}
        parts = {"attention": per["attention"], "moe_calls": per["moe_calls"],
                 "router": per["mlp"] - per["moe_calls"], "head": per["head"]}
        parts["other"] = 1e3 * step_s / steps - per["attention"] - per["mlp"] - per["head"]
        return parts

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
