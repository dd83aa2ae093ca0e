"""The worker's compute runner: one thread runs the experts, fed by fair, bounded queues.

Work waits in one FIFO queue per owner (one owner per connection), for the compute thread. The
loop reads frames, answers PING and HELLO at once, and writes replies; it runs a job itself only
when the runner is idle (`run_here`: nothing waiting, nothing in service), for a small job (a
decode step's DISPATCH): the hand-off to the thread and back is then most of such a job's cost.
Jobs arriving meanwhile wait in the socket, and are queued when it is done: the order fair
queuing would give is the same, since nothing else was waiting.
The compute thread shares itself between owners by cost (a DISPATCH's tokens), with start-time
fair queuing: each job gets a start tag, max(the tag of the job in service, its owner's previous
finish tag), and a finish tag start + cost; the head with the smallest start tag runs next. So a
backlog of large prefills on some connections never holds a small decode step of another back by
more than the job in service, and equal jobs take turns (round-robin). One thread is enough: torch releases the GIL
inside its kernels, and one thread keeps the kernels' threading exactly as the worker set it
(bit-identical results need the same kernels, not more of them at once).

Outcomes: a job submitted with a `done` callback hands its outcome to it on the compute thread
(the worker sends a RESULT from there, without waking the event loop: session.py); a job without
one settles an asyncio future on its loop's thread (`call_soon_threadsafe`). A job that will never
run (its owner dropped, the runner stopped) gets `done(None, CANCELLED)` or a cancelled future.

Merging: a job submitted with a batch key may run in one call with the jobs at the head of other
owners' queues that carry the same key (one per owner, so each owner's jobs still run in its
order), when the runner was given a `batch_work` function: the worker merges DISPATCHes of one
layer from several backbones this way (worker/merge.py decides which may merge and keeps the bits).
The job picked by fair queuing leads (batch_work must run it); the others join early, each charged
its own cost as before, or are DECLINED and go back to the head of their queue.

The queues are bounded in total and per owner (jobs waiting, not the one running): a full runner
refuses new work with WorkerBusy instead of growing without limit. An owner with nothing waiting
is still admitted when the total is reached (one job over the total per owner at most), so a
flood from some connections cannot starve a well-behaved one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from moeswarm.errors import MoeSwarmError

log = logging.getLogger("moeswarm.worker")
DEFAULT_QUEUE_LIMIT = 64
T = TypeVar("T")
DECLINED = object()  # batch_work's outcome for a job it did not run: the job goes back to its queue's head
CANCELLED = asyncio.CancelledError()  # the error a `done` callback gets for a job that will never run
Done = Callable[[Any, "BaseException | None"], None]


class WorkerBusy(MoeSwarmError):
    """The worker holds `limit` of something already: the request is refused, to be retried later."""

    def __init__(self, queued: int, limit: int, what: str = "requests queued"):
        super().__init__(f"worker busy: {queued} {what} (limit {limit}); retry later")
        self.queued = queued
        self.limit = limit


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs a setattr call per field, per DISPATCH
class Job(Generic[T]):
    """One unit of work, its start tag (fair queuing), and where its outcome goes: `done` (called on
    the compute thread) or else the future, on `loop`."""

    work: Callable[[], T]
    owner: Hashable
    loop: asyncio.AbstractEventLoop | None  # None with `done`: nothing to resolve on a loop
    future: asyncio.Future[T] | None
    start: float = 0.0
    cost: float = 1.0
    batch_key: Hashable | None = None  # jobs with equal keys may run in one batch_work call
    item: Any = None  # what batch_work receives for this job
    done: Done | None = None

    def settle(self, value: Any, error: BaseException | None) -> None:
        """Hand the outcome on (called on the compute thread)."""
        if self.done is not None:
            _call(self.done, value, error)
            return
        try:
            self.loop.call_soon_threadsafe(_resolve, self.future, value, error)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def cancel(self, on_loop: bool = False) -> None:
        """The job will never run: tell `done`, or cancel the future (from the compute thread unless `on_loop`)."""
        if self.done is not None:
            _call(self.done, None, CANCELLED)
        elif on_loop:
            self.future.cancel()
        else:
            try:
                self.loop.call_soon_threadsafe(self.future.cancel)
            except RuntimeError:  # the loop is closed
                pass


def _call(done: Done, value: Any, error: BaseException | None) -> None:
    try:
        done(value, error)
    except Exception:  # the callback's own failure must not end the compute thread
        log.exception("a compute job's outcome could not be delivered")


def _run_alone(job: Job) -> None:
    try:
        value, error = job.work(), None
    except Exception as failure:  # the owner's request failed, not the runner
        value, error = None, failure
    job.settle(value, error)


def _resolve(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled meanwhile: its connection went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class ComputeRunner:
    """A compute thread serving per-owner FIFO queues by fair queuing, at most `queue_limit` jobs
    waiting in all and `owner_limit` (default: no tighter bound) from one owner; jobs of several
    owners may run in one batch_work call (see the module's docstring).

    `submit`, `drop`, `stop` and `close` are called on the event loop; the work runs on the thread.
    A runner is started once and stopped once; it cannot be restarted.
    """

    def __init__(self, queue_limit: int = DEFAULT_QUEUE_LIMIT, name: str = "moeswarm-compute",
                 owner_limit: int | None = None, batch_work: Callable[[list[Any]], list[Any]] | None = None,
                 batch_cost: float = float("inf"), on_idle: Callable[[], None] | None = None):
        """batch_work: runs several jobs' items at once, returning one outcome per item, in order, or
        DECLINED for an item it left (never the first); None: every job runs alone.
        batch_cost: the most cost one batch may add up to.
        on_idle: called (cheap, lock held) each time the runner is left with nothing to run: the
        worker's kernels rest then (qkernels.rest), their threads no longer spinning on cores that
        other processes need while this one waits for the network."""
        if queue_limit < 1:
            raise MoeSwarmError(f"queue limit must be at least 1, got {queue_limit}")
        self.queue_limit = queue_limit
        self.owner_limit = owner_limit or queue_limit
        self._name = name
        self._batch_work = batch_work
        self._batch_cost = batch_cost
        self._on_idle = on_idle or (lambda: None)
        self._ready = threading.Condition()
        # Owners with waiting jobs, in turn order: the head's first job runs next, then that
        # owner goes to the back if it has more.
        self._queues: dict[Hashable, collections.deque[Job]] = {}
        self._finish: dict[Hashable, float] = {}  # each owner's last finish tag, until drop(owner)
        self._virtual_time = 0.0  # the start tag of the job in service
        self._queued = 0
        self._in_service = False  # a job is running (on the compute thread, or the loop's: run_here)
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def queued(self) -> int:
        """Jobs waiting (not counting the one running)."""
        with self._ready:
            return self._queued

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            return
        # A daemon thread: a server whose loop is dropped without close() must not keep the
        # process alive; close() still stops and joins it properly.
        self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
        self._thread.start()

    def submit(self, owner: Hashable, work: Callable[[], T], cost: float = 1.0, batch_key: Hashable | None = None,
               item: Any = None, done: Done | None = None) -> asyncio.Future[T] | None:
        """Queue `work` behind `owner`'s earlier jobs; its future resolves on the calling loop, or
        (given `done`) `done(value, error)` is called on the compute thread and None is returned.

        cost: the job's share of the compute thread (a DISPATCH's tokens); fair queuing weighs by it.
        batch_key, item: the job may run in one batch_work call, given `item`, with other owners'
        jobs of the same key (see the module's docstring); None: it runs alone, as `work()`.
        Raises WorkerBusy when `owner_limit` of `owner`'s jobs are waiting already, or when
        `queue_limit` jobs are waiting and `owner` has one of them.
        """
        loop = asyncio.get_running_loop() if done is None else None  # only a future needs it (3.11 asks getpid())
        with self._ready:
            if self._stopping:
                raise MoeSwarmError("worker is shutting down")
            queue = self._queues.get(owner)
            # An owner with nothing waiting is admitted even when the total is reached: others'
            # floods cannot starve it, and the excess is bounded by one job per owner.
            if self._queued >= self.queue_limit and queue:
                raise WorkerBusy(self._queued, self.queue_limit)
            if queue is not None and len(queue) >= self.owner_limit:
                raise WorkerBusy(len(queue), self.owner_limit, "requests of this connection queued")
            start = max(self._virtual_time, self._finish.get(owner, 0.0))
            self._finish[owner] = start + max(cost, 1.0)
            job = Job(work, owner, loop, None if done else loop.create_future(), start, cost, batch_key, item, done)
            self._queues.setdefault(owner, collections.deque()).append(job)
            self._queued += 1
            self._ready.notify()
        return job.future

    def run_here(self, owner: Hashable, work: Callable[[], T], cost: float, done: Done) -> bool:
        """Run `work` on the calling thread now, then `done(value, error)`, if nothing waits and
        nothing is in service (the store is entered by one thread at a time); False otherwise
        (then `submit` it). Charged to `owner` as `submit` would."""
        ran, _ = self.run_now(owner, lambda: _run_alone(Job(work, owner, None, None, 0.0, cost, done=done)), cost)
        return ran

    def run_now(self, owner: Hashable, work: Callable[[], T], cost: float) -> tuple[bool, T | None]:
        """(True, `work()`) run on the calling thread now, if nothing waits and nothing is in service;
        (False, None) otherwise. Charged to `owner` as `submit` would; `work`'s errors are its caller's."""
        with self._ready:
            if self._stopping or self._queues or self._in_service:
                return False, None
            start = max(self._virtual_time, self._finish.get(owner, 0.0))
            self._finish[owner] = start + max(cost, 1.0)
            self._virtual_time = start
            self._in_service = True
        try:
            return True, work()
        finally:
            with self._ready:
                self._in_service = False
                if self._queues:
                    self._ready.notify()
                else:
                    self._on_idle()

    def charge(self, owner: Hashable, cost: float) -> None:
        """Charge `owner` for `cost` more of work `run_now` ran (it charged the call's own cost)."""
        with self._ready:
            self._finish[owner] = self._finish.get(owner, self._virtual_time) + cost

    def drop(self, owner: Hashable) -> int:
        """Forget `owner`'s jobs that have not started (their futures are cancelled); return how many."""
        with self._ready:
            jobs = self._queues.pop(owner, ())
            self._finish.pop(owner, None)
            self._queued -= len(jobs)
        for job in jobs:
            job.cancel(on_loop=True)
        return len(jobs)

    def stop(self) -> asyncio.Future[None]:
        """Refuse new work, cancel what waits, and let the thread end after its current job.

        Returns a future that resolves once the thread has ended. The join runs in the loop's
        default executor from this call on, so it goes on even if the caller is cancelled while
        waiting, and asyncio.run() waits for it before the interpreter ends: a daemon thread cut
        off in the middle of a torch kernel aborts the process ("terminate called ...").
        """
        with self._ready:
            self._stopping = True
            jobs = [job for queue in self._queues.values() for job in queue]
            self._queues.clear()
            self._finish.clear()
            self._queued = 0
            self._ready.notify_all()
        for job in jobs:
            job.cancel(on_loop=True)
        loop = asyncio.get_running_loop()
        if self._thread is None or not self._thread.is_alive():
            ended = loop.create_future()
            ended.set_result(None)
            return ended
        return loop.run_in_executor(None, self._thread.join)

    async def close(self) -> None:
        """Stop, and wait for the thread to finish its current job (off the loop)."""
        await asyncio.shield(self.stop())

    def _serve(self) -> None:
        while True:
            with self._ready:
                while not self._stopping and (not self._queues or self._in_service):
                    if not self._queues:
                        self._on_idle()
                    self._ready.wait()
                if self._stopping:
                    return
                jobs = self._next_jobs()
                self._in_service = True
            try:
                if len(jobs) > 1:
                    self._run_batch(jobs)
                else:
                    _run_alone(jobs[0])
            finally:
                with self._ready:
                    self._in_service = False

    def _run_batch(self, jobs: list[Job]) -> None:
        """One batch_work call for `jobs`; if it fails as a whole, the lead runs alone instead."""
        try:
            values = self._batch_work([job.item for job in jobs])
        except Exception:
            log.exception("a batch of %d jobs failed: running its first alone", len(jobs))
            values = None
        if values is None or len(values) != len(jobs) or values[0] is DECLINED:
            _run_alone(jobs[0])
            self._requeue(jobs[1:])
            return
        for job, value in zip(jobs, values):
            if value is not DECLINED:
                job.settle(value, None)
        self._requeue([job for job, value in zip(jobs, values) if value is DECLINED])

    def _requeue(self, jobs: list[Job]) -> None:
        """Put declined jobs back at the head of their queues (cancelled if their owner was dropped meanwhile)."""
        with self._ready:
            for job in jobs:
                if self._stopping or job.owner not in self._finish:
                    job.cancel()
                    continue
                self._queues.setdefault(job.owner, collections.deque()).appendleft(job)
                self._queued += 1
            self._ready.notify()

    def _next_jobs(self) -> list[Job]:
        """Pop the head with the smallest start tag (the earliest owner on a tie), and the heads of
        other owners that may run in one batch with it (same batch key, within batch_cost). Lock held."""
        owner = min(self._queues, key=lambda o: self._queues[o][0].start)  # dicts keep insertion order: ties FIFO
        lead = self._pop(owner)
        self._virtual_time = lead.start
        jobs = [lead]
        if lead.batch_key is None or self._batch_work is None:
            return jobs
        cost = lead.cost
        for other in list(self._queues):
            if other == owner:
                continue  # one job per owner: an owner's jobs run in its order
            head = self._queues[other][0]
            if head.batch_key == lead.batch_key and cost + head.cost <= self._batch_cost:
                jobs.append(self._pop(other))
                cost += head.cost
        return jobs

    def _pop(self, owner: Hashable) -> Job:
        queue = self._queues[owner]
        job = queue.popleft()
        if not queue:
            del self._queues[owner]  # its finish tag stays until drop(): it just had its share
        self._queued -= 1
        return job
