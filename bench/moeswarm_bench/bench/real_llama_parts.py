"""llama.cpp's decode step by part, from its own scheduler: the eval callback (`cb_eval`) of a context.

With a callback that asks to see every graph node, llama.cpp's scheduler computes a step's graph node
by node and calls back after each; the time from one call to the next is that node's compute. Each
node is put in one of `bench real`'s parts by its name, as llama.cpp's graph builders name them
(`ggml_get_name`, public API): the router (`ffn_moe_logits`, `_probs`, `_argsort`, `_topk`,
`_weights*`), the MoE experts (every other `ffn_moe_*` node, the shared `ffn_*` ones), attention
(`Qcur`, `Kcur`, `Vcur`, `kq*`, `kqv*`, `attn_*`, the cache's views and copies), the output head
(`result_output`), and other (norms, as moeswarm's profile counts them, embeddings, adds). Computing node by node costs llama.cpp a
thread-pool round per node, so the parts are reported as shares of the profiled step applied to
llama.cpp's own unprofiled step time (`scale_to`).
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

ROUTER = ("ffn_moe_logits", "ffn_moe_probs", "ffn_moe_argsort", "ffn_moe_topk", "ffn_moe_weights",
          "ffn_moe_group_topk", "ffn_moe_sum")
ATTENTION = ("Qcur", "Kcur", "Vcur", "kq", "kqv", "attn_", "q-", "k-", "v-", "cache_", "__fattn__", "wo")


NORMS = ("attn_norm", "ffn_norm", "ffn_inp", "norm", "result_norm")  # "other", as moeswarm's profile counts them


def part_of(name: str) -> str:
    """The part of a decode step a llama.cpp graph node belongs to, by its name."""
    if name.startswith(NORMS):
        return "other"
    if name.startswith(ROUTER):
        return "router"
    if name.startswith("ffn_"):
        return "moe_calls"
    if name.startswith("result_output"):
        return "head"
    if name.startswith(ATTENTION):
        return "attention"
    return "other"


class NodeTimer:
    """The eval callback: asks for every node, sums the time since the previous call by part."""

    def __init__(self, low):
        lib_dir = Path(low.__file__).resolve().parent / "lib"
        ggml = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
        ggml.ggml_get_name.argtypes, ggml.ggml_get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
        self._name = ggml.ggml_get_name
        self.parts: dict[str, float] = {}
        self.enabled = False
        self._last = time.perf_counter()
        self.callback = low.ggml_backend_sched_eval_callback(self._call)  # kept: ctypes frees it otherwise

    def _call(self, tensor, ask, user_data) -> bool:
        if ask:
            return True  # see every node: the scheduler computes them one by one
        now = time.perf_counter()
        if self.enabled:
            part = part_of(self._name(tensor).decode(errors="replace"))
            self.parts[part] = self.parts.get(part, 0.0) + now - self._last
        self._last = now
        return True

    def start(self) -> None:
        self.parts.clear()
        self._last = time.perf_counter()
        self.enabled = True


def with_callback(default, timer: NodeTimer):
    """`llama_context_default_params` with the timer's callback in (put in its place while a model loads)."""

    def params():
        value = default()
        value.cb_eval = timer.callback
        value.cb_eval_user_data = None
        return value

    return params


def scale_to(parts_s: dict[str, float], steps: int, step_ms: float) -> dict[str, float]:
    """Per-step ms by part: the profiled shares applied to llama.cpp's unprofiled step time."""
    total = sum(parts_s.values()) or 1.0
    names = ("attention", "moe_calls", "router", "head", "other")
    return {name: step_ms * parts_s.get(name, 0.0) / total for name in names}
