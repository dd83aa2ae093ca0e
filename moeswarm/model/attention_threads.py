"""Attention whose bits do not depend on how many threads the process runs.

torch 2.13's CPU `scaled_dot_product_attention` splits its work by the thread count, and a query
row's bits depend on the split. At OLMoE's real dimensions (Q4_K_M) a decode step's attention
output moved by 2.4e-7 between 1 and 2 threads, and 3 of 17 greedy 24-token requests then gave
other text: the same request on `serve --threads 2` and on `generate --threads 1` differed, and a
stage had to run with its gateway reference's thread count. Every matrix around the attention is
already thread-invariant on a GGUF file (qkernels' threads split rows, never a dot product). With
the attention on one thread the three requests give the same text at 1 and 2 threads.

The cost: a long prompt's attention loses its second thread (a decode step's is one query per
sequence, so it loses little: docs/measured.md, "attention").

A decode step's attention (one query, no mask) is one C call instead (qkernels.attend_one: a fixed
order of sums), cheaper than sdpa behind transformers' wrapper (docs/measured.md, "attention");
the output never carries a gradient (nothing here trains). It splits the heads among the process's
threads, each head computed whole by one thread, so its bits do not depend on the thread count
either; at long contexts, where a decode step's attention reads every cached position, that
about halves it on 2 cores. Its bits differ from
sdpa's in the last places; the local reference takes the same path, so `--check-local` compares
like with like. Only transformers' "sdpa" implementation is wrapped; a family that runs its own
eager attention keeps torch's threads.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from moeswarm.kernels import qkernels

# torch.set_num_threads is partly process-wide (MKL's count): one thread toggles it at a time, and
# puts back what it found (serve's groups in flight run forwards on two threads).
_LOCK = threading.Lock()


def sdpa_one_thread(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' sdpa attention, computed on one torch thread; a single unmasked query in C."""
    if _one_query(query, key, value, attention_mask, args, kwargs):
        scaling = kwargs.get("scaling")
        scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        return qkernels.attend_one(query, key, value, scale, torch.get_num_threads()), None  # [B, 1, Hq, Dv]
    if key.dtype != query.dtype:  # a float16 cache (forward/sequence_cache.py): widened for torch
        key, value = key.to(query.dtype), value.to(query.dtype)
    with one_torch_thread():
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


@contextlib.contextmanager
def one_torch_thread():
    """torch's ops inside run on one thread (their bits then do not depend on the process's count)."""
    with _LOCK:
        threads = torch.get_num_threads()
        if threads == 1:
            yield
            return
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


_CACHED = (torch.float32, torch.float16)  # the keys and values qkernels.attend_one reads (float16: a float16 cache)
# Arguments that change what sdpa_attention_forward computes when given (anything else it ignores).
_CHANGES_RESULT = ("softcap", "position_bias", "cache", "s_aux", "sinks")


def _one_query(query, key, value, attention_mask, args, kwargs) -> bool:
    """Whether this call is one query per batch row with no mask and no dropout: query [B, Hq, 1, D],
    key [B, Hkv, p, D], value [B, Hkv, p, Dv] on the CPU, query float32, key and value float32 or
    float16, last dimensions contiguous."""
    return (not args and attention_mask is None and query.dim() == 4 and query.shape[2] == 1
            and key.dim() == 4 and value.dim() == 4 and key.shape[2] >= 1 and qkernels.available()
            and query.dtype is torch.float32 and key.dtype is value.dtype and key.dtype in _CACHED
            and query.device.type == "cpu"
            and not kwargs.get("dropout") and not kwargs.get("output_attentions")
            and all(kwargs.get(name) is None for name in _CHANGES_RESULT)
            and key.shape[:3] == value.shape[:3] and key.shape[0] == query.shape[0] and key.shape[3] == query.shape[3]
            and query.shape[1] % key.shape[1] == 0 and query.stride(3) == key.stride(3) == value.stride(3) == 1)


def is_sdpa(attention) -> bool:
    return attention is sdpa_attention_forward or attention is sdpa_one_thread


def attention_on_one_thread() -> None:
    """Make transformers' "sdpa" attention run on one thread in this process (idempotent)."""
    AttentionInterface.register("sdpa", sdpa_one_thread)
