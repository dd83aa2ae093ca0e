#!/usr/bin/env python
"""A prefill whose RESULT is over a default worker's reply bound, with and without the backbone's cut.

One `moeswarm worker` with default flags (--max-unsent-bytes 32 MiB) holds every expert of a
random model at OLMoE's width (hidden 2048, 64 experts, top-8, 2 MoE layers, tiny experts); a
640-token prompt asks S = 640 x 8 rows x 8 KiB = 40 MiB of RESULT per MoE layer. With the cut
(dispatch/chunks.py) the share goes as pieces of whole experts and the logits equal the local
model's bit for bit; without it (the pool reporting no bound, as the backbone was before) the
worker refuses the DISPATCH. Prints both, the round trips and MiB received per layer call.
The prefill time means something only on a quiet machine.

    python scripts/reply_bound_prefill.py
"""

from __future__ import annotations

import tempfile
import time

import torch

from moeswarm.dispatch.pool import HolderPool
from moeswarm.errors import MoeSwarmError
from moeswarm.sources.loading import load_local
from moeswarm.swarm import open_swarm
from moeswarm.local.workers import spawn_worker, stop, wait_listening
from moeswarm.model.tiny import make_tiny_model

PROMPT_TOKENS = 640


def main() -> None:
    torch.set_num_threads(1)
    path = str(make_tiny_model("olmoe", tempfile.mkdtemp(), hidden_size=2048, intermediate_size=32, num_experts=64,
                               num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                               num_hidden_layers=2))
    process = spawn_worker(path, range(64))
    try:
        address = wait_listening(process)
        ids = torch.tensor([[(7 * i + 3) % 250 for i in range(PROMPT_TOKENS)]])
        with torch.inference_mode():
            local = load_local(path)(input_ids=ids).logits
        for cut in (True, False):
            if not cut:
                HolderPool.reply_bound = lambda self, worker: None  # one DISPATCH per share, whatever its size
            with open_swarm(path, [address]) as swarm:
                started = time.perf_counter()
                try:
                    with torch.inference_mode():
                        remote = swarm.model(input_ids=ids).logits
                except MoeSwarmError as error:
                    print(f"cut={cut}: {type(error).__name__}: {error}")
                    continue
                seconds = time.perf_counter() - started
                calls = swarm.layer_calls()
                print(f"cut={cut}: torch.equal(remote, local) = {torch.equal(remote, local)}; round trips per MoE "
                      f"layer call {[c.round_trips for c in calls]}, MiB received {[round(c.bytes_in / 2**20, 1) for c in calls]}, "
                      f"prefill {seconds:.2f} s")
    finally:
        stop([process])


if __name__ == "__main__":
    main()
