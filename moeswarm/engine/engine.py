"""The engine: one thread owns the model and the swarm, and steps every active request together.

Requests join and leave between steps. A step is schedule, run, postprocess. Schedule: each
sequence drafts, and the scheduler plans the step (engine/scheduler.py's StepPlan: each sequence's
feed, a prompt chunk or its last token plus its drafts, several alternative drafts one row each
for a greedy sequence; and the groups). Run: engine/runner.py, one packed forward per group for
every sequence of the group, so the backbone reads each weight once per group and each MoE layer
makes one DISPATCH per worker per group; the groups take turns so that one computes while
another's trip is on the wire. Postprocess: each sequence accepts or rejects its drafts and emits
its text; the finished ones leave.

What only watches the step (the requests' figures, the policies' measurements, the metrics and the
swarm's accounting, the rollback checkpoints, the --check-local reference) is a list of observers
told at each phase's end (engine/step.py, engine/observers.py). With a reference model (serve
--check-local), every step also runs on a local eager model with the same sequences in the same
groups, and every logit row is compared bit for bit.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from moeswarm.errors import MoeSwarmError, one_line
from moeswarm.generation.check import LocalCheck
from moeswarm.generation.draft_names import check_draft_flags
from moeswarm.generation.drafters import Drafter
from moeswarm.forward.sequence_cache import cache_bytes
from moeswarm.sources.tokenizer import TextCodec
from moeswarm.engine.job import Failed, Job
from moeswarm.engine.admission import Admission
from moeswarm.engine.between_steps import BetweenSteps
from moeswarm.engine.config import EngineConfig
from moeswarm.engine.metrics import ServeMetrics, UnrecordedMetrics
from moeswarm.engine.observers import Policies, ReferenceCheck, RequestFigures, StepMetrics
from moeswarm.engine.request_metrics import RequestClock
from moeswarm.engine.rollback import Rollback
from moeswarm.engine.runner import PackedRunner, build_runners
from moeswarm.engine.scheduler import Scheduler, Slot
from moeswarm.engine.sequence import Sequence
from moeswarm.engine.spec_metrics import register_spec_metrics
from moeswarm.engine.speculation import Speculation, resolve_speculation
from moeswarm.engine.stats import EngineStats
from moeswarm.engine.step import Ran, Step, StepObserver, Taken, Took, Work
from moeswarm.engine.tally import Tally
from moeswarm.engine.whole_model import WholeModel
from moeswarm.swarm import Swarm


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
        # the step's budget and groups (--groups 0: one or two batches in flight, by measurement)
        self.scheduler = Scheduler(config.prefill_chunk, config.step_tokens, config.max_batch, config.groups,
                                   self.packed)
        self.speculation = Speculation(config.speculate, config.adaptive)  # drafts per step, and their acceptance
        register_spec_metrics(self.metrics, self.speculation)
        self.problems: list[str] = ["not checked yet"]  # why a full forward cannot run now ([] when it can)
        # --check-local: every step's logits against the reference's (bit for bit; a lossy wire: the gate's thresholds)
        self.check = LocalCheck(swarm.wire.exact) if reference is not None else None
        self.reference_check = ReferenceCheck(self.check, self.reference_runner, swarm.model, reference, self.metrics) \
            if self.check is not None else None
        self.figures = RequestFigures()
        self.step_metrics = StepMetrics(swarm, self.metrics, self.stats, config.keep_accounting)
        self.rollback = Rollback(swarm, self._roll_back)  # what each sequence was before each step, to undo a liar's steps
        # what watches the steps, told in this order (engine/observers.py)
        self.observers: list[StepObserver] = [self.figures, Policies(self.scheduler, self.speculation),
                                              self.step_metrics, self.rollback]
        if self.reference_check is not None:
            self.observers.append(self.reference_check)
        self._queue: deque[tuple[Job, Tally]] = deque()
        self._active: list[Sequence] = []
        self._tallies: dict[int, Tally] = {}  # id(sequence) -> its request's figures
        self._wake = threading.Condition()
        self._stopping = False
        self._calls = BetweenSteps(self._wake)  # run_between_steps' work
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
        if self.reference_check is not None:
            self.reference_check.close()

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

    @property
    def steps(self) -> int:
        return self.step_metrics.steps

    @property
    def groups_in_flight(self) -> int:
        """Forwards in flight in the last step."""
        return self.step_metrics.groups_in_flight

    @property
    def decode_steps(self) -> int:
        """Sequences' decode steps."""
        return self.figures.decode_steps

    @property
    def branches(self) -> int:
        """The branches (rows) the decode steps verified."""
        return self.figures.branches

    @property
    def checked_rows(self) -> int:
        """Logit rows compared with the reference's (--check-local)."""
        return self.reference_check.checked_rows if self.reference_check is not None else 0

    @property
    def mismatched_rows(self) -> int:
        return self.reference_check.mismatched_rows if self.reference_check is not None else 0

    def run_between_steps(self, call: Callable[[], object]) -> Future:
        """Run `call()` on the engine's thread between two steps, when the model and the swarm are
        free (a forward outside the batch: /v1/embeddings), from any thread; its result or exception
        in the future."""
        return self._calls.add(call)

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
        self._calls.refuse("the server is shutting down")
        for sequence in list(self._active):
            self._remove(sequence, "error")
            sequence.job.emit(Failed("the server is shutting down", 503))

    def step(self) -> bool:
        """Admit what waits, and step every active request once: schedule, run, postprocess (the
        health check first when due). False when there was nothing to step."""
        if time.monotonic() >= self._health_due and (not self._active or self.problems):
            self._check_health()
        self._calls.run()
        self._admit()
        if not self._active:
            return False
        try:
            self._step()
        except Exception as error:  # a bug outside any one sequence: fail the step's sequences, keep serving
            for sequence in list(self._active):
                self._fail(sequence, error)
        return True

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
        step = self._schedule()
        if step is None:
            return
        ran = self._run_step(step)
        self._postprocess(step, ran)

    def _schedule(self) -> Step | None:
        """Free the slots of clients gone away; each sequence drafts; the scheduler plans the step
        (engine/scheduler.py) and each working sequence is given its feed. None: nothing to step."""
        started = time.monotonic()
        for sequence in list(self._active):
            if sequence.job.cancelled.is_set():  # the client went away: free its slot now
                self._remove(sequence, "abort")
        if not self._active:
            self._count_cache_bytes()
            return None
        sequences = list(self._active)
        tallies = [self._tallies[id(s)] for s in sequences]
        drafting = self._draft(sequences, tallies)
        plan = self.scheduler.schedule([Slot(s.prefill_left, s.draft_counts) for s in sequences],
                                       [s.scored for s in sequences], self.swarm.remote)
        work = []
        for slot in plan.working:
            sequence, feed = sequences[slot], plan.feeds[slot]
            decoding = not sequence.prefill_left
            work.append(Work(sequence, tallies[slot], sequence.feed(feed.tokens, feed.rows), self._keep(sequence),
                             decoding))
        return Step(plan, tuple(work), tuple(zip(tallies, drafting)), started,
                    decoding=all(w.sequence.output for w in work), drafted=any(w.sequence.draft_counts for w in work))

    def _draft(self, sequences: list[Sequence], tallies: list[Tally]) -> list[float]:
        """Each sequence's drafts for this step (their count by the speculation first); the seconds each took."""
        self.speculation.plan(sequences, [tally.drafts for tally in tallies])
        seconds = []
        for sequence, tally in zip(sequences, tallies):
            started = time.perf_counter()
            sequence.plan_drafts(self.config.context)
            self.speculation.size(sequence, tally.drafts)
            self.speculation.shadow(sequence, tally.drafts)
            seconds.append(time.perf_counter() - started)
        return seconds

    def _run_step(self, step: Step) -> Ran:
        """The plan's forwards (engine/runner.py), the observers told before and after."""
        for observer in self.observers:
            observer.before_step(step)
        started = time.perf_counter()
        self.swarm.set_decoding(all(w.decoding for w in step.work))  # the accounting counts decode by step
        try:
            outputs = self.runner.run([(w.sequence.stepper, w.feed, w.keep) for w in step.work], step.groups)
        finally:
            self.swarm.set_decoding(False)
        ran = Ran(outputs, time.perf_counter() - started, self.runner.waiting_s)
        for observer in self.observers:
            observer.after_run(step, ran)
        return ran

    def _postprocess(self, step: Step, ran: Ran) -> None:
        """Each sequence takes its logits (a failed forward fails its sequence); the observers are
        told; the finished sequences leave, their caches kept for prefix reuse."""
        took, failed_worker = [], False
        for work, logits in zip(step.work, ran.outputs):
            if isinstance(logits, BaseException):
                failed_worker |= isinstance(logits, MoeSwarmError)
                self._fail(work.sequence, logits)
                continue
            result = self._advance(work, logits)
            if result is not None:
                took.append(result)
        taken = Taken(tuple(took), failed_worker)
        for observer in self.observers:
            observer.after_step(step, ran, taken)
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

    def _advance(self, work: Work, logits: torch.Tensor) -> Took | None:
        """Let the work's sequence take its logits; what it took (None: it failed)."""
        sequence = work.sequence
        before = (len(sequence.output), sequence.drafted, sequence.accepted, sequence.first_token_at)
        try:
            sequence.advance(logits)
        except Exception as error:  # a bug in one sequence's bookkeeping ends that sequence, not the engine
            self._fail(sequence, error)
            return None
        at = time.monotonic()
        drafted, accepted = sequence.drafted - before[1], sequence.accepted - before[2]
        if drafted:
            sequence.drafter.feedback(drafted, accepted, sequence.max_drafts)  # local drafts adapt their length
        return Took(work, len(sequence.output) - before[0], drafted, accepted, at,
                    first_token=before[3] is None and sequence.first_token_at is not None)

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
