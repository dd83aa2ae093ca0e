"""Sampling and speculative verification: exact filtering, and the output distribution, measured.

The statistical tests draw with fixed seeds, so they give the same counts on every run (no
flakes), yet a wrong accept/reject rule moves the counts far past the bounds: each test's
docstring says what it guards. Counts are judged by a chi-square test (scipy) and by a bound on
the total variation distance, computed from the counts alone.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from moeswarm.generation.sampling import SamplingParams, make_generator, probabilities, sample, verify
from moeswarm.generation.stops import find_stop, held_back
from moeswarm.generation.stream import TextStream

V = 6
# The next token's logits after each token of a tiny vocabulary: a "model" whose distribution
# depends on the context, so the joint law of two emitted tokens is a real test.
TABLE = torch.tensor([
    [2.0, 1.0, 0.5, 0.0, -1.0, 0.3],
    [0.1, 1.5, -0.5, 1.0, 0.0, 0.7],
    [1.2, 0.0, 0.9, -2.0, 0.4, 0.4],
    [-0.3, 0.8, 0.8, 1.1, 0.0, -1.0],
    [0.0, 0.0, 1.0, 0.5, 2.0, -0.5],
    [0.6, -1.0, 0.2, 0.2, 1.3, 0.0],
])  # [V, V]: row t = logits of the token after t
START = 2  # its most likely successor (0) has another row: a draw from the wrong row shows
SAMPLED = SamplingParams(temperature=0.9, top_k=5, top_p=0.9)  # top-k and top-p both remove tokens here


def model_law(params: SamplingParams) -> torch.Tensor:
    """The model's own sampling distribution after each token: [V, V] float64, row t = p(. | t)."""
    return probabilities(TABLE, params).double()


def emit_two(drafts: list[int], params: SamplingParams, generator: torch.Generator) -> tuple[int, int]:
    """The first two tokens a speculative decoder emits after START, with `drafts` proposed at the first step."""
    rows = [START] + drafts  # the context token before each verified position
    accepted, following = verify(TABLE[rows], drafts, params, generator)  # logits [1 + D, V]
    out = drafts[:accepted] + [following]
    if len(out) < 2:  # the next step: no drafts this time
        out.append(verify(TABLE[[out[0]]], [], params, generator)[1])
    return out[0], out[1]


def assert_matches(counts: Counter, expected: dict, draws: int) -> None:
    """Observed counts follow `expected` (outcome -> probability): zero-probability outcomes never occur,
    total variation distance within ~3x its sampling spread, and chi-square p-value above 1e-4."""
    assert sum(counts.values()) == draws
    impossible = {k: n for k, n in counts.items() if expected.get(k, 0.0) == 0.0}
    assert impossible == {}, f"outcomes the model gives probability 0: {impossible}"
    cells = [k for k, p in expected.items() if p > 0]
    tvd = 0.5 * sum(abs(counts[k] / draws - expected[k]) for k in cells)
    assert tvd < math.sqrt(len(cells) / draws), f"total variation distance {tvd:.4f}"
    try:
        from scipy.stats import chisquare
    except ImportError:
        return
    observed = [counts[k] for k in cells]
    wanted = [expected[k] * draws for k in cells]
    scale = sum(observed) / sum(wanted)  # float rounding of the probabilities' sum
    assert chisquare(observed, [w * scale for w in wanted]).pvalue > 1e-4


# --- filtering, exactly -----------------------------------------------------------------------

PROBS = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15, 0.0], dtype=torch.float64)
LOGITS = PROBS.log().float()  # [V]: at temperature 1 their softmax is PROBS; token 5 is -inf


def test_temperature_scales_the_logits():
    logits = torch.tensor([1.0, 2.0, -0.5, 0.0, 3.0, 0.25])
    for temperature in (0.5, 1.0, 2.0, 7.0):
        got = probabilities(logits, SamplingParams(temperature=temperature))
        assert got.dtype == torch.float32 and got.shape == (V,)
        torch.testing.assert_close(got, torch.softmax(logits / temperature, -1), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("top_k, top_p, kept", [
    (0, 1.0, {0: 0.05, 1: 0.4, 2: 0.1, 3: 0.3, 4: 0.15}),
    (2, 1.0, {1: 0.4, 3: 0.3}),
    (3, 1.0, {1: 0.4, 3: 0.3, 4: 0.15}),
    (0, 0.75, {1: 0.4, 3: 0.3, 4: 0.15}),  # 0.4 + 0.3 < 0.75: the third is needed; then 0.85 >= 0.75
    (0, 0.9, {1: 0.4, 3: 0.3, 4: 0.15, 2: 0.1}),
    (0, 0.3, {1: 0.4}),  # the top token alone reaches top_p
    (2, 0.5, {1: 0.4}),  # top-k first: 0.4 / 0.7 = 0.57 reaches 0.5
    (3, 0.75, {1: 0.4, 3: 0.3}),  # top-k first: 0.4 / 0.85 + 0.3 / 0.85 = 0.82 reaches 0.75
])
def test_top_k_and_top_p_keep_exactly_the_nucleus(top_k, top_p, kept):
    got = probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)).double()  # [V]
    outside = [t for t in range(V) if t not in kept]
    assert got[outside].tolist() == [0.0] * len(outside)  # exactly 0, not merely small
    mass = sum(kept.values())
    torch.testing.assert_close(got[list(kept)], torch.tensor([p / mass for p in kept.values()], dtype=torch.float64),
                               rtol=1e-5, atol=1e-7)


def test_top_k_keeps_tokens_tied_with_the_kth():
    logits = torch.tensor([3.0, 1.0, 1.0, 0.0, 1.0, 2.0])
    got = probabilities(logits, SamplingParams(temperature=1.0, top_k=3))
    assert (got > 0).tolist() == [True, True, True, False, True, True]


def test_rows_are_filtered_independently_and_any_float_dtype_gives_float32():
    rows = torch.stack([LOGITS, LOGITS.flip(0)]).to(torch.bfloat16).clamp(min=-100)  # [2, V]
    got = probabilities(rows, SamplingParams(temperature=1.0, top_k=2))
    assert got.dtype == torch.float32 and got.shape == (2, V)
    assert (got > 0).tolist() == [[False, True, False, True, False, False], [False, False, True, False, True, False]]


def test_greedy_is_a_one_hot_of_argmax_with_its_tie_break():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])  # ties
    for params in (SamplingParams(), SamplingParams(temperature=0.0, top_p=0.2), SamplingParams(temperature=1.5, top_k=1)):
        assert params.greedy
        got = probabilities(logits, params)
        assert got.tolist() == torch.nn.functional.one_hot(logits.argmax(-1), V).float().tolist()
        assert [sample(row, params, make_generator(0)) for row in logits] == logits.argmax(-1).tolist()


# --- parameters and seeds ---------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", 100.5),
    ("temperature", "1"), ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan), ("top_k", -1), ("top_k", 2.0),
    ("top_k", True), ("seed", -1), ("seed", 2**64), ("seed", 1.5),
])
def test_bad_params_name_their_field_in_one_line(field, value):
    with pytest.raises(ValueError) as caught:
        SamplingParams(**{field: value})
    assert str(caught.value).startswith(f"{field} must be") and "\n" not in str(caught.value)


def test_good_params_edges_are_accepted():
    SamplingParams(temperature=100.0, top_p=1e-9, top_k=10**6, seed=2**64 - 1)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy


def test_the_same_seed_gives_the_same_tokens():
    def run(seed: int) -> list[int]:
        generator = make_generator(seed)
        tokens = [sample(TABLE[i % V], SAMPLED, generator) for i in range(40)]
        return tokens + [v for i in range(40) for v in verify(TABLE[[0, 3, 1]], [3, 1], SAMPLED, generator)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert make_generator(None).initial_seed() != make_generator(None).initial_seed()  # from the OS's entropy


# --- verify: greedy ---------------------------------------------------------------------------

def test_greedy_verify_follows_the_argmax_path():
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        drafts_len = int(torch.randint(0, 5, (), generator=generator))
        logits = torch.randn(1 + drafts_len, V, generator=generator).round(decimals=1)  # ties happen
        best = logits.argmax(-1).tolist()
        # drafts that follow the argmax for a random while, then anything
        agree = int(torch.randint(0, drafts_len + 1, (), generator=generator))
        drafts = best[:agree] + torch.randint(0, V, (drafts_len - agree,), generator=generator).tolist()
        accepted, following = verify(logits, drafts, SamplingParams(), make_generator(0))
        expect = next((i for i, d in enumerate(drafts) if d != best[i]), drafts_len)
        assert (accepted, following) == (expect, best[expect])


def test_verify_refuses_logits_of_the_wrong_length():
    with pytest.raises(ValueError, match=r"verify needs logits \[1 \+ D, V\] for D = 2 drafts, got \[2, 6\]"):
        verify(TABLE[:2], [1, 2], SAMPLED, make_generator(0))


# --- verify: sampled, the distribution --------------------------------------------------------

def test_sample_follows_the_filtered_distribution():
    law = model_law(SAMPLED)[START]
    generator = make_generator(11)
    draws = 8_000
    counts = Counter(sample(TABLE[START], SAMPLED, generator) for _ in range(draws))
    assert_matches(counts, {t: float(law[t]) for t in range(V)}, draws)


DRAFT_WEIGHTS = [1, 6, 1, 3, 4, 1]  # skewed: a uniform mix of drafts would hide some wrong rules on average


@pytest.mark.parametrize("strategy", ["likely", "skewed"])
def test_speculative_sampling_keeps_the_models_distribution(strategy):
    """The first emitted token follows p(. | START), and the first two follow p(a | START) p(b | a).

    "likely": one or two drafts, the most likely tokens (mostly accepted: the all-accepted path and
    its draw from p_D). "skewed": 0 to 3 drafts drawn from DRAFT_WEIGHTS, filtered-out tokens
    included (often rejected: the residual draw). Drawing the next token from p instead of the
    residual, or from p_(D-1) after all D are accepted, or accepting with any probability other than
    p(draft), moves these counts far out of bounds.
    """
    law = model_law(SAMPLED)  # [V, V]
    pick = random.Random(5)
    generator = make_generator(1234)
    draws = 12_000
    firsts, pairs = Counter(), Counter()
    for n in range(draws):
        if strategy == "likely":
            top = int(law[START].argmax())
            drafts = [top, int(law[top].argmax())][: 1 + n % 2]
        else:
            drafts = pick.choices(range(V), DRAFT_WEIGHTS, k=pick.randrange(4))
        first, second = emit_two(drafts, SAMPLED, generator)
        firsts[first] += 1
        pairs[first, second] += 1
    assert_matches(firsts, {a: float(law[START, a]) for a in range(V)}, draws)
    assert_matches(pairs, {(a, b): float(law[START, a] * law[a, b]) for a in range(V) for b in range(V)}, draws)


def test_a_draft_the_model_cannot_sample_is_never_kept_nor_drawn():
    law = model_law(SAMPLED)
    impossible = int(law[START].argmin())
    assert law[START, impossible] == 0  # top-k removed it
    generator = make_generator(3)
    for _ in range(500):
        accepted, following = verify(TABLE[[START, impossible]], [impossible], SAMPLED, generator)
        assert accepted == 0 and following != impossible and law[START, following] > 0


def test_a_certain_draft_is_always_kept():
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.1)  # only the top token survives top-p
    generator = make_generator(4)
    top = int(TABLE[START].argmax())
    assert all(verify(TABLE[[START, top]], [top], params, generator)[0] == 1 for _ in range(200))


# --- stop strings -----------------------------------------------------------------------------

def test_find_stop_gives_the_earliest_start():
    assert find_stop("abcXYdefZ", ["Z", "XY"]) == 3
    assert find_stop("abcXYdefZ", ["XYd", "cX"]) == 2  # overlapping stops: the earlier start wins
    assert find_stop("abc", ["d", "bcd"]) is None
    assert find_stop("abc", []) is None
    assert find_stop("a\n\nb", ["\n\n"]) == 1


def test_held_back_is_the_longest_tail_that_starts_a_stop():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["lo!", "x"]) == 2
    assert held_back("hello", ["o!", "llo!"]) == 3  # the longest of several
    assert held_back("hello", ["world"]) == 0
    assert held_back("", ["abc"]) == 0
    assert held_back("ab", ["abc"]) == 2
    assert held_back("aaa", ["aab"]) == 2


def test_streaming_up_to_held_back_never_shows_a_stops_start():
    """Stream random texts char by char, showing text[:len - held_back] each time: what was shown
    is always a prefix of the final output (the text cut at its first stop)."""
    pick = random.Random(9)
    stops = ["aba", "bb", "cab"]
    for _ in range(400):
        full = "".join(pick.choice("abc") for _ in range(pick.randrange(1, 16)))
        cut = find_stop(full, stops)
        final = full if cut is None else full[:cut]
        shown = ""
        for end in range(1, len(full) + 1):
            text = full[:end]
            if find_stop(text, stops) is not None:
                break
            shown = text[: len(text) - held_back(text, stops)]
            assert final.startswith(shown), (full, text, shown)
        assert final.startswith(shown)


def test_text_stream_writes_only_final_text_and_cuts_at_the_stop():
    written: list[str] = []
    stream = TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"), ["END"], written.append)
    shown = []
    for byte in "abc EN".encode() + "é".encode() + b"END tail":
        stream.add([byte])
        shown.append("".join(written))
    assert shown[5] == "abc "  # "EN" might start "END": held back
    assert shown[6] == "abc EN"  # the first byte of "é" alone: a replacement character, held back
    assert shown[7] == "abc ENé"
    stream.finish()
    assert "".join(written) == stream.text == "abc ENé" and stream.stopped(stream.tokens)
