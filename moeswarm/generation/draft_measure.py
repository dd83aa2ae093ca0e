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

Cost: decode steps' seconds, kept as an EMA per count of tokens fed, and a least-squares line
through those averages. Until two counts have been seen the slope is unknown and taken as the
floor: MIN_TOKEN_SHARE of a one-token step per extra token (a row is never quite free: its bytes,
its experts, its compute), which also bounds a noisy fit's slope from below.
"""

from __future__ import annotations

from moeswarm.generation.goodput import StepCost

PRIOR = 0.5  # a position's acceptance before any verify step tried it
ACCEPT_WEIGHT = 0.4  # of the newest outcome in a position's EMA (7 rejections take a position from PRIOR to 2 %)
COST_WEIGHT = 0.25  # of the newest step in a token count's EMA
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
        for position in range(min(len(estimates), accepted + 1)):
            b = _bucket(min(max(estimates[position], 0.0), 1.0))
            self.tried[b] = DECAY * self.tried[b] + 1.0
            self.kept[b] = DECAY * self.kept[b] + (1.0 if position < accepted else 0.0)


def _bucket(estimate: float) -> int:
    return min(int(estimate * BUCKETS), BUCKETS - 1)


class CostModel:
    """Decode steps' seconds by tokens fed, and the line through them."""

    def __init__(self):
        self.by_tokens: dict[int, float] = {}  # tokens fed -> seconds (EMA)
        self.draft_s: float | None = None  # drafting seconds of a drafting step (EMA)

    def record(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds >= 0:
            return
        old = self.by_tokens.pop(tokens, None)  # re-inserted: the dict's order is recency
        self.by_tokens[tokens] = seconds if old is None else old + COST_WEIGHT * (seconds - old)
        if len(self.by_tokens) > MAX_COUNTS:
            del self.by_tokens[next(iter(self.by_tokens))]

    def record_drafting(self, seconds: float) -> None:
        if seconds >= 0:
            self.draft_s = seconds if self.draft_s is None else self.draft_s + COST_WEIGHT * (seconds - self.draft_s)

    @property
    def measured(self) -> bool:
        return bool(self.by_tokens)

    def line(self) -> StepCost:
        """The step's cost: least squares through the per-count averages, the slope floored."""
        points = list(self.by_tokens.items())
        if not points:
            return StepCost(1.0, MIN_TOKEN_SHARE, 0.0)  # nothing measured: only the shape matters
        n = len(points)
        mean_x = sum(x for x, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        spread = sum((x - mean_x) ** 2 for x, _ in points)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
        one = max(mean_y - slope * (mean_x - 1), 1e-9)  # a one-token step, on the line
        slope = max(slope, MIN_TOKEN_SHARE * one)
        fixed = max(mean_y - slope * mean_x, 0.0)
        return StepCost(fixed, slope, self.draft_s or 0.0)
