"""How long a stage failover takes: a 1k-token context through 2 stages (the real-dimension
OLMoE-shaped file of `moeswarm bench real`), the second stage killed, its replica taking over and
the gateway's step log replayed into the chain; the next step's logits against an uninterrupted
local run (bit-identical), and the time from the failure to the failed step's answer.

    python scripts/stage_replay.py [--context 1024]
"""

from __future__ import annotations

import argparse
import time

import torch

from moeswarm.forward.packed import PackedStepper, install
from moeswarm.stages.gateway import open_gateway
from moeswarm.swarm import open_swarm
from moeswarm_bench.bench.real_build import DEFAULT_CACHE, model_file
from moeswarm_bench.bench.real_shapes import SHAPES
from moeswarm.local.stages import spawn_stage
from moeswarm.local.workers import stop, wait_listening


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = str(model_file(SHAPES["olmoe"], DEFAULT_CACHE))
    processes = [spawn_stage(path, span, threads=1) for span in ("0-7", "8-15", "8-15")]
    try:
        first, second, replica = [wait_listening(p) for p in processes]
        with open_swarm(path, []) as local, open_gateway(path, [[first], [second, replica]]) as gateway:
            install(local.model)
            install(gateway.model)
            got, want = PackedStepper(gateway.model), PackedStepper(local.model)
            context = [(13 * i) % 50000 + 7 for i in range(args.context)]
            for at in range(0, len(context), args.chunk):
                got.forward(context[at : at + args.chunk], last_only=True)
                want.forward(context[at : at + args.chunk], last_only=True)
            chain = gateway.model.base_model.layers[0].chain
            processes[1].kill()
            processes[1].wait()
            started = time.perf_counter()
            out = got.forward([11])
            wall = time.perf_counter() - started
            same = torch.equal(out, want.forward([11]))
            print(f"context {args.context} tokens in {len(chain._log) - 1} logged steps; failovers {chain.failovers}, "
                  f"replayed {chain.replayed_steps} steps; failed step answered {wall:.2f} s after it was sent "
                  f"(replay {chain.last_replay_s:.2f} s); bit-identical to local: {same}")
    finally:
        stop(processes)


if __name__ == "__main__":
    main()
