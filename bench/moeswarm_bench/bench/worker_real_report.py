"""The text tables of `moeswarm bench worker` (the JSON is its {meta, rows} as measured)."""

from __future__ import annotations

MB = 1e6


def table_lines(result: dict) -> list[str]:
    meta, rows = result["meta"], result["rows"]
    lines = [f"moeswarm bench worker: {meta['threads']} thread(s), {meta['cpu_count']} CPU(s) ({meta['cpu']}, "
             f"kernels {meta['kernels']}), memory read bandwidth {meta['memory_read_bandwidth_gb_s']:.1f} GB/s, "
             f"{meta['date']}",
             "", "start-up and memory (RSS once listening; fixed + slope x hosted fitted over the two workers)",
             f"{'model':<12} {'type':<7} {'hosted':>9} {'hosted MB':>10} {'start s':>8} {'RSS MB':>8} {'RSS/hosted':>10} "
             f"{'peak MB':>8} {'slope':>6} {'fixed MB':>9}"]
    for r in rows:
        lines.append(f"{r['model']:<12} {r['type']:<7} {r['hosted_experts']:>4}/{r['experts_in_layer']:<4} "
                     f"{r['hosted_bytes'] / MB:>10.1f} {r['startup_s']:>8.2f} {r['rss_loaded_bytes'] / MB:>8.0f} "
                     f"{r['rss_over_hosted']:>10.2f} {r['rss_peak_bytes'] / MB:>8.0f} {r['rss_slope_over_hosted']:>6.2f} "
                     f"{r['rss_fixed_bytes'] / MB:>9.0f}")
    lines += ["", "expert compute per token per layer, µs: worker wall (DISPATCH round trip - idle PING) and CPU (the "
              "worker process's);", "llama.cpp CPU and wall (decode - narrow-expert baseline; all-experts rows only); "
              "bound: touched bytes / read bandwidth",
              f"{'model':<12} {'type':<7} {'hosted':>9} {'T':>3} {'touched':>7} {'wall':>8} {'CPU':>8} {'llama CPU':>9} "
              f"{'CPU/llama':>9} {'bound':>7} {'CPU/bound':>9} {'llama wall':>10}"]
    for r in rows:
        for t in r["per_tokens"]:
            lines.append(f"{r['model']:<12} {r['type']:<7} {r['hosted_experts']:>4}/{r['experts_in_layer']:<4} "
                         f"{t['tokens']:>3} {t['experts_touched']:>7} {t['worker_us_per_token']:>8.0f} "
                         f"{t['worker_cpu_us_per_token']:>8.0f} {_cell(t, 'llama_cpp_cpu_us_per_token', 9, '.0f')} "
                         f"{_cell(t, 'worker_cpu_over_llama_cpp_cpu', 9, '.2f')} {t['bound_us_per_token']:>7.0f} "
                         f"{t['worker_cpu_over_bound']:>9.2f} {_cell(t, 'llama_cpp_us_per_token', 10, '.0f')}")
    unmeasured = {t["llama_cpp_unmeasured"] for r in rows for t in r["per_tokens"] if "llama_cpp_unmeasured" in t}
    lines += [f"llama.cpp not measured: {why}" for why in sorted(unmeasured)]
    buffers = {f"{r['model']} {r['type']}: llama.cpp ran with its {t['llama_cpp_buffers']} CPU buffers"
               + (" (as it ships: weights repacked for the CPU where it does that)" if t["llama_cpp_buffers"] == "default"
                  else " (without its extra buffer types: the default ones failed)")
               for r in rows for t in r["per_tokens"] if "llama_cpp_buffers" in t}
    lines += sorted(buffers)
    notes = {f"{r['model']}: {r['note']}" for r in rows if r["note"]}
    types = {f"{r['model']} {r['type']}: experts stored as {', '.join(f'{k} {v}' for k, v in r['expert_types'].items())}"
             for r in rows}
    return lines + [""] + sorted(notes) + sorted(types)


def _cell(entry: dict, key: str, width: int, form: str) -> str:
    return f"{entry[key]:>{width}{form}}" if key in entry else f"{'-':>{width}}"
