"""The text tables of `moeswarm bench real`, and its report: docs/bench-real.md, docs/bench/real.{png,json}."""

from __future__ import annotations

import json
from pathlib import Path

from moeswarm_bench.bench.markdown import markdown_table, write_page
from moeswarm_bench.bench.real_shapes import QUICK_SHAPE, SHAPES

DOCS = Path(__file__).resolve().parents[3] / "docs"
MB = 1e6


def speed_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """(headers, lines): speeds, ratios against llama.cpp, the layer call and its parts."""
    headers = ["shape", "configuration", "decode tok/s", "x llama.cpp", "prompt tok/s", "x llama.cpp", "step ms",
               "layer call ms", "worker RTT ms", "worker kernel ms", "machinery ms", "tokens = local"]
    lines = [[r["shape"], r["label"], r["decode_tokens_per_s"], r["decode_over_llama_cpp"], r["prompt_tokens_per_s"],
              r["prompt_over_llama_cpp"], r["step_ms"], r.get("layer_call_ms"), r.get("worker_rtt_ms"),
              r.get("worker_compute_ms"), r.get("machinery_ms"), r["tokens_match_local"]] for r in rows]
    return headers, lines


# the targets (issue 57's, against llama.cpp as it ships where it runs; issue 23's machinery):
# (what, configuration, the row's field, the least or most it may be)
TARGETS = (("moeswarm local decode >= 1.0x llama.cpp", "local", "decode_over_llama_cpp", ">=", 1.0),
           ("moeswarm local prompt (64 tokens) >= 1.0x llama.cpp", "local", "prompt_over_llama_cpp", ">=", 1.0),
           ("2 workers on loopback decode >= 0.8x llama.cpp", "loopback", "decode_over_llama_cpp", ">=", 0.8),
           ("machinery per layer call, one worker on loopback <= 0.3 ms", "loopback1", "machinery_ms", "<=", 0.3))


def targets_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """(headers, lines): each of issue 23's targets against this run, per shape."""
    headers = ["target", "shape", "measured", "met"]
    lines = []
    for what, config, field, sense, bound in TARGETS:
        for row in (r for r in rows if r["config"] == config and r.get(field) is not None):
            value = row[field]
            lines.append([what, row["shape"], value, value >= bound if sense == ">=" else value <= bound])
    return headers, lines


def parts_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """(headers, lines): a decode step's ms by part (profiled runs), and CPU in use per process."""
    headers = ["shape", "configuration", "attention", "MoE layer calls", "router", "output head", "other", "step",
               "CPU cores (llama.cpp, backbone)", "workers' CPU cores"]
    lines = []
    for r in rows:
        if r["config"].startswith("llama.cpp") and "parts_ms" not in r:  # its step and CPU in use, to compare
            lines.append([r["shape"], r["label"], None, None, None, None, None, r["step_ms"], r["cpu_cores_decode"], None])
        if "parts_ms" not in r:
            continue
        parts = r["parts_ms"]
        workers = " + ".join(f"{w['cpu_cores_decode']:.2f}" for w in r.get("workers", [])) or None
        lines.append([r["shape"], r["label"], parts["attention"], parts["moe_calls"], parts["router"], parts["head"],
                      parts["other"], r["profiled_step_ms"], r["cpu_cores_decode"], workers])
    return headers, lines


def process_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """(headers, lines): every process once per shape: start-up and memory."""
    headers = ["shape", "process", "start-up s", "RSS MB", "anonymous MB", "file-backed MB", "peak MB"]
    lines, seen = [], set()
    for r in rows:
        for p in r["processes"]:
            if (r["shape"], p["pid"]) in seen:
                continue
            seen.add((r["shape"], p["pid"]))
            role = p["role"] + (f" (experts {p['experts']})" if "experts" in p else "")
            lines.append([r["shape"], role, p["startup_s"], p["rss_bytes"] / MB, p["rss_anon_bytes"] / MB,
                          p["rss_file_bytes"] / MB, p["rss_peak_bytes"] / MB])
    return headers, lines


def table_lines(result: dict) -> list[str]:
    """The report as text: a header line, then the three tables."""
    meta = result["meta"]
    lines = [f"moeswarm bench real: {meta['threads']} thread(s) (workers {meta['worker_threads']} each), "
             f"{meta['cpu_count']} CPU(s) ({meta['cpu']}, kernels {meta['kernels']}), llama-cpp-python "
             f"{meta['llama_cpp_python']} ({_buffers(meta)}), {meta['prompt_tokens']}-token prompt, "
             f"{meta['decode_tokens']} decode steps, median of {meta['repeats']}, {meta['date']}, {_load(meta)}"]
    for title, (headers, body) in (("speed", speed_table(result["rows"])),
                                   ("targets", targets_table(result["rows"])),
                                   ("decode step by part, ms (one profiled run)", parts_table(result["rows"])),
                                   ("processes", process_table(result["rows"]))):
        lines += ["", title, *_text_table(headers, body)]
    return lines


def _buffers(meta: dict) -> str:
    """Which buffers llama.cpp ran on, per file: its default where it runs here, else plain."""
    said = {f["shape"]: f.get("llama_cpp_default_buffers", "not probed") for f in meta["files"]}
    return "; ".join(f"{shape}: default buffer types and plain" if how == "run" else
                     f"{shape}: plain buffers, the default {how}" for shape, how in said.items())


def _load(meta: dict) -> str:
    load = meta.get("load_average_1min")
    return f"load average (1 min) {load['start']:.1f} at the start, {load['end']:.1f} at the end" if load else "load not recorded"


def _text_table(headers: list[str], body: list[list]) -> list[str]:
    from moeswarm_bench.bench.markdown import cell

    cells = [headers] + [[cell(v) for v in line] for line in body]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  ".join(value.ljust(widths[i]) if i < 2 else value.rjust(widths[i]) for i, value in enumerate(row))
            for row in cells]


def write_report(result: dict, docs: Path = DOCS) -> Path:
    """docs/bench-real.md (method, tables, plot), docs/bench/real.png and docs/bench/real.json."""
    (docs / "bench").mkdir(parents=True, exist_ok=True)
    (docs / "bench" / "real.json").write_text(json.dumps(result, indent=1) + "\n")
    plot = _plot(result, docs / "bench" / "real.png")
    meta = result["meta"]
    files = "; ".join(f"{f['shape']}: {Path(f['file']).name} ({f['file_bytes'] / 1e9:.2f} GB, "
                      f"{f['parameters'] / 1e9:.2f} B parameters)" for f in meta["files"])
    text = [
        "# moeswarm at real dimensions against llama.cpp (`moeswarm bench real`)", "",
        f"Measured with `{meta['command']}` on {meta['date']}: {meta['cpu_count']} CPU(s) ({meta['cpu']}), moeswarm's "
        f"kernels {meta['kernels']}, torch {meta['torch']}, llama-cpp-python {meta['llama_cpp_python']}"
        f"{', moeswarm at commit ' + meta['commit'] if meta.get('commit') else ''}. "
        "The rows are in [bench/real.json](bench/real.json); rerun with `moeswarm bench real --report`.", "",
        "## Method", "",
        "- **Models**: random-weight models at real dimensions (`bench/moeswarm_bench/bench/real_shapes.py`): "
        f"{'; '.join(_shape(f['shape']).describe() for f in meta['files'])}. Written as Hugging Face bf16 safetensors with N(0, 0.02) "
        "matrices, converted by llama.cpp's own `convert_hf_to_gguf.py` and quantized to "
        f"{meta['quant_type']} by llama.cpp's own quantizer; built once into a cache directory. Files: {files}.",
        f"- **Runs**: a {meta['prompt_tokens']}-token prompt as one forward computing its last logits only, "
        "on both sides (prompt tokens/s), then "
        f"{meta['decode_tokens']} greedy decode steps of one token each (decode tokens/s: {meta['decode_tokens']} "
        "over the time of those steps, each step's argmax included), on both sides the same way.",
        f"- **Threads**: llama.cpp and moeswarm local {meta['threads']}; with workers the backbone "
        f"{meta['threads']} and each of the {meta['workers']} workers {meta['worker_threads']} (3 processes on "
        f"{meta['cpu_count']} cores: each stands for a machine of its own; their kernels' threads rest while they "
        "wait, and a call's experts go to whichever thread is free); the lone worker 1 (its kernels' CPU time is "
        "then their wall time). "
        f"llama.cpp: {meta['llama_cpp_buffers']}.",
        "- **Configurations**: llama.cpp (llama-cpp-python) on the same file as it ships (its default buffer "
        "types: repacked weights where the CPU has them), probed first in a child process; where that crashes on "
        "the host, plain buffers (`use_extra_bufts=False`) stand in as `llama.cpp` and the row's label says so; "
        "where it runs, the plain row is reported beside it. Ratios are against the `llama.cpp` row. "
        f"This run: {_buffers(meta)}. moeswarm local (the whole model in "
        "one process, every expert held by the backbone); moeswarm with 2 `moeswarm worker` processes each holding "
        "half of every layer's experts, on loopback; one `moeswarm worker` holding every expert, on loopback (the "
        "backbone and the worker take turns on the cores: its layer call less the worker's kernels is the "
        "machinery alone, no third process in the way); the 2 workers behind the WAN emulator (`moeswarm/wan`) at "
        "20 and 80 ms RTT. Every process is started once, alone, on a file already in the page cache "
        "(start-up: spawn to ready).",
        f"- **Alternation**: one untimed warm-up run each, then {meta['repeats']} rounds in which every "
        "configuration runs once, the order reversed every other round; each figure is the median over the "
        "rounds. Ratios are a row's median over llama.cpp's median, same shape.",
        "- **Per layer call** (decode steps): `layer call ms` is the dispatcher's own accounting of a MoE layer "
        "call (plan, send, wait, combine); `worker RTT ms` a worker's round trip as the dispatcher timed it, the "
        "slower worker's; `worker kernel ms` the CPU time of the worker's experts per round trip, as its RESULTs "
        "say (`cpu_us`, docs/protocol.md), per call the slowest answering worker's, averaged over the calls (a call "
        "waits for it; a decode step's experts run on the worker's event loop when its compute thread is idle, so "
        "/proc's threads no longer split kernels from the rest; `kernel_imbalance_ms` in the JSON is what the "
        "experts' uneven split adds over the busier worker's mean; none of these for workers of several threads, "
        "whose RESULTs time only the answering thread's share); "
        "`machinery ms` = layer call - worker kernel: what a call costs beyond the workers' kernels (the JSON also "
        "has `backbone_side_ms` = layer call - worker RTT, each worker's event-loop CPU per trip, and `waiting`: "
        "whether the backbone's layer calls spun for their replies or slept, as it learned, dispatch/wait.py).",
        "- **By part**: one more run of local and of both loopback configurations with forward hooks on the model's modules "
        "(`bench/moeswarm_bench/bench/real_profile.py`): attention, the MoE layer calls, the router (the MoE block less its "
        "experts call), the output head, and the rest; CPU cores in use = CPU time / wall time during decode.",
        "- `tokens = local`: the greedy tokens equal the local run's (exact wire mode is bit-identical).",
        f"- **Noise**: {_load(meta)}. Where other work shares the cores, the figures move between repeats (the "
        "plot's whiskers show their range; every repeat is in the JSON), and llama.cpp's threads, which meet at a "
        "barrier after every operation, lose more to a core taken away than one process that does not wait: "
        "compare its CPU cores in use (the table by part) with its threads before reading a ratio.", "",
        "## Speed", "", markdown_table(*speed_table(result["rows"])), "",
        f"The targets against this run, on this host ({meta['cpu']}, kernels {meta['kernels']}): a ratio holds "
        "for the host it was measured on, never in general.", "", markdown_table(*targets_table(result["rows"])), "",
        f"![decode and prompt tokens/s, whiskers: the repeats' range]({plot.relative_to(docs).as_posix()})", "",
        "## A decode step by part (ms)", "", markdown_table(*parts_table(result["rows"])), "",
        "## Processes: start-up and memory", "",
        "RSS once every run is done; file-backed pages are the GGUF file's, mapped (shared through the page cache "
        "by every process that maps the file).", "", markdown_table(*process_table(result["rows"])), "",
    ]
    return write_page(docs / "bench-real.md", "\n".join(text))


def _plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(shapes)
    for axis, key, title in ((axes[0], "decode_tokens_per_s", "decode"), (axes[1], "prompt_tokens_per_s", "prompt")):
        for i, shape in enumerate(shapes):
            chosen = [next(r for r in rows if r["shape"] == shape and r["config"] == c) for c in configs]
            values = [r[key] for r in chosen]
            spread = [[v - min(r[f"{key}_runs"]) for v, r in zip(values, chosen)],  # whiskers: the repeats' range
                      [max(r[f"{key}_runs"]) - v for v, r in zip(values, chosen)]]
            axis.bar([x + i * width for x in range(len(configs))], values, width, yerr=spread, capsize=3, label=shape)
        axis.set_xticks([x + width * (len(shapes) - 1) / 2 for x in range(len(configs))], configs)
        axis.set_ylabel("tokens/s")
        axis.set_title(f"{title}: median of {result['meta']['repeats']} ({result['meta']['threads']} threads, Q4_K_M)")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _shape(name: str):
    """The shape a report's file was built from (bench real's, or --quick's)."""
    return {**SHAPES, QUICK_SHAPE.name: QUICK_SHAPE}[name]
