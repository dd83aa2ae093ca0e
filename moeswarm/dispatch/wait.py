"""How a backbone waits for a decode step's replies: spinning, or asleep in poll, as this machine rewards.

A core with nothing to run halts, and on a virtual machine waking it can cost far more than the
wake-up itself: a backbone asleep through each layer call runs its attention slower after it,
while a backbone spinning for the reply takes a core from workers on the same cores
(docs/measured.md, "wait").

A third mode sits between them: dozing, asleep through most of a reply's expected wait (its
holder's median round trip) and spinning for the rest, so that the core is awake when the reply
comes and is left to the holders meanwhile.

Which holds depends on where the holders run and what else the cores do, which a backbone cannot
see; so it measures. Decode layer calls come one after another, and the time from one call's send
to the next one's (the wait, then the backbone's own work up to the next layer) is what the wait
changes. The cost of a halted core lasts longer than one call (taking turns call by call, both
modes measured the same on that VM), so `WaitPolicy` makes a trial of blocks of BLOCK calls, the
modes in turn (a machine whose speed drifts meanwhile weighs on both alike), TRIAL calls of each,
leaving out each block's first SETTLE intervals (still the other mode's). It keeps the mode whose
median interval is lowest, a mode that costs more CPU only where it is faster by more than TIE
(asleep, dozing, spinning: in that order), and tries again every RETRY calls.
Plain data: the dispatcher feeds it the clock (`observe`) and asks how long to spin (`spin_s`).
"""

from __future__ import annotations

import statistics

SPIN_S = 0.01  # the longest a lane call spins for its replies before it sleeps in poll
TRIAL = 64  # calls per mode in a trial (12 decode steps of a 16-layer model in all)
BLOCK = 16  # a trial's calls in a row in one mode
SETTLE = 2  # intervals at a block's start left out
RETRY = 4096  # calls between trials
LONGEST_S = 0.25  # an interval longer than this is a pause between steps, not a step's layer cycle
TIE = 0.98  # a mode that costs more CPU must be at least 2 % faster to be kept

DOZE_SHARE = 0.7  # a dozing call sleeps through this share of its holder's median round trip,
DOZE_MARGIN_S = 150e-6  # and wakes at least this long before that median

SLEEP, DOZE, SPIN = "sleep", "doze", "spin"
MODES = (SLEEP, DOZE, SPIN)  # the least CPU first


def doze_s(median_s: float | None, elapsed_s: float) -> float:
    """How long a dozing call sleeps for its reply, `elapsed_s` after its send, where its holder's
    median round trip is `median_s` (None: not measured yet, it spins at once)."""
    if median_s is None:
        return 0.0
    return max(0.0, min(DOZE_SHARE * median_s, median_s - DOZE_MARGIN_S) - elapsed_s)


class WaitPolicy:
    """The wait mode for the next decode layer call, learned from the intervals between them."""

    def __init__(self):
        self.mode = SLEEP  # the mode of the call now being made
        self.chosen = SLEEP  # the mode the last trial kept
        self.trials = 0  # trials completed
        self._intervals: dict[str, list[float]] = {mode: [] for mode in MODES}
        self._last: float | None = None  # the previous call's send (time.perf_counter())
        self._trial = 0  # calls made in the trial under way; None: settled on `chosen`
        self._settled = 0  # calls made since the last trial ended

    def spin_s(self) -> float:
        """How long the current call spins for its replies before it sleeps (dozing: after its doze)."""
        return 0.0 if self.mode == SLEEP else SPIN_S

    @property
    def dozes(self) -> bool:
        """Whether the current call sleeps through most of its reply's expected wait first (`doze_s`)."""
        return self.mode == DOZE

    def observe(self, now: float) -> None:
        """A decode layer call is sent at `now`: the interval since the last one is the last call's
        mode's; then the mode of this call is chosen."""
        if (self._last is not None and self._trial and (self._trial - 1) % BLOCK >= SETTLE
                and now - self._last <= LONGEST_S):
            self._intervals[self.mode].append(now - self._last)  # the interval the last trial call began
        self._last = now
        if self._trial is None:
            self._settled += 1
            if self._settled < RETRY:
                return
            self._trial, self._intervals = 0, {mode: [] for mode in MODES}  # the machine may have changed
        if self._trial == len(MODES) * TRIAL:
            self._settle()
            return
        self.mode = MODES[self._trial // BLOCK % len(MODES)]
        self._trial += 1

    def _settle(self) -> None:
        medians = {mode: statistics.median(seen) for mode, seen in self._intervals.items() if seen}
        if len(medians) == len(MODES):
            best = SLEEP
            for mode in MODES[1:]:  # costlier in CPU each: kept where faster by more than TIE
                if medians[mode] < TIE * medians[best]:
                    best = mode
            self.chosen = best
        self.trials += 1
        self.mode, self._trial, self._settled = self.chosen, None, 0
