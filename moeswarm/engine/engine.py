"""The engine: one thread owns the model and the swarm, and steps every active request together.

Requests join and leave between steps. A step plans each sequence's feed (a prompt chunk, or its
last token plus its drafts, several alternative drafts one row each for a greedy sequence:
`scheduler.plan_step`), runs them (engine/runner.py: one packed forward per group for every
sequence of the group, so the backbone reads each weight once per group and each MoE layer makes
one DISPATCH per worker per group; the groups take turns so that one computes while another's
trip is on the wire), then lets each sequence accept or reject its drafts and emit its text.

With a reference model (serve --check-local), every step also runs on a local eager model with the
same sequences in the same groups, and every logit row is compared bit for bit.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from moeswarm.errors import MoeSwarmError, one_line
from moeswarm.generation.check import LocalCheck
from moeswarm.generation.draft_names import DEFAULT_DRAFT, check_draft_flags
from moeswarm.generation.drafters import Drafter
from moeswarm.forward.sequence_cache import cache_bytes
from moeswarm.generation.trace import LayerTrace, first_difference
from moeswarm.sources.tokenizer import TextCodec
from moeswarm.engine.job import Failed, Job
from moeswarm.engine.admission import Admission
from moeswarm.engine.group_policy import GroupPolicy
from moeswarm.engine.metrics import ServeMetrics, UnrecordedMetrics
from moeswarm.engine.request_metrics import RequestClock
from moeswarm.engine.rollback import Rollback
from moeswarm.engine.runner import PackedRunner, build_runners, split_groups
from moeswarm.engine.scheduler import Slot, plan_step
from moeswarm.engine.sequence import Sequence, apart
from moeswarm.engine.spec_metrics import register_spec_metrics
from moeswarm.engine.speculation import Speculation, resolve_speculation
from moeswarm.engine.stats import EngineStats, StepRecord
from moeswarm.engine.step_budget import GROWTH as STEP_TOKENS_GROWTH, StepBudget
from moeswarm.engine.tally import Tally
from moeswarm.engine.whole_model import WholeModel
from moeswarm.swarm import Swarm


@dataclass(frozen=True)
class EngineConfig:
    context: int  # positions a sequence may use (prompt + output)
    max_batch: int = 16  # sequences stepped together; more wait in the queue
    speculate: int | None = 0  # most drafts per sequence per step, in each of its branches (0: off; None: on with
    # AUTO_SPECULATE and the goodput rule where steps have remote trips, off otherwise: engine/speculation.py)
    prefill_chunk: int = 64  # most prompt tokens a sequence feeds per step
    step_tokens: int = 256  # token budget of a step (decode tokens first, then prompt chunks); more, up to
    # STEP_TOKENS_GROWTH times, while their compute fits in the step's wait on replies (engine/step_budget.py)
    cache_slots: int = 8  # finished sequences' KV caches kept for prefix reuse (0: off)
    keep_accounting: bool = False  # keep every layer call in the swarm's accounting (one generation); else per step
    health_interval_s: float = 2.0
    draft: str = DEFAULT_DRAFT  # where drafts come from (generation/drafters.py): ngram, suffix, local or both
    groups: int = 0  # batches in flight per step (engine/turns.py); 0: one or two, by measurement (engine/group_policy.py)
    adaptive: bool = False  # each step's drafts chosen by the goodput rule, `speculate` their cap (engine/speculation.py)


class Engine:
    def __init__(self, swarm: Swarm | WholeModel, codec: TextCodec, config: EngineConfig,
                 metrics: ServeMetrics | UnrecordedMetrics | None = None, reference: torch.nn.Module | None = None,
                 drafter: Callable[[], Drafter] | None = None):
        """swarm: where the forwards run (a WholeModel: a model computing its own experts here);
        reference: a local eager model every step is compared with (--check-local);
        drafter: makes each sequence's drafter (default: config.draft's, over the swarm's local experts)."""
        config = resolve_speculation(config, swarm)
        if drafter is None:
            check_draft_flags(config.draft, config.speculate, swarm.local_store is not None)
        self.swarm, self.codec, self.config = swarm, codec, config
        self.metrics = metrics or ServeMetrics()
        self.metrics.follow(self.running_requests, self.waiting_requests)
        self.stats = EngineStats(swarm.num_experts)
        self.reference = reference
        self.runner, self.reference_runner = build_runners(swarm, reference, config.max_batch, config.groups)
        self.packed = isinstance(self.runner, PackedRunner)
        self.admission = Admission(swarm, codec, config, self.runner, self.reference_runner, self.metrics, self.packed,
                                   drafter)
        self.group_policy = GroupPolicy()  # --groups 0: one or two batches in flight, by measurement
        self.speculation = Speculation(config.speculate, config.adaptive)  # drafts per step, and their acceptance
        register_spec_metrics(self.metrics, self.speculation)
        self.budget = StepBudget(config.step_tokens, STEP_TOKENS_GROWTH * config.step_tokens)
        self.problems: list[str] = ["not checked yet"]  # why a full forward cannot run now ([] when it can)
        # --check-local: every step's logits against the reference's (bit for bit; a lossy wire: the gate's thresholds)
        self.check = LocalCheck(swarm.wire.exact) if reference is not None else None
        # where an exact check's first mismatch begins (generation/trace.py): both models' layers fingerprinted
        self.traces = (LayerTrace(swarm.model), LayerTrace(reference)) if self.check and self.check.exact else None
        self.checked_rows = self.mismatched_rows = 0
        self.steps = 0
        self.groups_in_flight = 0  # groups of the last step
        self.decode_steps = self.branches = 0  # sequences' decode steps, and the branches (rows) they verified
        self._queue: deque[tuple[Job, Tally]] = deque()
        self._active: list[Sequence] = []
        self._tallies: dict[int, Tally] = {}  # id(sequence) -> its request's figures
        self.rollback = Rollback()  # what each sequence was before each step, to undo a liar's steps
        self._wake = threading.Condition()
        self._stopping = False
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()  # run_between_steps' work
        self._health_due = 0.0
        self._thread = threading.Thread(target=self._run, name="moeswarm-engine", daemon=True)

    # -- called from other threads -----------------------------------------------------------

    def start(self) -> None:
        """Step in the engine's own thread (serve: commands/serve.py sets the interpreter's switch interval)."""
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        self.close()

    def close(self) -> None:
        """Let go of the runners' threads (after `run`; `stop` does it for a started engine)."""
        for runner in (self.runner, self.reference_runner):
            if runner is not None:
                runner.close()
        self._stop_tracing()

    def _stop_tracing(self) -> None:
        for trace in self.traces or ():
            trace.remove()
        self.traces = None

    def submit(self, job: Job, tally: Tally | None = None) -> None:
        """Queue `job`; its figures go to `tally` as it runs (its moments to tally.clock: engine/request_metrics.py)."""
        tally = tally or Tally()
        tally.clock = RequestClock(arrived=job.submitted, queued=time.monotonic())
        with self._wake:
            self._queue.append((job, tally))
            self.metrics.queue_depth.set(len(self._queue))
            self._wake.notify_all()

    def run(self, job: Job) -> Tally:
        """`job` alone, stepped in this thread until it ends (generate: one request, the same engine)."""
        tally = Tally()
        self.submit(job, tally)
        while self.step():
            pass
        return tally

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return len(self._active)

    def run_between_steps(self, call: Callable[[], object]) -> Future:
        """Run `call()` on the engine's thread between two steps, when the model and the swarm are
        free (a forward outside the batch: /v1/embeddings), from any thread; its result or exception
        in the future."""
        future: Future = Future()
        with self._wake:
            self._calls.append((call, future))
            self._wake.notify_all()
        return future

    def end_all(self, message: str) -> None:
        """End every queued and running job now, from any thread: each is told Failed(message, 503) (a
        stream's last event) and cancelled; the engine drops them at its next step (serve/drain.py)."""
        with self._wake:
            jobs = [job for job, _ in self._queue] + [sequence.job for sequence in list(self._active)]
        for job in jobs:
            if not job.cancelled.is_set():
                job.cancelled.set()
                job.emit(Failed(message, 503))

    def running_requests(self) -> int:
        """Sequences in the batch whose client is still there (any thread: a client that went away stops
        counting at once, not at the engine's next step)."""
        return sum(1 for sequence in list(self._active) if not sequence.job.cancelled.is_set())

    def waiting_requests(self) -> int:
        """Jobs in the queue whose client is still there (any thread)."""
        return sum(1 for job, _ in list(self._queue) if not job.cancelled.is_set())

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                if self._stopping:
                    break
                if not self._queue and not self._active and not self._calls:
                    self._wake.wait(timeout=max(0.0, self._health_due - time.monotonic()))
                    if self._stopping:
                        break
            self.step()
        while self._calls:
            self._calls.popleft()[1].set_exception(MoeSwarmError("the server is shutting down"))
        for sequence in list(self._active):
            self._remove(sequence, "error")
            sequence.job.emit(Failed("the server is shutting down", 503))

    def step(self) -> bool:
        """Admit what waits, and step every active request once: schedule, run, postprocess (the
        health check first when due). False when there was nothing to step."""
        if time.monotonic() >= self._health_due and (not self._active or self.problems):
            self._check_health()
        self._run_calls()
        self._admit()
        if not self._active:
            return False
        try:
            self._step()
        except Exception as error:  # a bug outside any one sequence: fail the step's sequences, keep serving
            for sequence in list(self._active):
                self._fail(sequence, error)
        return True

    def _run_calls(self) -> None:
        while self._calls:
            with self._wake:
                call, future = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as error:  # the caller's to report: the engine goes on
                future.set_exception(error)

    def _check_health(self) -> None:
        try:
            self.problems = self.swarm.health()
        except Exception as error:  # a health check must never end the engine
            self.problems = [f"health check failed: {one_line(error)}"]
        self._health_due = time.monotonic() + self.config.health_interval_s

    def _admit(self) -> None:
        with self._wake:
            waiting: deque[tuple[Job, Tally]] = deque()
            while self._queue and len(self._active) < self.config.max_batch:
                job, tally = self._queue.popleft()
                if job.cancelled.is_set():
                    self.metrics.vllm.ended(tally.clock, "abort")
                    continue
                if self.admission.waits(job, self._active):
                    waiting.append((job, tally))  # the same prompt is being prefilled: take its cache next step
                    continue
                sequence = self.admission.start(job, self._active)
                self._active.append(sequence)
                self._tallies[id(sequence)] = tally
                tally.drafts = self.speculation.start(sequence)
                tally.tokens = sequence.output  # the same list: it grows as the sequence does
                self.metrics.vllm.admitted(tally.clock, len(job.prompt))
            self._queue.extendleft(reversed(waiting))
            self.metrics.queue_depth.set(len(self._queue))
        self.metrics.active.set(len(self._active))

    def _step(self) -> None:
        started = time.monotonic()
        for sequence in list(self._active):
            if sequence.job.cancelled.is_set():  # the client went away: free its slot now
                self._remove(sequence, "abort")
        if not self._active:
            self._count_cache_bytes()
            return
        sequences = list(self._active)
        self.speculation.plan(sequences, [self._tallies[id(s)].drafts for s in sequences])
        step_drafting = 0.0
        for sequence in sequences:
            drafting = time.perf_counter()
            tally = self._tallies[id(sequence)]
            sequence.plan_drafts(self.config.context)
            self.speculation.shadow(sequence, tally.drafts)
            drafting = time.perf_counter() - drafting
            tally.draft_seconds += drafting
            tally.seconds += drafting
            step_drafting += drafting
        plans = plan_step([Slot(s.prefill_left, s.draft_counts) for s in sequences],
                          self.config.prefill_chunk, self.budget.tokens())
        work = [(s, s.feed(plan.tokens, plan.rows), self._keep(s)) for s, plan in zip(sequences, plans) if plan.tokens]
        for sequence, feed, _ in work:
            if not sequence.prefill_left:
                tally = self._tallies[id(sequence)]
                rows = len(feed) if _is_rows(feed) else 1
                self.decode_steps, self.branches = self.decode_steps + 1, self.branches + rows
                tally.steps, tally.branches = tally.steps + 1, tally.branches + rows
                tally.drafted_all += _tokens(feed) - rows  # each row's first token is the last one taken
        sizes = [_tokens(feed) for _, feed, _ in work]  # every row's tokens, padding included
        fed = sum(sizes)
        groups = split_groups(sizes, self._group_count(len(work)))
        groups = apart(groups, [s.scored for s, _, _ in work], self.config.max_batch)  # log-probabilities: own forwards
        if not self.config.keep_accounting:
            self.swarm.reset_accounting()  # a server's accounting stays one step long
        seen = self.swarm.layer_calls_accounted() if self.config.keep_accounting else 0
        points = [(s, s.checkpoint()) for s, _, _ in work] if self.swarm.remote else []  # only remote holders are banned
        first_call = self.swarm.layer_call_number() + 1
        for trace in self.traces or ():
            trace.begin()
        forward = time.perf_counter()
        self.swarm.set_decoding(not any(s.prefill_left for s, _, _ in work))  # the accounting counts decode by step
        try:
            outputs = self.runner.run([(s.stepper, feed, keep) for s, feed, keep in work], groups)
        finally:
            self.swarm.set_decoding(False)
        forward = time.perf_counter() - forward
        last_call = self.swarm.layer_call_number()
        self.rollback.record(points, first_call, last_call)
        if all(s.output for s, _, _ in work):  # decode steps teach the policies
            if not self.config.groups:
                self.group_policy.record(len(groups), forward, fed)
            drafted_any = any(s.draft_counts for s, _, _ in work)
            self.speculation.record_step(fed, forward, step_drafting if drafted_any else None)
        for sequence, _, _ in work:
            tally = self._tallies[id(sequence)]
            tally.seconds += forward
            if not sequence.output:  # a prompt chunk (its first token comes from this step's logits)
                tally.prefill_seconds += forward
        calls, waiting_s = self.swarm.layer_calls(seen), self.runner.waiting_s
        self.budget.record(fed, forward, waiting_s)
        self.groups_in_flight = len(groups)
        if self.reference_runner is not None:
            expected = self.reference_runner.run([(s.reference, feed, keep) for s, feed, keep in work], groups)
            self._compare(work, outputs, expected, located=len(groups) == 1)
        failed_worker, generated, drafted, accepted = False, 0, 0, 0
        for (sequence, feed, _), logits in zip(work, outputs):
            if isinstance(logits, BaseException):
                failed_worker |= isinstance(logits, MoeSwarmError)
                self._fail(sequence, logits)
                continue
            decoding = sequence.chunk is None
            counts = self._advance(sequence, logits)
            if decoding and sequence in self._active:
                rows = len(feed) if _is_rows(feed) else 1
                self.speculation.after_step(sequence, self._tallies[id(sequence)].drafts, _tokens(feed), rows,
                                            counts[1], counts[2])
            generated, drafted, accepted = generated + counts[0], drafted + counts[1], accepted + counts[2]
        self.steps += 1
        self.metrics.observe_step(len(work), fed, time.monotonic() - started, calls, len(groups), waiting_s)
        self.stats.record_step(StepRecord(time.monotonic(), len(work), fed, generated, drafted, accepted),
                               [call.worker_seconds for call in calls])
        taints = self.swarm.take_taints()
        if taints:
            self._roll_back(taints)
        for sequence in [s for s in self._active if s.done]:
            self._remove(sequence, sequence.finish_reason)
            self.admission.prefix_cache.put(sequence.context[: sequence.stepper.length],
                                  (sequence.stepper.cache, sequence.reference.cache if sequence.reference else None))
        self.metrics.active.set(len(self._active))
        self._count_cache_bytes()
        if failed_worker:
            self._health_due = 0.0  # find out now which holders are gone

    def _count_cache_bytes(self) -> None:
        """The backbone's keys and values in bytes, the batch's and the prefix cache's (the
        --check-local reference's own copies are not counted). Not for a lone `generate`: nobody reads it."""
        if isinstance(self.metrics, UnrecordedMetrics):
            return
        self.metrics.kv_cache_bytes.labels("sequences").set(sum(cache_bytes(s.stepper.cache) for s in self._active))
        self.metrics.kv_cache_bytes.labels("prefix_cache").set(
            sum(cache_bytes(backbone) for backbone, _ in self.admission.prefix_cache.held()))

    def _keep(self, sequence: Sequence) -> str:
        """Which of its feed's logits a sequence needs (called before it feeds): a prompt chunk's last
        row only, unless every row is compared (--check-local) or scored (prompt log-probabilities)."""
        if not sequence.prefill_left or self.reference is not None or sequence.job.prompt_logprobs is not None:
            return "all"
        return "last"

    def _group_count(self, sequences: int) -> int:
        """Batches in flight this step: as configured, or (auto) as measured (engine/group_policy.py);
        never more than the sequences."""
        if not self.packed:
            return 1
        wanted = self.config.groups or self.group_policy.choose(self.swarm.remote, sequences)
        return max(1, min(wanted, sequences))

    def _advance(self, sequence: Sequence, logits: torch.Tensor) -> tuple[int, int, int]:
        """Let `sequence` take its logits; (tokens generated, drafts fed, drafts accepted) by it."""
        before = (len(sequence.output), sequence.drafted, sequence.accepted, sequence.first_token_at)
        try:
            sequence.advance(logits)
        except Exception as error:  # a bug in one sequence's bookkeeping ends that sequence, not the engine
            self._fail(sequence, error)
            return 0, 0, 0
        counts = (len(sequence.output) - before[0], sequence.drafted - before[1], sequence.accepted - before[2])
        if counts[1]:
            sequence.drafter.feedback(counts[1], counts[2], sequence.max_drafts)  # local drafts adapt their length
        tally = self._tallies[id(sequence)]
        tally.drafted, tally.accepted = tally.drafted + counts[1], tally.accepted + counts[2]
        self.metrics.generated_tokens.inc(counts[0])
        self.metrics.drafted.inc(counts[1])
        self.metrics.accepted.inc(counts[2])
        self.metrics.vllm.tokens(tally.clock, counts[0])
        if before[3] is None and sequence.first_token_at is not None:
            hit = "hit" if sequence.cached_tokens else "miss"
            self.metrics.first_token.labels(hit).observe(sequence.first_token_at - sequence.job.submitted)
        return counts

    def _remove(self, sequence: Sequence, reason: str) -> None:
        """Take `sequence` out of the batch; `reason`: how it ended (engine/request_metrics.py FINISHED_REASONS)."""
        self._active.remove(sequence)
        tally = self._tallies.pop(id(sequence), None)
        self.rollback.forget(sequence)
        if tally is not None and tally.clock is not None:
            self.metrics.vllm.ended(tally.clock, reason)

    def _roll_back(self, taints: list) -> None:
        """A holder was banned: the sequences that used its unchecked answers go back (engine/rollback.py)."""
        self.admission.prefix_cache.clear()  # it may hold such steps' keys and values
        for sequence, error in self.rollback.apply(self._active, taints):
            self.metrics.rolled_back.inc()
            if error is not None:
                self._fail(sequence, MoeSwarmError(f"a worker was caught lying after serving this request: {error}"))

    def _fail(self, sequence: Sequence, error: BaseException) -> None:
        self._remove(sequence, "error")
        self.metrics.failed_sequences.inc()
        if isinstance(error, MoeSwarmError):
            sequence.job.emit(Failed(one_line(error), 503, error))
        else:
            sequence.job.emit(Failed(f"internal error: {one_line(error)}", 500, error))

    def _compare(self, work: list, outputs: list, expected: list, located: bool) -> None:
        """Each sequence's logits against the reference's; located: the step ran as one group, so
        the models' layer traces line up (generation/trace.py)."""
        unmatched = self.check.first_mismatch is None
        for (sequence, _, _), got, want in zip(work, outputs, expected):
            if isinstance(got, BaseException) or isinstance(want, BaseException):
                continue
            vocabulary = got.shape[-1]
            got, want = got.reshape(-1, vocabulary), want.reshape(-1, vocabulary)  # every row of every branch: [B*n, V]
            step = self._tallies[id(sequence)].steps
            self.check.compare(got, want, f"step {step}" if step else "prefill")
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
            self._stop_tracing()  # only the first mismatch is located: no more fingerprints


def _is_rows(feed: list[int] | list[list[int]]) -> bool:
    return bool(feed) and isinstance(feed[0], list)


def _tokens(feed: list[int] | list[list[int]]) -> int:
    return sum(len(row) for row in feed) if _is_rows(feed) else len(feed)

