"""llama.cpp's side of `moeswarm bench real`: a child process running the same GGUF file.

`python -m moeswarm.tools.bench.real_llama FILE THREADS` loads the file with llama-cpp-python on plain
CPU buffers (without llama.cpp's "extra buffer types", which crash on this project's AMX Xeons:
worker_real_llamacpp.plain_cpu_buffers) and answers `run` requests (real_proc.serve): a fresh
context state, the prompt as one batch (timed: prompt speed), then greedy decode steps, one
token per eval with the argmax of its logits (timed together: decode speed), exactly as the
moeswarm children time theirs. An optional third argument sets the context size (default N_CTX).

A request with `reuse` and the prompt the context already starts with keeps the prompt's cache:
it drops what came after the prompt's last token and evaluates that token again (`bench kv-cache`
decodes many times from one long prompt).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from moeswarm.tools.bench.real_proc import serve

N_CTX = 512  # the 64-token prompt and 32 decoded tokens, with room


def load(path: str, threads: int, n_ctx: int = N_CTX):
    from moeswarm.tools.bench.llamacpp_convert import require_llama_cpp
    from moeswarm.tools.bench.worker_real_llamacpp import plain_cpu_buffers

    llama_cpp = require_llama_cpp("moeswarm bench real")
    import llama_cpp.llama_cpp as low

    low.llama_model_default_params = plain_cpu_buffers(low.llama_model_default_params)
    model = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                            n_threads_batch=threads, use_mmap=True, logits_all=False, verbose=False)
    vocab = model.n_vocab()

    def next_token() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(model.ctx, -1), shape=(vocab,))  # [V]
        return int(logits.argmax())

    def run(request: dict) -> dict:
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

    info = {"vocab": vocab, "buffers": "plain (use_extra_bufts=False)", "llama_cpp_python": llama_cpp.__version__,
            "threads": threads}
    return info, run


if __name__ == "__main__":
    file, thread_count, *context = sys.argv[1:]
    serve(lambda: load(file, int(thread_count), int(context[0]) if context else N_CTX))
