"""The benchmark section of docs/serve.md from a `moeswarm bench serve` run: the table and a plot."""

from __future__ import annotations

from pathlib import Path

from moeswarm_bench.bench.serve_load import table_lines

DOCS = Path(__file__).resolve().parents[3] / "docs"
START, END = "<!-- bench serve: start -->", "<!-- bench serve: end -->"


def write_serve_report(result: dict, docs: Path = DOCS) -> Path:
    plot = _plot(result, docs / "serve")
    meta = result["meta"]
    lines = [START, "",
             f"Measured with `{meta['command']}`: {_model_words(meta['model'])}, {meta['workers']} worker processes each "
             f"behind an emulated link of {meta['rtt_ms']:.0f} ms round trip, N clients streaming greedy completions "
             f"of {meta['max_tokens']} tokens from {meta['prompt_tokens']}-token prompts at once through the openai "
             "client. `scaling` is aggregate tokens/s / (N x the N = 1 tokens/s); `spec` the most n-gram drafts per "
             "step (0: off); `groups` the batches in flight asked (auto: the server's choice), `in flight` those a step "
             "had, `backbone ms` the part of a step the backbone computed rather than waited on replies; `=alone` how many of the N greedy outputs equal the same prompt run alone on the local "
             "eager model (what `generate --check-local` is bit-identical to).", "", "```", *table_lines(result), "```", "",
             f"![aggregate tokens/s against concurrent clients]({plot.relative_to(docs).as_posix()})", "", END]
    path = docs / "serve.md"
    text = path.read_text()
    if START not in text or END not in text:
        raise RuntimeError(f"{path} lacks the markers {START} and {END} around its benchmark section")
    path.write_text(text[: text.index(START)] + "\n".join(lines) + text[text.index(END) + len(END):])
    return path


def _model_words(model: str) -> str:
    name = Path(model).name
    return f"the model file {name}" if name.endswith(".gguf") else "the bundled trained model"


def _plot(result: dict, where: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    where.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(6, 4))
    for speculate, groups in sorted({(r["speculate"], r.get("groups_flag", 0)) for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["speculate"] == speculate and r.get("groups_flag", 0) == groups]
        label = "speculation off" if speculate == 0 else f"speculation (up to {speculate} drafts)"
        label += f", {groups} group{'s' * (groups != 1)}" if groups else ""
        axes.plot([r["clients"] for r in rows], [r["aggregate_tokens_per_s"] for r in rows], marker="o", label=label)
    base = next(r for r in result["rows"] if r["clients"] == 1 and r["speculate"] == 0)["aggregate_tokens_per_s"]
    clients = sorted({r["clients"] for r in result["rows"]})
    axes.plot(clients, [0.8 * n * base for n in clients], linestyle="--", color="grey", label="goal: 0.8 x N x (N=1)")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("concurrent clients")
    axes.set_ylabel("aggregate generated tokens/s")
    axes.set_title(f"moeswarm serve, {result['meta']['workers']} workers at {result['meta']['rtt_ms']:.0f} ms RTT")
    axes.legend()
    figure.tight_layout()
    path = where / "tokens_per_s.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
