"""Choosing tokens from logits: greedy, or sampled (temperature, top-k, top-p, min-p), and verifying drafts.

`verify` is speculative sampling's accept/reject rule for a deterministic draft (n-gram lookup:
the draft distribution q is a point mass on the drafted token). Draft i is kept with probability
p_i(draft_i); on the first rejection the next token comes from the residual max(0, p_i - q_i)
renormalised, which is p_i with the drafted token removed. The emitted tokens then follow the
model's own sampling distribution exactly, whatever the drafts were. Greedy is the same rule
with p a one-hot of the argmax: drafts are kept while they equal it.

The rule is coupled to plain sampling: at each position one token is drawn from p_i, with one
uniform, as plain sampling draws it; the draft is kept when that token is the draft (probability
p_i(draft_i)), and otherwise that token is the step's next one (a draw from p_i given it is not
the draft: the residual). So a seed's tokens are those of plain sampling with that seed, whatever
was drafted: a draft count chosen by measured timings (engine/speculation.py) never changes them.

Penalties (repetition, presence, frequency) and logit_bias change the logits before any of that
(`penalize`, `biased`);
they depend on the tokens so far, so a penalised sequence is decoded without drafts. Log-probabilities
(`top_logprobs`) are the model's own log-softmax, before temperature, filters and penalties.

V = vocabulary size, D = drafted tokens.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

MAX_TEMPERATURE = 100.0
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range
MAX_PENALTY = 10.0
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; completions allow 5, llama-server and vLLM more


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # nucleus: the fewest most likely tokens whose mass reaches top_p; 1.0: off
    top_k: int = 0  # the k most likely tokens (and any tied with the k-th); 0: off
    seed: int | None = None  # None: seeded from the OS's entropy
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest one; 0.0: off
    repetition_penalty: float = 1.0  # CTRL's: a seen token's logit divided (if > 0) or multiplied by it; 1.0: off
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from a token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per time a token was generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: (token, -100 to 100) added to its logit

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not (math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be a number from 0 to {MAX_TEMPERATURE:g}, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_integer(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0: off), got {self.top_k!r}")
        if self.seed is not None and (not _is_integer(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer from 0 to 2**64 - 1, got {self.seed!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_PENALTY:
            raise ValueError(f"repetition_penalty must be a number in (0, {MAX_PENALTY:g}], got {self.repetition_penalty!r}")
        if any(not _is_integer(t) or t < 0 or not _is_number(b) or not -100 <= b <= 100 for t, b in self.logit_bias):
            raise ValueError("logit_bias maps token ids to numbers from -100 to 100")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number from -2 to 2, got {value!r}")

    @property
    def penalised(self) -> bool:
        """Whether the logits depend on the tokens so far (then no drafts: each position needs its own history)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def greedy(self) -> bool:
        """The argmax every time: temperature 0, or only the top token kept."""
        return self.temperature == 0 or self.top_k == 1


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with `seed`, or from the OS's entropy when None (`initial_seed()` tells which)."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(os.urandom(8), "little") if seed is None else seed)
    return generator


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution: logits [V] or [n, V], any float dtype -> float32, same shape.

    Temperature, then top-k, then min-p, then top-p (vLLM's order); filtered-out tokens
    get exactly 0. Greedy params give a one-hot of the argmax.
    """
    rows = logits.detach().float().reshape(-1, logits.shape[-1])  # [n, V]
    if params.greedy:
        probs = torch.zeros_like(rows)  # [n, V]
        probs.scatter_(-1, rows.argmax(-1, keepdim=True), 1.0)
        return probs.reshape(logits.shape)
    # The max subtracted first: a tiny temperature then gives -inf, never inf - inf.
    scaled = (rows - rows.max(-1, keepdim=True).values) / params.temperature  # [n, V], max 0
    vocab = rows.shape[-1]
    if 0 < params.top_k < vocab:
        kth = scaled.topk(params.top_k, dim=-1).values[:, -1:]  # [n, 1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = torch.softmax(scaled, dim=-1)  # [n, V]
    if params.min_p > 0:
        floor = params.min_p * probs.max(-1, keepdim=True).values  # [n, 1]
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [n, V] each
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [n, V]: mass of the tokens ranked above
        outside = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, mass_before >= params.top_p)
        probs = probs.masked_fill(outside, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs.reshape(logits.shape)


def penalize(logits: torch.Tensor, context: list[int], output_count: int, params: SamplingParams) -> torch.Tensor:
    """logits [V] with the penalties applied (a new tensor; the same one when there are none).

    context: every token so far, prompt then output; its last `output_count` are the output. The
    repetition penalty counts them all (as transformers and vLLM do); presence and frequency
    penalties count the output only (as OpenAI does).
    """
    if not params.penalised or not context:
        return logits
    logits = logits.detach().float().clone()  # [V]
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(context)), dtype=torch.long)  # [S]
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    output = context[len(context) - output_count:] if output_count else []
    if output and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).float()  # [V]
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits


def biased(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] with params.logit_bias added (a new tensor; the same one when there is none).
    The same at every position, so drafts are verified against the biased distribution alike."""
    if not params.logit_bias:
        return logits
    logits = logits.detach().float().clone()
    tokens, values = zip(*params.logit_bias)
    logits[..., list(tokens)] += torch.tensor(values, dtype=torch.float32)
    return logits


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """The model's log-probabilities: log-softmax of logits [..., V] in float32 (no temperature, no filter)."""
    return torch.log_softmax(logits.detach().float(), dim=-1)


def top_logprobs(row: torch.Tensor, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """(log-probability of `token`, the `top` likeliest (token, log-probability), likeliest first) of
    log-probabilities row [V]; ties keep the lower token id first."""
    chosen = float(row[token])
    if top <= 0:
        return chosen, ()
    values, ids = row.topk(min(top, row.shape[-1]), sorted=True)  # [top] each
    pairs = sorted(zip(ids.tolist(), values.tolist()), key=lambda pair: (-pair[1], pair[0]))
    return chosen, tuple(pairs)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from logits [V]: the argmax when greedy (torch.argmax's tie-break), else one draw."""
    if params.greedy:
        return int(logits.argmax())
    return _draw(probabilities(logits, params), generator)


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
           generator: torch.Generator) -> tuple[int, int]:
    """(accepted, next_token): how many of the D drafts to keep, and the token that follows them.

    logits [1 + D, V]: the model's logits at the last accepted token and at each drafted token.
    """
    if logits.dim() != 2 or logits.shape[0] != 1 + len(drafts):
        raise ValueError(f"verify needs logits [1 + D, V] for D = {len(drafts)} drafts, got {list(logits.shape)}")
    if params.greedy:
        best = logits.argmax(dim=-1).tolist()  # [1 + D]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == best[accepted]:
            accepted += 1
        return accepted, best[accepted]
    probs = probabilities(logits, params)  # [1 + D, V]
    for position, draft in enumerate(drafts):
        token = _draw(probs[position], generator)  # the token plain sampling draws here, with the same uniform
        if token != draft:  # kept with probability p(draft); else a token of p without the draft: the residual
            return position, token
    return len(drafts), _draw(probs[-1], generator)


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One index from non-negative weights [V] (any total), by inverse CDF in float64.

    A zero weight is never drawn: it would need cdf[i - 1] <= u < cdf[i] = cdf[i - 1].
    """
    cdf = weights.double().cumsum(0)  # [V]
    point = _uniform(generator) * float(cdf[-1])
    index = int(torch.searchsorted(cdf, torch.tensor([point], dtype=torch.float64), right=True)[0])
    if index == len(cdf):  # u * total rounded up to the total: the last token with weight
        index = int(weights.nonzero()[-1, 0])
    return index


def _uniform(generator: torch.Generator) -> float:
    """A float64 from [0, 1)."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
