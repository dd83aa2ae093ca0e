"""What watches the engine's steps (engine/step.py's StepObserver) without steering them.

`RequestFigures`: each request's figures (its Tally) and the engine's decode counts.
`Policies`: the scheduler's and the speculation's measurements learn from each step.
`StepMetrics`: /metrics and the dashboard's windows, over the swarm's accounting of the step.
`ReferenceCheck`: --check-local, every step again on the local reference, compared bit for bit.
(engine/rollback.py's `Rollback` is one too: each sequence's checkpoint before each step.)

The engine tells them in its list's order; where two read the same state, that order is the
original one of the step (the figures before the metrics, the metrics before a rollback fails a
sequence).
"""

from __future__ import annotations

import time

from moeswarm.generation.check import LocalCheck
from moeswarm.generation.trace import LayerTrace, first_difference
from moeswarm.engine.metrics import ServeMetrics, UnrecordedMetrics
from moeswarm.engine.scheduler import Scheduler
from moeswarm.engine.speculation import Speculation
from moeswarm.engine.stats import EngineStats, StepRecord
from moeswarm.engine.step import Ran, Step, StepObserver, Taken


class RequestFigures(StepObserver):
    """Each request's figures (engine/tally.py), and the engine's decode steps and the branches they verified."""

    def __init__(self):
        self.decode_steps = self.branches = 0

    def before_step(self, step: Step) -> None:
        for tally, seconds in step.drafting:
            tally.draft_seconds += seconds
            tally.seconds += seconds
        for work in step.work:
            if work.decoding:
                tally, rows = work.tally, work.rows
                self.decode_steps, self.branches = self.decode_steps + 1, self.branches + rows
                tally.steps, tally.branches = tally.steps + 1, tally.branches + rows
                tally.drafted_all += work.tokens - rows  # each row's first token is the last one taken

    def after_run(self, step: Step, ran: Ran) -> None:
        for work in step.work:
            work.tally.seconds += ran.seconds
            if not work.sequence.output:  # a prompt chunk (its first token comes from this step's logits)
                work.tally.prefill_seconds += ran.seconds

    def after_step(self, step: Step, ran: Ran, taken: Taken) -> None:
        for took in taken.took:
            tally = took.work.tally
            tally.drafted, tally.accepted = tally.drafted + took.drafted, tally.accepted + took.accepted


class Policies(StepObserver):
    """The scheduler's budget and group count, and the speculation's costs and acceptance, learn from the
    steps (decode steps only, but the budget: engine/step_budget.py)."""

    def __init__(self, scheduler: Scheduler, speculation: Speculation):
        self.scheduler, self.speculation = scheduler, speculation

    def after_run(self, step: Step, ran: Ran) -> None:
        self.scheduler.learn(step.plan, ran.seconds, ran.waiting_s, step.decoding)
        if step.decoding:
            self.speculation.record_step(step.plan.tokens, ran.seconds, step.drafting_s if step.drafted else None)

    def after_step(self, step: Step, ran: Ran, taken: Taken) -> None:
        for took in taken.took:
            work = took.work
            if work.decoding:
                self.speculation.after_step(work.sequence, work.tally.drafts, work.tokens, work.rows, took.drafted,
                                            took.accepted)


class StepMetrics(StepObserver):
    """The step in /metrics (engine/metrics.py, the vllm series) and the dashboard (engine/stats.py).
    The swarm's accounting is reset before each step (a server's stays one step long) unless kept
    (EngineConfig.keep_accounting: one generation's, whole)."""

    def __init__(self, swarm, metrics: ServeMetrics | UnrecordedMetrics, stats: EngineStats, keep_accounting: bool):
        self.swarm, self.metrics, self.stats, self.keep_accounting = swarm, metrics, stats, keep_accounting
        self.steps = 0
        self.groups_in_flight = 0  # forwards of the last step
        self._seen = 0  # layer calls accounted before this step
        self._calls: list = []  # this step's layer calls (swarm.layer_calls)

    def before_step(self, step: Step) -> None:
        if not self.keep_accounting:
            self.swarm.reset_accounting()
        self._seen = self.swarm.layer_calls_accounted() if self.keep_accounting else 0

    def after_run(self, step: Step, ran: Ran) -> None:
        self._calls = self.swarm.layer_calls(self._seen)
        self.groups_in_flight = len(step.plan.groups)

    def after_step(self, step: Step, ran: Ran, taken: Taken) -> None:
        metrics = self.metrics
        for took in taken.took:
            sequence = took.work.sequence
            metrics.generated_tokens.inc(took.generated)
            metrics.drafted.inc(took.drafted)
            metrics.accepted.inc(took.accepted)
            metrics.vllm.tokens(took.work.tally.clock, took.generated, took.at)
            if took.first_token:
                hit = "hit" if sequence.cached_tokens else "miss"
                metrics.first_token.labels(hit).observe(sequence.first_token_at - sequence.job.submitted)
        self.steps += 1
        batch, calls = len(step.work), self._calls
        metrics.observe_step(batch, step.plan.tokens, time.monotonic() - step.started, calls, len(step.plan.groups),
                             ran.waiting_s)
        self.stats.record_step(StepRecord(time.monotonic(), batch, step.plan.tokens, taken.generated, taken.drafted,
                                          taken.accepted), [call.worker_seconds for call in calls])
        self._calls = []


class ReferenceCheck(StepObserver):
    """--check-local: each step's forwards again on the local reference, in the same groups, and every
    logit row compared (bit for bit; a lossy wire: the gate's thresholds, generation/check.py). In an
    exact check both models' layers are fingerprinted (generation/trace.py), so the first mismatch
    says where it begins."""

    def __init__(self, check: LocalCheck, runner, backbone, reference, metrics: ServeMetrics | UnrecordedMetrics):
        """runner: the reference's (engine/runner.py); backbone, reference: the two models, traced when exact."""
        self.check, self.runner, self.metrics = check, runner, metrics
        self.traces = (LayerTrace(backbone), LayerTrace(reference)) if check.exact else None
        self.checked_rows = self.mismatched_rows = 0

    def before_step(self, step: Step) -> None:
        for trace in self.traces or ():
            trace.begin()

    def after_run(self, step: Step, ran: Ran) -> None:
        # before the sequences take their logits: that crops the reference's caches too
        expected = self.runner.run([(work.sequence.reference, work.feed, work.keep) for work in step.work], step.groups)
        self._compare(step, ran.outputs, expected, located=len(step.plan.groups) == 1)

    def close(self) -> None:
        """Take the fingerprinting hooks off both models."""
        for trace in self.traces or ():
            trace.remove()
        self.traces = None

    def _compare(self, step: Step, outputs: list, expected: list, located: bool) -> None:
        """Each sequence's logits against the reference's; located: the step ran as one group, so
        the models' layer traces line up."""
        unmatched = self.check.first_mismatch is None
        for work, got, want in zip(step.work, outputs, expected):
            if isinstance(got, BaseException) or isinstance(want, BaseException):
                continue
            vocabulary = got.shape[-1]
            got, want = got.reshape(-1, vocabulary), want.reshape(-1, vocabulary)  # every row of every branch: [B*n, V]
            steps = work.tally.steps
            self.check.compare(got, want, f"step {steps}" if steps else "prefill")
            rows = got.shape[0]
            differing = int((got != want).any(dim=-1).sum())
            self.checked_rows += rows
            self.mismatched_rows += differing
            self.metrics.checked_logits.inc(rows)
            self.metrics.mismatched_logits.inc(differing)
        if unmatched and self.check.first_mismatch is not None and self.traces:
            where = first_difference(*self.traces) if located else None
            if where is not None:
                self.check.first_mismatch += f" (first at {where})"
            self.close()  # only the first mismatch is located: no more fingerprints
