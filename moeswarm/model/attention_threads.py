"""Attention on one thread: its bits do not depend on how many threads the process runs.

torch 2.13's CPU `scaled_dot_product_attention` splits its work by the thread count, and a query
row's bits depend on the split. At OLMoE's real dimensions (Q4_K_M) a decode step's attention
output moved by 2.4e-7 between 1 and 2 threads, and 3 of 17 greedy 24-token requests then gave
other text: the same request on `serve --threads 2` and on `generate --threads 1` differed, and a
stage had to run with its gateway reference's thread count. Every matrix around the attention is
already thread-invariant on a GGUF file (qkernels' threads split rows, never a dot product). With
the attention on one thread the three requests give the same text at 1 and 2 threads.

The cost: a decode step's attention is one query per sequence (a real-dimension decode step took
the same time within noise: 67.7 against 70.0 ms, one worker, 4 alternating pairs); a long
prompt's attention loses its second thread. Only transformers' "sdpa" implementation is wrapped;
a family that runs its own eager attention keeps torch's threads.
"""

from __future__ import annotations

import threading

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

# torch.set_num_threads is partly process-wide (MKL's count): one thread toggles it at a time, and
# puts back what it found (serve's groups in flight run forwards on two threads).
_LOCK = threading.Lock()


def sdpa_one_thread(*args, **kwargs):
    """transformers' sdpa attention, computed on one torch thread."""
    with _LOCK:
        threads = torch.get_num_threads()
        if threads == 1:
            return sdpa_attention_forward(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return sdpa_attention_forward(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)


def is_sdpa(attention) -> bool:
    return attention is sdpa_attention_forward or attention is sdpa_one_thread


def attention_on_one_thread() -> None:
    """Make transformers' "sdpa" attention run on one thread in this process (idempotent)."""
    AttentionInterface.register("sdpa", sdpa_one_thread)
