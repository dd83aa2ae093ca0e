"""The trained model moeswarm ships: the default of the demo, gate and benches.

An installed wheel carries it as package data in `moeswarm/pymoe/` (pyproject.toml maps
`models/pymoe/` there); a checkout or an editable install reads `models/pymoe/` itself.
"""

from __future__ import annotations

from pathlib import Path

from moeswarm.errors import ModelError

PACKAGE = Path(__file__).resolve().parent
REPO = PACKAGE.parent
PLACES = (PACKAGE / "pymoe", REPO / "models" / "pymoe")  # installed wheel, then checkout
PYMOE = next((place for place in PLACES if (place / "hf" / "config.json").is_file()), PLACES[-1])
TRAINED = PYMOE / "hf"
PROMPTS = PYMOE / "prompts.jsonl"
DEMO_PROMPT = "def fibonacci(n):\n"


def demo_model() -> Path:
    """The bundled trained model's directory; ModelError (one line) when this installation lacks it."""
    if not (TRAINED / "config.json").is_file() or not list(TRAINED.glob("*.safetensors")):
        raise ModelError(f"the bundled model is missing (looked in {' and '.join(str(p / 'hf') for p in PLACES)}): "
                         f"reinstall moeswarm from its wheel or a full clone, or give --model DIR")
    return TRAINED
