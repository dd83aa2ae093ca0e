"""What the goodput rule (generation/goodput.py) is fed: live acceptance per draft position, and the
step's cost as a line in the tokens it feeds. Numbers in, numbers out: the engine passes the
seconds it measured.

Acceptance: after a verify step whose kept draft had D tokens of which m were kept, positions 1..m
were each accepted and position m + 1 (when m < D) rejected; later positions were not tried and
keep their value. Each position's value is an EMA (weight ACCEPT_WEIGHT to the newest), starting
at PRIOR: a drafter starts trusted, and a few rejections bring it down.

Calibration: what drafts of each estimated strength really keep (a drafter that scores its own drafts,
generation/draft_support.py). The estimates' range is cut into BUCKETS; each bucket counts the
positions tried at an estimate in it and those kept, decayed by DECAY per new outcome there, and
starts from TRUST pseudo-tries kept at the estimate itself: a fresh engine takes a drafter's word,
and a few outcomes correct it where it is wrong (rejections at 0.3: sampled text; keeps at 0.7:
text the model copies). The buckets are per drafter, engine-wide: a long-lived server's later
requests start from what its earlier ones measured.

Cost: decode steps' seconds per count of tokens fed, each count's cost the median of its last
COST_WINDOW steps, and a least-squares line through those medians, each weighted by its steps. A
count enters the line once MIN_STEPS steps measured it: one step's time is no estimate of a count's
cost (a load spike, the first step of a new shape or of a first set of branches: docs/drafts.md),
and a line through one such step and a well-measured count makes rows look dear, so K = 0, so the
count is never measured again: the estimate confirms itself. Until two counts qualify the slope is unknown and taken as the floor: MIN_TOKEN_SHARE of a
one-token step per extra token (a row is never quite free: its bytes, its experts, its compute),
which also bounds a noisy fit's slope from below; drafting at the floor is what measures the rows.
"""

from __future__ import annotations

from moeswarm.generation.goodput import StepCost

PRIOR = 0.5  # a position's acceptance before any verify step tried it
ACCEPT_WEIGHT = 0.4  # of the newest outcome in a position's EMA (7 rejections take a position from PRIOR to 2 %)
COST_WEIGHT = 0.25  # of the newest drafting time in its EMA
COST_WINDOW = 5  # a token count's latest steps, whose median is its cost
MIN_STEPS = 2  # steps a token count needs before it enters the cost line
MIN_TOKEN_SHARE = 0.02  # the least a token costs, as a share of a one-token step
MAX_POSITIONS = 64  # positions tracked (drafts past them count as the last one's)
MAX_COUNTS = 256  # token counts whose cost is kept (the most recent)
BUCKETS = 10  # of the estimates' range [0, 1]
TRUST = 3.0  # pseudo-tries a bucket starts from, kept at the estimate's own rate
DECAY = 0.95  # a bucket's counts' weight kept per new outcome in it (about the last 20 count)


class Acceptance:
    """A drafter's acceptance per draft position: an EMA each."""

    def __init__(self, values: list[float] | None = None):
        self.values = list(values) if values is not None else []
        self.drafts = self.drafted = self.accepted = 0  # verify steps with drafts, their draft tokens, kept ones
        self.accepted_at: list[int] = []  # per position: drafts kept there (vLLM's num_accepted_tokens_per_pos)

    def rates(self, positions: int) -> list[float]:
        """a_1..a_positions (PRIOR where never tried)."""
        known = self.values[:positions]
        return known + [PRIOR] * (positions - len(known))

    def record(self, drafted: int, accepted: int, counted: bool = True) -> None:
        """One verify step: `accepted` of the `drafted` tokens of its kept draft were kept (counted: a
        draft really fed, not a shadow one scored against the output: engine/speculation.py)."""
        if drafted <= 0:
            return
        drafted = min(drafted, MAX_POSITIONS)
        accepted = max(0, min(accepted, drafted))
        tried = min(drafted, accepted + 1)
        while len(self.values) < tried:
            self.values.append(PRIOR)
        for position in range(tried):
            outcome = 1.0 if position < accepted else 0.0
            self.values[position] += ACCEPT_WEIGHT * (outcome - self.values[position])
        if counted:
            self.observe(drafted, accepted)

    def observe(self, drafted: int, accepted: int) -> None:
        """Count a verified draft (what the metrics report); `record` calls it."""
        self.drafts += 1
        self.drafted += drafted
        self.accepted += accepted
        while len(self.accepted_at) < accepted:
            self.accepted_at.append(0)
        for position in range(accepted):
            self.accepted_at[position] += 1


class Calibration:
    """A drafter's estimates (draft_support.py's e_i) mapped to acceptance, by what was kept."""

    def __init__(self):
        self.tried = [0.0] * BUCKETS  # decayed counts of positions tried with an estimate in the bucket
        self.kept = [0.0] * BUCKETS  # of those, kept

    def rate(self, estimate: float) -> float:
        """The acceptance a position estimated at `estimate` has had: its bucket's kept share, with
        TRUST pseudo-tries at the estimate."""
        estimate = min(max(estimate, 0.0), 1.0)
        b = _bucket(estimate)
        return (self.kept[b] + TRUST * estimate) / (self.tried[b] + TRUST)

    def rates(self, estimates: list[float]) -> list[float]:
        return [self.rate(e) for e in estimates]

    def record(self, estimates: list[float], accepted: int) -> None:
        """One verified draft whose positions had `estimates`: the first `accepted` kept, the next (if
        any) rejected, the rest not tried."""
        accepted = max(0, min(accepted, len(estimates)))
        self.record_positions([(estimates[p], p < accepted) for p in range(min(len(estimates), accepted + 1))])

    def record_positions(self, outcomes: list[tuple[float, bool]]) -> None:
        """Tried positions, each (its estimate, whether it was kept)."""
        for estimate, kept in outcomes:
            b = _bucket(min(max(estimate, 0.0), 1.0))
            self.tried[b] = DECAY * self.tried[b] + 1.0
            self.kept[b] = DECAY * self.kept[b] + (1.0 if kept else 0.0)


def _bucket(estimate: float) -> int:
    return min(int(estimate * BUCKETS), BUCKETS - 1)


class CostModel:
    """Decode steps' seconds by tokens fed, and the line through them."""

    def __init__(self):
        self.by_tokens: dict[int, list[float]] = {}  # tokens fed -> its latest steps' seconds (up to COST_WINDOW)
        self.draft_s: float | None = None  # drafting seconds of a drafting step (EMA)

    def record(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds >= 0:
            return
        steps = self.by_tokens.pop(tokens, [])  # re-inserted: the dict's order is recency
        self.by_tokens[tokens] = (steps + [seconds])[-COST_WINDOW:]
        if len(self.by_tokens) > MAX_COUNTS:
            del self.by_tokens[next(iter(self.by_tokens))]

    def record_drafting(self, seconds: float) -> None:
        if seconds >= 0:
            self.draft_s = seconds if self.draft_s is None else self.draft_s + COST_WEIGHT * (seconds - self.draft_s)

    @property
    def measured(self) -> bool:
        return bool(self.by_tokens)

    def line(self) -> StepCost:
        """The step's cost: weighted least squares through the counts measured MIN_STEPS times, the
        slope floored; with fewer than two such counts, the floor through the best-measured count."""
        points = [(x, _median(steps), len(steps)) for x, steps in self.by_tokens.items()]  # (tokens, seconds, weight)
        if not points:
            return StepCost(1.0, MIN_TOKEN_SHARE, 0.0)  # nothing measured: only the shape matters
        qualified = [p for p in points if p[2] >= MIN_STEPS]
        if len(qualified) < 2:
            x, y, _ = max(qualified or points, key=lambda p: p[2])  # the first seen on a tie
            one = y / (1 + MIN_TOKEN_SHARE * (x - 1))  # a one-token step, on the floor's line
            return StepCost(one * (1 - MIN_TOKEN_SHARE), one * MIN_TOKEN_SHARE, self.draft_s or 0.0)
        total = sum(w for _, _, w in qualified)
        mean_x = sum(w * x for x, _, w in qualified) / total
        mean_y = sum(w * y for _, y, w in qualified) / total
        spread = sum(w * (x - mean_x) ** 2 for x, _, w in qualified)
        slope = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in qualified) / spread
        one = max(mean_y - slope * (mean_x - 1), 1e-9)  # a one-token step, on the line
        slope = max(slope, MIN_TOKEN_SHARE * one)
        fixed = max(mean_y - slope * mean_x, 0.0)
        return StepCost(fixed, slope, self.draft_s or 0.0)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
