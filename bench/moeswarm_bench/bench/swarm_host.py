"""The host a `moeswarm bench swarm` run measured on: its CPU, kernels, Python and date, and the
1-minute load average sampled through the run (the machine is shared: every second counts waiting
for a core)."""

from __future__ import annotations

import datetime
import os
import platform
import threading


class LoadSampler:
    """The 1-minute load average, sampled every few seconds while the bench runs (a shared machine's)."""

    def __init__(self, every_s: float = 5.0):
        self.every_s = every_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load sampler", daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        s = self.samples or [os.getloadavg()[0]]
        return {"min": min(s), "mean": sum(s) / len(s), "max": max(s), "samples": len(s)}


def host_facts(load: LoadSampler) -> dict:
    from moeswarm_bench.bench.worker_real import _cpu_count, _cpu_model, _kernels

    return {"cpu": _cpu_model(), "cpu_count": _cpu_count(), "machine": platform.machine(), "kernels": _kernels(),
            "python": platform.python_version(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "load_1min": load.summary()}
