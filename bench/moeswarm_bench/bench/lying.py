"""A lying holder, and how fast spot checks catch it (`moeswarm bench faults`, spot-check and liars parts).

`LyingLink` wraps a real link to a real worker and corrupts what it returns: all zeros, small
noise on a fraction of rows, or 1e30 on one row. Detection trials run decode-shaped steps (every
MoE layer of the model, T tokens each, routing drawn at random) straight through a dispatcher
over TCP, until the liar is banned or the step budget runs out. Liar trials run greedy
generations through a swarm with a liar among 2 or 3 holders, rolling back every step that used
the liar's unchecked answers once it is banned (`generate_with_rollback`), and compare each
output with the local model's.

Legend: T = tokens per step, k = top-k, d = hidden size, E = experts.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from moeswarm.dispatch.spot_check import SpotCheckPolicy
from moeswarm.model.experts import num_experts_in_config
from moeswarm.sources.source import open_source
from moeswarm.forward.stepper import Stepper
from moeswarm.swarm import connect, open_swarm
from moeswarm.transport.link import Pending, Reply
from moeswarm.transport.tcp import TcpLink
from moeswarm.wire.config import EXACT


class LyingLink:
    """Any link, whose RESULTs are corrupted: `zeros` (every row), `noise` (a `rate` of rows get
    relative noise of 1e-3: small enough to pass a casual look) or `huge` (the first row 1e30:
    finite, so it passes a finiteness check)."""

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
        elif self.how == "huge":
            lie = outputs.clone()
            lie[:1] = 1e30
            self.corrupted_rows += min(1, outputs.shape[0])
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


def generate_with_rollback(swarm, prompt: list[int], new_tokens: int,
                           on_step: Callable[[], None] = lambda: None) -> tuple[list[int], list[int], int]:
    """Greedy tokens after `prompt`, one step at a time; after a ban, every step that made a layer
    call using the liar's unchecked answers (`swarm.take_taints`) is undone: the cache is cropped to
    its length before the first such step and the steps are recomputed.

    on_step: called after each step (forward), recomputed ones included.
    Returns (the final new tokens, the new tokens as first emitted, rollbacks): the second is what
    a client streaming without rollback would have received.
    """
    stepper = Stepper(swarm.model)
    tokens = list(prompt)
    steps: list[tuple[int, int, int, int]] = []  # (cache length before, len(tokens) before, first call, last call)
    first_emitted: dict[int, int] = {}
    rollbacks = 0
    while len(tokens) - len(prompt) < new_tokens:
        length, count, first = stepper.length, len(tokens), swarm.layer_call_number() + 1
        logits = stepper.forward(tokens[length:])  # [n, V]
        steps.append((length, count, first, swarm.layer_call_number()))
        on_step()
        tokens.append(int(logits[-1].argmax()))
        first_emitted.setdefault(len(tokens) - 1, tokens[-1])
        taints = swarm.take_taints()
        bad = next((i for i, (_, _, low, high) in enumerate(steps) if any(t.hits(low, high) for t in taints)), None)
        if bad is not None:
            rollbacks += 1
            length, count = steps[bad][0], steps[bad][1]
            del steps[bad:]
            tokens = tokens[:count]
            if length == 0:
                stepper = Stepper(swarm.model)
            else:
                stepper.crop(length)
    emitted = [first_emitted[i] for i in range(len(prompt), len(tokens))]
    return tokens[len(prompt):], emitted, rollbacks


def greedy(stepper: Stepper, prompt: list[int], new_tokens: int) -> list[int]:
    """The honest run: the same steps (the prompt, then one token each) on the local model."""
    tokens = list(prompt)
    logits = stepper.forward(tokens)
    while True:
        tokens.append(int(logits[-1].argmax()))
        if len(tokens) - len(prompt) >= new_tokens:
            return tokens[len(prompt):]
        logits = stepper.forward(tokens[-1:])


def liar_trials(model: str, addresses: list[str], reference, how: str, fraction: float, holders: int, trials: int,
                max_steps: int, new_tokens: int, seed: int = 0) -> dict:
    """Greedy generations through a swarm whose first holder lies, until it is banned or `max_steps`
    steps (forwards) have run; per trial: whether it was caught, the steps until then, and how
    many generations ended unlike the local model's (with rollback) or emitted a wrong token first.

    addresses: two workers holding every expert. Holders: 2: [liar -> addresses[0], addresses[1]];
    3: [liar -> addresses[0], addresses[0], addresses[1]]. The backbone settles a dispute itself
    when no third holder can (dispatch/referee.py).
    """
    workers = [addresses[0], addresses[1]] if holders == 2 else [addresses[0], addresses[0], addresses[1]]
    vocab = open_source(model).config.vocab_size
    honest_runs: dict[tuple[int, ...], list[int]] = {}
    rows = []
    for trial in range(trials):
        rng = random.Random(seed + 7919 * trial)
        wrap = lambda i, link: LyingLink(link, how, seed=seed + trial) if i == 0 else link  # noqa: E731
        with open_swarm(model, workers, spot_check=fraction, spot_check_seed=seed + 1000 + trial, wrap_link=wrap) as swarm:
            generations = changed = emitted_wrong = rollbacks = 0
            steps, banned_at = [0], [None]

            def count_step():
                steps[0] += 1
                if banned_at[0] is None and swarm.resilience()["bans"]:
                    banned_at[0] = steps[0]

            while banned_at[0] is None and steps[0] < max_steps:
                prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 8))]
                key = tuple(prompt)
                if key not in honest_runs:
                    honest_runs[key] = greedy(Stepper(reference), prompt, new_tokens)
                out, emitted, undone = generate_with_rollback(swarm, prompt, new_tokens, count_step)
                generations += 1
                changed += out != honest_runs[key]
                emitted_wrong += emitted != honest_runs[key]
                rollbacks += undone
            standing = swarm.standing()
            rows.append({"trial": trial, "banned_at_step": banned_at[0], "generations": generations,
                         "outputs_changed": changed, "emitted_wrong": emitted_wrong, "rollbacks": rollbacks,
                         "honest_banned": sum(s["banned"] for s in standing[1:]), "cause": standing[0]["cause"]})
    caught = [r["banned_at_step"] for r in rows if r["banned_at_step"] is not None]
    return {"liar": how, "fraction": fraction, "holders": holders, "trials": trials, "max_steps": max_steps,
            "detected": len(caught), "steps_to_ban_mean": sum(caught) / len(caught) if caught else None,
            "steps_to_ban_max": max(caught) if caught else None,
            "generations": sum(r["generations"] for r in rows),
            "outputs_changed": sum(r["outputs_changed"] for r in rows),
            "outputs_changed_without_rollback": sum(r["emitted_wrong"] for r in rows),
            "rollbacks": sum(r["rollbacks"] for r in rows), "honest_banned": sum(r["honest_banned"] for r in rows),
            "trials_detail": rows}
