"""A lying holder, and how fast spot checks catch it (`moeswarm bench faults`, spot-check part).

`LyingLink` wraps a real link to a real worker and corrupts what it returns: all zeros, or small
noise on a fraction of rows. Trials run decode-shaped steps (every MoE layer of the model, T
tokens each, routing drawn at random) straight through a dispatcher over TCP, until the liar is
banned or the step budget runs out.

Legend: T = tokens per step, k = top-k, d = hidden size, E = experts.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace

import torch

from moeswarm.dispatch.spot_check import SpotCheckPolicy
from moeswarm.model.experts import num_experts_in_config
from moeswarm.model.source import open_source
from moeswarm.swarm import connect
from moeswarm.transport.link import Pending, Reply
from moeswarm.transport.tcp import TcpLink
from moeswarm.wire.config import EXACT


class LyingLink:
    """Any link, whose RESULTs are corrupted: `zeros` (every row) or `noise` (a `rate` of rows get
    relative noise of 1e-3: small enough to pass a casual look)."""

    def __init__(self, inner, how: str = "zeros", rate: float = 0.01, seed: int = 0):
        self.inner, self.how, self.rate = inner, how, rate
        self._rng = torch.Generator().manual_seed(seed)
        self.corrupted_rows = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def broken(self) -> bool:
        return self.inner.broken

    def wait(self, pending: Pending, deadline: float) -> Reply:
        reply = self.inner.wait(pending, deadline)
        outputs = reply.result.outputs  # [n, d]
        if self.how == "zeros":
            lie = torch.zeros_like(outputs)
            self.corrupted_rows += outputs.shape[0]
        else:
            rows = torch.rand(outputs.shape[0], generator=self._rng) < self.rate  # [n]
            noise = torch.randn(outputs.shape, generator=self._rng) * 1e-3 * outputs.abs().amax(dim=1, keepdim=True)
            lie = torch.where(rows.unsqueeze(1), outputs + noise.to(outputs.dtype), outputs)
            self.corrupted_rows += int(rows.sum())
        return replace(reply, result=replace(reply.result, outputs=lie))


def detection_trials(model: str, addresses: list[str], how: str, fraction: float, trials: int, max_steps: int,
                     tokens: int, seed: int = 0) -> dict:
    """Steps until a liar (link 0, a second connection to the first worker) is banned, per trial.

    addresses: workers that each hold every expert. Links: [liar -> addresses[0], addresses...],
    so the liar serves 1/(n+1) of the experts and two honest holders remain to arbitrate.
    """
    source = open_source(model)
    config = source.config
    num_experts, hidden = num_experts_in_config(config), config.hidden_size
    top_k = _top_k(config)
    steps_to_ban, seconds, checks = [], [], 0
    for trial in range(trials):
        links = [LyingLink(TcpLink(addresses[0]), how, seed=seed + trial)] + [TcpLink(a) for a in addresses]
        layers = _layers(addresses[0], source.fingerprint)
        dispatcher = connect(links, source.fingerprint, num_experts, hidden, layers, EXACT,
                             spot_checks=SpotCheckPolicy(fraction, seed + 1000 + trial))
        rng = random.Random(seed + trial)
        banned_at = None
        started = time.perf_counter()
        for step in range(1, max_steps + 1):
            for layer in sorted(dispatcher.table.candidates):
                dispatcher.combine(dispatcher.dispatch(layer, *_routing(rng, tokens, hidden, num_experts, top_k)))
            if dispatcher.holders[0].banned:
                banned_at = step
                break
        seconds.append((time.perf_counter() - started) / step)
        checks += dispatcher.stats.checks
        honest_banned = any(h.banned for h in dispatcher.holders[1:])
        dispatcher.close()
        steps_to_ban.append(banned_at)
        if honest_banned:
            raise AssertionError("an honest holder was banned")
    caught = [s for s in steps_to_ban if s is not None]
    return {"liar": how, "fraction": fraction, "tokens_per_step": tokens, "trials": trials, "max_steps": max_steps,
            "detected": len(caught), "detection_rate": len(caught) / trials,
            "steps_to_ban_mean": sum(caught) / len(caught) if caught else None,
            "steps_to_ban_max": max(caught) if caught else None, "seconds_per_step_mean": sum(seconds) / trials}


def check_cost(model: str, addresses: list[str], fraction: float, steps: int, tokens: int, seed: int = 0) -> dict:
    """Seconds and bytes per step with spot checks at `fraction`, all holders honest."""
    source = open_source(model)
    config = source.config
    num_experts, hidden = num_experts_in_config(config), config.hidden_size
    links = [TcpLink(a) for a in addresses]
    dispatcher = connect(links, source.fingerprint, num_experts, hidden, _layers(addresses[0], source.fingerprint), EXACT,
                         spot_checks=SpotCheckPolicy(fraction, seed))
    rng = random.Random(seed)
    started = time.perf_counter()
    for _ in range(steps):
        for layer in sorted(dispatcher.table.candidates):
            dispatcher.combine(dispatcher.dispatch(layer, *_routing(rng, tokens, hidden, num_experts, _top_k(config))))
    elapsed = time.perf_counter() - started
    summary = dispatcher.accounting.summary()
    result = {"fraction": fraction, "steps": steps, "tokens_per_step": tokens, "ms_per_step": 1000 * elapsed / steps,
              "bytes_per_step": (summary["bytes_out"] + summary["bytes_in"]) / steps, "checks": dispatcher.stats.checks,
              "check_failures": dispatcher.stats.check_failures, "bans": dispatcher.stats.bans}
    dispatcher.close()
    return result


def _layers(address: str, fingerprint: str) -> list[int]:
    """The MoE layers a worker (holding every layer) announces."""
    probe = TcpLink(address)
    try:
        return sorted(probe.connect(fingerprint).held)
    finally:
        probe.close()


def _top_k(config) -> int:
    for key in ("num_experts_per_tok", "moe_k", "top_k_experts", "num_experts_per_token", "moe_topk"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    raise ValueError("cannot tell the model's top-k")


def _routing(rng: random.Random, tokens: int, hidden: int, num_experts: int, top_k: int):
    """hidden [T, d], top_k_index [T, k] (distinct experts per row), top_k_weights [T, k]."""
    g = torch.Generator().manual_seed(rng.getrandbits(32))
    x = torch.randn(tokens, hidden, generator=g)
    index = torch.rand(tokens, num_experts, generator=g).argsort(dim=1)[:, :top_k]
    weights = torch.rand(tokens, top_k, generator=g).softmax(-1)
    return x, index, weights
