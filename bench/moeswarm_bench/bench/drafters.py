"""`moeswarm bench drafters`: tokens per verify step of each model-free drafter, on two workloads.

Held-out: the bundled trained model's greedy continuation (32 tokens) of each held-out prompt.
Editing: a file re-emitted with small changes, as coding agents do: the prompt is a held-out code
file and an instruction, the output the same file with one identifier renamed, a number changed
and a line added.

Both are measured by replay: a greedy step verifies the drafter's branches against what the model
emits, keeps the longest accepted one and adds the step's own token (generation/branches.py's
rule), so tokens per verify step depend only on the drafter and the output, not on the model's
speed. For the held-out rows the output is the model's own (computed once without drafts); for the
editing rows it is the edited file, what a model that follows the instruction emits.
"""

from __future__ import annotations

import json
import re
import statistics

from moeswarm.bundled import PROMPTS, TRAINED
from moeswarm.generation.drafters import NgramDrafter
from moeswarm.generation.draft_suffix import SuffixDrafter, SuffixHistory

DRAFT_LIMIT = 8  # drafts per step (--speculate)
NEW_TOKENS = 32
INSTRUCTION = "\n# The same file again, with the changes asked for:\n"


def replay(drafter, prompt: list[int], output: list[int], limit: int = DRAFT_LIMIT) -> tuple[int, int]:
    """(tokens after the first, verify steps) to emit `output` after `prompt` with `drafter`'s branches."""
    context = list(prompt) + output[:1]  # the first token comes from the prompt's own forward
    done, steps = 1, 0
    while done < len(output):
        room = min(limit, len(output) - done - 1)
        truth = output[done:]
        best = 0
        for branch in (drafter.branches(context, None, room) if room > 0 else []):
            accepted = 0
            while accepted < len(branch) and branch[accepted] == truth[accepted]:
                accepted += 1
            best = max(best, accepted)
        taken = truth[: best + 1]
        context += taken
        done += len(taken)
        steps += 1
    return len(output) - 1, steps


def edited(text: str) -> str | None:
    """`text` with its most frequent identifier renamed, its first number changed and a line added
    after its first line; None when it has no identifier worth renaming."""
    words = [w for w in re.findall(r"\b[a-z_][a-z_0-9]{3,}\b", text) if w not in {"self", "return", "None", "else"}]
    if not words:
        return None
    name = max(set(words), key=lambda w: (words.count(w), w))
    out = re.sub(rf"\b{name}\b", name + "_new", text)
    out = re.sub(r"\b\d+\b", lambda m: str(int(m.group()) + 1), out, count=1)
    first, _, rest = out.partition("\n")
    indent = re.match(r"\s*", rest).group() if rest else ""
    return f"{first}\n{indent}# edited\n{rest}"


def run_drafters_bench(model: str | None = None, progress=None) -> dict:
    from moeswarm.engine.generate import generate
    from moeswarm.engine.whole_model import WholeModel
    from moeswarm.sources.loading import load_local
    from moeswarm.sources.tokenizer import load_text_codec

    model = str(model or TRAINED)
    reference = load_local(model)
    codec = load_text_codec(model, reference.config.vocab_size)
    texts = [json.loads(line)["text"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    held_out, editing = [], []
    for text in texts:
        prompt = codec.encode(text)[:96]
        output = generate(WholeModel(reference), prompt, NEW_TOKENS, codec=codec).tokens
        held_out.append((prompt, output))
        changed = edited(text)
        if changed is not None:
            editing.append((codec.encode(text + INSTRUCTION), codec.encode(changed)[:256]))
        if progress:
            progress(len(held_out), len(texts))
    rows = []
    for workload, cases in (("held-out", held_out), ("editing", editing)):
        for name, make in (("ngram", lambda history: NgramDrafter()), ("suffix", lambda history: SuffixDrafter(history))):
            history = SuffixHistory()  # the recent requests of one server: these cases, in order
            per_case = [replay(make(history), prompt, output) for prompt, output in cases]
            tokens, steps = sum(t for t, _ in per_case), sum(s for _, s in per_case)
            rows.append({"workload": workload, "drafter": name, "cases": len(cases), "tokens": tokens, "steps": steps,
                         "tokens_per_step": tokens / steps,
                         "median_tokens_per_step": statistics.median(t / s for t, s in per_case if s)})
    return {"meta": {"model": model, "draft_limit": DRAFT_LIMIT, "new_tokens": NEW_TOKENS,
                     "command": "moeswarm bench drafters"}, "rows": rows}


def table_lines(result: dict) -> list[str]:
    lines = [f"{'workload':>9} {'drafter':>7} {'cases':>5} {'tokens':>6} {'steps':>5} {'tok/step':>8} {'median':>6}"]
    for r in result["rows"]:
        lines.append(f"{r['workload']:>9} {r['drafter']:>7} {r['cases']:>5} {r['tokens']:>6} {r['steps']:>5} "
                     f"{r['tokens_per_step']:>8.2f} {r['median_tokens_per_step']:>6.2f}")
    return lines
