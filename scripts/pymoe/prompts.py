#!/usr/bin/env python
"""Write ``models/pymoe/prompts.jsonl``: the prompt set for gates and benchmarks.

- 24 ``"kind": "heldout"`` prompts: 200-600 characters of held-out stdlib source (never trained
  on), cut at line boundaries at positions drawn by ``random.Random(0)``, spread over the held-out
  files in sorted order. Each carries ``"repetitive"``: true when at least 30 % of its word 3-grams
  already occurred earlier in the same snippet (a tokenizer-independent proxy for "n-gram lookup
  should help here"), with the measured ``"rep3"`` fraction.
- 6 ``"kind": "demo"`` prompts: short openings that make sense for Python code.

    python scripts/pymoe/prompts.py [--out models/pymoe/prompts.jsonl]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from pymoe import corpus  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEMO = [
    "def fibonacci(n):\n",
    "import os\n",
    "class Stack:\n",
    "def __init__(self, ",
    "    for i in range(",
    "if __name__ == '__main__':\n",
]
N_HELDOUT = 24


def rep3(text: str) -> float:
    """Share of word 3-grams that already appeared earlier in the text."""
    words = re.findall(r"\w+|[^\w\s]", text)
    grams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
    seen, rep = set(), 0
    for g in grams:
        rep += g in seen
        seen.add(g)
    return rep / max(1, len(grams))


def snippet(text: str, rng: random.Random) -> str | None:
    lines = text.splitlines(keepends=True)
    if len(lines) < 10:
        return None
    for _ in range(20):
        i = rng.randrange(0, len(lines) - 5)
        out = ""
        for ln in lines[i:]:
            if len(out) + len(ln) > 600:
                break
            out += ln
            if len(out) >= 350:
                break
        if 200 <= len(out) <= 600 and out.strip():
            return out
    return None


def build() -> list[dict]:
    _, held = corpus.split()
    rng = random.Random(0)
    texts = {f: corpus.read(f) for f in held}
    out = []
    k = 0
    while len(out) < N_HELDOUT and k < 10 * N_HELDOUT:
        f = held[k % len(held)]
        k += 1
        s = snippet(texts[f], rng)
        if s is None or any(p["text"] == s for p in out):
            continue
        r = rep3(s)
        out.append({"id": f"heldout-{len(out):02d}", "kind": "heldout", "source": f, "text": s,
                    "rep3": round(r, 3), "repetitive": r >= 0.30})
    out += [{"id": f"demo-{i}", "kind": "demo", "text": t} for i, t in enumerate(DEMO)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "models/pymoe/prompts.jsonl"))
    args = ap.parse_args()
    prompts = build()
    pathlib.Path(args.out).write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(f"wrote {len(prompts)} prompts to {args.out}; repetitive: "
          f"{sum(p.get('repetitive', False) for p in prompts)}")


if __name__ == "__main__":
    main()
