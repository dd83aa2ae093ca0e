"""llama.cpp's side of `moeswarm bench real`: a child process running the same GGUF file.

`python -m moeswarm_bench.bench.real_llama FILE THREADS [CTX] [BUFFERS]` loads the file with
llama-cpp-python on BUFFERS: `default` (llama.cpp as it ships and as users run it: its CPU "extra
buffer types", repacked or AMX weights where the CPU has them) or `plain` (without them:
worker_real_llamacpp.plain_cpu_buffers; on some hosts the default crashes, `probe_buffers` finds out in
a child of its own) and answers `run` requests (real_proc.serve): a fresh
context state, the prompt as one batch (timed: prompt speed), then greedy decode steps, one
token per eval with the argmax of its logits (timed together: decode speed), exactly as the
moeswarm children time theirs. An optional third argument sets the context size (default N_CTX), a fourth the buffers (default
`default`).

A request with `reuse` and the prompt the context already starts with keeps the prompt's cache:
it drops what came after the prompt's last token and evaluates that token again (`bench kv-cache`
decodes many times from one long prompt).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from moeswarm_bench.bench.real_proc import serve

N_CTX = 512  # the 64-token prompt and 32 decoded tokens, with room


BUFFERS = ("default", "plain")


def load(path: str, threads: int, n_ctx: int = N_CTX, buffers: str = "default"):
    from moeswarm_bench.bench.llamacpp_convert import require_llama_cpp
    from moeswarm_bench.bench.worker_real_llamacpp import plain_cpu_buffers

    if buffers not in BUFFERS:
        raise ValueError(f"buffers must be one of {', '.join(BUFFERS)}, not {buffers!r}")
    llama_cpp = require_llama_cpp("moeswarm bench real")
    import llama_cpp.llama_cpp as low

    if buffers == "plain":
        low.llama_model_default_params = plain_cpu_buffers(low.llama_model_default_params)
    model = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                            n_threads_batch=threads, use_mmap=True, logits_all=False, verbose=False)
    vocab = model.n_vocab()

    def next_token() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(model.ctx, -1), shape=(vocab,))  # [V]
        return int(logits.argmax())

    profiled = {}

    def profile(request: dict) -> dict:
        """A plain run, then the same on a second context whose scheduler calls back after every
        node (real_llama_parts.py): the parts' shares applied to the plain run's step time."""
        from moeswarm_bench.bench.real_llama_parts import NodeTimer, scale_to, with_callback

        plain = run({**request, "profile": False})
        if not profiled:
            timer = NodeTimer(low)
            default = low.llama_context_default_params
            low.llama_context_default_params = with_callback(default, timer)
            try:
                profiled["model"] = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                                                    n_threads_batch=threads, use_mmap=True, logits_all=False,
                                                    verbose=False)
            finally:
                low.llama_context_default_params = default
            profiled["timer"] = timer
        other, timer = profiled["model"], profiled["timer"]
        other.reset()
        other.eval(request["prompt"])
        token = plain["tokens"][0]
        timer.start()
        for step in range(request["decode"]):
            other.eval([token])
            token = plain["tokens"][step + 1]
        timer.enabled = False
        step_ms = 1e3 * plain["decode_s"] / request["decode"]
        return {**plain, "parts_ms": scale_to(timer.parts, request["decode"], step_ms),
                "callback_step_ms": 1e3 * sum(timer.parts.values()) / request["decode"]}

    def run(request: dict) -> dict:
        if request.get("profile"):
            return profile(request)
        prompt, steps = request["prompt"], request["decode"]
        held = model.n_tokens >= len(prompt) and list(model.input_ids[: len(prompt)]) == prompt
        cpu_start, start = time.process_time(), time.perf_counter()
        if request.get("reuse") and held:
            model._ctx.kv_cache_seq_rm(-1, len(prompt) - 1, -1)  # as Llama.generate reuses a prefix
            model.n_tokens = len(prompt) - 1
            model.eval(prompt[-1:])
        else:
            model.reset()
            model.eval(prompt)
        token = next_token()
        prompt_s = time.perf_counter() - start
        tokens, step_s = [token], []
        cpu_decode, decode_start = time.process_time(), time.perf_counter()
        for _ in range(steps):
            step_start = time.perf_counter()
            model.eval([token])
            token = next_token()
            step_s.append(time.perf_counter() - step_start)
            tokens.append(token)
        decode_s = time.perf_counter() - decode_start
        return {"prompt_s": prompt_s, "decode_s": decode_s, "step_s": step_s, "tokens": tokens,
                "prompt_cpu_s": cpu_decode - cpu_start, "decode_cpu_s": time.process_time() - cpu_decode}

    info = {"vocab": vocab, "buffers": BUFFER_NAMES[buffers], "llama_cpp_python": llama_cpp.__version__,
            "threads": threads}
    return info, run


BUFFER_NAMES = {"default": "default (extra buffer types: repacked weights where the CPU has them)",
                "plain": "plain (use_extra_bufts=False)"}
PROBE_PROMPT = 8  # tokens of the probe's prompt (a batch: the repacked kernels' tiles run) ...
PROBE_DECODE = 2  # ... and its one-token steps


def probe_buffers(path: str, threads: int, n_ctx: int = N_CTX) -> str | None:
    """None when llama.cpp's default buffer types load `path` and run a short prompt and decode with
    `threads` threads on this host; else why not, in one line (a crash is a child's, not ours)."""
    from moeswarm.errors import MoeSwarmError
    from moeswarm_bench.bench.real_proc import Child

    try:
        child = Child("llama.cpp (default buffers, probe)", "moeswarm_bench.bench.real_llama",
                      [path, str(threads), str(n_ctx), "default"], {"OMP_NUM_THREADS": str(threads)})
    except MoeSwarmError as error:
        return str(error)
    try:
        child.request(op="run", prompt=list(range(1, PROBE_PROMPT + 1)), decode=PROBE_DECODE)
        return None
    except MoeSwarmError as error:
        return str(error)
    finally:
        child.close()


if __name__ == "__main__":
    file, thread_count, *rest = sys.argv[1:]
    serve(lambda: load(file, int(thread_count), int(rest[0]) if rest else N_CTX, rest[1] if len(rest) > 1 else "default"))
