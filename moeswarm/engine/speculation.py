"""The engine's speculation hook: each sequence's draft count per step, by the goodput rule.

Per step, before the sequences draft (`plan`), each drafting sequence's K comes from
generation/goodput.py's `choose_k`, fed by what this engine measured: its decode steps' seconds by
tokens fed (generation/draft_measure.py's CostModel: remote trips make the intercept, rows the
slope) and the sequence's acceptance per draft position (an EMA, seeded from its drafter's across
the engine's earlier sequences). `--speculate K` caps K; K = 0 when drafting is not expected to beat
plain decoding.

A drafter that scores its own drafts (the model-free ones: generation/draft_support.py) is sized by
each draft's evidence: the sequence drafts up to the cap, `size` reads the drafts' acceptance
estimates per position through the drafter's Calibration (generation/draft_measure.py: what drafts
of that strength have kept, engine-wide), a greedy step's branches taken as one step (goodput.py's
`branch_acceptance`), and keeps the drafter's first n drafts cut to K, the pair the rule picks
(`choose_branches`: a rival branch is fed only where its row pays). Greedy, the first draft's rate
at each position is at least the sequence's acceptance EMA there, once a first draft was tried
there: for such a drafter the EMA follows the first draft's outcomes (the metrics still count the
kept one's), so it lifts the draft it measured, not the step's rivals. A strongly supported draft (a
file being re-emitted) is fed long from the first step, an unsupported one (sampled text, a prompt
that repeats nothing) not at all; the drafts are then the step's shadow drafts. Every draft of a
fed step, dropped ones included, is judged against the emitted tokens for the calibration (the
output never depends on the drafts, so a dropped draft's outcome is the one it would have had).
Other drafters are sized by the sequence's acceptance EMA before they draft (`plan`).

A sequence at K = 0 still learns: while its K is 0 it asks its drafter for a shadow draft (every
step for the model-free drafters, every PROBE_EVERY steps for those that run forwards), never fed,
and scores it against the tokens the model then emits, so acceptance that returns (a file being
re-emitted) brings K back. Greedy, a shadow draft is kept exactly as a verify step would keep it;
sampled, a draft token is kept exactly when the model samples it (generation/sampling.py's coupled
rule), so the shadow's odds are a real draft's.

Without adaptation (EngineConfig.adaptive false: the library's default, `--speculate-policy
fixed`) every step drafts up to the cap, as before; the acceptance is still counted (metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moeswarm.generation.draft_measure import Acceptance, Calibration, CostModel
from moeswarm.generation.draft_names import AUTO_SPECULATE
from moeswarm.generation.goodput import StepCost, choose_branches, choose_k, own_rows
from moeswarm.errors import MoeSwarmError
from moeswarm.forward.packed import JOURNAL, keeps_recurrent_state

FREE_DRAFTERS = ("ngram", "suffix")  # a lookup, no forward: shadow drafts every step
PROBE_EVERY = 8  # steps between shadow drafts of a drafter that runs forwards
HISTORY = 1024  # a sequence's K per step kept for its report (the first ones)


@dataclass
class SequenceDrafts:
    """One sequence's speculation figures and state."""

    acceptance: Acceptance
    chosen: int = -1  # the K of its latest decode step (-1: none yet)
    chosen_sum: int = 0  # summed over its decode steps (mean K = chosen_sum / steps)
    steps: int = 0  # its decode steps
    fed: int = 1  # tokens it fed in its latest step
    rows: int = 1  # rows (branches) it fed in its latest drafting step
    shadow: tuple[int, list[list[int]]] | None = None  # (context length drafted at, drafts) while K = 0
    shadow_estimates: list[list[float]] | None = None  # the shadow drafts' estimates (a drafter scoring its drafts)
    since_probe: int = 0
    history: list[int] = field(default_factory=list)  # K per decode step, the first HISTORY
    sizing: tuple[StepCost, int] | None = None  # (cost line, other sequences' tokens) while its drafts await `size`
    estimated: tuple[int, list[list[int]], list[list[float]]] | None = None  # (context length, drafts cut to K, estimates): the first fed

    def summary(self) -> dict:
        a = self.acceptance
        return {"speculate_chosen": max(self.chosen, 0),
                "speculate_mean": self.chosen_sum / self.steps if self.steps else 0.0,
                "speculate_per_step": list(self.history),
                "acceptance_per_position": [round(v, 4) for v in a.values],
                "accepted_per_position": list(a.accepted_at),
                "verify_drafts": a.drafts,
                "mean_accepted_per_draft": a.accepted / a.drafts if a.drafts else None}


@dataclass
class Speculation:
    cap: int  # --speculate: the most drafts per row
    adaptive: bool  # the goodput rule chooses K (else: always the cap)
    cost: CostModel = field(default_factory=CostModel)
    by_drafter: dict[str, Acceptance] = field(default_factory=dict)  # "suffix/greedy" -> engine-wide acceptance
    calibrations: dict[str, Calibration] = field(default_factory=dict)  # "suffix/greedy" -> its estimates' calibration
    totals: Acceptance = field(default_factory=Acceptance)  # every sequence's verified drafts (the metrics)

    def start(self, sequence) -> SequenceDrafts:
        shared = self.by_drafter.get(_key(sequence))
        return SequenceDrafts(Acceptance(shared.values if shared is not None else None))

    def plan(self, sequences: list, states: list[SequenceDrafts]) -> None:
        """Set each decoding sequence's draft limit for this step (Sequence.k_limit; adaptive only): the
        cap for a drafter that scores its drafts (`size` cuts them), else the rule's K from the EMA."""
        decoding = [(s, d) for s, d in zip(sequences, states) if not s.prefill_left and s.max_drafts > 0]
        total = sum(d.fed for _, d in decoding)
        line = self.cost.line() if self.adaptive else None
        for sequence, drafts in decoding:
            cap = sequence.max_drafts
            k = cap  # fixed: the sequence's own length rule within the cap (engine/sequence.py)
            if line is not None:
                if hasattr(sequence.drafter, "support"):
                    sequence.k_limit, drafts.sizing = cap, (line, total - drafts.fed)
                    continue  # its K is chosen once its drafts are seen
                rows = drafts.rows if sequence.job.params.greedy else 1
                k = choose_k(drafts.acceptance.rates(cap), line, cap, rows, total - drafts.fed)
                sequence.k_limit = k
            _chosen(drafts, k)

    def size(self, sequence, drafts: SequenceDrafts) -> None:
        """After drafting at the cap (`plan`): feed the first drafts cut to the K their calibrated
        estimates earn (`choose_branches`); at K = 0 they become its shadow drafts."""
        if drafts.sizing is None:
            return
        (line, base), drafts.sizing = drafts.sizing, None
        found = [b for b in sequence.branches if b]
        k = 0
        if found:
            calibration = self.calibrations.setdefault(_key(sequence), Calibration())
            estimates = sequence.drafter.support(sequence.context, found, sequence.job.params.greedy)  # [branch][position]
            rates = [calibration.rates(e) for e in estimates]  # [branch][position]
            if sequence.job.params.greedy:  # weak greedy drafts are kept more than estimated (docs/drafts.md):
                measured = drafts.acceptance.values  # what this text's first drafts kept, once tried, lifts the first
                rates[0] = [max(r, measured[i] if i < len(measured) else 0.0) for i, r in enumerate(rates[0])]
            fed, k = choose_branches(found, rates, line, sequence.max_drafts, base)
            if k:
                judged, judged_estimates = _cut(found, estimates, k)  # fed or dropped, each is judged
                drafts.estimated = (len(sequence.context), judged, judged_estimates)
                sequence.branches = own_rows([draft[:k] for draft in found[:fed]])
            else:
                if drafts.shadow is None:
                    drafts.shadow, drafts.shadow_estimates = (len(sequence.context), found), estimates
                sequence.branches = [[]]
        sequence.k_limit = k
        _chosen(drafts, k)

    def shadow(self, sequence, drafts: SequenceDrafts) -> None:
        """After planning: a sequence at K = 0 drafts without feeding, to keep learning its acceptance."""
        if (not self.adaptive or sequence.k_limit != 0 or sequence.prefill_left or drafts.shadow is not None
                or sequence.max_drafts <= 0 or hasattr(sequence.drafter, "support")):  # `size` kept its drafts as shadows
            return
        drafts.since_probe += 1
        if sequence.drafter.name not in FREE_DRAFTERS and drafts.since_probe < PROBE_EVERY:
            return
        drafts.since_probe = 0
        limit = min(sequence.max_drafts, sequence.job.max_tokens - len(sequence.output) - 1)
        if limit <= 0:
            return
        if sequence.branching:
            found = [b for b in sequence.drafter.branches(sequence.context, sequence.stepper, limit) if b]
        else:
            found = [b for b in [sequence.drafter.draft(sequence.context, sequence.stepper, limit)] if b]
        if found:
            drafts.shadow = (len(sequence.context), found)

    def after_step(self, sequence, drafts: SequenceDrafts, fed: int, rows: int, drafted: int, accepted: int) -> None:
        """A decode step's outcome for `sequence`: `accepted` of the `drafted` tokens of its kept draft."""
        drafts.fed = fed
        first = None  # (tokens, kept) of the first draft, which the EMA follows for a drafter scoring its drafts
        if drafted and drafts.estimated is not None:
            at, judged, estimates = drafts.estimated
            emitted = sequence.context[at:]
            first = (len(judged[0]), _kept(judged[0], emitted))
            self._calibrate(sequence, emitted, judged, estimates)
        if drafted:
            drafts.rows = rows
            self._record(sequence, drafts, drafted, accepted, first=first)
        drafts.estimated = None
        if drafts.shadow is not None:
            self._score_shadow(sequence, drafts)

    def record_step(self, tokens: int, seconds: float, drafting_s: float | None) -> None:
        """A decode step's wall time over the `tokens` it fed; drafting_s: its drafting, when it drafted."""
        self.cost.record(tokens, seconds)
        if drafting_s is not None:
            self.cost.record_drafting(drafting_s)

    def _record(self, sequence, drafts: SequenceDrafts, drafted: int, accepted: int, fed: bool = True,
                first: tuple[int, int] | None = None) -> None:
        """`accepted` of the `drafted` tokens of the kept draft; the EMA follows `first` (tokens, kept)
        where given (the first draft's outcome: a drafter scoring its drafts), else the kept draft's."""
        shared = self.by_drafter.setdefault(_key(sequence), Acceptance())
        for acceptance in (drafts.acceptance, shared):
            acceptance.record(*(first or (drafted, accepted)), counted=False)
            if fed:
                acceptance.observe(drafted, accepted)
        if fed:
            self.totals.observe(drafted, accepted)

    def _calibrate(self, sequence, emitted: list[int], drafts: list[list[int]], estimates: list[list[float]]) -> None:
        """Verified drafts' estimates against the tokens the model then `emitted`: every branch's
        positions that were tried (the prefix before them kept), each distinct prefix once; the kept
        branch's alone would count its rivals' misses nowhere and its own luck as the estimates' worth."""
        calibration, seen = self.calibrations[_key(sequence)], set()
        for draft, scored in zip(drafts, estimates):
            kept = _kept(draft, emitted)
            judged = min(len(draft), kept + 1, len(emitted))  # positions tried whose outcome is known
            fresh = [j for j in range(judged) if tuple(draft[: j + 1]) not in seen]
            seen.update(tuple(draft[: j + 1]) for j in fresh)
            calibration.record_positions([(scored[j], j < kept) for j in fresh])

    def _score_shadow(self, sequence, drafts: SequenceDrafts) -> None:
        at, found = drafts.shadow
        emitted = sequence.context[at:]
        best, best_len, settled = -1, 0, True
        for draft in found:
            kept = _kept(draft, emitted)
            settled &= kept < len(emitted) or kept == len(draft)  # a mismatch seen, or the whole draft kept
            if kept > best:
                best, best_len = kept, len(draft)
        if settled or sequence.done:
            scored = drafts.shadow_estimates is not None  # a drafter scoring its drafts: the EMA follows the first
            if scored:
                self._calibrate(sequence, emitted, found, drafts.shadow_estimates)
            drafts.shadow = drafts.shadow_estimates = None
            first = (len(found[0]), _kept(found[0], emitted)) if scored else None
            self._record(sequence, drafts, best_len, best, fed=False, first=first)

    def summary(self) -> dict:
        """The engine's verified drafts, vLLM's counters' figures (engine/spec_metrics.py, the dashboard)."""
        t = self.totals
        return {"cap": self.cap, "adaptive": self.adaptive, "drafts": t.drafts, "draft_tokens": t.drafted,
                "accepted_tokens": t.accepted, "accepted_per_position": list(t.accepted_at),
                "mean_accepted_per_draft": t.accepted / t.drafts if t.drafts else None,
                "acceptance_per_position": {key: [round(v, 4) for v in a.values] for key, a in self.by_drafter.items()}}


def _cut(drafts: list[list[int]], estimates: list[list[float]], k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The drafts cut to K tokens, each distinct one once (drafts may share their first K), with their estimates."""
    cut: list[list[int]] = []
    cut_estimates: list[list[float]] = []
    for draft, scored in zip(drafts, estimates):
        if draft[:k] not in cut:
            cut.append(draft[:k])
            cut_estimates.append(scored[:k])
    return cut, cut_estimates


def _kept(draft: list[int], emitted: list[int]) -> int:
    """How many of the draft's first tokens the model emitted."""
    kept = 0
    while kept < min(len(draft), len(emitted)) and draft[kept] == emitted[kept]:
        kept += 1
    return kept


def _chosen(drafts: SequenceDrafts, k: int) -> None:
    drafts.chosen, drafts.chosen_sum, drafts.steps = k, drafts.chosen_sum + k, drafts.steps + 1
    if len(drafts.history) < HISTORY:
        drafts.history.append(k)


def _key(sequence) -> str:
    return f"{sequence.drafter.name}/{'greedy' if sequence.job.params.greedy else 'sampled'}"


def has_remote_trips(swarm) -> bool:
    """Whether a step waits on other machines: remote expert holders, or a gateway's chain of stages
    (where speculation is on by default: the commands' `--speculate` unset)."""
    return bool(getattr(swarm, "remote", False)) or hasattr(swarm.model, JOURNAL)


def resolve_speculation(config, swarm):
    """An EngineConfig with its default speculation decided (speculate None): AUTO_SPECULATE drafts
    (under the goodput rule when config.adaptive, as the commands ask by default) where a step has
    remote trips, none where it has not, nor on a model with recurrent layers (whose state cannot
    take rejected drafts back: a MoeSwarmError when drafts are asked for there)."""
    if keeps_recurrent_state(swarm.model):
        if config.speculate:
            raise MoeSwarmError(f"--speculate {config.speculate}: {swarm.model.config.model_type} has recurrent layers, "
                                "whose state cannot take rejected drafts back: leave --speculate unset or give 0")
        return replace(config, speculate=0)
    if config.speculate is not None:
        return config
    if has_remote_trips(swarm):
        return replace(config, speculate=AUTO_SPECULATE)
    return replace(config, speculate=0)
